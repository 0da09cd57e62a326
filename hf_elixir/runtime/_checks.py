"""The first phase of ``hf_elixir.prepare``: the arguments it can refuse before it looks at the model's
chunks, placements or plan (types, a model prepared twice, streamed init, the precision the device runs).

Each check raises the user's error (``TypeError``/``ValueError`` naming the argument, the value and the
fix) and changes nothing, so a fixed call works ([Note: all-or-nothing prepare] in ``_rollback.py``).
"""

from __future__ import annotations

import os

import torch

from hf_elixir.chunk._stream_load import meta_parameter_names
from hf_elixir.config import ElixirConfig
from hf_elixir.runtime._state import is_prepared

__all__ = ["check_arguments", "check_precision_supported", "check_streamed_init"]


def check_arguments(model, optimizer, config) -> None:
    """Refuse what ``prepare(model, optimizer, config)`` cannot take.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, ``optimizer`` not a ``torch.optim`` optimizer
            (or ``None``), ``config`` not an ``ElixirConfig``.
        ValueError: the model is already prepared.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"hf_elixir.prepare(model=...) got {type(model).__name__}; pass a torch.nn.Module "
                        "(e.g. a transformers model)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"hf_elixir.prepare(optimizer=...) got {type(optimizer).__name__}; pass a torch.optim "
                        "optimizer built on model.parameters(), or None for inference")
    if not isinstance(config, ElixirConfig):
        raise TypeError(f"hf_elixir.prepare(config={config!r}) must be an ElixirConfig")
    if is_prepared(model):
        raise ValueError("this model is already prepared by hf_elixir.prepare; prepare it only once")


def check_streamed_init(model, config: ElixirConfig, checkpoint) -> None:
    """Refuse what streamed init does not support, and a meta model without ``checkpoint=``.

    Raises:
        ValueError: meta parameters without ``checkpoint``; ``checkpoint`` with ``search="auto"`` and no plan.
        TypeError: ``checkpoint`` is not a path.
    """
    meta = meta_parameter_names(model)
    if checkpoint is None:
        if meta:
            raise ValueError(f"parameters {meta[:5]}{' and more' if len(meta) > 5 else ''} are on the meta device "
                             "(no data): pass hf_elixir.prepare(model, optimizer, config, checkpoint='path/to/"
                             "hf_folder') to load them from a Hugging Face folder, or build the model with real "
                             "weights (from_pretrained)")
        return
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"hf_elixir.prepare(checkpoint={checkpoint!r}) must be a path to a Hugging Face folder")
    if config.search == "auto" and config.plan is None:
        raise ValueError("ElixirConfig.search='auto' profiles a real training step, which a model streamed from "
                         "checkpoint= cannot run before prepare: write a plan first (`hf-elixir plan`) and pass "
                         "ElixirConfig(plan=...), or leave search='off'")


def check_precision_supported(precision: str, device: torch.device) -> None:
    """Raise ``ValueError`` for a precision the compute device cannot run (bf16 before Ampere)."""
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"ElixirConfig.precision='bf16' is not supported by this GPU ({name}); use "
                         "precision='fp16' (with loss scaling) or 'fp32'")
