"""Every command and snippet of README.md and docs/*.md runs, as a reader would run it.

The convention (also in docs/contributing.md):

- Each ```python and ```bash fenced block of a page is one pytest case; a page's blocks run in order, in one
  scratch directory per page, in which ``recipes``, ``benchmarks``, ``tests``, ``hf_elixir`` and
  ``triton_kernels`` are symlinks to the checkout (so ``python recipes/finetune_clm.py ...`` reads as from the
  repository root). ``PYTHONPATH`` holds the checkout, the hub is off (``HF_HUB_OFFLINE=1``), there is no GPU
  (``CUDA_VISIBLE_DEVICES=""``) and the simulated device is strict (``HF_ELIXIR_STRICT_DEVICE=1``, from
  conftest), one thread per process.
- A ```python block is saved as a script and run in a fresh process, with a fresh namespace (no block sees
  another's variables); a ```bash block runs with ``bash -euo pipefail``, with this interpreter's ``bin/`` first
  on ``PATH`` (``python``, ``hf-elixir``, ``accelerate``, ``torchrun``). Other fences (```yaml, ```text,
  ```console) are not run unless they carry ``file=``.
- Start-up is shared, not state: a one-process python block's process is forked from a warm interpreter
  (tests/_doc_warm_python.py, one per test module) that has already imported what the pages' one-process blocks
  import at top level (torch, transformers, hf_elixir, ...), with the same environment; the child then does what
  ``python blockNN.py`` does (cwd and ``sys.path[0]`` the scratch directory, the script as ``__main__``, stdin
  empty, exit code, atexit). A block that changes ``os.environ`` before its last top-level import, a
  ``procs=`` block and a bash block start their own interpreter as before; ``HF_ELIXIR_DOC_TEST_FRESH=1`` starts
  every block's own (to check that the warm start changes nothing).
- A marker is an HTML comment on the line right before the fence, ``<!-- doc-test: key=value key="a b" -->``:

  ``procs=2`` / ``procs=1,2``   the python block runs under ``torchrun --standalone --nproc_per_node=N``
                               (CPU, gloo) once per N, one case each;
  ``file=NAME``                 the block (any language) is written to NAME in the scratch directory instead
                               of being run; a later block uses it;
  ``args="..."``                appended to the block's last command (the page shows the same quick form in
                               its text);
  ``drop="PREFIX"``             every ``&&``-joined command starting with PREFIX is left out (the README's
                               ``pip install`` steps: the test runs in the installed checkout);
  ``timeout=SECONDS``           the case's limit (default 240);
  ``skip="REASON"``             not run (only for what needs a GPU or the hub); pytest reports the reason.

Running one case alone (``-k``) first runs the page's earlier blocks it may depend on. The module also checks
that no page carries an unknown or misplaced marker, that every relative link of README.md, docs/ and
benchmarks/RESULTS.md points to an existing file, and that README's test command is the one ``.ci/run`` runs.
(benchmarks/RESULTS.md's commands are run by tests/test_benchmarks.py and tests/test_benchmarks_gpu.py.)
"""

from __future__ import annotations

import ast
import json
import os
import re
import resource
import select
import signal
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = ["recipes", "benchmarks", "tests", "hf_elixir", "triton_kernels"]
RUN_LANGS = {"python", "bash"}
KNOWN_KEYS = {"procs", "file", "args", "drop", "timeout", "skip"}
DEFAULT_TIMEOUT_S = 240
MARKER = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
PAIR = re.compile(r'(?P<key>[\w-]+)=(?:"(?P<quoted>[^"]*)"|(?P<bare>\S+))')


@dataclass
class Block:
    page: Path
    index: int  # position among the page's fenced blocks (0-based)
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: dict[str, str] = field(default_factory=dict)

    @property
    def runs(self) -> bool:
        return self.lang in RUN_LANGS and "file" not in self.marker

    def procs(self) -> list[int]:
        return [int(n) for n in self.marker["procs"].split(",")] if "procs" in self.marker else [1]

    def case_id(self, procs: int) -> str:
        first = next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")
        slug = re.sub(r"[^A-Za-z0-9]+", "-", first).strip("-")[:40]
        page = self.page.relative_to(ROOT).as_posix()
        return f"{page}#{self.index}-{slug}" + (f"-procs{procs}" if "procs" in self.marker else "")


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


