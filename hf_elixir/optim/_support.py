"""The optimizers the chunk optimizer wraps, and what their states cost the plan.

Only element-wise optimizers give the same update on a parameter's slices as on the whole parameter
([Note: shard views] in ``_shard_views.py``), hence the allow-list.
"""

from __future__ import annotations

import torch

from hf_elixir.config import ElixirConfig
from hf_elixir.optim._overlap import snapshot_rollback

__all__ = ["SUPPORTED_OPTIMIZERS", "optimizer_cost_terms", "optimizer_state_numel_factor"]

SUPPORTED_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
)


def optimizer_state_numel_factor(optimizer: torch.optim.Optimizer) -> int:
    """fp32 state elements per parameter element (Adam: exp_avg + exp_avg_sq = 2)."""
    group = optimizer.defaults
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(optimizer, (torch.optim.Adagrad,)):
        return 1
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + int(bool(group.get("momentum", 0))) + int(bool(group.get("centered")))
    return 2


def optimizer_cost_terms(optimizer: torch.optim.Optimizer | None, config: ElixirConfig) -> dict:
    """What the plan search needs to know of the user's optimizer (``hf_elixir.search.search`` keywords).

    Returns:
        ``{"optim_states": fp32 state elements per parameter element (:func:`optimizer_state_numel_factor`:
        Adam/AdamW 2, i.e. 8 bytes; SGD with momentum 1, 4 bytes; plain SGD 0), "snapshot_rollback": whether the
        host lane keeps snapshots ([Note: inverse rollback] in ``_inverse_adam.py``; Adam/AdamW without AMSGrad:
        ``False``)}``. With
        ``optimizer=None`` the search's defaults (AdamW: 2, ``False``).
    """
    if optimizer is None:
        return {"optim_states": 2, "snapshot_rollback": False}
    return {"optim_states": optimizer_state_numel_factor(optimizer),
            "snapshot_rollback": snapshot_rollback(optimizer, config.precision, config.loss_scale)}
