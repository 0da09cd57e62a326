"""The access trace and the step bookkeeping of the chunk manager.

Every access of a chunk inside a step is appended to the step's trace (chunk ids, at most :data:`_MAX_TRACE`),
with the positions where each forward (micro-batch) and backward ended and the gradient-buffer bytes at each
access. When a step ends (the optimizer step, :meth:`StepTraceMixin.end_step`; or a forward of a model without an
optimizer) the trace becomes the previous step's: the order that eviction (``_eviction.py``), the gathers ahead
(``_prefetch.py``, ``_agreed_gathers.py``) and the early refresh read as the prediction of the next step
(:meth:`StepTraceMixin._next_use`). ``last_step`` holds the counters' change over the step (``step_*`` in
``memory_stats``).

[Note: forward steps] A model prepared without an optimizer (``hf_elixir.prepare(model, None, ...)``: evaluation,
``generate``) has no optimizer step to end a step, so each top-level forward is one: :meth:`end_forward` (the
model's outermost forward hook, also when forward raises) drains the gathers issued ahead, records the forward's
end and rotates the trace as :meth:`end_step` does, and ``last_step`` (``step_*`` in ``memory_stats``) holds that
forward's counters. The next forward is predicted by the previous one's order: Belady eviction and the prefetch
above, under the same rules (the window stops where that forward ended, so no gather ahead spans two forwards;
the first forward after ``prepare`` evicts by recency and prefetches nothing). Ranks issue the same gathers in
the same order because every decision reads only the previous forward's trace, the agreed plan and budget and
the pool state, and those are the same on every rank when the ranks run the same forwards in the same order.
Gathers inside the hooks need that already (which chunks are evicted, and so re-gathered, follows from the same
state under recency too), so prefetching adds no condition. A forward whose order differs from the previous one
(another path through the model, generation's prompt then its steps, an encoder called outside the top-level
forward) is still run right: the previous order only predicts; a chunk gathered ahead and not used is a wasted
gather, waited for by its eviction or at the end of the forward, on every rank alike. Off CUDA, where a local
onload ahead is a synchronous copy that overlaps nothing and only changes what is evicted, a forward step issues
none (``_prefetch`` stops at the first one; the cost model prices none off CUDA either, [Note: forward-only
pricing] in ``hf_elixir/search/_cost.py``); a backward after forward steps (a model with nothing trainable) gets
no gather ahead (the previous step had no backward). Inside a training run, a forward under ``torch.no_grad()``
outside backward (``Trainer.evaluate`` between steps) records into a trace of its own, predicted by the training
step's order from its start (a forward runs the modules in the same order), and dropped at its end: the training
step's trace, its phase ends and the reduce order's first uses are as if the evaluation had not run, so the next
step prefetches and evicts by the order it will follow (before, the evaluation's accesses were appended to the
next step's trace and shifted every position after them, backward's included).
"""

from __future__ import annotations

import bisect

import torch

from hf_elixir.chunk.chunk import Chunk
from hf_elixir.chunk.schedule import EventRecorder, StepOrder
from hf_elixir.chunk.states import TensorState

__all__ = ["StepTraceMixin"]

_MAX_TRACE = 1_000_000