def parse_marker(body: str) -> dict[str, str]:
    """``key=value key="a b"`` -> dict; raises ``ValueError`` on text that is not such a pair."""
    pairs, rest = {}, body
    for m in PAIR.finditer(body):
        pairs[m.group("key")] = m.group("quoted") if m.group("quoted") is not None else m.group("bare")
        rest = rest.replace(m.group(0), "", 1)
    if rest.strip() or not pairs:
        raise ValueError(f"cannot read marker {body.strip()!r}: write key=value or key=\"a value\"")
    return pairs


def parse_page(page: Path) -> tuple[list[Block], list[str]]:
    """The page's fenced blocks (with their markers) and the problems found with its markers."""
    lines = page.read_text().splitlines()
    blocks, problems, i = [], [], 0
    where = lambda n: f"{_rel(page)}:{n + 1}"  # noqa: E731
    while i < len(lines):
        marker_match = MARKER.match(lines[i])
        if marker_match:
            nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if not nxt or not nxt.group("lang"):
                problems.append(f"{where(i)}: a doc-test marker must be the line right before an opening fence")
        fence = FENCE.match(lines[i])
        if not fence or not fence.group("lang"):
            if lines[i].strip() == "```":
                problems.append(f"{where(i)}: a fence without a language (write ```text for output)")
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            problems.append(f"{where(i)}: unclosed fence")
            break
        marker: dict[str, str] = {}
        prev = MARKER.match(lines[i - 1]) if i else None
        if prev:
            try:
                marker = parse_marker(prev.group("body"))
            except ValueError as exc:
                problems.append(f"{where(i - 1)}: {exc}")
            problems += [f"{where(i - 1)}: {p}" for p in _marker_problems(marker)]
        blocks.append(Block(page, len(blocks), i + 1, fence.group("lang"), "\n".join(lines[i + 1:end]) + "\n", marker))
        i = end + 1
    return blocks, problems


def _marker_problems(marker: dict[str, str]) -> list[str]:
    problems = [f"unknown marker key {k!r} (known: {sorted(KNOWN_KEYS)})" for k in marker if k not in KNOWN_KEYS]
    if "procs" in marker and not re.fullmatch(r"[1-8](,[1-8])*", marker["procs"]):
        problems.append(f"procs={marker['procs']!r}: write procs=2 or procs=1,2")
    if "timeout" in marker and not marker["timeout"].isdigit():
        problems.append(f"timeout={marker['timeout']!r}: seconds, an integer")
    if "skip" in marker and not marker["skip"].strip():
        problems.append("skip= needs a reason")
    return problems


ALL_BLOCKS = {page: parse_page(page)[0] for page in PAGES}
CASES = [pytest.param(block, n, id=block.case_id(n)) for blocks in ALL_BLOCKS.values() for block in blocks
         if block.runs or ("skip" in block.marker and block.lang in RUN_LANGS) for n in block.procs()]


