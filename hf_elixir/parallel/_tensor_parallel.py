"""Tensor parallel: rewrite GPT-2 / OPT style blocks in place into column/row-parallel layers.

A block (see :class:`hf_elixir.placement.TensorParallelBlock`) is a parent module with column
children (their output features split over the tp axis; GPT-2's fused ``c_attn`` per head: each of
q, k, v keeps its own contiguous block of heads) and one row child (its input features split; the
partial outputs are summed with an all-reduce before the bias is added once). The parent's head
count and width attributes shrink to the local values, so the Hugging Face forward runs unchanged
on the local heads. Parameter FQNs stay the same; only their shapes shrink.

Layouts: ``nn.Linear`` weight is ``(out, in)``; transformers ``Conv1D`` weight is ``(in, out)``. A block with a
head count or widths to shrink splits evenly; an MLP block (and every standalone module in ``_tp_modules.py``) may
split unevenly ([Note: uneven tensor-parallel slices] in ``hf_elixir/chunk/_tp_slices.py``).

Source: Megatron-LM (arXiv 1909.08053, section 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_elixir.chunk._tp_slices import tp_slice, tp_slice_sizes
from hf_elixir.parallel._collectives import copy_to_group, reduce_from_group

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TPShardLayout", "parallelize_block"]


@dataclass(frozen=True)
class TPShardLayout:
    """How a tp-sharded parameter maps to its full tensor.

    Attributes:
        dim: the tensor dim that is split.
        parts: the full tensor along ``dim`` is ``parts`` equal pieces, each split over the tp ranks
            (3 for GPT-2's fused q|k|v), so a rank holds ``[part_0 slice | part_1 slice | ...]``.
        full_size: the full tensor's size along ``dim`` (all parts). The ranks need not divide a part: each
            holds the features :func:`~hf_elixir.chunk._tp_slices.tp_slice` gives it (ceil-sized, the last
            rank's shorter; [Note: uneven tensor-parallel slices]).
    """

    dim: int
    parts: int
    full_size: int

    def sizes(self, size: int) -> list[int]:
        """Every tp rank's length along ``dim`` (rank order) for a tp group of ``size`` ranks."""
        return [self.parts * n for n in tp_slice_sizes(self.full_size // self.parts, size)]


def _split(full: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``: each of its ``parts`` equal pieces cut by :func:`tp_slice`."""
    assert full.shape[dim] % parts == 0, f"{full.shape[dim]} features are not {parts} equal packed parts"
    start, length = tp_slice(full.shape[dim] // parts, rank, size)
    pieces = full.chunk(parts, dim=dim)
    return torch.cat([p.narrow(dim, start, length) for p in pieces], dim=dim).contiguous()


def merge_shards(shards: list[torch.Tensor], layout: TPShardLayout) -> torch.Tensor:
    """Inverse of the split: tp-rank-ordered local shards (uneven ones too) -> the full tensor."""
    per_rank = [s.split(s.shape[layout.dim] // layout.parts, dim=layout.dim) for s in shards]
    full = torch.cat([torch.cat([r[i] for r in per_rank], dim=layout.dim) for i in range(layout.parts)],
                     dim=layout.dim)
    assert full.shape[layout.dim] == layout.full_size, f"merged {tuple(full.shape)} for {layout}"
    return full


def _new_param(data: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(data.clone(), requires_grad=like.requires_grad)


class _ParallelMatmul(nn.Module):
    def __init__(self, module: nn.Module, group: Any, rank: int, size: int) -> None:
        super().__init__()
        self.conv1d = type(module).__name__ == "Conv1D"  # weight (in, out) instead of (out, in)
        self.group, self.tp_rank, self.tp_size = group, rank, size
        self.layouts: dict[str, TPShardLayout] = {}

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.conv1d:
            out = x @ self.weight
            return out if bias is None else out + bias
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(_ParallelMatmul):
    """Output features split over the tp group; input replicated. Output stays sharded (the
    row-parallel consumer of the block takes it as is).

    Args:
        module: the full ``nn.Linear`` or ``Conv1D`` (same init on every rank).
        group / rank / size: the tp group, this rank's index in it, its size.
        fused_parts: the output is this many equal parts (q|k|v), each split separately.
    """

    def __init__(self, module: nn.Module, group: Any, rank: int, size: int, fused_parts: int = 1) -> None:
        super().__init__(module, group, rank, size)
        out_dim = 1 if self.conv1d else 0
        self.weight = _new_param(_split(module.weight.data, out_dim, fused_parts, rank, size), module.weight)
        self.full_out_features = module.weight.shape[out_dim]  # all ranks together (a split may be uneven)
        self.layouts["weight"] = TPShardLayout(out_dim, fused_parts, self.full_out_features)
        if module.bias is not None:
            self.bias = _new_param(_split(module.bias.data, 0, fused_parts, rank, size), module.bias)
            self.layouts["bias"] = TPShardLayout(0, fused_parts, self.full_out_features)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(copy_to_group(x, self.group), self.bias)


class RowParallelLinear(_ParallelMatmul):
    """Input features split over the tp group (input arrives sharded); partial outputs all-reduced,
    then the (replicated) bias is added once."""

    def __init__(self, module: nn.Module, group: Any, rank: int, size: int) -> None:
        super().__init__(module, group, rank, size)
        in_dim = 0 if self.conv1d else 1
        self.weight = _new_param(_split(module.weight.data, in_dim, 1, rank, size), module.weight)
        self.layouts["weight"] = TPShardLayout(in_dim, 1, module.weight.shape[in_dim])
        self.bias = None if module.bias is None else _new_param(module.bias.data, module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_group(self._matmul(x, None), self.group)
        return out if self.bias is None else out + self.bias


def parallelize_block(parent: nn.Module, block: Any, group: Any, rank: int, size: int) -> dict[str, TPShardLayout]:
    """Replace ``block``'s children of ``parent`` by parallel layers; shrink head counts/widths.

    Returns:
        child-relative parameter name (``"c_attn.weight"``) -> :class:`TPShardLayout`.
    """
    layouts: dict[str, TPShardLayout] = {}
    for name in block.column:
        new = ColumnParallelLinear(getattr(parent, name), group, rank, size, block.fused_parts)
        setattr(parent, name, new)
        layouts.update({f"{name}.{p}": lay for p, lay in new.layouts.items()})
    new_row = RowParallelLinear(getattr(parent, block.row), group, rank, size)
    setattr(parent, block.row, new_row)
    layouts.update({f"{block.row}.{p}": lay for p, lay in new_row.layouts.items()})
    attrs = ((block.num_heads_attr,) if block.num_heads_attr else ()) + tuple(block.width_attrs)
    for attr in attrs:
        value = getattr(parent, attr)
        assert value % size == 0, f"{type(parent).__name__}.{attr}={value} not divisible by tp size {size}"
        setattr(parent, attr, value // size)
    return layouts