class StepTraceMixin:
    """:class:`~hf_elixir.chunk.manager.ChunkManager`'s access trace and step / forward bookkeeping (a mixin: the
    trace is read by eviction, prefetch and the reduce order alike)."""

    def _init_trace(self) -> None:
        # [Note: forward steps] a model prepared without an optimizer: each top-level forward is a step
        # (``end_forward`` rotates the trace); else the training step's trace while a no-grad forward between
        # steps records into a trace of its own (``None`` outside one)
        self.forward_steps = False
        self._outer_trace: tuple[list[int], list[tuple[int, int]]] | None = None
        # access trace (chunk ids) of the previous and the current step; the previous one as the step description
        # the prefetch scheduler executes ([Note: one step description] in schedule.py)
        self.prev_order = StepOrder()
        self.prev_trace: list[int] = []
        self.prev_positions: dict[int, list[int]] = {}
        self.trace: list[int] = []
        self.clock = 0
        # trace positions where each forward (micro-batch) / backward of this / the previous step ended
        self._forward_ends: list[int] = []
        self.prev_forward_ends: list[int] = []
        self._backward_ends: list[int] = []
        self.prev_backward_ends: list[int] = []
        # per access of this / the previous step's trace: (gradient-buffer bytes at it, peak since the access
        # before it) ([Note: backward gather prefetch] in _prefetch.py)
        self._grad_at: list[tuple[int, int]] = []
        self.prev_grad_at: list[tuple[int, int]] = []
        self._step_start = self.counters.as_dict()
        self.last_step: dict[str, int] = {}
        # the events the step executes, where a test compares them with the cost model's ([Note: one step
        # description]); ``None``: not recorded (every recording site tests this first)
        self.recorder: EventRecorder | None = None

    def record_event(self, kind: str, chunk: Chunk) -> None:
        """Record ``kind`` (:data:`~hf_elixir.chunk.schedule.EVENT_KINDS`) for ``chunk`` at this point of the step
        (callers test ``self.recorder is not None`` first, so that recording off costs nothing more)."""
        self.recorder.record("bwd" if self.backward_pending else "fwd", kind, chunk.chunk_id, len(self.trace))

    def _record(self, chunk: Chunk) -> None:
        self.clock += 1
        chunk.last_access = self.clock
        if not self.backward_pending and self._outer_trace is None:
            self.first_use.setdefault(chunk.chunk_id, self.clock)
        if len(self.trace) < _MAX_TRACE:
            self.trace.append(chunk.chunk_id)
            self._grad_at.append((self._grad_live_bytes, self._grad_peak_bytes))
            self._grad_peak_bytes = self._grad_live_bytes

    def _next_use(self, chunk: Chunk, after: int | None = None) -> float:
        """Position of ``chunk``'s next use in the previous step's order after position ``after`` (default:
        the current one); ``inf`` if none."""
        positions = self.prev_positions.get(chunk.chunk_id)
        if not positions:
            return float("inf")
        i = bisect.bisect_right(positions, len(self.trace) - 1 if after is None else after)
        return positions[i] if i < len(positions) else float("inf")

    def next_use_order(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` in the order the next forward first uses them: their first access in this step's trace
        (the previous step's when no access was recorded since), chunks it does not hold last, by id."""
        trace = self.trace or self.prev_trace
        first: dict[int, int] = {}
        for i, cid in enumerate(trace):
            first.setdefault(cid, i)
        return sorted(chunks, key=lambda c: (first.get(c.chunk_id, len(trace)), c.chunk_id))

    def used_no_more(self, chunk: Chunk) -> bool:
        """In backward: ``chunk`` has no later access in the previous step's order (the step's last backward)
        and no parameter left in COMPUTE, so nothing reads its compute copy again before the next forward
        ([Note: early refresh] in ``hf_elixir/optim/_refresh.py``). ``False`` without a previous step, and
        once this step has made more accesses than the previous one (its order says nothing about them), and
        while a slot holds a gradient not yet reduced (``READY_FOR_REDUCE``: the chunk is reduced again, and the
        host lane takes that gradient too, e.g. a parameter of a block that reentrant activation checkpointing ran
        under ``no_grad`` in forward, whose gradient comes after the chunk's first reduce)."""
        return (self.backward_pending and len(self.trace) < len(self.prev_trace)  # within the known order
                and self._next_use(chunk) == float("inf")
                and not any(slot.state in (TensorState.COMPUTE, TensorState.READY_FOR_REDUCE)
                            for slot in chunk.slots))

    def end_step(self) -> None:
        """Called at the optimizer step: the current trace becomes the reference for eviction."""
        self.drain_reduces()
        self.drain_gathers()
        self._rotate_trace()
        self.grads_stepped = self.grads_pending or self.grads_stepped
        self.grads_pending = False  # consumed by the step
        self.hide_stale()
        self._close_step()
        self.sync_activation_bytes()
        if self.compute_device.type == "cuda":
            self.pool.reconcile_cuda(self.compute_device)

    def begin_forward(self) -> None:
        """Called as the model's top-level forward starts ([Note: forward steps]): a forward under
        ``torch.no_grad()`` of a trained model outside backward (an evaluation between steps) records its
        accesses into a trace of its own, which :meth:`end_forward` drops."""
        if (not self.forward_steps and self._outer_trace is None and not self.backward_pending
                and not torch.is_grad_enabled()):
            self._outer_trace = (self.trace, self._grad_at)
            self.trace, self._grad_at = [], []

    def end_forward(self) -> None:
        """Called as the model's top-level forward returns or raises ([Note: forward steps]): without an
        optimizer the forward's trace becomes the reference for eviction and prefetch and ``last_step`` its
        counters; after an evaluation forward of a trained model the training step's trace is back."""
        if self._outer_trace is not None:
            self.drain_gathers()  # a gather issued ahead for a chunk this forward did not use
            self.trace, self._grad_at = self._outer_trace
            self._outer_trace = None
        elif self.forward_steps and not self.backward_pending:
            self.drain_gathers()
            if len(self.trace) < _MAX_TRACE:
                self._forward_ends.append(len(self.trace))
            self._rotate_trace()
            self._close_step()

    def _rotate_trace(self) -> None:
        """The current step's trace and phase ends become the previous step's (kept when nothing was recorded)."""
        if self.trace:
            self.prev_trace = self.trace
            self.prev_forward_ends = self._forward_ends
            self.prev_backward_ends = self._backward_ends
            self.prev_grad_at = self._grad_at
            self.prev_order = StepOrder(tuple(self.trace), tuple(self._forward_ends), tuple(self._backward_ends))
            self.prev_positions = self.prev_order.positions
        self.trace = []
        self._forward_ends = []
        self._backward_ends = []
        self._grad_at = []

    def _close_step(self) -> None:
        """``last_step``: the counters' change since the last step ended (``step_*`` in ``memory_stats``)."""
        now = self.counters.as_dict()
        self.last_step = {f"step_{k}": now[k] - self._step_start.get(k, 0)
                          for k in ("h2d_bytes", "d2h_bytes", "allgather_bytes", "reduce_scatter_bytes",
                                    "num_evictions", "num_onloads", "num_prefetches", "num_prefetched_gathers",
                                    "num_blocking_gathers", "num_agreed_gather_evictions", "num_refreshes_ahead",
                                    "gather_wait_s", "reduce_wait_s",
                                    "num_prefetched_act_onloads", "num_blocking_act_onloads")}
        self.last_step["step_device_peak_bytes"] = self.counters.device_peak_bytes
        self._step_start = now