# -- running blocks ------------------------------------------------------------------------------------------
def command_text(block: Block) -> str:
    """The bash text the test runs: ``drop=`` commands left out, ``args=`` appended to the last command."""
    lines = block.text.splitlines()
    if "drop" in block.marker:
        kept = []
        for line in lines:
            indent = line[:len(line) - len(line.lstrip())]
            parts = [p for p in re.split(r"\s*&&\s*", line.strip()) if not p.startswith(block.marker["drop"])]
            if not line.strip() or parts:
                kept.append(indent + " && ".join(parts) if line.strip() else line)
        lines = kept
    if "args" in block.marker:
        last = max(i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#"))
        lines[last] = lines[last].rstrip() + " " + block.marker["args"]
    return "\n".join(lines) + "\n"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def fresh_interpreter_needed(block: Block) -> bool:
    """Whether a python block must start its own interpreter: under ``procs=``, or when it changes the
    environment before its last top-level import (a module may read the environment as it is imported, so it
    must not come pre-imported), or when ``HF_ELIXIR_DOC_TEST_FRESH=1``."""
    if block.lang != "python" or "procs" in block.marker or os.environ.get("HF_ELIXIR_DOC_TEST_FRESH") == "1":
        return True
    try:
        body = ast.parse(block.text).body
    except SyntaxError:
        return True  # let the fresh interpreter report it as a reader would see it
    imports = [i for i, node in enumerate(body) if isinstance(node, (ast.Import, ast.ImportFrom))]
    before = body[:imports[-1]] if imports else []
    return any(re.search(r"\b(environ|putenv|unsetenv)\b", ast.unparse(node)) for node in before)


def warm_imports(blocks: list[Block]) -> list[tuple[str, str | None]]:
    """``(module, name)`` for each top-level ``from module import name`` (``(module, None)`` for ``import
    module``) of the blocks that run in the warm interpreter, in first-seen order."""
    pairs: dict[tuple[str, str | None], None] = {}
    for block in blocks:
        if block.lang != "python" or not block.runs or fresh_interpreter_needed(block):
            continue
        for node in ast.parse(block.text).body:
            if isinstance(node, ast.Import):
                pairs.update({(alias.name, None): None for alias in node.names})
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                pairs.update({(node.module, alias.name): None for alias in node.names if alias.name != "*"})
    return list(pairs)


class WarmPython:
    """The warm interpreter (tests/_doc_warm_python.py): started on first use, one forked child per block."""

    SERVER = Path(__file__).with_name("_doc_warm_python.py")

    def __init__(self, log: Path, imports: list[tuple[str, str | None]]) -> None:
        self.log, self.imports, self.proc, self.pending = log, imports, None, b""

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.pending = b""
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen([sys.executable, str(self.SERVER), json.dumps(self.imports)], cwd=ROOT,
                                             env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        return self.proc

    def _reply(self, deadline: float | None) -> str | None:
        """The server's next line; None when ``deadline`` (``time.monotonic()``) passes first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                self.close()
                raise RuntimeError(f"the warm interpreter exited; its log:\n{self.log.read_text()[-5000:]}")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode()

    def run(self, script: Path, argv: list[str], timeout_s: int) -> tuple[subprocess.CompletedProcess, float]:
        """Runs ``python SCRIPT ARGV`` in a forked child; (the result, the child's CPU seconds). Raises
        ``subprocess.TimeoutExpired`` (the child killed) after ``timeout_s`` seconds, as ``subprocess.run`` does."""
        proc = self._start()
        out, err = script.with_suffix(".stdout"), script.with_suffix(".stderr")
        request = {"script": str(script.resolve()), "argv": argv, "stdout": str(out), "stderr": str(err)}
        proc.stdin.write((json.dumps(request) + "\n").encode())
        proc.stdin.flush()
        pid = int(self._reply(None).split()[1])  # the limit counts from the fork, not the server start-up
        deadline = time.monotonic() + timeout_s
        done = self._reply(deadline)
        cmd = ["python", script.name, *argv]
        if done is None:
            os.kill(pid, signal.SIGKILL)
            self._reply(None)
            raise subprocess.TimeoutExpired(cmd, timeout_s, output=out.read_text(), stderr=err.read_text())
        _, code, cpu_s = done.split()
        return subprocess.CompletedProcess(cmd, int(code), out.read_text(), err.read_text()), float(cpu_s)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.proc = None


def run_block(block: Block, procs: int, scratch: Path, warm: WarmPython | None = None) -> subprocess.CompletedProcess:
    """Runs the block in ``scratch`` (in a child of ``warm`` when given and the block may use it)."""
    stem = f"block{block.index:02d}"
    timeout_s = int(block.marker.get("timeout", DEFAULT_TIMEOUT_S))
    if block.lang == "python":
        script = scratch / f"{stem}.py"
        script.write_text(block.text)
        args = shlex.split(block.marker["args"]) if "args" in block.marker else []
        if warm is not None and not fresh_interpreter_needed(block):
            proc, cpu_s = warm.run(script, args, timeout_s)
            print(f"doc-test {block.case_id(procs)}: {cpu_s:.1f} CPU s (warm start)")
            return proc
        cmd = ([sys.executable, script.name] if "procs" not in block.marker else
               [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", script.name])
        cmd += args
    else:
        script = scratch / f"{stem}.sh"
        script.write_text(command_text(block))
        cmd = ["bash", "-euo", "pipefail", script.name]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=scratch, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # CPU seconds of the block's processes: on quiet cores a one-process block's wall time is about this, so it is
    # what to keep small (the doc test's budget, docs/contributing.md); `pytest -s` shows it
    print(f"doc-test {block.case_id(procs)}: {cpu_s:.1f} CPU s")
    return proc


class _PageState:
    """One scratch directory per page and which of its blocks have run there."""

    def __init__(self, factory) -> None:
        self.factory, self.dirs, self.done = factory, {}, set()
        imports = warm_imports([block for blocks in ALL_BLOCKS.values() for block in blocks])
        self.warm = WarmPython(factory.mktemp("warm-python") / "server.log", imports)

    def scratch(self, page: Path) -> Path:
        if page not in self.dirs:
            path = self.factory.mktemp(page.stem.lower())
            for name in LINKED:
                (path / name).symlink_to(ROOT / name, target_is_directory=True)
            self.dirs[page] = path
        return self.dirs[page]

    def prepare_for(self, block: Block) -> None:
        """Write the page's ``file=`` blocks and run, once, every earlier runnable block (a ``-k`` selection)."""
        scratch = self.scratch(block.page)
        for earlier in ALL_BLOCKS[block.page]:
            if "file" in earlier.marker:
                target = scratch / earlier.marker["file"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(earlier.text)
            if earlier.index >= block.index:
                break
            if earlier.runs and "skip" not in earlier.marker and (earlier.page, earlier.index) not in self.done:
                _check(earlier, earlier.procs()[0], run_block(earlier, earlier.procs()[0], scratch, self.warm))
                self.done.add((earlier.page, earlier.index))


def _check(block: Block, procs: int, proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        shown = command_text(block) if block.lang == "bash" else block.text
        pytest.fail(f"{block.page.relative_to(ROOT)}:{block.line} ({block.lang}, {procs} process(es)) exited "
                    f"{proc.returncode}\n--- block ---\n{shown}--- stdout (tail) ---\n{proc.stdout[-3000:]}\n"
                    f"--- stderr (tail) ---\n{proc.stderr[-5000:]}", pytrace=False)


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    state = _PageState(tmp_path_factory)
    yield state
    state.warm.close()


@pytest.mark.parametrize("block,procs", CASES)
def test_doc_block_runs(block: Block, procs: int, pages: _PageState) -> None:
    if "skip" in block.marker:
        pytest.skip(f"{block.page.relative_to(ROOT)}:{block.line}: {block.marker['skip']}")
    pages.prepare_for(block)
    _check(block, procs, run_block(block, procs, pages.scratch(block.page), pages.warm))
    pages.done.add((block.page, block.index))


# -- checks of the pages themselves -------------------------------------------------------------------------
def test_pages_exist_and_have_runnable_blocks() -> None:
    assert (ROOT / "docs" / "README.md").exists(), "docs/README.md (the index) is missing"
    assert len(CASES) >= 10, f"only {len(CASES)} doc cases found: is the parser reading the pages?"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_has_no_unknown_or_misplaced_marker(page: Path) -> None:
    _, problems = parse_page(page)
    assert not problems, "\n".join(problems)


def test_marker_parser_rejects_unknown_keys_and_junk(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text('<!-- doc-test: procs=2 colour=red -->\n```python\nprint(1)\n```\n'
                    '<!-- doc-test: nonsense -->\n```bash\necho\n```\n<!-- doc-test: skip=x -->\n\ntext\n')
    blocks, problems = parse_page(page)
    assert blocks[0].marker == {"procs": "2", "colour": "red"}
    assert any("unknown marker key 'colour'" in p for p in problems)
    assert any("cannot read marker" in p for p in problems)
    assert any("right before an opening fence" in p for p in problems)


def test_command_text_drops_and_appends() -> None:
    block = Block(ROOT / "README.md", 0, 1, "bash", 'pip install -e ".[x]" && python run.py \\\n    --a 1\n',
                  {"drop": "pip install", "args": "--max_steps 2"})
    assert command_text(block) == "python run.py \\\n    --a 1 --max_steps 2\n"


def test_warm_interpreter_children_start_fresh(tmp_path: Path) -> None:
    """Each block forked from the warm interpreter gets a fresh namespace and process state, the script's folder
    as cwd and ``sys.path[0]``, and the exit code, traceback and timeout a ``python script.py`` run gives."""
    warm = WarmPython(tmp_path / "server.log", [("json", None), ("os", "path")])
    scripts = {
        "a": "import os, sys\nos.environ['DOC_TEST_LEAK'] = '1'\nleaked = 1\nprint(os.getcwd(), sys.path[0], sys.argv)",
        "b": "import os\nassert 'leaked' not in globals() and 'DOC_TEST_LEAK' not in os.environ\nprint(__name__)",
        "c": "def f():\n    raise KeyError('from block c')\nf()",
        "d": "raise SystemExit(3)",
        "e": "import time\ntime.sleep(60)",
    }
    try:
        done = {}
        for name, text in scripts.items():
            folder = tmp_path / name
            folder.mkdir()
            (folder / f"{name}.py").write_text(text + "\n")
            if name == "e":
                with pytest.raises(subprocess.TimeoutExpired):
                    warm.run(folder / "e.py", [], timeout_s=1)
            else:
                done[name] = warm.run(folder / f"{name}.py", ["--x"], timeout_s=60)[0]
        after_timeout = warm.run(tmp_path / "b" / "b.py", [], timeout_s=60)[0]
    finally:
        warm.close()
    folder_a = str((tmp_path / "a").resolve())
    assert done["a"].returncode == 0 and done["a"].stdout == f"{folder_a} {folder_a} ['a.py', '--x']\n", done["a"]
    assert done["b"].returncode == 0 and done["b"].stdout == "__main__\n", done["b"]
    assert done["c"].returncode == 1 and "KeyError: 'from block c'" in done["c"].stderr, done["c"]
    assert 'c.py", line 3, in <module>' in done["c"].stderr and "_doc_warm_python" not in done["c"].stderr, done["c"].stderr
    assert done["d"].returncode == 3, done["d"]
    assert after_timeout.returncode == 0, after_timeout


def test_blocks_that_set_the_environment_before_importing_start_their_own_interpreter() -> None:
    page = ROOT / "docs" / "x.md"
    late = Block(page, 0, 1, "python", "import os\nimport torch\nos.environ['WORLD_SIZE'] = '2'\n")
    early = Block(page, 1, 1, "python", "import os\nos.environ['HF_ELIXIR_X'] = '1'\nimport hf_elixir\n")
    launched = Block(page, 2, 1, "python", "import torch\n", {"procs": "2"})
    assert not fresh_interpreter_needed(late)
    assert fresh_interpreter_needed(early) and fresh_interpreter_needed(launched)
    assert warm_imports([late, early, launched]) == [("os", None), ("torch", None)]


LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)|!\[[^\]]*\]\((?P<image>[^)\s]+)\)")


@pytest.mark.parametrize("page", [*PAGES, ROOT / "benchmarks" / "RESULTS.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code are not links
    broken = []
    for m in LINK.finditer(text):
        target = (m.group("target") or m.group("image")).split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue
        if not (page.parent / target).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def _readme_test_command() -> str:
    blocks = [b for b in ALL_BLOCKS[ROOT / "README.md"] if b.lang == "bash" and "pytest" in b.text]
    assert len(blocks) == 1, "README.md should hold exactly one bash block that runs pytest (the test command)"
    return command_text(Block(blocks[0].page, 0, 0, "bash", blocks[0].text, {"drop": "pip install"})).strip()


def test_readme_test_command_is_what_ci_runs() -> None:
    """`.ci/run` runs README's test command: the same pytest line (``python3`` there, for a bare image)."""
    command = _readme_test_command()
    env_prefix, _, pytest_cmd = (" " + command).rpartition(" python ")
    assert pytest_cmd, command
    ci = (ROOT / ".ci" / "run").read_text()
    ci_cmds = [ln.strip() for ln in ci.splitlines() if "pytest" in ln and not ln.lstrip().startswith("#")]
    assert ci_cmds == [f"python3 {pytest_cmd}"], (command, ci_cmds)
    for assignment in env_prefix.split():
        assert assignment in ci, f"README's test command sets {assignment}; .ci/run does not"
