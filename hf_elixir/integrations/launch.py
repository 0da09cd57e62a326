"""``hf-elixir launch``: run an unchanged Accelerate (or ``Trainer``) script under hf_elixir.

``hf-elixir launch [accelerate launch arguments] train.py [script arguments]`` runs

    accelerate launch [accelerate launch arguments] --module hf_elixir.integrations.launch train.py [script arguments]

so that every process accelerate starts first routes ``Accelerator.prepare`` and ``transformers.Trainer`` to
hf_elixir ([Note: routing an unchanged script] in :mod:`hf_elixir.integrations._route`), then runs
``train.py`` as ``__main__`` with its own arguments, exactly as ``accelerate launch`` would have. The Elixir
settings are the ``dynamo_config.elixir`` section of ``--config_file`` (plus ``ELIXIR_<FIELD>`` overrides);
the launcher checks them before any process starts and passes the file on as ``ELIXIR_CONFIG_FILE``.

The same routing reaches plain ``accelerate launch`` through the start hook ([Note: the start hook] in
``hf_elixir_autoroute.py``). The verb adds what a hook cannot: the settings are checked once, before any process
starts, and it works where no ``accelerate launch`` parent exists: ``torchrun ... -m hf_elixir.integrations.launch
train.py`` with ``ELIXIR_CONFIG_FILE`` set.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["accelerate_command", "launch_main"]

BOOTSTRAP = "hf_elixir.integrations.launch"
_CONFIG_FILE_ENV = "ELIXIR_CONFIG_FILE"


def accelerate_command(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """The ``accelerate launch`` command that ``hf-elixir launch argv`` runs, and the config file it names.

    Args:
        argv: what follows ``hf-elixir launch``: accelerate launch's own arguments, the training script (or
            ``-m module``) and the script's arguments.

    Returns:
        ``(command, config_file)``: the full command (``python -m accelerate.commands.launch ...``) and the
        absolute path of ``--config_file`` (``None`` when not given: accelerate's default config applies).

    Raises:
        ValueError: no training script in ``argv``, or ``--no_python`` (the script must be Python).
    """
    from accelerate.commands.launch import launch_command_parser

    argv = list(argv)
    args = launch_command_parser().parse_args(argv)
    if not args.training_script:
        raise ValueError("hf-elixir launch needs a training script: hf-elixir launch [accelerate launch args] "
                         "train.py [script args]")
    if args.no_python:
        raise ValueError("hf-elixir launch --no_python: the training script must be Python (drop --no_python)")
    tail = [args.training_script, *args.training_script_args]
    prefix = argv[:len(argv) - len(tail)]
    assert argv[len(prefix):] == tail, (argv, tail)
    target = tail
    if args.module:
        prefix = [a for a in prefix if a not in ("-m", "--module")]
        target = ["-m", *tail]
    config_file = str(Path(args.config_file).expanduser().resolve()) if args.config_file else None
    command = [sys.executable, "-m", "accelerate.commands.launch", *prefix, "--module", BOOTSTRAP, *target]
    return command, config_file


def launch_main(argv: Sequence[str]) -> int:
    """``hf-elixir launch``: check the Elixir settings, then run ``accelerate launch`` through the bootstrap.

    Returns:
        The exit status of ``accelerate launch``.

    Raises:
        ValueError / TypeError: an invalid setting in the YAML's ``dynamo_config.elixir`` section or an
            ``ELIXIR_*`` variable (raised here, before any process starts).
        FileNotFoundError: ``--config_file`` names a missing file.
    """
    from hf_elixir.integrations.accelerate_plugin import resolve_elixir_config

    command, config_file = accelerate_command(argv)
    env = dict(os.environ)
    if config_file is not None:
        env[_CONFIG_FILE_ENV] = config_file
    resolve_elixir_config(env.get(_CONFIG_FILE_ENV))  # fail here, not once per process
    return subprocess.run(command, env=env, check=False).returncode


def _run(argv: list[str]) -> None:
    """In one launched process: install the routing, then run the script (or ``-m module``) as ``__main__``."""
    from hf_elixir.integrations._route import install

    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(f"usage: python -m {BOOTSTRAP} (train.py | -m module) [script args]")
    install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = str(Path(argv[0]).resolve())
    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = str(Path(script).parent)  # as `python train.py` would have it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _run(sys.argv[1:])
