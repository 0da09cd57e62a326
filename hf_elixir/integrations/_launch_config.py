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

An ``ELIXIR_CONFIG_FILE`` that names another file than the launcher's ``--config_file`` is a
``ValueError`` naming both (one file would configure the launch and the other route it).

``ELIXIR_<FIELD>`` environment variables (:meth:`hf_elixir.ElixirConfig.from_env`) override single
fields of whatever the file says.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

# Finding and reading the file lives in a module of its own that imports no hf_elixir, so the start hook can use it
# to decide whether a launch is Elixir's ([Note: the start hook stays out of other launches] in hf_elixir_autoroute.py).
from hf_elixir_launch_config import _config_file_from_launcher_argv  # noqa: F401 - its tests read it from here
from hf_elixir_launch_config import ELIXIR_SECTION, find_launch_config_file, has_elixir_section, read_launch_config

__all__ = ["ELIXIR_SECTION", "find_launch_config_file", "has_elixir_section", "read_elixir_section", "read_launch_config"]

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
