"""The gradient path of backward in the chunk manager: when each chunk's gradients are reduced (reduce-scattered,
or all-reduced when replicated), in which order, and how many collectives stay in flight. The reduced shards'
way to the optimizer (host offload, zeroing) is ``_grad_shards.py``; the has-gradient flags' all-reduce at the end
of backward and the checks riding it are ``_rank_checks.py``.

[Note: reduce order] Every rank reduce-scatters every trainable chunk exactly once per backward, in
one order fixed before the backward starts: descending position of the chunk's first use in the
preceding forward (a chunk's gradients are complete once backward passes its earliest forward use).
The forward access sequence is identical on every rank (see the Chunk notes), so is this order. A chunk is reduced
as soon as it and all chunks before it in that order are ready (all its trainable parameters that the
forward used on this rank have their gradients, or it holds only MoE-expert parameters none of which this
forward used: [Note: idle experts] in hooks.py); whatever is left is flushed at the end of backward.
Ranks whose MoE experts got no tokens therefore issue the same collectives in the same order.

[Note: late reduce waits] Off CUDA a gradient collective is issued with
``async_op=True`` as soon as its chunk is complete and finished (waited, divided, added into the gradient
shard) as late as possible: when the in-flight window is full during backward ([Note: reduce window]), and
after backward only when something reads the gradient shards. The chunks completed last (the embeddings',
used first in forward) are ready only when backward ends, so their collectives cannot overlap backward's
compute; they overlap the optimizer step instead, which steps the chunks whose reduce has finished first
(``ElixirOptimizer._inner_step``). The has-gradient flags' all-reduce (small, needed by the step's host read)
is issued asynchronously too, just before the last chunk's collective: collective order ``[... chunks, flags,
last chunk, re-reduces]``, the same on every rank. It sits in the same in-flight list (id
:data:`FLAGS_IN_FLIGHT`) and is finished, in issue order, by the step's read (:meth:`wait_flags`), so the
wait for the slowest rank to end its backward is timed into ``reduce_wait_s`` like every other gradient
collective's. Every reader of gradient shards or flags calls :meth:`drain_reduces` (or :meth:`wait_flags`)
first: the optimizer's step / clipping / state, ``zero_grad``, ``clear_param_grad``, the next backward;
``make_room`` finishes them when it needs room.

[Note: reduce window] During backward at most ``ReduceWindow.max_pending`` (2) gradient collectives that hold a buffer
([Note: in-place reduces]) stay in flight when some chunk can leave the device: their buffers are freed early so that
evictions and the backward gather prefetch's room rule ([Note: backward gather prefetch] in ``_prefetch.py``) see the
same free bytes as the cost model. It stays at 2 as well when the host lane steps host chunks during backward ([Note:
host lane] in ``hf_elixir/optim/_overlap.py``: a chunk is handed to it when its reduce finishes). When every chunk stays
on the device for the whole step (resident, or whole on a single rank) and no lane steps in backward, there is nothing
to evict or gather and the window has no limit but the budget: a collective is finished only when ``make_room`` needs
its bytes, or after backward. The rank that runs ahead then does not wait at every third chunk for the other to catch
up; the ranks meet once, at the step (a wait a window of 2 pays at each chunk where the other rank lags, and pays again
where this rank lags). The decision reads only the plan, and ``make_room``'s pool accounting is the same on every rank
for a model-data budget, so every rank finishes the same reduces at the same points; no collective is issued by
finishing one, so their order is unchanged. The cost model's ``predict`` holds its pending reduces the same way.

[Note: in-place reduces] The in-flight window (``ReduceWindow.max_pending``) bounds the gradient buffers and reduce
outputs that in-flight collectives keep alive. A chunk whose gradients were accumulated straight into the
optimizer's shard (``Chunk.direct_grad_shard``: all resident, replicated, device optimizer) is all-reduced in
place and holds no buffer, so its collective does not count toward the window: backward does not stop to wait
for it, as DDP waits for none of its bucket all-reduces before the end of backward. Which chunks these are
follows from the plan alone; only the point where a rank waits changes, never the collectives or their order.
"""

from __future__ import annotations

import time

import torch

from hf_elixir.chunk._reduce_window import FLAGS_IN_FLIGHT, ReduceWindow
from hf_elixir.chunk._steps import _MAX_TRACE
from hf_elixir.chunk.chunk import Chunk
from hf_elixir.chunk.params import raw_grad, set_raw_grad
from hf_elixir.chunk.states import TensorState

__all__ = ["ReduceMixin", "FLAGS_IN_FLIGHT"]


