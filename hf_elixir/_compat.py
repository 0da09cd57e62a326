"""Version shims: the one place that knows which names this torch gives a function.

torch 2.13 renamed the tensor-in/tensor-out collectives: ``all_gather_into_tensor`` became
``all_gather_single`` and ``reduce_scatter_tensor`` became ``reduce_scatter_single``; the old names
still work there but emit a ``FutureWarning`` on every call (once per step and chunk in a training
log). torch 2.11 (what the GPU machines run) has only the old names. The functions below call the
current name when torch has it, else the old one, with the same arguments.

Both look the name up on ``torch.distributed`` at call time, so a wrapper installed on that module
(the test suite's strict device checks) still sees every call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]


def all_gather_single(output: torch.Tensor, input: torch.Tensor, *, group: Any = None, async_op: bool = False):
    """All-gather ``input`` (``[n]``) from every rank of ``group`` into ``output`` (``[n * world]``, rank
    order). ``torch.distributed.all_gather_single`` (torch >= 2.13), else ``all_gather_into_tensor``.

    Returns:
        The async work handle when ``async_op``, else ``None``.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *, op: Any = None, group: Any = None,
                          async_op: bool = False):
    """Reduce ``input`` (``[n * world]``) over ``group`` with ``op`` (default sum) and leave this rank's
    ``[n]`` slice in ``output``. ``torch.distributed.reduce_scatter_single`` (torch >= 2.13), else
    ``reduce_scatter_tensor``.

    Returns:
        The async work handle when ``async_op``, else ``None``.
    """
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)
