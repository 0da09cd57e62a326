"""Tensor parallel one module at a time: the placements a model config's plan gives (Llama, Qwen3, Gemma3, ...).

A spec's *block* (:func:`hf_elixir.parallel._tensor_parallel.parallelize_block`) also shrinks its parent's head
count; the modules here need no parent change, because the attention of every family with a transformers plan
reshapes to ``(-1, head_dim)``: a rank whose ``q_proj`` / ``k_proj`` / ``v_proj`` give ``heads / tp`` whole heads
runs the Hugging Face forward unchanged on them (this is what transformers' own ``colwise`` relies on; the head
counts are checked by ``hf_elixir.placement._hf_plans.check_heads``).

What each placement runs (weights as plain tensors, so chunks can hold them; see [Note: plan styles] in
``hf_elixir/placement/_hf_plans.py`` for why not transformers' DTensor styles):

Every split may be uneven: a rank holds the ceil-sized slice :func:`~hf_elixir.chunk._tp_slices.tp_slice` gives it
([Note: uneven tensor-parallel slices]); gathers pad to the longest slice and trim, the vocabulary-parallel
embedding masks ids outside this rank's ``[first, first + rows)``.

- ``column`` / ``row``: :class:`ColumnParallelLinear` / :class:`RowParallelLinear`.
- ``column_gather``: column, then the output all-gathered over the last dim (backward: this rank's slice).
- ``row_split``: the whole input sliced to this rank's features (backward: all-gather), then row.
- ``embedding_row``: the module keeps its class (Gemma3's scaled embedding too); its weight becomes this
  rank's vocabulary rows, a pre-hook maps the ids into them (others to row 0), a hook zeroes the rows of
  ids another rank owns and all-reduces (Megatron's vocabulary-parallel embedding).
- ``embedding_column``: the weight's hidden columns split; a hook all-gathers the lookups.
- ``grad_allreduce``: nothing split; each parameter's gradient is summed over the tp group as it is computed
  (before it reaches ``.grad`` or a chunk), so every tp rank holds the gradient of all heads.
- ``packed_column``: :class:`PackedColumnLinear`, ``column`` with two packed parts (``gate_r|up_r``).
- ``mla_kv_a``: nothing split; a hook passes the output's last ``qk_rope_head_dim`` features through an identity
  whose backward sums the gradient over the tp group (see [Note: packed and MLA styles] in ``_hf_plans.py``).
- ``moe_tp``: every fused expert parameter replaced by this rank's slice (``moe_tp_splits``: its plan entry's dim
  and packed parts); the module's input and routing weights pass an identity whose backward all-reduces, its
  output is all-reduced (a column/row pair per expert).

[Note: gradient sum in forward] ``grad_allreduce`` runs the module's forward on its parameters passed through
an identity whose backward sums the gradient over the tp group (as transformers' ``_use_local_dtensor_params``
swaps a module's parameters for its forward), not through a tensor hook on the parameter: streamed init
(``prepare(..., checkpoint=folder)`` on a meta model) swaps each meta parameter's implementation for a
placeholder's (``torch.utils.swap_tensors``), and a hook leaves with the old implementation. With hooks,
Qwen3/Gemma3's q_norm/k_norm gradients stayed partial after a streamed load (``stream_gemma3_tp2`` caught it).
The swap sits inside ``forward`` (after every forward pre-hook, so ``prepare``'s unshard hooks still find
the parameters themselves) and is undone after it.

[Note: tied tensor-parallel weights] Gemma3 ties ``lm_head.weight`` to ``embed_tokens.weight``; the plan splits
both by vocabulary rows (``colwise_gather_output`` / ``embedding_rowwise``), so they stay one parameter: the
first module rewritten makes the shard, the other takes the same ``nn.Parameter`` (``_check_tied`` in
``hf_elixir/placement/_resolve.py`` refuses ties whose placements split differently).

Source: Megatron-LM (arXiv 1909.08053, section 3: column/row pairs, the vocabulary-parallel embedding);
transformers ``distributed/tensor_parallel.py`` (the style semantics mirrored here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_elixir.chunk._tp_slices import tp_slice
from hf_elixir.parallel._collectives import copy_to_group, gather_last_dim, reduce_from_group, split_last_dim
from hf_elixir.parallel._tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPShardLayout, _split
from hf_elixir.placement._hf_plans import moe_tp_splits, rope_dim_of

__all__ = ["ColumnGatherLinear", "PackedColumnLinear", "RowSplitLinear", "parallelize_modules"]


class ColumnGatherLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` whose output is all-gathered to full features (``colwise_gather_output``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_last_dim(super().forward(x), self.group, self.full_out_features)


class RowSplitLinear(RowParallelLinear):
    """:class:`RowParallelLinear` taking its input whole and slicing it locally (``rowwise_split_input``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(split_last_dim(x, self.group))


class PackedColumnLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` of a linear whose output packs two equal parts (``packed_colwise``): each part
    is split over the tp group, so this rank holds and computes ``gate_r|up_r`` (``TPShardLayout(dim, 2, full)``)."""

    def __init__(self, module: nn.Module, group: Any, rank: int, size: int) -> None:
        super().__init__(module, group, rank, size, fused_parts=2)


_LINEARS = {"column": ColumnParallelLinear, "column_gather": ColumnGatherLinear,
            "row": RowParallelLinear, "row_split": RowSplitLinear, "packed_column": PackedColumnLinear}


def _split_embedding(module: nn.Embedding, placement: str, group: Any, rank: int, size: int) -> dict[str, TPShardLayout]:
    dim = 0 if placement == "embedding_row" else 1
    weight = module.weight
    full = weight.shape[dim]
    module.weight = nn.Parameter(_split(weight.data, dim, 1, rank, size), requires_grad=weight.requires_grad)
    first, rows = tp_slice(full, rank, size)  # this rank's vocabulary rows or hidden columns (may be uneven)
    if dim == 1:
        module.embedding_dim = rows
        module.register_forward_hook(lambda mod, args, out: gather_last_dim(out, group, full))
        return {"weight": TPShardLayout(1, 1, full)}
    module.num_embeddings = rows
    pad = module.padding_idx
    module.padding_idx = pad - first if pad is not None and first <= pad < first + rows else None
    owned: list[torch.Tensor] = []  # the ids mask between the pre-hook and the hook of one call

    def map_ids(mod: nn.Module, args: tuple) -> tuple:
        ids = args[0]
        outside = (ids < first) | (ids >= first + rows)
        owned.append(outside)
        return ((ids - first).masked_fill(outside, 0), *args[1:])

    def combine(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        outside = owned.pop()
        return reduce_from_group(out.masked_fill(outside.unsqueeze(-1), 0), group)

    module.register_forward_pre_hook(map_ids)
    module.register_forward_hook(combine)
    return {"weight": TPShardLayout(0, 1, full)}


def _sum_grads_over(module: nn.Module, group: Any) -> None:
    """See ``grad_allreduce`` in the module docstring and [Note: gradient sum in forward]."""
    original_forward = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        params = dict(module._parameters)
        for name, param in params.items():
            if param is not None and param.requires_grad and torch.is_grad_enabled():
                module._parameters[name] = copy_to_group(param, group)  # identity; backward sums over group
        try:
            return original_forward(*args, **kwargs)
        finally:
            module._parameters.update(params)

    module.forward = forward


def _sum_rope_grad_over(module: nn.Module, group: Any, rope_dim: int) -> None:
    """``mla_kv_a``: the output's last ``rope_dim`` features pass an identity whose backward sums over ``group``."""

    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        kv_pass, k_rot = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([kv_pass, copy_to_group(k_rot, group)], dim=-1)

    module.register_forward_hook(hook)


def _split_experts_over_tp(module: nn.Module, fqn: str, model: nn.Module, group: Any, rank: int,
                           size: int) -> dict[str, TPShardLayout]:
    """``moe_tp``: see the module docstring and [Note: packed and MLA styles] in ``_hf_plans.py``."""
    layouts = {}
    for pname, (dim, parts) in moe_tp_splits(model, fqn, module, size).items():
        param = getattr(module, pname)
        setattr(module, pname, nn.Parameter(_split(param.data, dim, parts, rank, size),
                                            requires_grad=param.requires_grad))
        layouts[pname] = TPShardLayout(dim, parts, param.shape[dim])
    original_forward = module.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2 and isinstance(args[1], torch.Tensor) and args[1].is_floating_point():  # routing weights
            args = (args[0], copy_to_group(args[1], group), *args[2:])
        return reduce_from_group(original_forward(copy_to_group(hidden_states, group), *args, **kwargs), group)

    module.forward = forward
    return layouts


def _rewrite(module: nn.Module, placement: str, group: Any, rank: int, size: int,
             model: nn.Module, fqn: str) -> tuple[nn.Module, dict]:
    """The module to install at its FQN (a new one for linears, the same one otherwise) and its layouts."""
    if placement in _LINEARS:
        new = _LINEARS[placement](module, group, rank, size)
        return new, dict(new.layouts)
    if placement.startswith("embedding_"):
        return module, _split_embedding(module, placement, group, rank, size)
    if placement == "moe_tp":
        return module, _split_experts_over_tp(module, fqn, model, group, rank, size)
    if placement == "mla_kv_a":
        rope_dim = rope_dim_of(model)
        if not isinstance(rope_dim, int):
            raise ValueError(f"placement 'mla_kv_a' needs config.qk_rope_head_dim (the rotary features of the "
                             f"output, got {rope_dim!r}); place the module 'sharded' in ElixirConfig.placements")
        _sum_rope_grad_over(module, group, rope_dim)
        return module, {}
    assert placement == "grad_allreduce", f"rank {dist.get_rank()}: no tensor-parallel rewrite for {placement!r}"
    _sum_grads_over(module, group)
    return module, {}


def parallelize_modules(model: nn.Module, items: list[tuple[str, str]], group: Any, rank: int,
                        size: int) -> dict[str, TPShardLayout]:
    """Rewrite each ``(fqn, placement)`` of ``items`` in place on the tp ``group``.

    Args:
        model: the model (same weights on every rank).
        items: standalone tensor-parallel modules, from ``ResolvedPlacements.tp_modules``.
        group / rank / size: the tensor-parallel group, this rank's index in it and its size.

    Returns:
        parameter FQN -> :class:`TPShardLayout` for every split parameter, under every name a tied parameter
        has (see [Note: tied tensor-parallel weights]).
    """
    named = dict(model.named_modules())
    shards: dict[int, nn.Parameter] = {}  # id of an original parameter -> its shard
    layouts: dict[str, TPShardLayout] = {}
    for fqn, placement in items:
        module = named[fqn]
        originals = dict(module.named_parameters(recurse=False))
        new, local = _rewrite(module, placement, group, rank, size, model, fqn)
        for pname, original in originals.items():
            if id(original) in shards:  # tied: take the shard the first owner made
                setattr(new, pname, shards[id(original)])
            else:
                shards[id(original)] = getattr(new, pname)
        if new is not module:
            parent_fqn, _, child = fqn.rpartition(".")
            setattr(named[parent_fqn] if parent_fqn else model, child, new)
        layouts.update({f"{fqn}.{k}": v for k, v in local.items()})
    return layouts
