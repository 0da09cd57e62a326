"""A warm interpreter for tests/test_docs.py: imports the modules the doc pages' python blocks import once, then
forks one fresh child process per block.

Run as ``python tests/_doc_warm_python.py MODULES_JSON`` with the environment the blocks get. ``MODULES_JSON`` is a
JSON list of ``[module, name-or-null]`` pairs (``from module import name`` / ``import module``) to import before
the first request; one that fails to import is left for the block itself to report.

Protocol (one JSON object a line on stdin, plain lines on the protocol pipe that stdout was when started):

- request ``{"script": ABS_PATH, "argv": [...], "stdout": PATH, "stderr": PATH}``;
- reply ``started PID`` once forked, then ``done RETURNCODE CPU_SECONDS`` when the child has exited
  (``RETURNCODE`` as ``subprocess`` gives it: negative for a signal; ``CPU_SECONDS`` user + system of the child and
  its own children).

The child does what ``python SCRIPT ARGV...`` does after start-up: cwd and ``sys.path[0]`` are the script's folder,
``sys.argv`` is ``[SCRIPT, *ARGV]``, stdin is ``/dev/null``, stdout/stderr go to the given files, the script runs as
``__main__`` in a fresh namespace, an uncaught exception prints its traceback and exits 1, ``SystemExit`` exits as
Python does, atexit handlers and non-daemon threads finish before the exit. Python's and NumPy's global random
generators are reseeded from the OS, as a new process would seed them.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import random
import resource
import sys
import threading
import traceback
import types


def _preimport(pairs: list[list]) -> None:
    for module, name in pairs:
        try:
            mod = importlib.import_module(module)
            if name is not None and not hasattr(mod, name):  # hasattr runs transformers' lazy import of `name`
                importlib.import_module(f"{module}.{name}")
        except Exception:  # noqa: BLE001 - the block itself will import it and report the error
            pass


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _print_script_traceback(script: str) -> None:
    """The traceback Python prints for an uncaught exception, without this runner's frames."""
    etype, exc, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    traceback.print_exception(etype, exc, tb if tb is not None else exc.__traceback__)


def _run_as_main(script: str) -> None:
    """Runs ``script`` as ``python script`` runs it: a new ``__main__`` module (``__file__`` absolute)."""
    main = types.ModuleType("__main__")
    main.__file__, main.__cached__, main.__builtins__ = script, None, __builtins__
    sys.modules["__main__"] = main
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec")
    exec(code, main.__dict__)


def _child(request: dict, protocol_fds: list[int]) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        for fd in protocol_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        script = request["script"]
        folder = os.path.dirname(script)
        os.chdir(folder)
        sys.argv = [os.path.basename(script), *request["argv"]]
        sys.path[0] = folder
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        try:
            _run_as_main(script)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # noqa: BLE001 - as the interpreter does for an uncaught exception
            _print_script_traceback(script)
            code = 1
        threading._shutdown()  # joins non-daemon threads, as interpreter shutdown does
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a failure of this runner itself
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the pre-imports print goes to this server's stderr, not into the protocol
    _preimport(json.loads(sys.argv[1]))
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        pid = os.fork()
        if pid == 0:
            _child(request, [protocol.fileno(), sys.stdin.fileno()])
        protocol.write(f"started {pid}\n")
        _, status = os.waitpid(pid, 0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        protocol.write(f"done {os.waitstatus_to_exitcode(status)} {cpu_s:.3f}\n")


if __name__ == "__main__":
    main()
