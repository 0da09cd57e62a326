"""MoE token permutation for expert parallelism: routing map, permute (gather), unpermute (weighted scatter).

Given each token's expert choice(s), ``moe_permute`` gathers the token rows into expert-contiguous order
(what an all-to-all over expert-parallel ranks, or a loop over local experts, consumes) and
``moe_unpermute`` brings the expert outputs back to token order, weighted by the router gates and summed
over a token's choices. Both are differentiable (``torch.autograd.Function``).

[Note: capacity and dropping, as HF Switch-Transformers]
``SwitchTransformersTop1Router`` (transformers ``models/switch_transformers``) one-hot encodes each
token's argmax expert, takes a cumulative sum over the tokens of a *sequence* (``dim=-2`` of
``(batch, seq, experts)``) and keeps a token for its expert only while that running count is
``<= expert_capacity``; ``SwitchTransformersExperts`` then gives a dropped token a zero expert output
(the residual connection carries it). Here the same rule is applied to the flat ``[T]`` token list:
``group_size`` consecutive tokens (HF: ``sequence_length``) share one capacity budget per expert, and
within a group tokens are served in token order. For top-k (``expert_index`` of shape ``[T, k]``) all
first choices of a group have priority over all second choices, and so on (the GShard convention);
for ``k == 1`` this is exactly the Switch rule.

[Note: row map]
``row_map`` (int64, same shape as ``expert_index``) gives for each (token, choice) its row in the
permuted tensor, or ``-1`` if the choice was dropped. Rows are ordered by expert, then by token, then
by choice; ``counts[e]`` is the number of rows of expert ``e``, so expert ``e`` owns rows
``[offsets[e], offsets[e] + counts[e])`` with ``offsets = cumsum(counts) - counts``. The number of
rows ``T' = counts.sum()`` is read on the host once (the output must be allocated); everything else
stays on the device.

Kernels: ``_gather_rows_kernel`` (one program per permuted row: copy a token row, optionally scaled by a
weight, optionally also the dot product with another row, used for the gate gradient) and
``_combine_rows_kernel`` (one program per token: sum of its k permuted rows, optionally weighted).
Both accumulate in fp32 and loop over the hidden dimension in ``BLOCK_H`` pieces.
"""

from __future__ import annotations

import torch

from ._dispatch import HAS_TRITON, use_triton

__all__ = ["moe_permute", "moe_unpermute", "moe_routing_map"]

