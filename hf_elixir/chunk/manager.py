"""``ChunkManager``: owns every chunk of a model, decides what is on the device, evicts, prefetches,
and orders gradient reduce-scatters.

Eviction: the chunk whose next use in the access order recorded in the previous step is furthest away
(Belady/MIN over the warm-up trace, PatrickStar arXiv 2108.05818 section 5); least recently used
before a trace exists.

[Note: reduce order] Every rank reduce-scatters every trainable chunk exactly once per backward, in
one order fixed before the backward starts: descending position of the chunk's first use in the
preceding forward (a chunk's gradients are complete once backward passes its earliest forward use).
The forward access sequence is identical on every rank (see the Chunk notes), so is this order. A chunk is reduced
as soon as it and all chunks before it in that order are ready (all its trainable parameters that the
forward used on this rank have their gradients, or it holds only MoE-expert parameters none of which this
forward used: [Note: idle experts] in hooks.py); whatever is left is flushed at the end of backward.
Ranks whose MoE experts got no tokens therefore issue the same collectives in the same order.

[Note: reduce order check] Nothing but the model's code makes the forward the same on every rank: a module called
on some ranks only (data-dependent control flow), or modules called in another order, gives the ranks different
reduce orders, and chunks of equal size then pair with the wrong chunk in their collectives: silently wrong
gradients (measured: parameters 0.2 relative off PyTorch after one step, no error). So the has-gradient flags'
all-reduce (one per backward already, MAX) carries two more numbers per flag group: ``code`` and ``-code``, a 24-bit
CRC of the order of the group's chunks in this backward (exact in float32). After the MAX, ``max(code) +
max(-code)`` is ``max - min`` over the group's ranks: zero iff every rank reduced in the same order. The result is
kept on the device (``reduce_order_mismatch``, no host read) and read by the step's one host read, which raises
before anything is updated: parameters and optimizer state stay as they were; ``zero_grad`` discards the
gradients and the mismatch with them. A mismatch of unequal sizes fails in the collective itself (gloo, NCCL).

[Note: hyperparameter check] The same all-reduce carries ``hyper`` and ``-hyper``: a 24-bit CRC of the optimizer's
hyperparameters (every param group's numbers, flags and strings: lr, weight_decay, betas, eps, ...) as this rank
holds them when its backward ends (``hyper_code``, set by the optimizer). Ranks that step with different ones
(``ReduceLROnPlateau`` stepped with each rank's own loss, an lr set from rank-local data) used to train on
silently: replicated copies drifted apart (5.8e-2 from PyTorch after a few steps, sharded chunks 3.3e-2), each
shard with its own rank's lr. DDP drifts the same way; hf_elixir raises at the step instead, before anything
is updated, as for the reduce order (``hyper_mismatch``). A value changed between the end of backward and
``step()`` is not seen; schedulers step after ``step()``, so the next backward carries their value.

[Note: late reduce waits] (issue 14: blocked-wait time.) Off CUDA a gradient collective is issued with
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

[Note: reduce window] During backward at most ``max_pending_reduces`` (2) gradient collectives that hold a
buffer ([Note: in-place reduces]) stay in flight when some chunk can leave the device: their buffers are freed early so that evictions and the
backward gather prefetch's room rule ([Note: backward gather prefetch]) see the same free bytes as the cost
model. It stays at 2 as well when the host lane steps host chunks during backward ([Note: host lane] in
``hf_elixir/optim/_overlap.py``: a chunk is handed to it when its reduce finishes). When every chunk stays
on the device for the whole step (resident, or whole on a single rank) and no lane steps in backward, there
is nothing to evict or gather and the window has no limit but the budget: a collective is finished only
when ``make_room`` needs its bytes, or after backward. The rank that runs ahead then does not wait at every
third chunk for the other to catch up; the ranks meet once, at the step (a wait a window of 2 pays at each
chunk where the other rank lags, and pays again where this rank lags). The decision reads only the plan, and
``make_room``'s pool accounting is the same on every rank for a model-data budget, so every rank finishes
the same reduces at the same points; no collective is issued by finishing one, so their order is unchanged.
The cost model's ``predict`` holds its pending reduces the same way.

[Note: in-place reduces] The in-flight window (``max_pending_reduces``) bounds the gradient buffers and reduce
outputs that in-flight collectives keep alive. A chunk whose gradients were accumulated straight into the
optimizer's shard (``Chunk.direct_grad_shard``: all resident, replicated, device optimizer) is all-reduced in
place and holds no buffer, so its collective does not count toward the window: backward does not stop to wait
for it, as DDP waits for none of its bucket all-reduces before the end of backward. Which chunks these are
follows from the plan alone; only the point where a rank waits changes, never the collectives or their order.

[Note: gather prefetch] (FSDP2's all-gather prefetch; issue 14 item 1.) During forward, :meth:`_prefetch`
issues the all-gathers of the next ``prefetch_depth`` chunks of the previous step's order ahead of their
use: on CUDA on the copy stream (the compute stream waits for its event), elsewhere with ``async_op=True``
(gloo runs it on its own threads while this thread computes). The chunk's pre-forward access waits for it
(:meth:`Chunk.wait_ready`, timed into ``gather_wait_s``). Collectives on one group must be issued in the same
order on every rank, so a rank may issue a gather ahead only where every rank does the same:

* the decision reads only the previous step's trace, the agreed plan and the agreed budget, through the
  pool's accounting and Belady's victim choice. That state is identical on every rank when the pool
  charges model data only (an explicit ``device_memory_budget_bytes``; a whole-device budget also charges
  activations, which are rank-local) and every rank accesses the same chunks in the same order, which holds
  for dense models. A model with MoE-expert chunks (``subtree_only`` / ``host_copy_required``: backward
  touches them only where experts got tokens, so pool states drift apart) gets no gather prefetch: its
  gathers stay in the hooks, where they already agree. A pool that charges activations (a whole-device
  budget) follows [Note: agreed gathers ahead] instead. Never free memory, timing, or whether a collective
  has finished (waits happen at fixed points: the chunk's access, its eviction, the start of backward, the
  optimizer step);
* a gather ahead evicts only what the hook of its chunk would evict anyway ([Note: Belady-consistent gather
  ahead] in :meth:`_kept_until`), so prefetching issues the same gathers as the hooks alone, only earlier
  (what the cost model assumes);
* within one phase: in forward the window stops where the previous step's forward (micro-batch) ended, so
  no rank issues a gather ahead of the backward's reduce-scatters; in backward it stops where that step's
  backward ended, under the stricter room rule of [Note: backward gather prefetch];
* nothing reads an unfilled buffer: the parameters stay stale placeholders until the wait, eviction and
  ``unshard`` wait first, and the start of backward and the optimizer step drain every pending gather.

[Note: agreed gathers ahead] (issue 14 item 1 on a real GPU, whose budget covers activations.) A pool that
charges activations is rank-local: each rank's batch decides how much room its forward leaves, so the rule
above (a decision every rank computes alike) does not hold. The runtime then keeps a rank-local host copy of
every offloadable chunk (``keep_host_copy``, ``hf_elixir/placement/_device_placement.py``): after a chunk's
first all-gather of a step, every refill is a local onload, so the step's all-gathers are exactly the first
unshards in forward order, the same on every rank; only *when* each is issued can differ. Collectives on one
group must still be issued in one order on every rank (and on NCCL, interleaved alike with the collectives of
other groups), so which gathers run ahead is agreed, one step late:

* in forward, where a chunk that still needs its all-gather first enters the prefetch window
  (``prefetch_depth`` chunks of the previous step's order, within the forward), each rank records whether its
  pool has room for it without evicting a chunk used before it (free bytes, kept gradient buffers, and
  evictable chunks not in the window whose next use comes later): ``_ahead_room``. Evaluation forwards
  between steps do not vote;
* the votes ride the has-gradient flags' all-reduce (MAX of 1 "no room", 0 "room", -1 "no vote") and the
  step's one host read brings them back (``ElixirOptimizer._read_step_state`` -> :meth:`agree_gathers_ahead`):
  the chunks every rank had room for, the same set on every rank. A chunk no rank voted on keeps the last
  agreement: an evaluation forward between steps issues the agreed gathers (its chunks then need none in the
  training forward, so nothing votes), and dropping them would leave every step after an evaluation without
  gathers ahead (``Trainer`` with ``eval_steps``); a vote of "room" from some ranks and none from others
  agrees (whether a chunk needs its all-gather is the same on every rank);
* in the next step each rank issues exactly those gathers ahead, at the same window positions, in the same
  order (whatever its local onloads ahead do), making room rank-locally with Belady's victims (safe: with the
  copies an eviction costs a local refill, never a collective). Where this batch left less room than the
  previous one, that may evict a chunk used before the gathered one (counted,
  ``num_agreed_gather_evictions``; its vote then says no room); where no eviction makes room at all the
  access raises :class:`DeviceBudgetExceededError` (the hook would need that room moments later too).

So prefetch starts with the third step (the first has no order, the second votes), backward keeps its
refills local (no gather ahead there), and a model prepared without an optimizer (no step to agree at)
keeps its gathers in the hooks under such a pool. Test: ``tests/test_activation_budget_ranks.py`` (ranks
with different batch shapes: no hang, the same gathers issued ahead, parity with PyTorch).

[Note: backward gather prefetch] In backward the re-gathers of evicted chunks without a host copy are issued
ahead too (FSDP2's backward prefetch), on the same terms as in forward (previous trace, agreed plan and
budget; off for MoE and for a pool that charges activations; pending gathers drained at eviction, unshard,
the end of backward and the step). Backward also charges and frees gradient buffers and reduce-scatter
outputs between two accesses (and finishes reduces when the pool is short), so Belady's argument above does
not carry over: a gather ahead could evict a chunk the hooks alone would have kept, or be evicted itself
before its use. A backward gather ahead is therefore issued only when its bytes, plus those of the chunks
of the window that the hooks will still fill, plus the rise of gradient-buffer and reduce-output bytes the
previous step saw up to the chunk's access (``prev_grad_at``: bytes at each access and the peak since the
one before), fit in the free budget plus the chunks this step no longer uses (:meth:`_dead`: trainable,
no later use in the previous trace, so the step makes their gathered copy stale anyway); it evicts only
those. Every later make-room in the window then finds its room among free and dead bytes, which Belady
evicts first, so no chunk the step still uses leaves the device earlier than without the prefetch: the
same all-gathers, only issued ahead. All of this is the same on every rank for dense models with a
model-data budget (the gradient charges follow the autograd graph, identical on every rank). At the
tightest budgets there is no such room and backward gathers stay in the hooks.

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

``num_prefetched_gathers`` counts gathers issued ahead, ``num_blocking_gathers`` those issued inside an
access for the chunk it needs (the compute waits for the whole collective).

Refreshes of device shards from host masters ([Note: overlapped refresh] in ``hf_elixir/optim/optimizer.py``)
are uploads on the copy stream issued by the optimizer step; :meth:`access` waits for each chunk's own
(:meth:`Chunk.wait_ready`), :meth:`start_backward` drains the rest (:meth:`drain_refreshes`).

[Note: gradient offload] A chunk whose optimizer state is on the host gets its reduced gradient shard by
:meth:`ChunkManager.offload_grad`: one non-blocking device->host copy, straight into the fp32 gradient
shard when it holds nothing yet (the first backward after ``zero_grad``), else into a host staging
buffer of the chunk that is added on the host afterwards (gradient accumulation). On CUDA the copy runs on
the manager's offload stream after it waited for the compute stream, into pinned host blocks, and an
event recorded after it marks completion; nothing on the main thread waits for it. Whoever consumes the
host gradient (the optimizer's host lane, ``on_grad_offloaded``) waits for that event first, then adds
the staging buffer. On the simulated device the copy is a plain copy through the sanctioned host-copy
path (:func:`hf_elixir.chunk.strict.host_copies`). The host step may update a shard in place while
backward goes on (``host_fence``): every read of a shard (:meth:`Chunk.unshard`, ``write_back``) calls
the fence first.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import struct
import time
import weakref
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

from hf_elixir.chunk.chunk import Chunk, ParamSlot
from hf_elixir.chunk import strict
from hf_elixir.chunk.host_blocks import HostBlockAllocator
from hf_elixir.chunk.memory import DeviceBudgetExceededError, DevicePool, MemoryCounters
from hf_elixir.chunk.params import raw_grad, set_raw_grad
from hf_elixir.chunk.states import TensorState

__all__ = ["ChunkManager"]

logger = logging.getLogger(__name__)

_MAX_TRACE = 1_000_000
_INF = float("inf")


# ``reduces_in_flight`` id of the has-gradient flags' all-reduce ([Note: late reduce waits])
FLAGS_IN_FLIGHT = -1


def _no_fence(chunk) -> None:
    """The default ``ChunkManager.early_refresh_fence``: no optimizer issues refreshes early."""


class ChunkManager:
    """Chunks of one model plus the device pool, counters, access trace and reduce bookkeeping."""

    def __init__(self, *, compute_device: torch.device, budget_bytes: int | None,
                 reduce_dtype: torch.dtype | None, prefetch_depth: int) -> None:
        self.compute_device = compute_device
        self.counters = MemoryCounters()
        self.pool = DevicePool(budget_bytes, self.counters)
        self.host = HostBlockAllocator(pin=compute_device.type == "cuda", on_change=self._count_host)
        self.reduce_dtype = reduce_dtype
        self.prefetch_depth = prefetch_depth
        # prefetches are issued on a side stream on CUDA, overlapped with compute
        self.copy_stream = torch.cuda.Stream() if compute_device.type == "cuda" else None
        # gradient reduce-scatters of device-optimizer chunks overlap backward on CUDA
        self.reduce_stream = torch.cuda.Stream() if compute_device.type == "cuda" else None
        # device->host copies of reduced gradient shards of host-optimizer chunks ([Note: gradient offload])
        self.offload_stream = torch.cuda.Stream() if compute_device.type == "cuda" else None
        self._grad_staging: dict[int, torch.Tensor] = {}  # chunk id -> fp32 host [shard_numel]
        # off CUDA, gradient buffers whose reduce finished, kept for the next backward ([Note: buffer reuse])
        self._free_buffers: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.kept_buffer_bytes = 0  # their bytes, charged to the pool while kept
        self._offload_done: dict[int, object] = {}  # chunk id -> callable waiting for its last host add
        # ``on_grad_offloaded(chunk, staging, event)`` takes over a host gradient (the optimizer's host lane)
        # and may return a callable that waits until it has consumed ``staging``; ``host_fence(chunk)`` is
        # called before a shard is read (see [Note: gradient offload])
        self.on_grad_offloaded = None
        self.host_fence = None
        # ``on_param_writes(chunks)`` merges parameter writes a reshard took into the shards of ``chunks`` into the
        # optimizer's masters ([Note: parameter writes] in chunk.py); ``None`` without an optimizer
        self.on_param_writes = None
        # the optimizer's: ``before_backward()`` runs as a backward starts, ``on_zero_grad()`` when every gradient
        # is zeroed ([Note: owed clip factor] in optim/optimizer.py)
        self.before_backward = None
        self.on_zero_grad = None
        # [Note: early refresh] in optim/optimizer.py: ``on_grad_progress()`` runs after each gradient lands (the
        # host lane issues the uploads of chunks it has stepped); ``early_refresh_fence(chunk)`` runs before a
        # wait for a refresh issued from an unvalidated speculative step
        self.on_grad_progress = None
        self.early_refresh_fence = _no_fence
        self.backward_count = 0  # backwards started so far
        # host mirror of this rank's has-gradient arrivals since the last zero_grad (flag indices)
        self.local_flags: set[int] = set()
        # off CUDA, gradient collectives are issued asynchronously and finished a few chunks later
        self.async_reduce = compute_device.type != "cuda"
        # in-flight window where some chunk may leave the device or the host lane steps chunks during
        # backward ([Note: reduce window]); the lane sets ``host_steps_in_backward``
        self.max_pending_reduces = 2
        self.host_steps_in_backward = False
        self._pending: list[tuple[int, object]] = []  # (chunk id, callable finishing its reduce), issue order
        self._bufferless: set[int] = set()  # chunks in ``_pending`` whose reduce holds no buffer ([Note: in-place reduces])
        # off CUDA, all-gathers issued ahead are async collectives waited at the chunk's access
        self.async_gather = compute_device.type != "cuda"
        self._pending_gathers: list[Chunk] = []
        # trace positions where each forward (micro-batch) / backward of this / the previous step ended
        self._forward_ends: list[int] = []
        self.prev_forward_ends: list[int] = []
        self._backward_ends: list[int] = []
        self.prev_backward_ends: list[int] = []
        # device bytes of gradient buffers and reduce outputs now and their peak since the last access; per
        # access of this / the previous step's trace: (bytes at it, peak since the access before it)
        # ([Note: backward gather prefetch])
        self._grad_live_bytes = 0
        self.num_grad_spills = 0  # gradient buffers moved to the host for room ([Note: gradient spill])
        self._grad_peak_bytes = 0
        self._grad_at: list[tuple[int, int]] = []
        self.prev_grad_at: list[tuple[int, int]] = []
        self.chunks: list[Chunk] = []
        self.slot_of: dict[torch.nn.Parameter, ParamSlot] = {}
        self.chunk_of: dict[torch.nn.Parameter, Chunk] = {}
        self.grad_shards: dict[int, torch.Tensor] = {}  # chunk id -> fp32 [shard_numel]
        # every rank training this model (``None``: one rank): the optimizer's norm and overflow
        # reductions run over it, never over WORLD by default (two jobs can share one world)
        self.job_group = None
        self.num_flags = 0
        # [Note: has-gradient flags] one element per trainable parameter: 1.0 if it has a gradient
        # since the last zero_grad. On the compute device (they are all-reduced over the flag groups,
        # and NCCL takes device memory only); this backward's arrivals are kept on the host
        # (``arrived_flags``, read by the hooks without a device sync) and uploaded once at its end.
        self.has_grad_flags = torch.zeros(0, device=compute_device)
        self.flag_groups: list[tuple[object, torch.Tensor]] = []  # (group of size > 1, flag indices)
        self.arrived_flags: set[int] = set()
        # [Note: reduce order check] > 0 where the ranks of a flag group reduced its chunks in different orders in
        # a backward since the last step / zero_grad (one element, on the compute device; read by the step)
        self.reduce_order_mismatch = torch.zeros(1, device=compute_device)
        # [Note: hyperparameter check] > 0 where the ranks of a flag group stepped with different optimizer
        # hyperparameters in a backward since the last step / zero_grad; ``hyper_code()`` (the optimizer's) gives
        # this rank's 24-bit code of them, 0 without an optimizer
        self.hyper_mismatch = torch.zeros(1, device=compute_device)
        self.hyper_code = None
        self._flag_group_chunks: list[list[int]] = []  # per flag group, its chunk ids (init_flags)
        # [Note: agreed gathers ahead] this step's votes (chunk id -> room for its gather ahead), the chunks every
        # rank voted for at the last step (issued ahead now), and the merged "no room" votes (on the compute
        # device, [num_chunks], read by the step's host read)
        self._ahead_room: dict[int, bool] = {}
        self._ahead_agreed: frozenset[int] = frozenset()
        self.ahead_veto = torch.zeros(0, device=compute_device)
        self._voter_indices: dict[int, torch.Tensor] = {}
        # activation storages charged -> their bytes (see saved_tensors_accounting)
        self._saved_storages: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # [Note: forward steps] a model prepared without an optimizer: each top-level forward is a step
        # (``end_forward`` rotates the trace); else the training step's trace while a no-grad forward between
        # steps records into a trace of its own (``None`` outside one)
        self.forward_steps = False
        self._outer_trace: tuple[list[int], list[tuple[int, int]]] | None = None
        # access trace (chunk ids) of the previous and the current step
        self.prev_trace: list[int] = []
        self.prev_positions: dict[int, list[int]] = {}
        self.trace: list[int] = []
        self.clock = 0
        self.backward_pending = False
        self._reduce_order: list[Chunk] = []
        self._trainable_chunks: list[Chunk] = []
        self.first_use: dict[int, int] = {}
        self._last_forward: tuple[dict[int, int], dict[int, set[int]]] | None = None
        self._reduce_cursor = 0
        self._step_start = self.counters.as_dict()
        self.last_step: dict[str, int] = {}
        # reduced gradients wait in the shards for the optimizer: set at the end of backward, cleared by the
        # step and by zero_grad ([Note: gradients in chunks] in params.py)
        self.grads_pending = False

    # -- activations ([Note: activations in the budget] in memory.py) ----------------------------
    def saved_tensors_accounting(self):
        """A context (entered around the model's forward) that charges every storage autograd saves for
        backward, other than the chunks', to the pool's activation bytes while the storage lives (dead
        storages are dropped at the next :meth:`sync_activation_bytes`: each forward, each end of
        backward, and before evicting for an activation)."""
        self.sync_activation_bytes()
        outer = _active_saved_tensors_hooks()
        if outer is None:
            return torch.autograd.graph.saved_tensors_hooks(self._pack_saved, _unpack_saved)
        outer_pack, outer_unpack = outer  # e.g. the profiler's tracer: keep it seeing every saved tensor, itself
        # (the tracer tells tensors apart by identity); what the outer hook packs is what autograd keeps
        return torch.autograd.graph.saved_tensors_hooks(lambda t: (self._pack_saved(t), outer_pack(t))[1], outer_unpack)

    def sync_activation_bytes(self) -> None:
        """Set the pool's activation bytes to the storages still alive (a weak mapping forgets the dead)."""
        live = sum(self._saved_storages.values())
        self.pool.release_activation(self.counters.activation_bytes - live)

    def _pack_saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """Charge ``tensor``'s storage (saved for backward) to the activation bytes; return what autograd keeps.

        [Note: pack without a cycle] The packed object is ``tensor.detach()`` (autograd re-attaches the history
        at unpack), never ``tensor`` itself, except for chunk views (parameters: leaves, no history): a saved
        output packed as itself holds its own ``grad_fn``, which holds it, a cycle through C++ that the garbage
        collector cannot see. Backward frees it, but a forward with grad enabled and no backward (an evaluation
        without ``torch.no_grad()``, a forward that raised, a loss computed only to log) then kept its graph
        and every activation it saved for good, still charged to the budget, until a later step failed with
        ``DeviceBudgetExceededError`` on that rank alone (PyTorch's ``saved_tensors_hooks`` warns of this).
        Autograd does not check the version of a tensor packed by hooks, so :func:`_packed` records it and
        :func:`_unpack_saved` raises as PyTorch does when the saved tensor was modified in place (before, backward
        used the modified values silently). Chunk views are exempt: refills write the chunk buffers in place."""
        if strict.is_managed_device(tensor):
            return tensor
        if tensor.device != self.compute_device or tensor.layout != torch.strided:
            return _packed(tensor)
        storage = tensor.untyped_storage()
        if storage in self._saved_storages:
            return _packed(tensor)
        nbytes = storage.nbytes()
        if self.pool.charges_activations and not self.pool.fits(nbytes):
            self.sync_activation_bytes()
            try:
                self.make_room(nbytes, f"activations saved for backward ({nbytes} bytes)")
            except DeviceBudgetExceededError:
                err = self.pool.activation_error(nbytes, tuple(tensor.shape), self.counters.device_used_bytes)
                raise DeviceBudgetExceededError(f"{err}. Device holds: {self.describe()}") from None
        self.pool.charge_activation(nbytes)
        self._saved_storages[storage] = nbytes
        return _packed(tensor)

    def charge_temporary(self, nbytes: int, what: str):
        """Context: ``nbytes`` of an autograd temporary live on the device inside (charged only when the
        budget covers activations and temporaries; chunks are evicted to make room)."""
        if not self.pool.charges_activations:
            return contextlib.nullcontext()
        self.make_room(nbytes, what)
        self.pool.charge(nbytes, what)
        return _Release(self.pool, nbytes)

    def init_flags(self, num_flags: int, flag_groups: list[tuple[object, torch.Tensor]]) -> None:
        """Allocate the has-gradient flags ([Note: has-gradient flags]) on the compute device.

        Args:
            num_flags: number of trainable parameters.
            flag_groups: ``(group, int64 indices)``: the flags of the parameters whose gradients are
                reduced over ``group`` (size > 1) are max-reduced over it at the end of backward.
        """
        self.num_flags = num_flags
        self.has_grad_flags = torch.zeros(num_flags, device=self.compute_device)
        self.flag_groups = [(group, indices.to(self.compute_device)) for group, indices in flag_groups]
        # [Note: reduce order check] each flag group's chunks (read here, from the host indices: no device read later)
        self._flag_group_chunks = []
        for _, indices in flag_groups:
            wanted = set(indices.tolist())
            self._flag_group_chunks.append(sorted({c.chunk_id for c in self.chunks for slot in c.slots
                                                   if slot.trainable and slot.flag_index in wanted}))

    # -- memory helpers ------------------------------------------------------------------------
    def _count_host(self, delta_bytes: int) -> None:
        self.counters.host_bytes += delta_bytes

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor ``[numel]`` sliced from the manager's host blocks (pinned when the compute device
        is CUDA, for async copies); ``host_bytes`` counts the blocks (see [Note: host blocks]). Registered
        as host memory ([Note: strict device] in ``hf_elixir/chunk/strict.py``)."""
        return strict.register_host(self.host.empty(numel, dtype))

    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`host_empty` filled with zeros (a fresh range of an unpinned block is not written: it stays
        out of the resident set until first used, see [Note: zero pages] in ``host_blocks.py``)."""
        return strict.register_host(self.host.zeros(numel, dtype))

    def grad_buffer(self, numel: int, dtype: torch.dtype, what: str, zero: bool = True,
                    keep: Chunk | None = None) -> torch.Tensor:
        """A device tensor ``[numel]`` of ``dtype`` for a gradient buffer or a reduce-scatter output, charged to
        the pool (counted for the backward gather prefetch's reserve, [Note: backward gather prefetch]) until
        :meth:`recycle_buffer` takes it back; zero-filled unless ``zero`` is False.

        [Note: buffer reuse] On CUDA this is ``torch.zeros`` / ``torch.empty``: the caching allocator reuses
        freed blocks. Off CUDA a fresh tensor of a chunk's size is a new ``mmap`` every time, whose pages fault
        in as they are first written (~50-75 ms per 147 MiB buffer, each backward, for every chunk); the buffers
        :meth:`recycle_buffer` got back are kept and reused instead, as the caching allocator would. A kept
        buffer is device memory (it stays allocated), so it stays charged to the pool while kept
        (``kept_buffer_bytes``; in ``device_used_bytes`` and its peak), and :meth:`make_room` drops kept
        buffers before it finishes reduces or evicts a chunk: the pool never holds more than its budget, kept
        buffers included (DESIGN.md: "The simulation must be as strict as the hardware"). Reusing a kept
        buffer moves its charge from kept to in use (no new charge, no room to make).

        Args:
            numel: elements of the buffer.
            dtype: its dtype (the chunk's gradient dtype).
            what: what the buffer is for (named in a budget error).
            zero: zero-fill it (a reduce-scatter output is written whole by the collective: ``False``).
            keep: a chunk whose gradient buffer is being read and must not be spilled to make room
                ([Note: gradient spill]).

        Raises:
            DeviceBudgetExceededError: nothing left to drop, finish or evict and still no room.
        """
        nbytes = numel * dtype.itemsize
        free = self._free_buffers.get((numel, dtype))
        if free:
            buffer = free.pop()
            self.kept_buffer_bytes -= nbytes  # its charge moves to the in-use gradient bytes
            buffer = buffer.zero_() if zero else buffer
        else:
            self.make_room(nbytes, what, exclude={keep.chunk_id} if keep is not None else None)
            self.pool.charge(nbytes, what)
            buffer = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=self.compute_device)
        self._grad_live_bytes += nbytes
        self._grad_peak_bytes = max(self._grad_peak_bytes, self._grad_live_bytes)
        return buffer

    def recycle_buffer(self, buffer: torch.Tensor) -> None:
        """Give back a :meth:`grad_buffer` tensor nothing reads any more: off CUDA it is kept for reuse, still
        charged ([Note: buffer reuse]); on CUDA it is dropped and its bytes released."""
        nbytes = buffer.numel() * buffer.element_size()
        self._grad_live_bytes -= nbytes
        if self.compute_device.type != "cuda":
            self._free_buffers[(buffer.numel(), buffer.dtype)].append(buffer)
            self.kept_buffer_bytes += nbytes
        else:
            self.pool.release(nbytes)

    def drop_kept_buffers(self, nbytes: int | None = None) -> None:
        """Free kept gradient buffers ([Note: buffer reuse]) and release their charge: until ``nbytes`` more
        fit the pool (largest first), or all of them when ``nbytes`` is ``None``."""
        for key in sorted(self._free_buffers, key=lambda k: k[0] * k[1].itemsize, reverse=True):
            free = self._free_buffers[key]
            while free and (nbytes is None or not self.pool.fits(nbytes)):
                buffer = free.pop()
                size = buffer.numel() * buffer.element_size()
                del buffer
                self.kept_buffer_bytes -= size
                self.pool.release(size)
            if not free:
                del self._free_buffers[key]
            if nbytes is not None and self.pool.fits(nbytes):
                return

    def host_free(self, tensor: torch.Tensor) -> None:
        """Give back a tensor :meth:`host_empty` returned (drop every reference to it)."""
        self.host.free(tensor)

    def _next_use(self, chunk: Chunk, after: int | None = None) -> float:
        """Position of ``chunk``'s next use in the previous step's order after position ``after`` (default:
        the current one); ``inf`` if none."""
        positions = self.prev_positions.get(chunk.chunk_id)
        if not positions:
            return float("inf")
        i = bisect.bisect_right(positions, len(self.trace) - 1 if after is None else after)
        return positions[i] if i < len(positions) else float("inf")

    def _victim(self, exclude: set[int], beyond: tuple[float, int] | None = None) -> Chunk | None:
        """The chunk to evict: Belady (farthest next use in the previous step's order, the least recently used
        of those never used again), else LRU.

        Args:
            exclude: chunk ids that must stay.
            beyond: only chunks Belady ranks above this ``(next use, -last access)`` key (:meth:`_kept_until`).
        """
        candidates = [c for c in self.chunks if c.evictable and c.chunk_id not in exclude]
        if beyond is not None:
            candidates = [c for c in candidates if self._belady_key(c) > beyond]
        if not candidates:
            return None
        if self.prev_trace:
            return max(candidates, key=self._belady_key)
        return min(candidates, key=lambda c: c.last_access)

    def _belady_key(self, chunk: Chunk, after: int | None = None) -> tuple[float, int]:
        """Belady's eviction rank of ``chunk`` (the largest goes first): its next use after ``after``
        (:meth:`_next_use`), ties (never used again) to the least recently used."""
        return self._next_use(chunk, after), -chunk.last_access

    def make_room(self, nbytes: int, what: str, exclude: set[int] | None = None) -> None:
        """Evict unpinned unsharded chunks until ``nbytes`` more fit the budget.

        Raises:
            DeviceBudgetExceededError: nothing left to evict and still no room.
        """
        exclude = exclude or set()
        if self.pool.charges_activations and not self.pool.fits(nbytes):
            self.sync_activation_bytes()  # activations freed since the last count give their room back
        while not self.pool.fits(nbytes) and (self.kept_buffer_bytes or self._pending):
            if self.kept_buffer_bytes:
                self.drop_kept_buffers(nbytes)  # kept for reuse only: the first to go ([Note: buffer reuse])
            else:
                self._finish_reduce()  # finishing an in-flight reduce frees (keeps) its gradient buffers
        while not self.pool.fits(nbytes):
            victim = self._victim(exclude)
            if victim is None and self._spill_a_grad(exclude):
                self.drop_kept_buffers(nbytes)  # the spilled buffer is kept for reuse until dropped here
                continue
            if victim is None:
                try:
                    self.pool.charge(nbytes, what)  # raises with the numbers
                except DeviceBudgetExceededError as err:
                    raise DeviceBudgetExceededError(f"{err}. Device holds: {self.describe()}") from None
            victim.reshard()

    def _spill_a_grad(self, exclude: set[int]) -> bool:
        """[Note: gradient spill] A chunk's gradient buffer lives from its first gradient to its reduce, and a chunk
        whose parameters are used far apart in forward (packing follows registration order, which is not always
        the order of use: OPT registers the decoder's ``final_layer_norm`` between the position embedding and the
        first layer) keeps it through most of backward, beside the buffers of the chunks in between: three or
        more at once, where the budget floor (``device_floor_bytes``: two adjacent units and two gradient
        buffers) and the cost model count two. When nothing is left to evict, the partial buffer of the chunk
        reduced last (the one needed farthest ahead) goes to the host instead (:meth:`Chunk.spill_grad`) and
        comes back before its next gradient or its reduce: rank-local copies, the same collectives in the same
        order. So a step runs within the floor. Returns whether a buffer was spilled.

        Neither copy syncs the host (DESIGN.md: host syncs in the step's hot path are counted, one per step): the
        spill is a non-blocking device->host copy into the chunk's host buffer (:meth:`host_empty`: pinned on CUDA,
        so a real asynchronous DMA) queued on the current stream, the restore a non-blocking host->device copy on
        the current stream, and nothing on the host reads that buffer, so nothing waits for them (a blocking
        ``copy_`` would: ``memcpy_and_sync``, both ways). The device buffer goes to :meth:`recycle_buffer` right
        after its copy is queued: on CUDA that releases its pool charge and the chunk drops the last reference, so
        the caching allocator puts the block back in the free pool of the stream it was allocated on (the compute
        stream: gradient buffers are made by the backward hooks and the restore), where a later allocation is
        used only by work queued after the copy, which therefore reads it first. A spill can also be asked for on
        the reduce stream (the ``make_room`` of a reduce-scatter output, [Note: reduce overlap] in ``chunk.py``):
        its copy is then queued there, and ``record_stream`` on it keeps the allocator from handing the block to
        the compute stream before the copy ran (a no-op on the allocation stream). The host buffer is reused by
        the chunk's next spill: an event recorded after each copy and waited for by the next one (a stream wait)
        orders spill, restore and the next spill when they run on different streams. Off CUDA both are plain
        copies, the buffer is kept for reuse as before, the counters (``d2h_bytes``, ``h2d_bytes``,
        ``num_grad_spills``) are unchanged. ``tests/test_host_syncs.py`` counts the syncs of steps that spill."""
        if not self.backward_pending:
            return False
        order = {c.chunk_id: i for i, c in enumerate(self._reduce_order)}
        open_buffers = [c for c in self.chunks if c.grad_full is not None and c.chunk_id not in exclude]
        if not open_buffers:
            return False
        max(open_buffers, key=lambda c: (order.get(c.chunk_id, -1), c.chunk_id)).spill_grad()
        self.num_grad_spills += 1
        return True

    def describe(self) -> str:
        """What occupies the device, for error messages."""
        parts = []
        for c in self.chunks:
            held = []
            if c.unsharded and not c.full_alias:
                held.append(f"unsharded{'(pinned)' if c.pins else ''}{'(resident)' if c.resident else ''}")
            if c.full_alias:
                held.append("resident")
            elif c.shard_on_device:
                held.append("shard")
            if c.grad_full is not None:
                held.append("grad buffer")
            elif c.grad_spill is not None:
                held.append("grad buffer spilled to host")
            if held:
                parts.append(f"chunk {c.chunk_id}: {'+'.join(held)}")
        return "; ".join(parts) or "no chunk data"

    # -- access --------------------------------------------------------------------------------
    def access(self, chunks: list[Chunk]) -> None:
        """Unshard ``chunks`` for compute and pin them; record the access; prefetch ahead.

        """
        pinned: set[int] = {c.chunk_id for c in chunks}
        # inside a gathered context (full_parameters pins every chunk; one rank may run a forward alone):
        # not part of a step, so not recorded; the eviction state stays identical on every rank, which
        # chunks without a rank-local host copy rely on ([Note: rank-local refill] in chunk.py)
        gathered = not torch.is_grad_enabled() and all(c.pins > 0 and not c.needs_fill() for c in chunks)
        for chunk in chunks:
            chunk.pins += 1  # pin first so that making room for a sibling never evicts it
        for chunk in chunks:
            if not gathered:
                self._record(chunk)
            gather = chunk.needs_fill() and chunk.needs_collective()
            if chunk.needs_fill():
                self.make_room(chunk.fill_bytes_needed(), f"chunk {chunk.chunk_id}", exclude=pinned)
            started = time.perf_counter()
            if chunk.needs_fill():
                chunk.unshard()
            if chunk.wait_ready() or gather:  # a gather issued ahead, or one issued just now
                self.counters.gather_wait_s += time.perf_counter() - started
            if gather:
                self.counters.num_blocking_gathers += 1
        if self.prefetch_depth and self.prev_trace and not gathered:
            self._prefetch(pinned)

    def release(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            assert chunk.pins > 0, f"chunk {chunk.chunk_id} released more often than accessed"
            chunk.pins -= 1
            if self.backward_pending and self._reshard_dead(chunk):
                chunk.reshard()

    def _reshard_dead(self, chunk: Chunk) -> bool:
        """[Note: dead chunks] In backward, a :meth:`_dead` chunk (no later use in the previous step's order; the
        optimizer step makes its gathered copy stale) is resharded as soon as its last access is released,
        instead of holding its buffer until the next forward's make-room evicts it: what Belady would evict
        first, only earlier, so the device (and on CPU the process) does not carry stale copies through the
        end of backward and the step, where the tied embedding's gradients and the optimizer's work peak.
        Only for a chunk whole on one rank without a replica group: its refill is a local onload (no
        collective ranks could disagree on), and no gradient collective of it is in flight. With several
        ranks the room freed here would keep more reduces in flight ([Note: late reduce waits]); not measured
        apart, so not there."""
        if chunk.world_size != 1 or chunk.replicate_group is not None or not self.prev_trace:
            return False
        if not self._dead(chunk):
            return False
        # a unit that released its pins without leaving COMPUTE (it leaves it at end_backward)
        return not any(slot.state is TensorState.COMPUTE for slot in chunk.slots)

    def _record(self, chunk: Chunk) -> None:
        self.clock += 1
        chunk.last_access = self.clock
        if not self.backward_pending and self._outer_trace is None:
            self.first_use.setdefault(chunk.chunk_id, self.clock)
        if len(self.trace) < _MAX_TRACE:
            self.trace.append(chunk.chunk_id)
            self._grad_at.append((self._grad_live_bytes, self._grad_peak_bytes))
            self._grad_peak_bytes = self._grad_live_bytes

    def _prefetch(self, pinned: set[int]) -> None:
        """Unshard the next ``prefetch_depth`` chunks of the previous step's order, when that does not
        evict a chunk needed sooner than the prefetched one; all-gathers only where
        [Note: gather prefetch] allows (in backward: [Note: backward gather prefetch])."""
        pos = len(self.trace)
        gather_end = self._gather_window_end(pos)
        seen: set[int] = set(pinned)
        upcoming: list[tuple[int, int]] = []  # (position in prev_trace, chunk id)
        for index in range(pos, min(len(self.prev_trace), pos + 8 * self.prefetch_depth)):
            cid = self.prev_trace[index]
            if cid not in seen:
                seen.add(cid)
                upcoming.append((index, cid))
            if len(upcoming) == self.prefetch_depth:
                break
        keep = pinned | {cid for _, cid in upcoming}
        if self.gather_prefetch_mode() == "agreed":
            self._agreed_gathers_ahead(pos, pinned, upcoming, keep)  # the loop below then onloads only
        fills_before = 0  # bytes the hooks will charge for upcoming chunks not filled here ([Note: backward ...])
        for index, cid in upcoming:
            chunk = self.chunks[cid]
            if not chunk.needs_fill():
                continue
            collective = chunk.needs_collective()
            if not collective and self.forward_steps and self.copy_stream is None:
                return  # [Note: forward steps]: a local onload ahead off CUDA overlaps nothing, it only evicts
            need = chunk.fill_bytes_needed()
            if collective and (index >= gather_end or (self.backward_pending
                                                        and not self._backward_room(need + fills_before, pos, index))):
                fills_before += need
                continue  # not this phase's, not allowed, or no room (see [Note: gather prefetch])
            dead_only = collective and self.backward_pending  # [Note: backward gather prefetch]
            if self.kept_buffer_bytes and not self.pool.fits(need):
                self.drop_kept_buffers(need)  # what the hook's make_room drops first too ([Note: buffer reuse])
            beyond = (self._kept_until(pinned, upcoming, index, cid)
                      if collective and not dead_only and not self.pool.fits(need) else None)
            while not self.pool.fits(need):
                victim = self._dead_victim() if dead_only else self._victim(keep, beyond=beyond)
                if victim is None or self._next_use(victim) <= self._next_use(chunk):
                    return  # prefetching would evict something needed sooner: stop
                victim.reshard()
            chunk.unshard(side_stream=self.copy_stream, async_op=collective and self.async_gather)
            self.counters.num_prefetches += 1
            if collective:
                self.counters.num_prefetched_gathers += 1
            if chunk.pending_gather is not None:
                self._pending_gathers.append(chunk)

    def _kept_until(self, pinned: set[int], upcoming: list[tuple[int, int]], index: int,
                    target: int) -> tuple[float, int]:
        """[Note: Belady-consistent gather ahead] A gather issued ahead for chunk ``target``, used at position
        ``index`` of the previous step's order, may evict only a chunk Belady ranks above every rival: a chunk
        the hook at ``index`` could evict instead, i.e. one of ``pinned`` (pinned now) or of ``upcoming`` (the
        prefetch window, ``(position, chunk id)``) that will be on the device and unpinned then (on it now, or
        used before ``index``; not ``target``, which its hook pins, nor a resident chunk), as that hook will rank
        them: used after every rival is next used after ``index``, or, where a rival is not used again either,
        less recently than it (the accesses up to ``index`` are of rivals, which only makes them more recent).
        When that hook makes room, such a chunk is Belady's first victim anyway (nothing in forward frees memory
        in between), so issuing the gather early evicts what the hook would, and adds no all-gather. The tie
        matters where the chunk just used is never used again (a forward without backward, [Note: forward
        steps]): the hook would evict an older such chunk, not it. Returns that Belady key
        (:meth:`_belady_key`), ``(-inf, 0)`` without a rival."""
        before = {cid for position, cid in upcoming if position < index}
        rivals = [self.chunks[cid] for cid in pinned | {cid for _, cid in upcoming}
                  if cid != target and (cid in before or self.chunks[cid].unsharded)]
        return max((self._belady_key(c, after=index) for c in rivals if not (c.resident or c.full_alias)),
                   default=(-_INF, 0))

    def _dead(self, chunk: Chunk) -> bool:
        """An evictable trainable chunk this step uses no more (the optimizer step makes its gathered copy
        stale, so evicting it now costs no all-gather)."""
        return chunk.evictable and chunk.trainable and self._next_use(chunk) == float("inf")

    def _dead_victim(self) -> Chunk | None:
        """The least recently used :meth:`_dead` chunk (Belady's first victim: none is used again)."""
        return min((c for c in self.chunks if self._dead(c)), key=lambda c: c.last_access, default=None)

    def _backward_room(self, need: int, pos: int, index: int) -> bool:
        """[Note: backward gather prefetch] Whether ``need`` bytes, plus the gradient buffers and reduce
        outputs the previous step charged between positions ``pos - 1`` and ``index`` of its trace, fit in
        the free budget plus the chunks this step uses no more (:meth:`_dead`)."""
        if self.pool.budget_bytes is None:
            return True
        if not 0 < pos <= index < len(self.prev_grad_at):
            return False
        at = self.prev_grad_at
        reserve = max(0, max(peak for _, peak in at[pos:index + 1]) - self._grad_live_bytes)
        dead = sum(c.full_bytes for c in self.chunks if self._dead(c))
        # kept gradient buffers ([Note: buffer reuse]) are room: the rise reuses them, make_room drops the rest
        used = self.pool.used_bytes - self.kept_buffer_bytes
        return used + need + reserve <= self.pool.budget_bytes + dead

    def gather_prefetch_mode(self) -> str | None:
        """How all-gathers may be issued ahead: ``"fixed"`` (a pool that charges model data only: every rank
        computes the same decisions, [Note: gather prefetch]), ``"agreed"`` (a pool that charges activations,
        in training, every offloadable chunk with a rank-local host copy: [Note: agreed gathers ahead]), or
        ``None`` (in the hooks only: MoE-expert chunks, or such a pool without the copies or an optimizer)."""
        if any(c.subtree_only or c.host_copy_required for c in self.chunks):
            return None
        if not self.pool.charges_activations:
            return "fixed"
        if self.forward_steps:
            return None
        if all(c.keep_host_copy for c in self.chunks if c.world_size > 1 and not c.resident):
            return "agreed"
        return None

    def gather_prefetch_allowed(self) -> bool:
        """Whether any all-gather may be issued ahead (:meth:`gather_prefetch_mode` is not ``None``)."""
        return self.gather_prefetch_mode() is not None

    def _agreed_gathers_ahead(self, pos: int, pinned: set[int], upcoming: list[tuple[int, int]],
                              keep: set[int]) -> None:
        """[Note: agreed gathers ahead] In forward, for each chunk of the prefetch window ``upcoming``
        (``(position in the previous step's order, chunk id)``) that still needs its all-gather: record this
        rank's vote (room without evicting a chunk used sooner) the first time, and issue the gather now when
        every rank voted for it at the last step, making room by Belady's victims (never one of ``pinned``).

        Raises:
            DeviceBudgetExceededError: no eviction makes room for an agreed gather (this rank's activations
                leave less than the batch it voted with).
        """
        if self.backward_pending or not self.prev_forward_ends:
            return
        i = bisect.bisect_right(self.prev_forward_ends, pos)
        end = self.prev_forward_ends[i] if i < len(self.prev_forward_ends) else len(self.prev_trace)
        for index, cid in upcoming:
            chunk = self.chunks[cid]
            if index >= end or not chunk.needs_collective():
                continue
            if cid in self._ahead_room and cid not in self._ahead_agreed:
                continue  # voted at its first window position; its gather waits for its hook
            need = chunk.fill_bytes_needed()
            room = self._room_ahead(chunk, need, keep)
            if self._outer_trace is None:  # an evaluation forward between steps does not vote
                self._ahead_room.setdefault(cid, room)
            if cid not in self._ahead_agreed:
                continue
            evictions = self.counters.num_evictions
            self.make_room(need, f"chunk {cid}, all-gathered ahead of its use as every rank agreed at the last "
                           "optimizer step ([Note: agreed gathers ahead] in hf_elixir/chunk/manager.py; this rank's "
                           "batch saved more activations than the one it voted with)", exclude=pinned)
            if not room:
                self.counters.num_agreed_gather_evictions += self.counters.num_evictions - evictions
            chunk.unshard(side_stream=self.copy_stream, async_op=self.async_gather)
            self.counters.num_prefetches += 1
            self.counters.num_prefetched_gathers += 1
            if chunk.pending_gather is not None:
                self._pending_gathers.append(chunk)

    def _room_ahead(self, chunk: Chunk, need: int, keep: set[int]) -> bool:
        """Whether ``need`` more bytes for ``chunk`` fit the pool after dropping kept gradient buffers and
        evicting only chunks outside ``keep`` whose next use comes after ``chunk``'s ([Note: agreed gathers
        ahead])."""
        if self.pool.fits(need):
            return True
        self.sync_activation_bytes()  # activations freed since the last count give their room back
        target = self._next_use(chunk)
        spare = self.kept_buffer_bytes + sum(c.full_bytes for c in self.chunks if c.evictable and c.chunk_id not in keep
                                             and self._next_use(c) > target)
        return self.pool.used_bytes + need <= self.pool.budget_bytes + spare

    def agree_gathers_ahead(self, veto: list[float]) -> None:
        """The step's host read of the merged votes (``ahead_veto``, one per chunk: > 0 where some rank had no
        room, 0 where every voting rank had room, < 0 where no rank voted: the last agreement stands): the
        chunks whose all-gathers the next step issues ahead ([Note: agreed gathers ahead]). The same list and
        the same last agreement, so the same set, on every rank."""
        self._ahead_agreed = frozenset(cid for cid, v in enumerate(veto)
                                       if v == 0 or (v < 0 and cid in self._ahead_agreed))
        self._ahead_room = {}

    def _ahead_votes(self, group) -> list[float]:
        """This rank's votes for the chunks gathered over ``group``, by chunk id: 1.0 no room, 0.0 room, -1.0 no
        vote this step (none outside the agreed mode): [Note: agreed gathers ahead]."""
        if self.gather_prefetch_mode() != "agreed":
            return []
        return [-1.0 if c.chunk_id not in self._ahead_room else 0.0 if self._ahead_room[c.chunk_id] else 1.0
                for c in self._voters(group)]

    def _voters(self, group) -> list[Chunk]:
        return [c for c in self.chunks if c.world_size > 1 and c.group is group]

    def _voter_index(self, group) -> torch.Tensor:
        """The chunk ids of :meth:`_voters` as an int64 tensor on the compute device (uploaded once per group)."""
        index = self._voter_indices.get(id(group))
        if index is None:
            ids = torch.tensor([c.chunk_id for c in self._voters(group)], dtype=torch.int64)
            index = self._voter_indices[id(group)] = ids.to(self.compute_device, non_blocking=True)
        return index

    def _gather_window_end(self, pos: int) -> int:
        """The first position of the previous step's trace, at or after ``pos``, whose chunk may not be
        all-gathered ahead by the rule every rank computes alike: where the forward or backward running now
        ended in that step (``pos`` itself unless :meth:`gather_prefetch_mode` is ``"fixed"``; the agreed
        mode issues its gathers in :meth:`_agreed_gathers_ahead`)."""
        if self.gather_prefetch_mode() != "fixed":
            return pos
        ends = self.prev_backward_ends if self.backward_pending else self.prev_forward_ends
        if not ends:  # the previous step had no such phase (a backward after forward steps): its order says nothing
            return pos
        i = bisect.bisect_right(ends, pos)
        return ends[i] if i < len(ends) else len(self.prev_trace)

    def drain_gathers(self) -> None:
        """Wait for every all-gather issued ahead (at the start of backward and at the optimizer step: a
        prefetched chunk that forward did not use)."""
        for chunk in self._pending_gathers:
            chunk.wait_ready()
        self._pending_gathers = []

    def drain_refreshes(self) -> None:
        """Wait for every refresh of a device shard issued ahead ([Note: overlapped refresh] in
        ``hf_elixir/optim/optimizer.py``; on CUDA a stream wait, no host sync): at the start of backward, after
        which the host lane writes the masters and staging buffers those uploads read, and before anything
        reads or writes the compute copies outside an access."""
        for chunk in self.chunks:
            chunk.wait_refresh()

    def next_use_order(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` in the order the next forward first uses them: their first access in this step's trace
        (the previous step's when no access was recorded since), chunks it does not hold last, by id."""
        trace = self.trace or self.prev_trace
        first: dict[int, int] = {}
        for i, cid in enumerate(trace):
            first.setdefault(cid, i)
        return sorted(chunks, key=lambda c: (first.get(c.chunk_id, len(trace)), c.chunk_id))

    def join_side_streams(self) -> None:
        """Order the current CUDA stream after the prefetch, reduce and offload streams, without waiting on
        the host (the optimizer step's one host read then covers their work too); wait for the all-gathers
        issued ahead off CUDA (the step writes shards, which may be views into ``full``)."""
        self.drain_gathers()
        for stream in (self.copy_stream, self.reduce_stream, self.offload_stream):
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)

    def end_step(self) -> None:
        """Called at the optimizer step: the current trace becomes the reference for eviction."""
        self.drain_reduces()
        self.drain_gathers()
        self._rotate_trace()
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
            positions: dict[int, list[int]] = defaultdict(list)
            for i, cid in enumerate(self.trace):
                positions[cid].append(i)
            self.prev_positions = dict(positions)
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

    def take_param_writes(self) -> None:
        """Take what user code wrote in place into parameters with a current copy (``with torch.no_grad():
        p.mul_(0.99)`` between backward and step) into the shards, and give every chunk whose shard holds such
        writes to ``on_param_writes`` (the optimizer's masters take them) ([Note: parameter writes] in chunk.py).
        Called at the start of each backward, at the step and on entering ``full_parameters``; each reshard takes
        its chunk's. No collective: each rank takes its own writes. Costs one version-counter read per parameter
        when nothing was written."""
        for chunk in self.chunks:
            chunk.take_param_writes()
        if self.on_param_writes is not None:
            written = [c for c in self.chunks if c.params_written]
            if written:
                self.on_param_writes(written)

    def hide_stale(self) -> None:
        """Point the parameters of every chunk without a current unsharded copy at stale placeholders
        (:meth:`Chunk.hide_stale_params`): reading or writing one raises until its next unshard."""
        for chunk in self.chunks:
            chunk.hide_stale_params()

    def reset_peak(self) -> None:
        counters = self.counters
        counters.device_peak_bytes = counters.device_used_bytes
        counters.activation_peak_bytes = counters.activation_bytes
        counters.device_total_peak_bytes = counters.device_used_bytes + counters.activation_bytes

    def reshard_all(self) -> None:
        """Free every evictable unsharded chunk (e.g. after the optimizer step made them stale)."""
        for chunk in self.chunks:
            if chunk.evictable:
                chunk.reshard()

    # -- gradients -----------------------------------------------------------------------------
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
        self.arrived_flags.add(slot.flag_index)
        if slot.state is not TensorState.READY_FOR_REDUCE:
            slot.set_state(TensorState.READY_FOR_REDUCE)
        self._reduce_ready_prefix()
        if self.on_grad_progress is not None:
            self.on_grad_progress()

    def used_no_more(self, chunk: Chunk) -> bool:
        """In backward: ``chunk`` has no later access in the previous step's order (the step's last backward)
        and no parameter left in COMPUTE, so nothing reads its compute copy again before the next forward
        ([Note: early refresh] in ``hf_elixir/optim/optimizer.py``). ``False`` without a previous step, and
        once this step has made more accesses than the previous one (its order says nothing about them), and
        while a slot holds a gradient not yet reduced (``READY_FOR_REDUCE``: the chunk is reduced again, and the
        host lane takes that gradient too, e.g. a parameter of a block that reentrant activation checkpointing ran
        under ``no_grad`` in forward, whose gradient comes after the chunk's first reduce)."""
        return (self.backward_pending and len(self.trace) < len(self.prev_trace)  # within the known order
                and self._next_use(chunk) == float("inf")
                and not any(slot.state in (TensorState.COMPUTE, TensorState.READY_FOR_REDUCE)
                            for slot in chunk.slots))

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
        if self.before_backward is not None:
            self.before_backward()
        self.drain_gathers()
        self.drain_refreshes()
        # writes made before the forward, in the masters before the host lane steps them and uploads its result
        # into the compute copies ([Note: early refresh] in optim/optimizer.py, [Note: parameter writes] in chunk.py)
        self.take_param_writes()
        if len(self.trace) < _MAX_TRACE:
            self._forward_ends.append(len(self.trace))
        self.backward_pending = True
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
        last = len(self._reduce_order) - int(self.async_reduce)
        while self._reduce_cursor < last:
            chunk = self._reduce_order[self._reduce_cursor]
            if not self._chunk_ready(chunk):
                return
            self._reduce(chunk)
            self._reduce_cursor += 1

    def _reduce(self, chunk: Chunk) -> None:
        before, started = self.counters.reduce_scatter_bytes, time.perf_counter()
        in_place = chunk.grad_full is None and chunk.grad_spill is None and chunk.direct_grad_shard() is not None
        finish = chunk.reduce_scatter_grad(self.grad_shards[chunk.chunk_id], async_op=self.async_reduce)
        collective = self.counters.reduce_scatter_bytes != before  # one rank, not replicated: a local add
        if collective:
            self.counters.reduce_wait_s += time.perf_counter() - started
        chunk.arrived_slots.clear()
        if finish is not None:
            self._pending.append((chunk.chunk_id, self._timed_wait(finish) if collective else finish))
            if in_place:
                self._bufferless.add(chunk.chunk_id)
            window = self.reduce_window()
            while window is not None and len(self._pending) - len(self._bufferless) > window:
                self._finish_reduce()

    def reduce_window(self) -> int | None:
        """How many gradient collectives stay in flight during backward; ``None``: as many as the budget
        holds (see [Note: reduce window])."""
        if not self.host_steps_in_backward and all(c.resident or c.full_alias for c in self.chunks):
            return None
        return self.max_pending_reduces

    def offload_grad(self, chunk: Chunk, reduced: torch.Tensor, grad_shard: torch.Tensor) -> None:
        """Hand a host-optimizer chunk's reduced gradient shard to the host ([Note: gradient offload]).

        Args:
            chunk: the chunk (``optim_on_device`` False).
            reduced: its reduced gradient shard on the compute device, ``[shard_numel]``, the reduce dtype;
                not read after this returns on the simulated device, kept alive for the copy on CUDA
                (``record_stream``).
            grad_shard: the fp32 host gradient shard ``[shard_numel]`` it is added into.
        """
        cid = chunk.chunk_id
        waiting = self._offload_done.pop(cid, None)
        if waiting is not None:
            waiting()  # the last host add of this chunk has consumed its staging buffer
        staging = None
        if chunk.grad_shard_clean:
            target = grad_shard
        else:
            staging = self._grad_staging.get(cid)
            if staging is None:
                staging = self._grad_staging[cid] = self.host_empty(chunk.shard_numel, torch.float32)
            target = staging
        stream, event = self.offload_stream, None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), strict.host_copies(), (torch.cuda.stream(stream) if stream is not None
                                                     else contextlib.nullcontext()):
            target.copy_(reduced, non_blocking=True)
        if stream is not None:
            reduced.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        self.counters.d2h_bytes += chunk.shard_numel * reduced.element_size()
        chunk.grad_shard_clean = False
        if self.on_grad_offloaded is not None:
            waiting = self.on_grad_offloaded(chunk, staging, event)
            if waiting is not None:
                self._offload_done[cid] = waiting
            return
        if event is not None:  # no host lane (no optimizer): finish here
            event.synchronize()
        if staging is not None:
            grad_shard.add_(staging)

    def spec_flags(self, chunk: Chunk) -> frozenset[int]:
        """Flag indices of ``chunk``'s trainable slots that have a gradient on this rank so far (this
        backward's arrivals and earlier ones since ``zero_grad``): the has-gradient flags as this rank
        knows them before they are merged over ranks at the end of backward."""
        return frozenset(s.flag_index for s in chunk.slots if s.trainable and s.flag_index >= 0 and
                         (s.flag_index in self.arrived_flags or s.flag_index in self.local_flags))

    def _timed_wait(self, finish):
        """``finish`` adding the seconds it blocks to ``counters.reduce_wait_s``."""
        def timed() -> None:
            started = time.perf_counter()
            finish()
            self.counters.reduce_wait_s += time.perf_counter() - started
        return timed

    def _finish_reduce(self) -> None:
        cid, finish = self._pending.pop(0)
        self._bufferless.discard(cid)  # a chunk has at most one in-place reduce per backward, issued first
        finish()

    def drain_reduces(self, settle_zeros: bool = True) -> None:
        """Wait for every in-flight gradient collective and accumulate its result (see [Note: late reduce
        waits]: every reader of gradient shards or has-gradient flags calls this first); with
        ``settle_zeros``, also zero what backward left unwritten in deferred-zero gradient shards
        (:meth:`settle_grad_zeros`)."""
        while self._pending:
            self._finish_reduce()
        if settle_zeros:
            self.settle_grad_zeros()

    def settle_grad_zeros(self) -> None:
        """Make every gradient shard whose zeroing ``zero_grad`` deferred whole again ([Note: deferred
        gradient zeroing] in chunk.py): a no-op for the chunks reduced since (their reduce settled them)."""
        for cid in self.grad_shards:
            self.chunks[cid].settle_grad_zero()

    def reduces_in_flight(self) -> set[int]:
        """Ids of the chunks whose gradient collective is still to be finished, and :data:`FLAGS_IN_FLIGHT`
        while the has-gradient flags' all-reduce is ([Note: late reduce waits])."""
        return {cid for cid, _ in self._pending}

    def wait_flags(self) -> None:
        """Finish in-flight collectives in issue order up to the has-gradient flags' all-reduce, so that
        ``has_grad_flags`` holds this backward's merged flags (the reduces issued after it stay in flight)."""
        while any(cid == FLAGS_IN_FLIGHT for cid, _ in self._pending):
            self._finish_reduce()

    def finish_backward(self) -> None:
        """End-of-backward callback: flush remaining reduce-scatters in the fixed order, merge the
        has-gradient flags over ranks, drop backward pins. Off CUDA the last reduces stay in flight
        ([Note: late reduce waits])."""
        last = len(self._reduce_order) - int(self.async_reduce)
        while self._reduce_cursor < last:
            self._reduce(self._reduce_order[self._reduce_cursor])
            self._reduce_cursor += 1
        if self.async_reduce:
            self._merge_flags()
            while self._reduce_cursor < len(self._reduce_order):
                self._reduce(self._reduce_order[self._reduce_cursor])
                self._reduce_cursor += 1
        # a gradient that arrived after its chunk was reduced (a parameter used in two reentrant
        # checkpoint segments) is reduced once more; structural, so every rank does the same
        for chunk in self._reduce_order:
            if chunk.grad_full is not None or chunk.grad_spill is not None:
                self._reduce(chunk)
        if not self.async_reduce:
            self.drain_reduces()
        self.drain_gathers()  # a gather issued ahead for a chunk this backward did not use
        if len(self.trace) < _MAX_TRACE:
            self._backward_ends.append(len(self.trace))
        if not self.async_reduce:
            if self.reduce_stream is not None:
                torch.cuda.current_stream().wait_stream(self.reduce_stream)
            self._merge_flags()
        self.sync_activation_bytes()
        for chunk in self.chunks:
            chunk.used_slots.clear()
            chunk.arrived_slots.clear()
        self.backward_pending = False
        self.grads_pending = True
        if self.on_backward_end is not None:
            self.on_backward_end()

    on_backward_end = None

    def _merge_flags(self) -> None:
        """This backward's arrivals -> ``has_grad_flags``: one upload of the arrived indices, then a MAX
        all-reduce per flag group, all on the compute device (no host read)."""
        flags = torch.zeros(self.num_flags, device=self.compute_device)
        if self.arrived_flags:
            arrived = torch.tensor(sorted(self.arrived_flags), dtype=torch.int64)
            flags[arrived.to(self.compute_device, non_blocking=True)] = 1.0
        # per group its "no room" votes ([Note: agreed gathers ahead]) and (code, -code) ([Note: reduce order
        # check]), uploaded like the arrivals: no stream sync on CUDA
        hyper = float(self.hyper_code()) if self.hyper_code is not None else 0.0  # [Note: hyperparameter check]
        extras = [self._ahead_votes(group) + [code, -code, hyper, -hyper]
                  for (group, _), code in zip(self.flag_groups, self._reduce_order_codes())]
        extras_dev = (torch.tensor([v for e in extras for v in e]).to(self.compute_device, non_blocking=True)
                      if extras else None)
        parts, begin = [], 0
        for (group, indices), extra in zip(self.flag_groups, extras):
            parts.append((indices, torch.cat([flags[indices], extras_dev[begin:begin + len(extra)]]), group))
            begin += len(extra)
        works = [dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group, async_op=self.async_reduce)
                 for _, part, group in parts]
        self.local_flags |= self.arrived_flags
        self.arrived_flags = set()
        if any(len(e) > 4 for e in extras) and self.ahead_veto.numel() != len(self.chunks):
            self.ahead_veto = torch.ones(len(self.chunks), device=self.compute_device)

        def finish() -> None:
            for work, (indices, part, group) in zip(works, parts):
                if self.async_reduce:
                    work.wait()
                flags[indices] = part[:len(indices)]
                votes = part[len(indices):-4]
                if votes.numel():
                    self.ahead_veto[self._voter_index(group)] = votes
                # [Note: reduce order check] max(code) + max(-code) = max - min over the group's ranks
                self.reduce_order_mismatch = torch.maximum(self.reduce_order_mismatch,
                                                           part[-4:-2].sum().abs().reshape(1))
                self.hyper_mismatch = torch.maximum(self.hyper_mismatch, part[-2:].sum().abs().reshape(1))
            self.has_grad_flags = torch.maximum(self.has_grad_flags, flags)
        if self.async_reduce and works:  # waited by the step's read, timed like a reduce's wait
            self._pending.append((FLAGS_IN_FLIGHT, self._timed_wait(finish)))
        else:
            finish()

    def _reduce_order_codes(self) -> list[float]:
        """Per flag group, a 24-bit code of the order in which this backward reduced the group's chunks
        ([Note: reduce order check]); exact in the float32 flags."""
        position = {c.chunk_id: i for i, c in enumerate(self._reduce_order)}
        codes = []
        for members in self._flag_group_chunks:
            order = sorted(members, key=lambda cid: position.get(cid, len(position)))
            codes.append(float(zlib.crc32(struct.pack(f"<{len(order)}q", *order)) & 0xFFFFFF))
        return codes

    def zero_grad(self, keep_has_grad: bool = False) -> None:
        """Zero every gradient shard; ``keep_has_grad``: parameters that had a gradient keep a (zero)
        one for the next step (``zero_grad(set_to_none=False)``), else they have none until backward."""
        self.drain_reduces(settle_zeros=False)
        if self.host_fence is not None:
            self.host_fence(None)  # host work on the gradient shards ends (and speculative steps are undone)
        for chunk in self.chunks:
            chunk.grad_shard_clean = True
        for cid, grad_shard in self.grad_shards.items():
            # [Note: deferred gradient zeroing] in chunk.py: a direct shard is zeroed as backward writes it
            if not self.chunks[cid].defer_grad_zero():
                grad_shard.zero_()
        if not keep_has_grad:
            self.has_grad_flags.zero_()
            self.local_flags = set()
        self.reduce_order_mismatch.zero_()  # the gradients a mismatched order reduced are gone
        self.hyper_mismatch.zero_()
        self.grads_pending = False
        if self.on_zero_grad is not None:
            self.on_zero_grad()

    def clear_param_grad(self, param: torch.nn.Parameter, keep_has_grad: bool = False) -> None:
        """One parameter's :meth:`zero_grad` (``p.grad = None``, ``submodule.zero_grad()``): zero its
        elements of this rank's gradient shard; without ``keep_has_grad`` it has no gradient until the
        next backward gives it one (the step skips it, as PyTorch's optimizers skip ``p.grad is None``)."""
        slot = self.slot_of.get(param)
        if slot is None or not slot.trainable or self.backward_pending:
            return  # backward's own hook clears p.grad after moving it into the chunk
        chunk = self.chunk_of[param]
        grad_shard = self.grad_shards.get(chunk.chunk_id)
        self.drain_reduces()
        if self.host_fence is not None:
            self.host_fence(None)
        if grad_shard is not None:
            lo = max(slot.offset, chunk.shard_begin) - chunk.shard_begin
            hi = min(slot.offset + slot.numel, chunk.shard_begin + chunk.shard_numel) - chunk.shard_begin
            if hi > lo:
                grad_shard[lo:hi].zero_()
        if not keep_has_grad:
            self.has_grad_flags[slot.flag_index] = 0.0
            self.local_flags.discard(slot.flag_index)


def _packed(tensor: torch.Tensor) -> torch.Tensor:
    """What :meth:`ChunkManager._pack_saved` hands autograd for a saved activation: ``tensor.detach()`` (shares its
    storage and version counter, holds no ``grad_fn``: [Note: pack without a cycle]), tagged with the version it
    was saved at, which :func:`_unpack_saved` checks as autograd does for tensors saved without hooks."""
    packed = tensor.detach()
    packed._elixir_saved_version = tensor._version
    return packed


def _unpack_saved(tensor: torch.Tensor) -> torch.Tensor:
    """The saved tensor back for backward.

    Raises:
        RuntimeError: it was modified in place after autograd saved it (PyTorch's own check, which does not run
            for tensors packed by ``saved_tensors_hooks``; without this the gradient would silently use the
            modified values).
    """
    saved = getattr(tensor, "_elixir_saved_version", None)
    if saved is not None and tensor._version != saved:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{tensor.dtype}, shape {tuple(tensor.shape)}] is at version {tensor._version}; expected version "
            f"{saved} instead (hf_elixir's activation accounting packed it; plain PyTorch raises the same). Use the "
            f"out-of-place form of the operation (e.g. y = y * 2 instead of y.mul_(2)) on tensors that backward "
            f"still needs")
    return tensor


def _active_saved_tensors_hooks():
    """The ``(pack, unpack)`` pair of an enclosing ``saved_tensors_hooks`` context, or ``None`` (a nested
    context replaces the outer one, so the accounting chains to it instead)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _Release:
    """Context that releases ``nbytes`` from ``pool`` on exit (see ``ChunkManager.charge_temporary``)."""

    def __init__(self, pool: DevicePool, nbytes: int) -> None:
        self.pool, self.nbytes = pool, nbytes

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self.pool.release(self.nbytes)


def budget_error(needed: int, budget: int, what: str) -> ValueError:
    return ValueError(
        f"ElixirConfig.device_memory_budget_bytes={budget} is too small: {what} needs {needed} bytes on "
        f"the device; set device_memory_budget_bytes >= {needed} (or leave it None for all the device has)"
    )


__all__ += ["DeviceBudgetExceededError", "budget_error"]
