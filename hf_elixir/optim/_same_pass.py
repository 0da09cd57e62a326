"""The host Adam/AdamW step that writes the compute-dtype copy in the same pass over memory.

[Note: same-pass host step] A host optimizer chunk whose compute copy is uploaded from a staging buffer
([Note: overlapped refresh] in ``_refresh.py``) used to be stepped by the inner ``torch.optim`` optimizer over
its shard views, then cast as a whole (``staging.copy_(master)``): a second pass over the fp32 master, which
by then has left the caches (a shard is tens of MiB). Adam/AdamW stepped by PyTorch's fused CPU kernel
(``fused=True``, what ``ElixirOptimizer`` picks when the user left the implementation to PyTorch, [Note: fused
shard update]) are instead stepped block by block: the shard is walked in blocks of about
:data:`BLOCK_NUMEL` elements; in each block every view's slice is updated by ``torch._fused_adamw_`` /
``torch._fused_adam_`` (one call per param group, so one call has one group's hyperparameters; a view's
slices share its ``step`` tensor, incremented once before the first block, as ``torch.optim``'s
``_fused_adam`` does), then the block's master is cast into the staging buffer while it is still in cache.

Exactness: the kernel is element-wise, but its vector loop starts at each tensor's first element and a tail
shorter than a vector takes a scalar path whose rounding can differ in the last bit. A block boundary that
falls inside a view is therefore moved up to the next multiple of :data:`ALIGN_NUMEL` elements from the
view's start, so each element takes the same path as in the one call over the whole view and the result is
bitwise that of ``torch.optim.AdamW(fused=True)`` on the views (``tests/test_same_pass_step.py``). The state
tensors (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``step``) are the inner optimizer's own, sliced, so
``state_dict`` / ``load_state_dict``, checkpoints and the host lane's snapshots and rollbacks see exactly what
the unblocked step leaves.

What falls back to step-then-cast: other optimizer classes, a group not run by the fused kernel (the user set
``foreach`` or ``fused=False``, ``differentiable``, ``capturable``), a tensor hyperparameter, chunks without
a staging buffer (fp32 compute, device optimizer chunks, host shards).

Source: DeepSpeed's CPU Adam (``DeepSpeedCPUAdam.step``, ``fp16_param_groups``) writes the fp16 parameter
copy in the same loop as the update; ZeRO-Offload (arXiv 2101.06840) section 4, the CPU optimizer with the
fp16 copy. PyTorch ``torch.optim.adam._fused_adam`` for the kernel's calling convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ALIGN_NUMEL", "BLOCK_NUMEL", "SamePassTable", "ViewTensors", "group_runs_fused", "step_and_cast"]

#: elements per block: the fp32 master (4 B), gradient (4 B) and two moments (8 B) of a block, 8 MiB at 512 Ki
#: elements, stay in the last-level cache until the cast reads the master. Chosen by
#: ``benchmarks/host_adam.py`` (see its docstring for the sweep and the figures).
BLOCK_NUMEL = 1 << 20
#: a block boundary inside a view is a multiple of this many elements from the view's start (vector width of
#: the fused kernel: 8 or 16 fp32 lanes; 64 = one cache line of 16 lanes x 4)
ALIGN_NUMEL = 64


def group_runs_fused(cls: type, group: dict) -> bool:
    """Whether ``torch.optim`` steps the params of ``group`` (an inner param group of ``cls``) with the fused
    Adam/AdamW kernel and scalar hyperparameters, i.e. whether the same-pass step reproduces it."""
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if group.get("fused") is not True or group.get("differentiable") or group.get("capturable"):
        return False
    scalars = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])
    return not any(torch.is_tensor(v) for v in scalars)


@dataclass(frozen=True)
class _Segment:
    view: int  # index into the table's spans
    start: int  # slice of the view, relative to the view's first element
    stop: int


@dataclass(frozen=True)
class SamePassTable:
    """A shard cut into blocks: ``bounds[k]:bounds[k + 1]`` is block ``k`` (shard offsets), ``segments[k]`` the
    view slices in it. Built once per chunk (views never move).

    Args:
        spans: ``(lo, hi)`` shard offsets of the views, sorted and disjoint (gaps: padding, frozen or foreign
            elements, cast but not stepped).
        numel: the shard's numel.
        block_numel: the target block size (elements); default :data:`BLOCK_NUMEL` (read at the call).
    """

    bounds: tuple[int, ...]
    segments: tuple[tuple[_Segment, ...], ...]

    @classmethod
    def build(cls, spans: list[tuple[int, int]], numel: int, block_numel: int | None = None) -> SamePassTable:
        block_numel = block_numel or BLOCK_NUMEL
        assert block_numel >= ALIGN_NUMEL, f"block_numel {block_numel} < {ALIGN_NUMEL}"
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"views overlap or are unsorted: {spans[:4]}"
        bounds, v = [0], 0
        for target in range(block_numel, numel, block_numel):
            while v < len(spans) and spans[v][1] <= target:
                v += 1
            bound = target
            if v < len(spans) and spans[v][0] < target:  # inside a view: align to the view's vector lanes
                lo, hi = spans[v]
                bound = min(hi, lo + -(-(target - lo) // ALIGN_NUMEL) * ALIGN_NUMEL)
            if bound > bounds[-1]:
                bounds.append(bound)
        if numel > bounds[-1] or numel == 0:
            bounds.append(numel)
        segments, v = [], 0
        for b0, b1 in zip(bounds, bounds[1:]):
            while v < len(spans) and spans[v][1] <= b0:
                v += 1
            block, w = [], v
            while w < len(spans) and spans[w][0] < b1:
                lo, hi = spans[w]
                block.append(_Segment(w, max(lo, b0) - lo, min(hi, b1) - lo))
                w += 1
            segments.append(tuple(block))
        return cls(tuple(bounds), tuple(segments))


@dataclass
class ViewTensors:
    """One view's tensors for the kernel (1-D fp32, its numel): the master slice, the gradient, the moments,
    ``max_exp_avg_sq`` under AMSGrad (else ``None``) and the ``step`` (fp32 0-d; the same tensor in every
    block), with its param group's hyperparameters (``group``: an inner ``torch.optim`` param group)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    step: torch.Tensor
    group: dict