class ReduceMixin:
    """:class:`~hf_elixir.chunk.manager.ChunkManager`'s gradient reduces (a mixin: backward's hooks call it per
    gradient, and its in-flight collectives hold buffers that eviction finishes for room)."""

    def _init_reduces(self) -> None:
        self.backward_count = 0  # backwards started so far
        self._in_backward = False  # read through backward_pending
        # the collectives in flight ([Note: reduce window]); off CUDA, gradient collectives are issued asynchronously
        # and finished a few chunks later
        self.reduces = ReduceWindow(self.counters, async_op=self.compute_device.type != "cuda")
        # [Note: reduce order] the trainable chunks, this backward's order of them, how far it got, and the first
        # use of each chunk in this step's forward (and the last forward's, for a retained graph)
        self._trainable_chunks: list[Chunk] = []
        self._reduce_order: list[Chunk] = []
        self._reduce_cursor = 0
        self.first_use: dict[int, int] = {}
        self._last_forward: tuple[dict[int, int], dict[int, set[int]]] | None = None
        # reduced gradients wait in the shards for the optimizer: set at the end of backward, cleared by the
        # step and by zero_grad ([Note: gradients in chunks] in params.py)
        self.grads_pending = False
        # the step consumed them and no zero_grad cleared them yet: where plain PyTorch's p.grad still holds them
        # (a Trainer callback's on_optimizer_step), a user's read of p.grad raises instead of seeing None
        self.grads_stepped = False

    @property
    def backward_pending(self) -> bool:
        """Whether a backward is running: from :meth:`start_backward` to :meth:`finish_backward`, the only two
        places that change it (every other part of the manager, the hooks and the optimizer only read it)."""
        return self._in_backward

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook body: move ``param.grad`` into its chunk's gradient buffer."""
        grad = raw_grad(param)
        if grad is None:
            return
        slot = self.slot_of[param]
        chunk = self.chunk_of[param]
        with self.charge_temporary(grad.numel() * grad.element_size(), f"gradient of {slot.name} before it "
                                   "lands in its chunk"):
            chunk.accumulate_grad(slot, grad)
            set_raw_grad(param, None)
            del grad
        chunk.arrived_slots.add(slot.index_in_chunk)
        self.flags.arrived.add(slot.flag_index)
        if slot.state is not TensorState.READY_FOR_REDUCE:
            slot.set_state(TensorState.READY_FOR_REDUCE)
        self._reduce_ready_prefix()
        self.listener.on_grad_progress()

    def start_backward(self) -> None:
        """Called by the first backward hook of a backward: fix the reduce order (see [Note: reduce order]).

        Raises:
            RuntimeError: the model was prepared without an optimizer (no gradient shards to reduce into).
        """
        if self.backward_pending:
            return
        # the previous backward's last reduces ([Note: late reduce waits]); deferred zeros stay deferred
        self.drain_reduces(settle_zeros=False)
        if self._trainable_chunks and not self.grad_shards:
            raise RuntimeError("backward through a model prepared without an optimizer (hf_elixir.prepare(model, "
                               "None, ...) is for inference): pass the optimizer to prepare to train, or run the "
                               "forward under torch.no_grad()")
        self.listener.before_backward()
        self.drain_gathers()
        self.drain_refreshes()
        # writes made before the forward, in the masters before the host lane steps them and uploads its result
        # into the compute copies ([Note: early refresh] in optim/_refresh.py, [Note: parameter writes] in
        # _chunk_params.py)
        self.take_param_writes()
        if len(self.trace) < _MAX_TRACE:
            self._forward_ends.append(len(self.trace))
        self._in_backward = True
        self.backward_count += 1
        self._reduce_cursor = 0
        if not self.first_use and self._last_forward is not None:
            # a second backward through a retained graph (``backward(retain_graph=True)``) with no
            # forward since the last backward: reuse that forward's use order and used parameters, so
            # chunks are reduced as their gradients complete, not all held until the end
            self.first_use, used = self._last_forward
            for chunk in self.chunks:
                chunk.used_slots = set(used.get(chunk.chunk_id, ()))
        self._last_forward = (dict(self.first_use), {c.chunk_id: set(c.used_slots) for c in self.chunks})
        first_use = self.first_use
        self._reduce_order = sorted(self._trainable_chunks,
                                    key=lambda c: (-first_use.get(c.chunk_id, -1), -c.chunk_id))
        self.first_use = {}
        for chunk in self._reduce_order:
            chunk.reduced_this_backward = False
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def _chunk_ready(self, chunk: Chunk) -> bool:
        """All gradients this forward's use promises have arrived (at least one: a parameter used
        functionally outside its unit is not marked), or an idle-experts chunk ([Note: idle experts])."""
        if chunk.arrived_slots:
            return chunk.used_slots <= chunk.arrived_slots
        return not chunk.used_slots and chunk.subtree_only

    def _reduce_ready_prefix(self) -> None:
        # off CUDA the last chunk of the order is issued by finish_backward, after the has-gradient flags
        # ([Note: late reduce waits])
        last = len(self._reduce_order) - int(self.reduces.async_op)
        while self._reduce_cursor < last:
            chunk = self._reduce_order[self._reduce_cursor]
            if not self._chunk_ready(chunk):
                return
            self._reduce(chunk)
            self._reduce_cursor += 1

    def _reduce(self, chunk: Chunk) -> None:
        before, started = self.counters.reduce_scatter_bytes, time.perf_counter()
        in_place = chunk.grad_full is None and chunk.grad_spill is None and chunk.direct_grad_shard() is not None
        if self.recorder is not None:  # [Note: one step description] in schedule.py
            self.record_event("reduce", chunk)
        finish = chunk.reduce_scatter_grad(self.grad_shards[chunk.chunk_id], async_op=self.reduces.async_op)
        collective = self.counters.reduce_scatter_bytes != before  # one rank, not replicated: a local add
        if collective:
            self.counters.reduce_wait_s += time.perf_counter() - started
        chunk.arrived_slots.clear()
        if finish is not None:
            self.reduces.issue(chunk.chunk_id, finish, timed=collective, in_place=in_place)
            self.reduces.shrink_to(self.reduce_window())

    def reduce_window(self) -> int | None:
        """How many gradient collectives stay in flight during backward; ``None``: as many as the budget
        holds (see [Note: reduce window])."""
        return self.reduces.limit(self.chunks)

    def drain_reduces(self, settle_zeros: bool = True) -> None:
        """Wait for every in-flight gradient collective and accumulate its result (see [Note: late reduce
        waits]: every reader of gradient shards or has-gradient flags calls this first); with
        ``settle_zeros``, also zero what backward left unwritten in deferred-zero gradient shards
        (:meth:`settle_grad_zeros`)."""
        self.reduces.drain()
        if settle_zeros:
            self.settle_grad_zeros()

    def reduces_in_flight(self) -> set[int]:
        """Ids of the chunks whose gradient collective is still to be finished, and :data:`FLAGS_IN_FLIGHT`
        while the has-gradient flags' all-reduce is ([Note: late reduce waits])."""
        return self.reduces.in_flight()

    def wait_flags(self) -> None:
        """Finish in-flight collectives in issue order up to the has-gradient flags' all-reduce, so that
        ``has_grad_flags`` holds this backward's merged flags (the reduces issued after it stay in flight)."""
        self.reduces.finish_through(FLAGS_IN_FLIGHT)

    def _merge_flags(self) -> None:
        """Issue the has-gradient flags' all-reduce (:meth:`GradFlags.merge`) with what rides it: per flag group its
        "no room" votes ([Note: agreed gathers ahead] in _agreed_gathers.py) and its checks' (code, -code, hyper,
        -hyper) (:meth:`RankChecks.values` of this backward's reduce order and the optimizer's hyperparameters)."""
        flags = self.flags
        checks = flags.checks.values(self._reduce_order, self.listener.hyper_code())
        extras = [self._ahead_votes(group) + mine for (group, _), mine in zip(flags.flag_groups, checks)]
        if any(len(e) > 4 for e in extras) and self.ahead_veto.numel() != len(self.chunks):
            self.ahead_veto = torch.ones(len(self.chunks), device=self.compute_device)

        def take_votes(group, votes: torch.Tensor) -> None:
            self.ahead_veto[self._voter_index(group)] = votes
        flags.merge(extras, self.reduces, take_votes)

    def finish_backward(self) -> None:
        """End-of-backward callback: flush remaining reduce-scatters in the fixed order, merge the
        has-gradient flags over ranks, drop backward pins. Off CUDA the last reduces stay in flight
        ([Note: late reduce waits])."""
        last = len(self._reduce_order) - int(self.reduces.async_op)
        while self._reduce_cursor < last:
            self._reduce(self._reduce_order[self._reduce_cursor])
            self._reduce_cursor += 1
        if self.reduces.async_op:
            self._merge_flags()
            while self._reduce_cursor < len(self._reduce_order):
                self._reduce(self._reduce_order[self._reduce_cursor])
                self._reduce_cursor += 1
        # a gradient that arrived after its chunk was reduced (a parameter used in two reentrant
        # checkpoint segments) is reduced once more; structural, so every rank does the same
        for chunk in self._reduce_order:
            if chunk.grad_full is not None or chunk.grad_spill is not None:
                self._reduce(chunk)
        if not self.reduces.async_op:
            self.drain_reduces()
        self.drain_gathers()  # a gather issued ahead for a chunk this backward did not use
        if len(self.trace) < _MAX_TRACE:
            self._backward_ends.append(len(self.trace))
        if not self.reduces.async_op:
            if self.reduce_stream is not None:
                torch.cuda.current_stream().wait_stream(self.reduce_stream)
            self._merge_flags()
        self.sync_activation_bytes()
        for chunk in self.chunks:
            chunk.used_slots.clear()
            chunk.arrived_slots.clear()
        self._in_backward = False
        self.grads_pending = True
        self.grads_stepped = False
        if self.on_backward_end is not None:
            self.on_backward_end()

    on_backward_end = None
