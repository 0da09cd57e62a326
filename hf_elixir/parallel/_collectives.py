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


def _all_gather_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _GatherLastDim(torch.autograd.Function):
    """Forward: all-gather the last dim over ``group`` (rank order). Backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


class _SplitLastDim(torch.autograd.Function):
    """Forward: this rank's slice of the last dim (the input is whole on every rank). Backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_gather_last_dim(grad, ctx.group), None


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


def gather_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather the last dim over ``group`` (a split output made whole); backward keeps this rank's slice."""
    return _GatherLastDim.apply(x, group)


def split_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's slice of the last dim of a tensor whole on every rank; backward all-gathers the gradient."""
    return _SplitLastDim.apply(x, group)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 (``in_splits[r]`` rows go to rank ``r``;
    ``out_splits[r]`` rows arrive from rank ``r``)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)
