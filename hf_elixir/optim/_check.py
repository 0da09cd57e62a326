"""Checks of the optimizer given to ``prepare``, run before ``prepare`` changes the model (see
[Note: all-or-nothing prepare] in ``hf_elixir/runtime/_rollback.py``); :class:`ElixirOptimizer` makes the
same checks again when it is built."""

from __future__ import annotations

import torch

from hf_elixir.optim.optimizer import SUPPORTED_OPTIMIZERS

__all__ = ["check_optimizer"]


def check_optimizer(optimizer: torch.optim.Optimizer, managed: dict[torch.nn.Parameter, list[str]]) -> None:
    """Raise for an optimizer ``prepare`` cannot wrap.

    Args:
        optimizer: the ``torch.optim`` optimizer given to ``prepare``.
        managed: the parameters ``prepare`` will pack (parameter -> its names in the model).

    Raises:
        TypeError: an optimizer that is not element-wise (lists the supported ones).
        ValueError: the optimizer holds a parameter that is not in the model.
    """
    if type(optimizer) not in SUPPORTED_OPTIMIZERS:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED_OPTIMIZERS)
        raise TypeError(
            f"hf_elixir.prepare(optimizer=<{type(optimizer).__name__}>) is not supported: the chunk "
            f"optimizer slices parameters into shards, which is exact only for element-wise optimizers. "
            f"Use one of: {names}")
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p not in managed:
                raise ValueError(
                    f"optimizer param_groups[{index}] holds a parameter of shape {tuple(p.shape)} that is not "
                    "in the prepared model; build the optimizer on model.parameters() before hf_elixir.prepare")
