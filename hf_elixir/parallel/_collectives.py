"""Differentiable collectives for tensor and expert parallelism.

Each is an ``autograd.Function`` whose backward issues the transposed collective, so every rank
runs the same collectives in the same order in backward as in forward (no hang when a rank has no
tokens: it still joins with an empty tensor).

Source: Megatron-LM (arXiv 1909.08053, section 3, the ``f``/``g`` operators); GShard / Switch
(arXiv 2006.16668, 2101.03961) for the all-to-all dispatch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_elixir.chunk._tp_slices import tp_slice, tp_slice_sizes

__all__ = ["all_to_all", "copy_to_group", "gather_last_dim", "reduce_from_group", "split_last_dim"]


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) the gradient over ``group`` (Megatron ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: all-reduce (sum) over ``group``. Backward: identity (Megatron ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None


def _all_gather_last_dim(x: torch.Tensor, group: Any, full: int) -> torch.Tensor:
    """All-gather the last dim of ``x`` over ``group``: rank ``r`` holds :func:`tp_slice`'s features of ``full``.

    Uneven slices ([Note: uneven tensor-parallel slices]) are padded to the longest before the all-gather (NCCL's
    and gloo's all_gather take equal sizes) and trimmed after."""
    sizes = tp_slice_sizes(full, dist.get_world_size(group))
    assert x.shape[-1] == sizes[dist.get_rank(group)], f"rank {dist.get_rank()}: {x.shape[-1]} features of {sizes}"
    x = x.contiguous()
    if x.shape[-1] < sizes[0]:
        x = F.pad(x, (0, sizes[0] - x.shape[-1]))
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x, group=group)
    return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)


def _my_slice(x: torch.Tensor, group: Any) -> torch.Tensor:
    start, length = tp_slice(x.shape[-1], dist.get_rank(group), dist.get_world_size(group))
    return x[..., start:start + length].contiguous()


class _GatherLastDim(torch.autograd.Function):
    """Forward: all-gather the last dim over ``group`` (rank order). Backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, full: int) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last_dim(x, group, full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _my_slice(grad, ctx.group), None, None


class _SplitLastDim(torch.autograd.Function):
    """Forward: this rank's slice of the last dim (the input is whole on every rank). Backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.full = group, x.shape[-1]
        return _my_slice(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_gather_last_dim(grad, ctx.group, ctx.full), None


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` (``N_in x H``) go to ranks by ``in_splits``; returns ``sum(out_splits) x H``.

    Backward sends the gradient rows back along the same routes (splits swapped).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad_in = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return grad_in, None, None, None


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity whose backward sums the gradient over ``group`` (input of a column-parallel layer)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over ``group`` whose backward is the identity (output of a row-parallel layer)."""
    return _ReduceFromGroup.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: Any, full: int | None = None) -> torch.Tensor:
    """All-gather the last dim over ``group`` (a split output made whole); backward keeps this rank's slice.

    ``full``: the whole last dim, whose :func:`tp_slice` each rank holds (default: ``x``'s times the group size,
    an even split)."""
    return _GatherLastDim.apply(x, group, x.shape[-1] * dist.get_world_size(group) if full is None else full)


def split_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's :func:`tp_slice` of the last dim of a tensor whole on every rank; backward all-gathers the
    gradient."""
    return _SplitLastDim.apply(x, group)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 (``in_splits[r]`` rows go to rank ``r``;
    ``out_splits[r]`` rows arrive from rank ``r``)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)
