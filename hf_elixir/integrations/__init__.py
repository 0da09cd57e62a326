"""Hugging Face integrations: the Accelerate plugin and the Trainer callback.

This is the only package of hf_elixir that knows the Accelerate/Trainer APIs. Names are imported
lazily so that ``import hf_elixir`` does not import ``transformers``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ELIXIR_SECTION", "ElixirCallback", "ElixirPlugin", "resolve_elixir_config"]

_LAZY = {
    "ElixirPlugin": "hf_elixir.integrations.accelerate_plugin",
    "resolve_elixir_config": "hf_elixir.integrations.accelerate_plugin",
    "ElixirCallback": "hf_elixir.integrations.trainer_callback",
    "ELIXIR_SECTION": "hf_elixir.integrations._launch_config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_elixir.integrations' has no attribute {name!r}")
