"""One chunk: a flat buffer of several parameters, its shard, its gradient buffer, and the verbs that
move them (unshard, reshard, accumulate a gradient, reduce-scatter).

[Note: parameters as views] After ``prepare`` each managed ``nn.Parameter`` keeps its identity but its
``.data`` is a view into ``Chunk.full``. Resharding frees ``full``'s storage
(``untyped_storage().resize_(0)``); unsharding re-allocates the same storage and fills it (copy from
the shard, or all-gather), so every view, including tensors autograd saved for backward, sees the
data again. This is how PyTorch FSDP keeps saved activations valid (``alloc_storage``/``free_storage``).

[Note: shard authority] Between steps the shard is the truth: the optimizer updates the fp32 master
and refreshes the shard, which bumps ``version``; an unsharded copy with an older version is stale and
is refilled on its next use. Parameters are read-only during forward/backward, so resharding needs no
write-back (no device->host traffic), except after ``load_state_dict`` wrote into ``full`` (``dirty``).
Between uses, a parameter without a current copy is a placeholder that raises on any read or write
([Note: stale placeholder] in params.py).

A chunk's verbs live by concept: its storage, sharding and collectives for the parameters (unshard, reshard) are
here; its gradients in ``_chunk_grads.py`` ([Note: deferred gradient zeroing]); the refresh of its device shard
from the optimizer in ``_chunk_refresh.py`` ([Note: strict refresh source]); its parameters' views, placeholders
and in-place writes in ``_chunk_params.py`` ([Note: parameter writes]).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_elixir._compat import all_gather_single
from hf_elixir.chunk import strict
from hf_elixir.chunk._chunk_grads import ChunkGradMixin
from hf_elixir.chunk._chunk_params import ChunkParamsMixin
from hf_elixir.chunk._chunk_refresh import ChunkRefreshMixin, _PendingRefresh
from hf_elixir.chunk._slot import ParamSlot
from hf_elixir.chunk.params import mark_managed
from hf_elixir.chunk.states import ChunkState, TensorState, check_chunk_transition

__all__ = ["ParamSlot", "Chunk", "REFRESH_STAGING_NUMEL", "refresh_staging_numel"]


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc_storage(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


#: elements of the fp32 device staging buffer a refresh cast on the device goes through, block by block ([Note:
#: refresh cast] in ``hf_elixir/optim/optimizer.py``): 32 Mi elements, 128 MiB (a smaller shard needs less)
REFRESH_STAGING_NUMEL = 1 << 25


def refresh_staging_numel(shard_numels: list[int]) -> int:
    """Elements of the one fp32 device staging buffer the refreshes cast on the device share: the largest such
    shard, at most :data:`REFRESH_STAGING_NUMEL` (0 when there is none). The optimizer charges it to the pool
    and the cost model prices the same bytes."""
    return min(max(shard_numels, default=0), REFRESH_STAGING_NUMEL)


@dataclass(eq=False)
class _PendingGather:
    """An all-gather into ``Chunk.full`` issued with ``async_op=True`` and not yet waited
    ([Note: gather prefetch] in ``_prefetch.py``).

    Attributes:
        work: the collective's work handle.
        staging: the onload staging buffer it reads (``[shard_numel]``), kept alive until it is done.
        staging_bytes: device-pool bytes charged for ``staging``, released by the wait.
    """

    work: object
    staging: torch.Tensor | None
    staging_bytes: int


class ChunkBytes:
    """Byte sizes of a chunk from ``chunk_numel``, ``shard_numel`` and ``element_size`` (the chunk
    itself, and the sizes-only stand-in ``hf_elixir.min_device_budget_bytes`` builds)."""

    chunk_numel: int
    shard_numel: int
    element_size: int

    @property
    def full_bytes(self) -> int:
        return self.chunk_numel * self.element_size

    @property
    def shard_bytes(self) -> int:
        return self.shard_numel * self.element_size


class Chunk(ChunkGradMixin, ChunkRefreshMixin, ChunkParamsMixin, ChunkBytes):
    """A contiguous 1-D buffer of ``chunk_numel`` elements of ``dtype`` holding ``slots``.

    The chunk is sharded over ``group`` (``world_size`` ranks): this rank owns elements
    ``[rank * shard_numel, (rank + 1) * shard_numel)``. Data movement is charged to the manager's
    :class:`~hf_elixir.chunk.memory.DevicePool` and counted in its counters.
    """

    def __init__(self, chunk_id: int, slots: list[ParamSlot], chunk_numel: int, dtype: torch.dtype,
                 group, compute_device: torch.device, manager) -> None:
        self.chunk_id = chunk_id
        self.slots = slots
        self.chunk_numel = chunk_numel
        self.dtype = dtype
        self.group = group
        self.manager = manager
        self.compute_device = compute_device
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        assert chunk_numel % self.world_size == 0, f"chunk {chunk_id}: numel {chunk_numel} not divisible"
        self.shard_numel = chunk_numel // self.world_size
        self.shard_begin = self.rank * self.shard_numel
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.trainable = any(s.trainable for s in slots)
        self.norm_replicas = 1  # ranks outside ``group`` holding an identical copy (tensor parallel)
        # "replicated" placement: every rank of this group keeps the whole chunk (world_size 1 storage);
        # gradients are all-reduced (mean) over it instead of reduce-scattered
        self.replicate_group = None
        # a frozen chunk every rank of this group keeps whole (world_size 1 storage, offloadable, no gradient):
        # rank 0's values are broadcast at prepare ([Note: whole frozen chunks] in _frozen_whole.py)
        self.whole_group = None
        # placement (set by the manager)
        self.resident = False
        self.shard_on_device = True
        self.optim_on_device = True
        # buffers
        self.full: torch.Tensor = torch.empty(0)
        self.shard: torch.Tensor = torch.empty(0)
        self.full_alias = False  # world_size 1 and shard on device: full *is* the shard
        self.unsharded = False
        self.version = 0
        self.full_version = -1
        self.pins = 0
        self.dirty = False
        self.params_written = False  # the shard holds parameter writes the master has not taken yet
        # gradients
        self.grad_full: torch.Tensor | None = None
        # [Note: gradient spill] in _grad_buffers.py: a partial gradient buffer moved to the host (None: not spilled)
        self.grad_spill: torch.Tensor | None = None
        self._grad_spill_host: torch.Tensor | None = None  # its host buffer, kept for the next spill
        self._grad_spill_event = None  # CUDA: recorded after the last copy into or out of that host buffer
        self.reduced_this_backward = False
        self.used_slots: set[int] = set()
        self.subtree_only = False  # only MoE-expert (subtree unit) parameters: see [Note: idle experts]
        self.arrived_slots: set[int] = set()
        self.last_access = 0
        # [Note: rank-local refill] with world_size > 1 an evicted unsharded chunk may be kept on the host
        # (``host_full``) until the shard changes, so re-unsharding it in the same step (backward,
        # recomputation, the next micro-batch) is a local onload, not a collective. It costs a full
        # compute-dtype copy of the chunk in host RAM on every rank, so it is a choice of the plan
        # (``keep_host_copy``, priced by the search against the all-gather it saves, bounded by
        # ``ElixirConfig.host_memory_budget_bytes``), not the default. Without it every rank re-gathers
        # in backward; dense modules run in the same order on every rank, so the gathers match. Chunks
        # holding MoE-expert parameters (``host_copy_required``) always keep it: only the first unshard
        # after a step gathers, in forward order, identical on every rank, so ranks whose experts got no
        # tokens never issue a different all-gather sequence.
        self.keep_host_copy = False
        self.host_copy_required = False
        self.host_full: torch.Tensor | None = None
        self.host_full_version = -1
        # a resident chunk sharded over several ranks: its shard is a view into ``full`` (one buffer, not
        # the gathered copy plus a separate shard copy); the all-gather then runs in place
        self.shard_in_full = False
        self.ready_event = None  # CUDA event of a side-stream unshard (prefetch)
        self.pending_gather: _PendingGather | None = None  # async all-gather issued ahead (prefetch, off CUDA)
        self.pending_refresh: _PendingRefresh | None = None  # upload of new values into the device shard
        self.hidden = False  # parameters are stale placeholders (see hide_stale_params)
        self.stale_values: torch.Tensor | None = None  # [len(slots)] NaN, backing one placeholder each
        self.grad_shard_clean = True  # the optimizer's gradient shard is zero (set by zero_grad)
        # [Note: deferred gradient zeroing] the shard is logically zero but not yet cleared; ``_grad_written``:
        # slots (``index_in_chunk``) backward has written into it since
        self.grad_zero_pending = False
        self._grad_written: set[int] = set()

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def grad_dtype(self) -> torch.dtype:
        return self.manager.reduce_dtype or self.dtype

    @property
    def grad_full_bytes(self) -> int:
        return self.chunk_numel * torch.empty((), dtype=self.grad_dtype).element_size()

    @property
    def copies_group(self):
        """The group every rank of which keeps this chunk whole ("replicated", or a whole frozen chunk), else None."""
        return self.replicate_group if self.replicate_group is not None else self.whole_group

    @property
    def wants_host_copy(self) -> bool:
        """Keep a rank-local host copy of the gathered chunk (see [Note: rank-local refill])."""
        return self.world_size > 1 and (self.keep_host_copy or self.host_copy_required)

    @property
    def state(self) -> ChunkState:
        """What ``full`` holds ([Note: chunk states] in ``states.py``), from the fields the verbs set."""
        if self.full_alias:
            return ChunkState.ALIAS
        if not self.unsharded:
            return ChunkState.SHARDED
        return ChunkState.GATHERING if self.pending_gather is not None else ChunkState.GATHERED

    def _moved(self, old: ChunkState, verb: str) -> None:
        check_chunk_transition(old, self.state, f"(rank {self.rank}, chunk {self.chunk_id}, {verb})")

    @property
    def evictable(self) -> bool:
        return self.unsharded and not self.full_alias and not self.resident and self.pins == 0

    # -- construction --------------------------------------------------------------------------
    def materialize(self, fill=None) -> None:
        """Copy the parameters' current data into the chunk, shard it, and point params at views.

        Called once by ``prepare``. Rank 0's values win (broadcast), so ranks start identical.

        Args:
            fill: streamed init ([Note: streamed init] in ``_stream_load.py``): ``fill(begin, end, out)``
                writes chunk elements ``[begin, end)`` into ``out``, read from a checkpoint, instead of
                the parameters' data. A chunk sharded over several ranks then reads only this rank's
                shard; a resident one all-gathers the rest, the others keep no gathered copy.
        """
        old = self.state
        counters = self.manager.counters
        full = torch.zeros(self.chunk_numel, dtype=self.dtype, device=self.compute_device)
        partial = False
        with torch.no_grad():
            if fill is None:
                for slot in self.slots:
                    full[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
            elif self.world_size == 1:  # whole on this rank (one rank, or "replicated"): read all of it
                fill(0, self.chunk_numel, full)
            else:
                own = full[self.shard_begin:self.shard_begin + self.shard_numel]
                fill(self.shard_begin, self.shard_begin + self.shard_numel, own)
                if self.resident:
                    all_gather_single(full, own, group=self.group)
                    counters.allgather_bytes += self.full_bytes
                partial = not self.resident
        if fill is None and self.world_size > 1:
            dist.broadcast(full, src=dist.get_global_rank(self.group, 0), group=self.group)
        elif fill is None and self.copies_group is not None:
            copies = self.copies_group
            dist.broadcast(full, src=dist.get_global_rank(copies, 0), group=copies)
        self.full = strict.register_device(full)
        for slot in self.slots:
            mark_managed(slot.param, slot.name, self.manager)
            slot.param.data = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
            slot.state = TensorState.HOLD
        self.full_alias = self.world_size == 1 and self.shard_on_device
        self.manager.pool.charge(self.full_bytes, f"chunk {self.chunk_id} (prepare)")
        if self.full_alias:
            self.shard = full
        else:
            src = full[self.shard_begin:self.shard_begin + self.shard_numel]
            self.shard_in_full = self.resident and self.shard_on_device
            if self.shard_in_full:
                self.shard = src
            elif self.shard_on_device:
                self.shard = strict.register_device(src.clone())
                self.manager.pool.charge(self.shard_bytes, f"chunk {self.chunk_id} shard")
            else:
                self.shard = self.manager.host_empty(self.shard_numel, self.dtype)
                with strict.host_copies():
                    self.shard.copy_(src)
        self.unsharded = True
        self.full_version = -1 if partial else self.version  # partial: only this rank's slice was read
        self.stamp_params()
        self._moved(old, "materialize")

    # -- unshard / reshard ---------------------------------------------------------------------
    def needs_fill(self) -> bool:
        return not (self.unsharded and self.full_version == self.version)

    def needs_collective(self) -> bool:
        """Would :meth:`unshard` all-gather (as opposed to a local copy)?"""
        return self.world_size > 1 and self.needs_fill() and self.host_full_version != self.version

    def fill_bytes_needed(self) -> int:
        """Device bytes an unshard must newly charge (full buffer + onload staging)."""
        need = 0 if (self.unsharded or self.full_alias) else self.full_bytes
        if self.needs_collective() and not self.shard_on_device:
            need += self.shard_bytes
        return need

    def unshard(self, side_stream=None, async_op: bool = False) -> None:
        """Make ``full`` hold this step's parameter values (onload and/or all-gather).

        The manager has made room (``fill_bytes_needed``) before calling.

        Args:
            side_stream: a CUDA stream to issue the copies and the all-gather on (prefetch overlapped with
                compute); :meth:`wait_ready` then orders the compute stream after them. ``None``: the
                current stream.
            async_op: issue an all-gather with ``async_op=True`` and return before it is done (prefetch
                off CUDA: gloo runs it on its own threads); :meth:`wait_ready` waits for it. Until then
                the parameters stay stale placeholders ([Note: stale placeholder] in params.py), so
                nothing reads the buffer while it is being filled.
        """
        if not self.needs_fill():
            self.wait_ready()  # a prefetched all-gather may still be filling ``full``
            self.show_params()
            return
        old = self.state
        self.wait_refresh(side_stream)  # the fill reads the shard the refresh writes
        self.manager.listener.host_fence(self)  # the host optimizer may be stepping this shard in place
        counters = self.manager.counters
        pool = self.manager.pool
        if async_op:
            self.hide_stale_params()  # (needs_fill() still holds here) no read before wait_ready
        if side_stream is not None:
            side_stream.wait_stream(torch.cuda.current_stream())
        stream_ctx = torch.cuda.stream(side_stream) if side_stream is not None else contextlib.nullcontext()
        with stream_ctx:
            self._fill(counters, pool, async_op)
        if side_stream is not None:
            self.ready_event = torch.cuda.Event()
            self.ready_event.record(side_stream)
        counters.num_unshards += 1
        self.unsharded = True
        self.full_version = self.version
        if self.pending_gather is None:
            self.show_params()
        for slot in self.slots:
            if slot.state is TensorState.FREE:
                slot.set_state(TensorState.HOLD)
        self._moved(old, "unshard")

    def wait_ready(self) -> bool:
        """Wait for the refresh of the device shard (:meth:`wait_refresh`) and for a prefetched all-gather
        issued with ``async_op`` (then release its staging buffer and point the parameters at ``full``);
        order the current CUDA stream after a side-stream unshard, and tell the caching allocator the
        compute stream uses the buffer (so freeing it later cannot race the compute).

        Returns:
            whether an all-gather issued ahead was waited for here.
        """
        self.wait_refresh()
        old = self.state
        pending, self.pending_gather = self.pending_gather, None
        self._moved(old, "wait_ready")
        if pending is not None:
            pending.work.wait()
            if pending.staging_bytes:
                self.manager.pool.release(pending.staging_bytes)
            self.show_params()
        if self.ready_event is not None:
            current = torch.cuda.current_stream()
            current.wait_event(self.ready_event)
            self.full.record_stream(current)
            self.ready_event = None
        return pending is not None

    def _fill(self, counters, pool, async_op: bool = False) -> None:
        if not self.unsharded and not self.full_alias:
            pool.charge(self.full_bytes, f"unsharded chunk {self.chunk_id}")
            _alloc_storage(self.full)
        pages = self.manager.disk_pages  # a host shard in the disk tier's file ([Note: disk parameters])
        if pages is not None:
            pages.onload(self)
        with torch.no_grad(), strict.host_copies():
            if self.world_size > 1 and self.host_full_version == self.version:
                self.full.copy_(self.host_full, non_blocking=True)
                counters.h2d_bytes += self.full_bytes
                counters.num_onloads += 1
            elif self.world_size == 1:
                if not self.full_alias:
                    self.full.copy_(self.shard, non_blocking=True)
                    counters.h2d_bytes += self.shard_bytes
                    counters.num_onloads += 1
            else:
                staged = not self.shard_on_device
                src = self.shard
                if staged:  # onload into a device staging buffer (a real copy also on CPU)
                    pool.charge(self.shard_bytes, f"onload staging of chunk {self.chunk_id}")
                    src = torch.empty(self.shard_numel, dtype=self.dtype, device=self.compute_device)
                    src.copy_(self.shard, non_blocking=True)
                    counters.h2d_bytes += self.shard_bytes
                    counters.num_onloads += 1
                work = all_gather_single(self.full, src, group=self.group, async_op=async_op)
                counters.allgather_bytes += self.full_bytes
                if async_op:  # waited (and the staging released) by wait_ready
                    self.pending_gather = _PendingGather(work, src if staged else None,
                                                         self.shard_bytes if staged else 0)
                elif staged:
                    del src
                    pool.release(self.shard_bytes)
        if pages is not None:
            pages.onloaded(self)

    def reshard(self) -> None:
        """Free the unsharded copy, keeping only the shard (no device->host traffic, see Note)."""
        assert self.pins == 0, f"rank {self.rank}: resharding pinned chunk {self.chunk_id}"
        if self.full_alias or not self.unsharded:
            return
        self.wait_ready()  # never free a buffer a collective is still writing
        if self.manager.recorder is not None:  # [Note: one step description] in schedule.py
            self.manager.record_event("evict", self)
        old = self.state
        if self.take_param_writes() and not self.manager.backward_pending:  # in backward: merged at the step
            self.manager.listener.on_param_writes([self])
        if self.dirty:
            self.write_back()
        assert not self.shard_in_full, f"rank {self.rank}: resharding chunk {self.chunk_id}, whose shard is in full"
        # keep a rank-local host copy only of a current gathered copy (not one full_parameters discarded)
        if (self.wants_host_copy and self.host_full_version != self.version
                and self.full_version == self.version):
            if self.host_full is None:
                self.host_full = self.manager.host_empty(self.chunk_numel, self.dtype)
            with torch.no_grad(), strict.host_copies():
                self.host_full.copy_(self.full)
            self.host_full_version = self.version
            self.manager.counters.d2h_bytes += self.full_bytes
        _free_storage(self.full)
        self.manager.pool.release(self.full_bytes)
        self.unsharded = False
        self._moved(old, "reshard")
        self.manager.counters.num_evictions += 1
        for slot in self.slots:
            if slot.state is not TensorState.READY_FOR_REDUCE:
                slot.set_state(TensorState.FREE)
        self.hide_stale_params()  # the views point at freed storage: reading them must raise

    def offload_shard(self, host: torch.Tensor) -> None:
        """Between steps, copy this rank's shard into ``host`` (a host buffer of ``shard_numel``), which becomes the
        shard, and stop being resident; a current gathered buffer stays, as cache eviction may free. Re-placement of
        a frozen chunk for another model ([Note: re-placing for a newcomer] in ``_shared_budget.py``), which counts
        the copy and releases a separate device shard's charge."""
        old = self.state
        inside = self.full_alias or self.shard_in_full  # the shard lives in the buffer, which is current
        src = self.full[self.shard_begin:self.shard_begin + self.shard_numel] if inside else self.shard
        with torch.no_grad(), strict.host_copies():
            host.copy_(src)
        if self.full_alias:  # the buffer is now the gathered copy of a host shard
            self.unsharded, self.full_version = True, self.version
        self.shard = host
        self.full_alias = self.shard_in_full = self.resident = self.shard_on_device = False
        self._moved(old, "offload_shard")

    def write_back(self) -> None:
        """Copy this rank's slice of ``full`` into the shard (after ``load_state_dict`` wrote ``full``)."""
        self.manager.listener.host_fence(self)
        self.wait_refresh()  # the refresh would overwrite what is written back
        with torch.no_grad(), strict.host_copies():
            if not self.full_alias:
                self.shard.copy_(self.full[self.shard_begin:self.shard_begin + self.shard_numel])
                if not self.shard_on_device:
                    self.manager.counters.d2h_bytes += self.shard_bytes
        if self.manager.disk_pages is not None:
            self.manager.disk_pages.onloaded(self)  # written: back to the file ([Note: disk parameters])
        self.dirty = False
        self.version += 1
        self.full_version = self.version
        self.stamp_params()  # what load_state_dict / full_parameters wrote through the parameters is in