MAX_BLOCK_H = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_rows_kernel(
        src_ptr,
        dst_ptr,
        src_row_ptr,
        weight_ptr,
        other_ptr,
        dot_ptr,
        hidden,
        HAS_WEIGHT: tl.constexpr,
        HAS_DOT: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """dst[r] = src[src_row[r]] * weight[r];  dot[r] = <src[src_row[r]], other[r]> (fp32)."""
        r = tl.program_id(0).to(tl.int64)
        s = tl.load(src_row_ptr + r).to(tl.int64)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + r).to(ACC_DTYPE)
        acc = tl.zeros([BLOCK_H], dtype=ACC_DTYPE)
        for h0 in range(0, hidden, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            hmask = cols < hidden
            x = tl.load(src_ptr + s * hidden + cols, mask=hmask, other=0.0).to(ACC_DTYPE)
            y = x
            if HAS_WEIGHT:
                y = x * w
            tl.store(dst_ptr + r * hidden + cols, y.to(dst_ptr.dtype.element_ty), mask=hmask)
            if HAS_DOT:
                o = tl.load(other_ptr + r * hidden + cols, mask=hmask, other=0.0).to(ACC_DTYPE)
                acc += x * o
        if HAS_DOT:
            tl.store(dot_ptr + r, tl.sum(acc, axis=0))

    @triton.jit
    def _combine_rows_kernel(
        src_ptr,
        dst_ptr,
        row_map_ptr,
        gate_ptr,
        hidden,
        K: tl.constexpr,
        HAS_GATE: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """dst[t] = sum_j [row_map[t, j] >= 0] * gate[t, j] * src[row_map[t, j]] (fp32 accumulation)."""
        t = tl.program_id(0).to(tl.int64)
        for h0 in range(0, hidden, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            hmask = cols < hidden
            acc = tl.zeros([BLOCK_H], dtype=ACC_DTYPE)
            for j in tl.static_range(K):
                row = tl.load(row_map_ptr + t * K + j).to(tl.int64)
                limit = tl.where(row >= 0, hidden, 0)  # a dropped choice (row -1) loads nothing
                x = tl.load(src_ptr + row * hidden + cols, mask=cols < limit, other=0.0).to(ACC_DTYPE)
                if HAS_GATE:
                    x = x * tl.load(gate_ptr + t * K + j).to(ACC_DTYPE)
                acc += x
            tl.store(dst_ptr + t * hidden + cols, acc.to(dst_ptr.dtype.element_ty), mask=hmask)


def _block_h(hidden: int) -> int:
    return min(triton.next_power_of_2(max(hidden, 1)), MAX_BLOCK_H)


def _acc_dtype(dtype: torch.dtype):
    """fp32 accumulation, fp64 for fp64 inputs (gradcheck)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _acc_torch_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# row primitives: Triton launch or PyTorch reference
# ---------------------------------------------------------------------------------------------


def _gather_rows(src, src_row, num_rows, weight=None, other=None, *, triton_path: bool):
    """Returns (dst [num_rows, H] in src.dtype, dot [num_rows] fp32 or None); see _gather_rows_kernel."""
    hidden = src.shape[1]
    acc = _acc_torch_dtype(src.dtype)
    if not triton_path:
        x = src.index_select(0, src_row).to(acc)
        dot = (x * other.to(acc)).sum(-1) if other is not None else None
        if weight is not None:
            x = x * weight.to(acc)[:, None]
        return x.to(src.dtype), dot
    dst = torch.empty(num_rows, hidden, dtype=src.dtype, device=src.device)
    dot = torch.empty(num_rows, dtype=acc, device=src.device) if other is not None else None
    if num_rows > 0 and hidden > 0:
        _gather_rows_kernel[(num_rows,)](
            src, dst, src_row,
            weight if weight is not None else src_row,
            other if other is not None else dst,
            dot if dot is not None else dst,
            hidden,
            HAS_WEIGHT=weight is not None, HAS_DOT=other is not None, ACC_DTYPE=_acc_dtype(src.dtype),
            BLOCK_H=_block_h(hidden),
        )
    elif dot is not None:
        dot.zero_()
    return dst, dot


def _combine_rows(src, row_map_2d, num_tokens, gate_2d=None, *, triton_path: bool):
    """Returns dst [num_tokens, H] in src.dtype; see _combine_rows_kernel."""
    hidden = src.shape[1]
    k = row_map_2d.shape[1]
    if not triton_path:
        acc = _acc_torch_dtype(src.dtype)
        kept = row_map_2d >= 0
        rows = src.to(acc)[row_map_2d.clamp(min=0)]  # [T, k, H]
        w = kept.to(acc)
        if gate_2d is not None:
            w = w * gate_2d.to(acc)
        return (rows * w[..., None]).sum(1).to(src.dtype)
    dst = torch.empty(num_tokens, hidden, dtype=src.dtype, device=src.device)
    if num_tokens > 0 and hidden > 0:
        _combine_rows_kernel[(num_tokens,)](
            src, dst, row_map_2d, gate_2d if gate_2d is not None else row_map_2d, hidden,
            K=k, HAS_GATE=gate_2d is not None, ACC_DTYPE=_acc_dtype(src.dtype), BLOCK_H=_block_h(hidden),
        )
    return dst


def _inverse_rows(row_map_2d: torch.Tensor, num_rows: int) -> torch.Tensor:
    """flat (token*k + choice) index of each permuted row, int64 [num_rows], without a host sync."""
    flat = row_map_2d.reshape(-1)
    slots = torch.arange(flat.numel(), device=flat.device)
    target = torch.where(flat >= 0, flat, torch.full_like(flat, num_rows))  # dropped -> dump slot
    inv = torch.zeros(num_rows + 1, dtype=torch.int64, device=flat.device)
    inv.scatter_(0, target, slots)
    return inv[:num_rows]


# ---------------------------------------------------------------------------------------------
# routing map
# ---------------------------------------------------------------------------------------------


def moe_routing_map(expert_index: torch.Tensor, num_experts: int, capacity: int | None,
                    group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row map and per-expert counts for ``expert_index`` (see [Note: capacity and dropping], [Note: row map]).

    Args:
        expert_index: int tensor ``[T]`` (top-1) or ``[T, k]`` of expert ids in ``[0, num_experts)``,
            or ``-1`` for a choice that is not routed (dropped before, e.g. by HF's router).
        num_experts: ``E``.
        capacity: max tokens per expert per group; ``None`` = no dropping.
        group_size: tokens per capacity group (HF Switch: ``sequence_length``); ``None`` = all ``T``.

    Returns:
        ``(row_map, counts)``: int64 like ``expert_index`` (row or -1), int64 ``[E]``.
    """
    row_map, counts, _ = _routing_map(expert_index, num_experts, capacity, group_size)
    return row_map, counts


def _as_2d(index: torch.Tensor) -> torch.Tensor:
    """``[T]`` -> ``[T, 1]``, ``[T, k]`` unchanged (a ``reshape(T, -1)`` fails for ``T = 0``: a rank
    that routes no token, which expert parallelism meets)."""
    return index.unsqueeze(1) if index.dim() == 1 else index


def _histogram(values: torch.Tensor, size: int) -> torch.Tensor:
    """int64 counts of ``values`` in ``[0, size)``; unlike ``torch.bincount`` it never syncs on CUDA."""
    return torch.zeros(size, dtype=torch.int64, device=values.device).scatter_add_(0, values, torch.ones_like(values))


def _routing_map(expert_index, num_experts, capacity, group_size):
    """moe_routing_map plus the number of kept rows (an int, read on the host once)."""
    ei = _as_2d(expert_index).to(torch.int64)
    num_tokens, k = ei.shape
    device = ei.device
    group = num_tokens if group_size is None else group_size
    num_groups = num_tokens // group if group > 0 else 0
    # a choice of -1 (not routed) goes to the extra bucket ``num_experts``, which is never kept
    routed = ei >= 0
    ei = torch.where(routed, ei, torch.full_like(ei, num_experts))
    buckets = num_experts + 1
    # priority order (group, choice, token): rank of each assignment within its (group, expert)
    prio_e = ei.reshape(num_groups, group, k).transpose(1, 2).reshape(-1)
    prio_g = torch.arange(num_groups, device=device).repeat_interleave(group * k)
    key = prio_g * buckets + prio_e
    sorted_key, order = torch.sort(key, stable=True)
    sizes = _histogram(key, num_groups * buckets)
    starts = torch.cumsum(sizes, 0) - sizes
    rank_sorted = torch.arange(key.numel(), device=device) - starts[sorted_key]
    rank_prio = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    keep_prio = rank_prio < capacity if capacity is not None else torch.ones_like(rank_prio, dtype=torch.bool)
    keep_prio &= prio_e < num_experts
    # back to (token, choice) order
    keep = keep_prio.reshape(num_groups, k, group).transpose(1, 2).reshape(num_tokens, k)
    flat_e = ei.reshape(-1)
    dest_key = torch.where(keep.reshape(-1), flat_e, torch.full_like(flat_e, num_experts))
    _, dest_order = torch.sort(dest_key, stable=True)  # kept rows first, by expert, then token, then choice
    counts = _histogram(dest_key, num_experts + 1)[:num_experts]
    num_rows = int(counts.sum())  # the one host sync: the permuted tensor's size
    row_map = torch.full((num_tokens * k,), -1, dtype=torch.int64, device=device)
    row_map[dest_order[:num_rows]] = torch.arange(num_rows, device=device)
    return row_map.reshape(expert_index.shape), counts, num_rows


# ---------------------------------------------------------------------------------------------
# autograd functions
# ---------------------------------------------------------------------------------------------


class _MoePermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, row_map_2d, num_rows, triton_path):
        src_row = _inverse_rows(row_map_2d, num_rows) // row_map_2d.shape[1]
        permuted, _ = _gather_rows(hidden, src_row, num_rows, triton_path=triton_path)
        ctx.save_for_backward(row_map_2d)
        ctx.triton_path = triton_path
        ctx.num_tokens = hidden.shape[0]
        return permuted

    @staticmethod
    def backward(ctx, grad_permuted):
        (row_map_2d,) = ctx.saved_tensors
        grad_hidden = _combine_rows(grad_permuted.contiguous(), row_map_2d, ctx.num_tokens,
                                    triton_path=ctx.triton_path)
        return grad_hidden, None, None, None


class _MoeUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted_out, row_map_2d, gates_2d, num_tokens, triton_path):
        out = _combine_rows(permuted_out, row_map_2d, num_tokens, gates_2d, triton_path=triton_path)
        ctx.save_for_backward(permuted_out, row_map_2d, gates_2d)
        ctx.triton_path = triton_path
        return out

    @staticmethod
    def backward(ctx, grad_out):
        permuted_out, row_map_2d, gates_2d = ctx.saved_tensors
        num_rows, k = permuted_out.shape[0], row_map_2d.shape[1]
        inv = _inverse_rows(row_map_2d, num_rows)
        row_gate = gates_2d.reshape(-1).index_select(0, inv)
        need_gate_grad = ctx.needs_input_grad[2]
        grad_permuted, row_dot = _gather_rows(
            grad_out.contiguous().to(permuted_out.dtype), inv // k, num_rows, row_gate,
            permuted_out if need_gate_grad else None, triton_path=ctx.triton_path,
        )
        grad_gates = None
        if need_gate_grad:
            flat = torch.zeros(gates_2d.numel(), dtype=row_dot.dtype, device=gates_2d.device)
            flat.index_copy_(0, inv, row_dot)
            grad_gates = flat.reshape(gates_2d.shape).to(gates_2d.dtype)
        return grad_permuted, None, grad_gates, None, None


# ---------------------------------------------------------------------------------------------
# public ops
# ---------------------------------------------------------------------------------------------


def _check_expert_index(expert_index, num_tokens, num_experts, capacity, group_size):
    if expert_index.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise TypeError(f"expert_index must be an integer tensor, got {expert_index.dtype}")
    if expert_index.dim() not in (1, 2) or expert_index.shape[0] != num_tokens:
        raise ValueError(f"expert_index must be [T] or [T, k] with T={num_tokens}, got {tuple(expert_index.shape)}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity must be a non-negative int or None (no dropping), got {capacity!r}")
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1 or num_tokens % group_size):
        raise ValueError(f"group_size must be a positive divisor of T={num_tokens} (HF Switch: sequence_length), "
                         f"got {group_size!r}")
    if expert_index.device.type == "cpu" and expert_index.numel():  # range check is a host sync elsewhere
        lo, hi = int(expert_index.min()), int(expert_index.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"expert_index values must lie in [0, {num_experts}) or be -1 (not routed), "
                             f"got min {lo} max {hi}")


