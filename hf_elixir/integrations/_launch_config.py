"""Finding the Elixir settings inside an ``accelerate launch`` YAML from a launched process.

[Note: how elixir.yaml reaches the training processes]

Stock ``accelerate launch --config_file elixir.yaml train.py`` (accelerate 1.x) has two properties
that rule out the obvious designs:

1. ``ClusterConfig.from_yaml_file`` rejects any unknown *top-level* key ("had unknown keys"), so an
   ``elixir:`` section at the top level makes the launch fail.
2. The launched processes are told the launch settings only through a fixed set of
   ``ACCELERATE_*`` environment variables; neither the config path nor free-form values are passed.

What accelerate does accept is free-form content *inside* its dict-valued sections: for
``dynamo_config`` it copies each key to the launcher's argument namespace as ``dynamo_<key>`` and
uses only the keys it knows (``dynamo_backend``, ``dynamo_mode``, ...). So the Elixir settings live
in ``dynamo_config.elixir`` (:data:`ELIXIR_SECTION`), a place stock accelerate carries without
complaint and without side effects (``dynamo_backend`` can sit next to it: an Elixir model is then
compiled per block, [Note: torch.compile through the integrations] in ``_compile.py``).

A launched process finds the file, in this order:

1. ``ElixirPlugin(config_file=...)``;
2. the ``ELIXIR_CONFIG_FILE`` environment variable (set it for ``torchrun`` or job schedulers);
3. the ``--config_file`` argument of the ``accelerate launch`` process that started it, read from
   ``/proc/<pid>/cmdline`` of its parent processes (Linux; ``accelerate launch`` is the direct
   parent both for one process and for ``--multi_gpu``, whose torchrun agent runs inside the
   launcher); without ``--config_file`` accelerate's default config file is used, as accelerate
   itself does.

``ELIXIR_<FIELD>`` environment variables (:meth:`hf_elixir.ElixirConfig.from_env`) override single
fields of whatever the file says.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["ELIXIR_SECTION", "find_launch_config_file", "has_elixir_section", "read_elixir_section", "read_launch_config"]

#: (top-level accelerate key, sub-key) under which elixir.yaml keeps the ElixirConfig fields.
ELIXIR_SECTION: tuple[str, str] = ("dynamo_config", "elixir")
_CONFIG_FILE_ENV = "ELIXIR_CONFIG_FILE"
_MAX_PARENT_DEPTH = 4


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


def find_launch_config_file(explicit: str | os.PathLike | None = None) -> Path | None:
    """Locate the accelerate/Elixir YAML for this process (see the module note for the order).

    Args:
        explicit: a path given by the user; wins over everything else.

    Returns:
        The absolute path, or ``None`` when the process was not started by ``accelerate launch``
        and neither ``explicit`` nor ``ELIXIR_CONFIG_FILE`` is set.

    Raises:
        FileNotFoundError: ``explicit`` or ``ELIXIR_CONFIG_FILE`` names a missing file.
    """
    for source, value in (("config_file", explicit), (_CONFIG_FILE_ENV, os.environ.get(_CONFIG_FILE_ENV))):
        if value:
            path = Path(value).expanduser().resolve()
            if not path.is_file():
                raise FileNotFoundError(f"{source}={str(value)!r}: no such file")
            return path
    pid: int | None = os.getpid()
    for _ in range(_MAX_PARENT_DEPTH):
        pid = _parent_pid(pid) if pid is not None else None
        if pid is None or pid <= 1:
            return None
        found = _config_file_from_launcher_argv(_cmdline(pid))
        if found is None:
            continue
        if found == "":
            from accelerate.commands.config import default_config_file

            return Path(default_config_file) if os.path.isfile(default_config_file) else None
        path = Path(found).expanduser()
        if not path.is_absolute():
            try:
                path = Path(os.readlink(f"/proc/{pid}/cwd")) / path
            except OSError:
                path = path.resolve()
        return path if path.is_file() else None
    return None


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


def read_elixir_section(path: str | os.PathLike) -> dict[str, Any]:
    """The ``dynamo_config.elixir`` mapping of an accelerate config file (``{}`` if absent).

    Raises:
        ValueError: the section is present but not a mapping, or ``elixir`` sits at the top level
            (where stock accelerate would reject it).
    """
    data = read_launch_config(path)
    outer, inner = ELIXIR_SECTION
    if inner in data:
        raise ValueError(
            f"{path}: a top-level {inner!r} key is rejected by `accelerate launch`; move it under "
            f"`{outer}:` as `{outer}: {{{inner}: ...}}`"
        )
    section = (data.get(outer) or {}).get(inner, {})
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{path}: `{outer}.{inner}` must be a mapping of ElixirConfig fields, got {section!r}")
    return dict(section)
