"""Finding and reading the config file of an ``accelerate launch``, on the standard library and PyYAML only.

The start hook (``hf_elixir_autoroute``) and the integrations (``hf_elixir/integrations/_launch_config.py``) both
read the launch's config file through this module; it imports neither of them, nor hf_elixir, so the hook can
decide whether a launch is Elixir's without importing the library ([Note: the start hook stays out of other
launches] in ``hf_elixir_autoroute.py``), and the integrations find the same file the hook found ([Note: how
elixir.yaml reaches the training processes] in ``hf_elixir/integrations/_launch_config.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["ELIXIR_SECTION", "find_launch_config_file", "has_elixir_section", "read_launch_config"]

_CONFIG_FILE_ENV = "ELIXIR_CONFIG_FILE"
_MAX_PARENT_DEPTH = 4
#: (top-level accelerate key, sub-key) under which elixir.yaml keeps the ElixirConfig fields.
ELIXIR_SECTION: tuple[str, str] = ("dynamo_config", "elixir")


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may contain spaces/parentheses, so split after the last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 else None


def _config_file_from_launcher_argv(argv: list[str]) -> str | None:
    """The ``--config_file`` value of an ``accelerate launch`` argv, ``""`` if it has none, else None."""
    head = argv[:4]
    via_cli = any(Path(a).name == "accelerate" for a in head[:2]) and "launch" in head
    via_module = "accelerate.commands.launch" in head or any(a.endswith("accelerate/commands/launch.py") for a in head)
    if not (via_cli or via_module):
        return None
    for i, arg in enumerate(argv):
        if arg == "--config_file" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config_file="):
            return arg.split("=", 1)[1]
    return ""


def _launcher_config_file() -> tuple[Path | None, bool]:
    """The config file of the ``accelerate launch`` that started this process (searched up to
    ``_MAX_PARENT_DEPTH`` parents), and whether it came from ``--config_file`` (``False``: accelerate's default
    file, or no launcher at all: ``(None, False)``)."""
    pid: int | None = os.getpid()
    for _ in range(_MAX_PARENT_DEPTH):
        pid = _parent_pid(pid) if pid is not None else None
        if pid is None or pid <= 1:
            return None, False
        found = _config_file_from_launcher_argv(_cmdline(pid))
        if found is None:
            continue
        if found == "":
            from accelerate.commands.config import default_config_file

            return (Path(default_config_file) if os.path.isfile(default_config_file) else None), False
        path = Path(found).expanduser()
        if not path.is_absolute():
            try:
                path = Path(os.readlink(f"/proc/{pid}/cwd")) / path
            except OSError:
                path = path.resolve()
        return (path.resolve() if path.is_file() else None), True
    return None, False


def find_launch_config_file(explicit: str | os.PathLike | None = None) -> Path | None:
    """Locate the accelerate/Elixir YAML for this process: ``explicit``, else ``ELIXIR_CONFIG_FILE``, else the
    ``--config_file`` of the ``accelerate launch`` parent (accelerate's default file without one); [Note: how
    elixir.yaml reaches the training processes] in ``hf_elixir/integrations/_launch_config.py``.

    Args:
        explicit: a path given by the user; wins over everything else.

    Returns:
        The absolute path, or ``None`` when the process was not started by ``accelerate launch``
        and neither ``explicit`` nor ``ELIXIR_CONFIG_FILE`` is set.

    Raises:
        FileNotFoundError: ``explicit`` or ``ELIXIR_CONFIG_FILE`` names a missing file.
        ValueError: ``ELIXIR_CONFIG_FILE`` and the launcher's ``--config_file`` name different files.
    """
    if explicit:
        path = Path(explicit).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"config_file={str(explicit)!r}: no such file")
        return path
    from_env = os.environ.get(_CONFIG_FILE_ENV)
    launcher, given = _launcher_config_file()
    if not from_env:
        return launcher
    path = Path(from_env).expanduser().resolve()
    if given and launcher is not None and launcher != path:
        raise ValueError(
            f"{_CONFIG_FILE_ENV}={from_env!r} disagrees with `accelerate launch --config_file {launcher}`: the "
            "launch would be configured by one file and routed by the other. Unset ELIXIR_CONFIG_FILE (a value "
            "left from an earlier run), or set it to the --config_file you launch with")
    if not path.is_file():
        raise FileNotFoundError(f"{_CONFIG_FILE_ENV}={from_env!r}: no such file")
    return path


def read_launch_config(path: str | os.PathLike) -> dict[str, Any]:
    """The whole accelerate config file (YAML or JSON) as a dict."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: an accelerate config file must be a mapping, got {type(data).__name__}")
    return dict(data)


def has_elixir_section(path: str | os.PathLike) -> bool:
    """Whether the accelerate config file has a ``dynamo_config.elixir`` key (even an empty one: the defaults)."""
    outer, inner = ELIXIR_SECTION
    section = read_launch_config(path).get(outer)
    return isinstance(section, Mapping) and inner in section