def moe_permute(
    hidden: torch.Tensor,
    expert_index: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    *,
    group_size: int | None = None,
    force_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather token rows into expert-contiguous order, dropping choices beyond capacity like HF Switch.

    Args:
        hidden: ``[T, H]`` token activations (any float dtype); differentiable.
        expert_index: ``[T]`` (top-1) or ``[T, k]`` integer expert ids in ``[0, E)``; ``-1`` marks a choice
            that is not routed (its ``row_map`` entry is ``-1`` and it uses no capacity), as an all-zero
            row of HF Switch's one-hot dispatch mask (a token the router already dropped).
        num_experts: ``E``.
        capacity: tokens an expert takes per group (HF: ``config.expert_capacity``); ``None`` keeps all.
        group_size: tokens per capacity group; HF Switch counts capacity per sequence, so pass
            ``sequence_length`` for a flattened ``[batch * seq, H]`` input. ``None``: one group of ``T``.
        force_triton: run the Triton kernels on CPU tensors (tests, under ``TRITON_INTERPRET=1``).

    Returns:
        ``(permuted [T', H], row_map, counts [E])``: ``permuted`` rows are ordered by expert (then
        token, then choice) and ``T' = counts.sum()``; ``row_map`` (int64, shape of
        ``expert_index``) holds each choice's row or ``-1`` if dropped; ``counts`` is int64 on
        ``hidden``'s device. See [Note: row map].

    Raises:
        ValueError / TypeError: shapes, dtypes or ranges are wrong (the message names the argument).
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}; flatten batch and sequence first")
    _check_expert_index(expert_index, hidden.shape[0], num_experts, capacity, group_size)
    if expert_index.device != hidden.device:
        raise ValueError(f"expert_index is on {expert_index.device} but hidden on {hidden.device}")
    row_map, counts, num_rows = _routing_map(expert_index, num_experts, capacity, group_size)
    row_map_2d = _as_2d(row_map)
    permuted = _MoePermute.apply(hidden.contiguous(), row_map_2d, num_rows, use_triton(hidden, force_triton))
    return permuted, row_map, counts