def _kernel_call(items: list[tuple[ViewTensors, int, int]]) -> None:
    """One ``torch._fused_adam(w)_`` call over the slices of views of one param group."""
    group = items[0][0].group
    beta1, beta2 = group["betas"]
    amsgrad = bool(group["amsgrad"])
    kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    params = [t.param[a:b] for t, a, b in items]
    kernel(params, [t.grad[a:b] for t, a, b in items],
           [t.exp_avg[a:b] for t, a, b in items], [t.exp_avg_sq[a:b] for t, a, b in items],
           [t.max_exp_avg_sq[a:b] for t, a, b in items] if amsgrad else [], [t.step for t, _, _ in items],
           amsgrad=amsgrad, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
           eps=group["eps"], maximize=bool(group["maximize"]))
    # the kernel does not bump the version counter of what it writes: the master's (shared with these slices)
    # is what a pending upload's check reads ([Note: strict refresh source] in hf_elixir/chunk/_chunk_refresh.py)
    torch.autograd.graph.increment_version(params)


@torch.no_grad()
def step_and_cast(table: SamePassTable, views: list[ViewTensors | None], master: torch.Tensor,
                  staging: torch.Tensor) -> None:
    """One Adam/AdamW step of the views that are not ``None`` and the cast of the whole shard, block by block
    ([Note: same-pass host step]).

    Args:
        table: the shard's blocks (:meth:`SamePassTable.build`), aligned with ``views``.
        views: per span of the table, the tensors to step, or ``None`` for a view that is not stepped now
            (no gradient this step): its elements are cast unchanged.
        master: fp32 ``[numel]``, the shard's master (the views' ``param`` are slices of it).
        staging: ``[numel]`` of the compute dtype (bf16 / fp16), written with ``master`` cast to its dtype.
    """
    assert master.shape == staging.shape and master.dim() == 1, f"{tuple(master.shape)} vs {tuple(staging.shape)}"
    steps = [t.step for t in views if t is not None]
    if steps:
        torch._foreach_add_(steps, 1)  # as torch.optim.adam._fused_adam, before the kernel reads them
    for b0, b1, segments in zip(table.bounds, table.bounds[1:], table.segments):
        by_group: dict[int, list[tuple[ViewTensors, int, int]]] = {}
        for seg in segments:
            tensors = views[seg.view]
            if tensors is not None:
                by_group.setdefault(id(tensors.group), []).append((tensors, seg.start, seg.stop))
        for items in by_group.values():
            _kernel_call(items)
        staging[b0:b1].copy_(master[b0:b1])