def moe_unpermute(
    permuted_out: torch.Tensor,
    row_map: torch.Tensor,
    gates: torch.Tensor,
    num_tokens: int,
    *,
    force_triton: bool = False,
) -> torch.Tensor:
    """Scatter expert outputs back to token order: ``out[t] = sum_j gates[t, j] * permuted_out[row_map[t, j]]``.

    Dropped choices (``row_map == -1``) contribute zero, so a token dropped by every choice gets a zero
    expert output, as in HF ``SwitchTransformersExperts``.

    Args:
        permuted_out: ``[T', H]`` expert outputs in ``moe_permute``'s row order; differentiable.
        row_map: int64 row map from ``moe_permute``, ``[T]`` or ``[T, k]``.
        gates: router weights with ``T * k`` elements (``[T]``, ``[T, 1]``, ``[T, k]`` or HF's
            ``[B, S, 1]``); differentiable.
        num_tokens: ``T``.
        force_triton: run the Triton kernels on CPU tensors (tests, under ``TRITON_INTERPRET=1``).

    Returns:
        ``[T, H]`` in ``permuted_out.dtype`` (fp32 accumulation inside).

    Raises:
        ValueError: shapes disagree (the message names the argument).
    """
    if permuted_out.dim() != 2:
        raise ValueError(f"permuted_out must be [T', H], got shape {tuple(permuted_out.shape)}")
    if row_map.dim() not in (1, 2) or row_map.shape[0] != num_tokens or row_map.dtype != torch.int64:
        raise ValueError(f"row_map must be int64 [T] or [T, k] with T={num_tokens}, got {row_map.dtype} "
                         f"{tuple(row_map.shape)}; pass the row_map returned by moe_permute")
    row_map_2d = _as_2d(row_map)
    if gates.numel() != row_map_2d.numel():
        raise ValueError(f"gates has {gates.numel()} elements, expected T*k={row_map_2d.numel()} "
                         f"(one weight per token and choice)")
    gates_2d = gates.reshape(row_map_2d.shape).contiguous()
    return _MoeUnpermute.apply(permuted_out.contiguous(), row_map_2d.contiguous(), gates_2d, num_tokens,
                               use_triton(permuted_out, force_triton))
