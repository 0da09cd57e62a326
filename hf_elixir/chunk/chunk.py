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

[Note: deferred gradient zeroing] (issue 14: all-resident overhead.) A chunk whose gradients are accumulated
straight into the optimizer's gradient shard (:meth:`Chunk.direct_grad_shard`: whole on this rank, optimizer
state on the device) is not zero-filled by ``zero_grad``: the shard is marked ``grad_zero_pending`` and the
first gradient of each parameter is *written* into it (``copy_``, or ``mul`` by ``1/world_size`` when
replicated) instead of added to zeros, as ``AccumulateGrad`` steals the first gradient instead of adding it
to a zero ``p.grad``. Before anything reads the shard as a whole, :meth:`Chunk.settle_grad_zero` zeroes what
backward did not write (parameters without a gradient, padding): at the chunk's reduce (before its
all-reduce) and in :meth:`ChunkManager.settle_grad_zeros`, which ``drain_reduces`` and the optimizer step call
(every reader of gradient shards calls ``drain_reduces`` first, [Note: late reduce waits] in manager.py). A
step's pass over the gradients shrinks from zero + add (write, then read + write) to one write per element.

[Note: parameter writes] A managed parameter with a current copy is a plain view into ``full``, so user code
may write it in place between steps (``with torch.no_grad(): p.mul_(0.99)``, ``p[pad_id].zero_()``,
``p.copy_(ema)``), as it would a plain PyTorch parameter. ``full`` is only a compute copy: the shard and the
optimizer's fp32 master are the truth ([Note: shard authority]), so such a write used to be lost silently
wherever they are separate buffers (resharding frees ``full``; the step overwrites it from the master): two
ranks with replicated chunks and host optimizer states trained as if the write never happened (4% parameter
difference after 4 steps of a manual weight decay), while one rank without a budget, where ``full`` is the
master, applied it. Every write through the parameter bumps its version counter (``param._version``; set
``.data`` keeps it), so :meth:`Chunk.take_param_writes` finds the written parameters by comparing it with
``ParamSlot.seen_version`` and copies this rank's slice of ``full`` into the shard (and into a rank-local host
copy); the manager's ``on_param_writes`` (the optimizer) then merges the shard into the master element by
element: elements whose compute value differs from the master's cast value take it, the others keep their fp32
master value (so bf16 masters are not rounded by a write elsewhere in the chunk). It runs at every reshard, at
the start of each backward (before the host lane steps the masters and uploads them into the compute copies,
[Note: early refresh] in ``hf_elixir/optim/optimizer.py``), at the start of ``step()`` and on entering
``full_parameters``: every way ``full`` is freed or overwritten while current. A managed parameter's
``.data`` shares its version counter (``_ManagedMixin.data`` in params.py), so ``p.data.mul_()`` is seen too. Every
rank takes its own writes (no collective); deterministic writes on every rank, as under DDP, stay identical.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_elixir._compat import all_gather_single, reduce_scatter_single
from hf_elixir.chunk import strict
from hf_elixir.chunk.params import hide as hide_param
from hf_elixir.chunk.params import mark_managed
from hf_elixir.chunk.params import show as show_param
from hf_elixir.chunk.states import TensorState, check_transition

__all__ = ["ParamSlot", "Chunk", "REFRESH_STAGING_NUMEL", "refresh_staging_numel"]


@dataclass(eq=False)
class ParamSlot:
    """Where one parameter lives inside its chunk.

    Attributes:
        name: canonical FQN (first name in ``named_parameters(remove_duplicate=False)`` order).
        param: the ``nn.Parameter`` (identity kept).
        offset / numel: element range ``[offset, offset + numel)`` inside the chunk.
        shape: the parameter's shape.
        trainable: ``param.requires_grad`` at ``prepare`` time.
        flag_index: position in the manager's has-gradient flag vector (trainable slots only, else -1).
    """

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    trainable: bool
    flag_index: int = -1
    index_in_chunk: int = -1
    state: TensorState = TensorState.FREE
    aliases: list[str] = field(default_factory=list)
    seen_version: int = 0  # ``param._version`` when its writes were last taken ([Note: parameter writes])

    def set_state(self, new: TensorState) -> None:
        check_transition(self.state, new, f"for parameter {self.name!r}")
        self.state = new


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc_storage(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


@dataclass(eq=False)
class _PendingRefresh:
    """An upload of the optimizer's new values into the device shard issued by
    :meth:`Chunk.issue_refresh` and not yet waited ([Note: overlapped refresh]).

    Attributes:
        source: the host buffer it reads (pinned staging in the compute dtype, or the fp32 master),
            ``[shard_numel]``; not written again before the wait (checked there, ``stamp``).
        staging: with a cast on the device, the fp32 device buffer the master goes through block by block
            (``[<= REFRESH_STAGING_NUMEL]``); ``None``: ``source`` is in the compute dtype.
        event: CUDA event recorded after the copy on the side stream; ``None`` on the simulated device,
            where the copy itself is done by the wait.
        stamp: ``source``'s :func:`_write_stamp` at the issue; the wait raises if it changed ([Note: strict
            refresh source]).
    """

    source: torch.Tensor
    event: object
    staging: torch.Tensor | None = None
    stamp: tuple[int, int] = (0, -1)
    # issued during backward from a speculative host step that ``step()`` has not validated yet ([Note: early
    # refresh] in ``hf_elixir/optim/optimizer.py``): a wait before the validation goes through the manager's
    # ``early_refresh_fence`` first
    speculative: bool = False


def _write_stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """``(data_ptr, version counter)`` of ``tensor``: both stay equal while nothing writes it in place (the
    counter is shared with its views and bumped by every in-place op autograd sees) or rebinds its storage
    ([Note: strict refresh source]). An inference tensor has no counter: ``-1`` (its writes are not seen)."""
    return tensor.data_ptr(), (-1 if tensor.is_inference() else tensor._version)


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
    ([Note: gather prefetch] in ``manager.py``).

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


class Chunk(ChunkBytes):
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
        # [Note: gradient spill] in manager.py: a partial gradient buffer moved to the host (None: not spilled)
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
    def wants_host_copy(self) -> bool:
        """Keep a rank-local host copy of the gathered chunk (see [Note: rank-local refill])."""
        return self.world_size > 1 and (self.keep_host_copy or self.host_copy_required)

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
        elif fill is None and self.replicate_group is not None:
            dist.broadcast(full, src=dist.get_global_rank(self.replicate_group, 0), group=self.replicate_group)
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
        self.wait_refresh(side_stream)  # the fill reads the shard the refresh writes
        if self.manager.host_fence is not None:  # the host optimizer may be stepping this shard in place
            self.manager.host_fence(self)
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

    def hide_stale_params(self) -> None:
        """Point the parameters of a chunk without a current unsharded copy (freed, or older than the shard)
        at stale placeholders that raise on any data access ([Note: stale placeholder] in params.py);
        ``shape``, ``dtype``, ``device`` and ``numel()`` stay right. Placeholder ``i`` is element ``i`` of
        :attr:`stale_values` expanded to slot ``i``'s shape (no memory). Called whenever the chunk is
        resharded, and at the optimizer step, the end of ``prepare`` and when
        ``full_parameters(writeback=False)`` exits; the next unshard (:meth:`show_params`) points them
        back at ``full`` before any use, so autograd's saved copies see the data again."""
        if self.hidden or not (self.needs_fill() or self.pending_refresh is not None):
            return
        if self.stale_values is None:
            self.stale_values = torch.full((len(self.slots),), float("nan"), dtype=self.dtype,
                                           device=self.compute_device)
        for i, slot in enumerate(self.slots):
            hide_param(slot.param, self.stale_values[i].expand(slot.shape))
        self.hidden = True

    def show_params(self) -> None:
        """Undo :meth:`hide_stale_params`: parameters are views into ``full`` again."""
        if not self.hidden:
            return
        for slot in self.slots:
            show_param(slot.param, self.full[slot.offset:slot.offset + slot.numel].view(slot.shape))
        self.hidden = False

    def issue_refresh(self, source: torch.Tensor, side_stream=None, staging: torch.Tensor | None = None,
                      speculative: bool = False) -> None:
        """Upload ``source`` (this rank's new shard values, a host buffer of ``shard_numel`` elements) into the
        device shard without making the compute wait ([Note: overlapped refresh] in
        ``hf_elixir/optim/optimizer.py``): on CUDA a non-blocking copy on ``side_stream`` and an event; on the
        simulated device the copy is left to :meth:`wait_refresh`, so a read that skips the wait sees the old
        values, and the parameters are stale placeholders until then (a read raises, [Note: stale placeholder]).
        With ``staging`` (an fp32 device buffer; ``source`` the fp32 master, the compute dtype narrower) the
        upload goes through it block by block and is cast on the device ([Note: refresh cast]).
        ``speculative``: issued during backward from an unvalidated host step ([Note: early refresh]).
        Counted in ``h2d_bytes`` (the source's bytes) and ``num_refreshes_ahead``."""
        assert strict.is_host(source) or source.device.type == "cpu", f"chunk {self.chunk_id}: refresh from device"
        assert source.numel() == self.shard_numel, f"chunk {self.chunk_id}"
        assert source.dtype == (torch.float32 if staging is not None else self.dtype), f"chunk {self.chunk_id}"
        assert staging is None or (staging.dtype == torch.float32 and not strict.is_host(staging)), \
            f"chunk {self.chunk_id}: the refresh cast's staging is an fp32 device buffer"
        self.wait_refresh()  # an earlier refresh never waited for (two steps without a forward)
        event = None
        if side_stream is not None:
            side_stream.wait_stream(torch.cuda.current_stream())  # after the compute's last read of the shard
            with torch.cuda.stream(side_stream), torch.no_grad(), strict.host_copies():
                self._copy_refresh(source, staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side_stream)
        self.pending_refresh = _PendingRefresh(source, event, staging, _write_stamp(source), speculative)
        counters = self.manager.counters
        counters.h2d_bytes += source.numel() * source.element_size()
        counters.num_refreshes_ahead += 1
        self.hide_stale_params()

    def _copy_refresh(self, source: torch.Tensor, staging: torch.Tensor | None, non_blocking: bool) -> None:
        """The refresh's copies (inside ``strict.host_copies``): one copy into the device shard, or, with
        ``staging``, per block of ``staging.numel()`` elements an fp32 upload into it and a cast out of it on the
        device. On CUDA all on one stream, so a block's upload waits for the cast that read the buffer before."""
        target = self._refresh_target()
        if staging is None:
            target.copy_(source, non_blocking=non_blocking)
            return
        block = staging.numel()
        for lo in range(0, source.numel(), block):
            hi = min(lo + block, source.numel())
            staging[:hi - lo].copy_(source[lo:hi], non_blocking=non_blocking)
            target[lo:hi].copy_(staging[:hi - lo])  # fp32 -> compute dtype on the device (round to nearest even)

    def _refresh_target(self) -> torch.Tensor:
        return self.full if self.full_alias else self.shard

    def wait_refresh(self, stream=None) -> None:
        """Make the refresh :meth:`issue_refresh` issued visible: on CUDA ``stream`` (default: the current one)
        waits for its event (no host sync); on the simulated device the copy is done here. The parameters of a
        current chunk point at ``full`` again. A refresh issued from a speculative host step that ``step()`` has
        not validated yet ([Note: early refresh] in ``hf_elixir/optim/optimizer.py``) is a misprediction when
        anything waits for it first: the manager's ``early_refresh_fence`` undoes that step and uploads the
        values from before it, which this then waits for.

        Raises:
            RuntimeError: the refresh's source was written in place (or its storage rebound) since
                :meth:`issue_refresh`: a race with the upload on CUDA ([Note: strict refresh source]); the
                refresh is dropped (the shard keeps its old values).
        """
        early = self.pending_refresh
        if early is not None and early.speculative:
            early.speculative = False
            self.manager.early_refresh_fence(self)  # may issue a new refresh in its place
        pending, self.pending_refresh = self.pending_refresh, None
        if pending is None:
            return
        self._check_refresh_source(pending)
        if pending.event is not None:
            (stream or torch.cuda.current_stream()).wait_event(pending.event)
        else:
            with torch.no_grad(), strict.host_copies():
                self._copy_refresh(pending.source, pending.staging, non_blocking=False)
        if not self.needs_fill():
            self.show_params()

    def _check_refresh_source(self, pending: _PendingRefresh) -> None:
        """[Note: strict refresh source] On CUDA :meth:`issue_refresh` queues a non-blocking host->device copy on
        the copy stream: the DMA reads ``source`` some time between the issue and the event, so a host write to
        ``source`` before the host knows the copy finished (its event synchronised) uploads the old values, or a
        torn mix of old and new. The simulated device copies at the wait, so it would upload the new values and
        hide that race. Both paths therefore stamp the source at the issue (``data_ptr`` and the version counter,
        :func:`_write_stamp`) and compare at the wait: a changed stamp raises. Every writer of a master or a
        staging buffer bumps the counter: ``copy_`` and the ``_foreach_*`` ops of the inverse rollback do it
        themselves; ``torch._fused_adam(w)_`` does not (PyTorch 2.13, direct or via ``torch.optim.AdamW(
        fused=True)``), so the same-pass step (``hf_elixir/optim/_same_pass.py``) and the inner optimizer's step
        (``ElixirOptimizer._run_inner``) bump it with ``torch.autograd.graph.increment_version`` after the
        kernel. A write through ``.data`` is not seen (new counter): the masters are not written that way. The
        sanctioned order is the one of ``ElixirOptimizer._release_staging`` (synchronise the event, wait, then
        write) or the start of backward's drain (the host lane writes only after it). Cost: two integer reads per
        issue and per wait."""
        stamp = _write_stamp(pending.source)
        if stamp == pending.stamp:
            return
        what = ("rebound to other storage" if stamp[0] != pending.stamp[0] else
                f"written in place (version counter {pending.stamp[1]} -> {stamp[1]})")
        raise RuntimeError(
            f"chunk {self.chunk_id}: the host buffer its refresh uploads (the {tuple(pending.source.shape)} "
            f"{'fp32 master' if pending.source.dtype == torch.float32 else 'staging buffer'}) "
            f"was {what} between issue_refresh and wait_refresh. On CUDA the upload is a non-blocking copy queued at "
            "issue_refresh, so it would have read the values of the issue time (or a torn mix), not the new ones. "
            "Wait for the refresh before writing its source (ElixirOptimizer._release_staging: synchronise its "
            "event, then Chunk.wait_refresh)")

    def wait_ready(self) -> bool:
        """Wait for the refresh of the device shard (:meth:`wait_refresh`) and for a prefetched all-gather
        issued with ``async_op`` (then release its staging buffer and point the parameters at ``full``);
        order the current CUDA stream after a side-stream unshard, and tell the caching allocator the
        compute stream uses the buffer (so freeing it later cannot race the compute).

        Returns:
            whether an all-gather issued ahead was waited for here.
        """
        self.wait_refresh()
        pending, self.pending_gather = self.pending_gather, None
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

    def reshard(self) -> None:
        """Free the unsharded copy, keeping only the shard (no device->host traffic, see Note)."""
        assert self.pins == 0, f"rank {self.rank}: resharding pinned chunk {self.chunk_id}"
        if self.full_alias or not self.unsharded:
            return
        self.wait_ready()  # never free a buffer a collective is still writing
        if self.take_param_writes() and self.manager.on_param_writes is not None \
                and not self.manager.backward_pending:  # in backward: merged at the step
            self.manager.on_param_writes([self])
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
        self.manager.counters.num_evictions += 1
        for slot in self.slots:
            if slot.state is not TensorState.READY_FOR_REDUCE:
                slot.set_state(TensorState.FREE)
        self.hide_stale_params()  # the views point at freed storage: reading them must raise

    def write_back(self) -> None:
        """Copy this rank's slice of ``full`` into the shard (after ``load_state_dict`` wrote ``full``)."""
        if self.manager.host_fence is not None:
            self.manager.host_fence(self)
        self.wait_refresh()  # the refresh would overwrite what is written back
        with torch.no_grad(), strict.host_copies():
            if not self.full_alias:
                self.shard.copy_(self.full[self.shard_begin:self.shard_begin + self.shard_numel])
                if not self.shard_on_device:
                    self.manager.counters.d2h_bytes += self.shard_bytes
        self.dirty = False
        self.version += 1
        self.full_version = self.version
        self.stamp_params()  # what load_state_dict / full_parameters wrote through the parameters is in

    def stamp_params(self) -> None:
        """Record every parameter's version counter as taken ([Note: parameter writes])."""
        for slot in self.slots:
            slot.seen_version = slot.param._version

    def take_param_writes(self) -> bool:
        """Carry in-place writes made through the parameters since they were last taken from ``full`` into
        the shard ([Note: parameter writes]); a rank-local host copy of ``full`` is updated too.

        Returns:
            whether there were writes on a current copy (the master still has to take them:
            ``params_written`` is set until the optimizer merged them).
        """
        written = False
        for slot in self.slots:
            if slot.param._version != slot.seen_version:
                slot.seen_version = slot.param._version
                written = True
        if not written or not self.unsharded or self.needs_fill() or self.hidden:
            return False  # a stale parameter raises on any write: nothing reached a freed or old copy
        if self.manager.host_fence is not None:  # the host optimizer may be stepping this shard in place
            self.manager.host_fence(self)
        with torch.no_grad(), strict.host_copies():
            if not self.full_alias and not self.shard_in_full:
                self.shard.copy_(self.full[self.shard_begin:self.shard_begin + self.shard_numel])
                if not self.shard_on_device:
                    self.manager.counters.d2h_bytes += self.shard_bytes
            if self.host_full is not None and self.host_full_version == self.version:
                self.host_full.copy_(self.full)
                self.manager.counters.d2h_bytes += self.full_bytes
        self.params_written = True
        return True

    # -- gradients -----------------------------------------------------------------------------
    def direct_grad_shard(self) -> torch.Tensor | None:
        """The optimizer's gradient shard when gradients can be accumulated straight into it: the chunk is
        whole on this rank (one rank, or "replicated" while the shard holds no all-reduced gradient yet,
        then all-reduced in place as DDP's ``gradient_as_bucket_view``), optimizer state on the device,
        same dtype. Saves the gradient buffer's allocation, zero-fill and the copy into the shard (what
        plain PyTorch's ``AccumulateGrad`` saves by stealing the gradient)."""
        if self.world_size != 1 or not self.optim_on_device:
            return None
        if self.replicate_group is not None and not self.grad_shard_clean:
            return None  # holds an earlier micro-batch's averaged gradient (all-reducing it again is exact only
            # for power-of-two world sizes): later micro-batches use a separate buffer
        shard = self.manager.grad_shards.get(self.chunk_id)
        if shard is None or shard.dtype != self.grad_dtype or shard.numel() != self.chunk_numel:
            return None
        return shard

    def defer_grad_zero(self) -> bool:
        """``zero_grad`` on a chunk whose gradients are accumulated straight into the optimizer's shard
        (:meth:`direct_grad_shard`): mark the shard zero without writing it ([Note: deferred gradient
        zeroing]). Returns False (nothing deferred: the caller zeroes the shard) for any other chunk."""
        if self.direct_grad_shard() is None:
            return False
        self.grad_zero_pending = True
        self._grad_written.clear()
        return True

    def settle_grad_zero(self) -> None:
        """Zero the parts of a deferred-zero gradient shard that backward has not written (unused parameters,
        padding): afterwards the whole shard holds this step's gradients ([Note: deferred gradient zeroing])."""
        if not self.grad_zero_pending:
            return
        shard = self.manager.grad_shards[self.chunk_id]
        begin = 0
        with torch.no_grad():
            for slot in sorted((s for s in self.slots if s.index_in_chunk in self._grad_written),
                               key=lambda s: s.offset):
                if slot.offset > begin:
                    shard[begin:slot.offset].zero_()
                begin = max(begin, slot.offset + slot.numel)
            if begin < shard.numel():
                shard[begin:].zero_()
        self.grad_zero_pending = False
        self._grad_written.clear()

    def spill_grad(self) -> None:
        """Move the partial gradient buffer to the host and free its device bytes ([Note: gradient spill] in
        ``manager.py``); :meth:`_restore_grad` brings it back before the next gradient or the reduce. No host
        sync: a non-blocking copy into the host buffer (pinned on CUDA) queued on the current stream."""
        assert self.grad_full is not None and self.grad_spill is None, f"chunk {self.chunk_id}: nothing to spill"
        host = self._grad_spill_host
        if host is None:
            host = self._grad_spill_host = self.manager.host_empty(self.chunk_numel, self.grad_dtype)
        grad_full = self.grad_full
        self._spill_copy(host, grad_full)
        if grad_full.is_cuda:  # freed below while the copy may still read it: no reuse before it ran on this
            grad_full.record_stream(torch.cuda.current_stream())  # stream (a no-op on the allocation stream)
        self.manager.counters.d2h_bytes += self.grad_full_bytes
        self.manager.recycle_buffer(grad_full)
        self.grad_full, self.grad_spill = None, host

    def _restore_grad(self) -> None:
        """Bring a spilled gradient buffer back to the device (charged again, making room as any buffer does);
        a non-blocking copy on the current stream, after the spill's."""
        host = self.grad_spill
        self.grad_spill = None
        self.grad_full = self.manager.grad_buffer(self.chunk_numel, self.grad_dtype,
                                                  f"gradient buffer of chunk {self.chunk_id} (spilled)", zero=False)
        self._spill_copy(self.grad_full, host)
        self.manager.counters.h2d_bytes += self.grad_full_bytes

    def _spill_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy of a gradient spill or restore ([Note: gradient spill] in ``manager.py``), non-blocking on
        the current stream; on CUDA after the previous copy into or out of the host buffer (an event: the spill
        may have run on the reduce stream, its restore on the compute stream), and an event recorded after it."""
        cuda = dst.is_cuda or src.is_cuda
        if cuda and self._grad_spill_event is not None:
            torch.cuda.current_stream().wait_event(self._grad_spill_event)
        with torch.no_grad(), strict.host_copies():
            dst.copy_(src, non_blocking=True)
        if cuda:
            self._grad_spill_event = torch.cuda.Event()
            self._grad_spill_event.record()

    def accumulate_grad(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Add ``grad`` (shape ``slot.shape``) into the chunk's gradient buffer."""
        if self.grad_spill is not None:
            self._restore_grad()
        if self.grad_full is None:
            direct = self.direct_grad_shard()
            if direct is not None:
                scale = 1.0 if self.replicate_group is None else 1.0 / dist.get_world_size(self.replicate_group)
                with torch.no_grad():  # [Note: pre-divided all-reduce] when replicated
                    target = direct[slot.offset:slot.offset + slot.numel]
                    if self.grad_zero_pending and slot.index_in_chunk not in self._grad_written:
                        # the first gradient into a deferred-zero shard: written, not added to zeros
                        self._grad_written.add(slot.index_in_chunk)
                        if scale == 1.0:
                            target.copy_(grad.reshape(-1))
                        else:
                            torch.mul(grad.reshape(-1), scale, out=target)
                    elif scale == 1.0:
                        target.add_(grad.reshape(-1))
                    else:
                        target.add_(grad.reshape(-1), alpha=scale)
                return
            self.grad_full = self.manager.grad_buffer(self.chunk_numel, self.grad_dtype,
                                                      f"gradient buffer of chunk {self.chunk_id}")
        with torch.no_grad():
            target = self.grad_full[slot.offset:slot.offset + slot.numel]
            if self.replicate_group is None:
                target.add_(grad.reshape(-1))
            else:  # [Note: pre-divided all-reduce], in the buffer as in the shard
                target.add_(grad.reshape(-1), alpha=1.0 / dist.get_world_size(self.replicate_group))

    def _mark_reduced(self) -> None:
        """This backward's gradients of the chunk are handed to the reduce: slots leave READY_FOR_REDUCE."""
        self.reduced_this_backward = True
        for slot in self.slots:
            if slot.state is TensorState.READY_FOR_REDUCE:
                slot.set_state(TensorState.HOLD_AFTER_BWD if (self.unsharded or self.full_alias) else TensorState.FREE)

    def reduce_scatter_grad(self, grad_shard: torch.Tensor, async_op: bool = False):
        """Reduce-scatter (mean over ranks) the gradient buffer and add the result into ``grad_shard``.

        Args:
            grad_shard: fp32 tensor ``[shard_numel]`` where the optimizer state lives (host or device).
            async_op: issue the collective asynchronously and return a callable that waits for it,
                accumulates into ``grad_shard`` and frees the buffers (the manager calls it later, so the
                communication overlaps the rest of backward, as DDP's bucketed all-reduce does).

        Returns:
            ``None`` when done, or the finishing callable (``async_op=True``).

        Every rank calls this for every trainable chunk exactly once per backward, in the manager's
        fixed order, even when it received no gradient for the chunk (zeros), so ranks never hang.
        """
        counters = self.manager.counters
        self.settle_grad_zero()  # the collective and the accumulation below read the whole shard
        if self.grad_spill is not None:
            self._restore_grad()
        direct = self.direct_grad_shard() if self.grad_full is None else None
        if direct is not None:  # gradients are already in the optimizer's shard
            self._mark_reduced()
            if self.replicate_group is None:
                return None
            self.grad_shard_clean = False  # later gradients of this step go to a buffer
            group = self.replicate_group
            work = dist.all_reduce(direct, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
            counters.reduce_scatter_bytes += self.grad_full_bytes

            # [Note: pre-divided all-reduce] the gradients were divided by the group's size as they were added
            # into the shard, or into the gradient buffer when there is one (host optimizer, later micro-batches;
            # DDP divides its buckets before the all-reduce too), so the sum is the mean: no pass over the whole
            # chunk after the collective
            if async_op:
                return work.wait
            return None
        if self.grad_full is None:  # no gradient on this rank (idle experts, unused branch)
            if self.world_size == 1 and self.replicate_group is None:
                self._mark_reduced()  # no collective to join: adding zeros changes nothing
                return None
            self.grad_full = self.manager.grad_buffer(self.chunk_numel, self.grad_dtype,
                                                      f"gradient buffer of chunk {self.chunk_id}")
        # [Note: reduce overlap] on CUDA, with the optimizer state on the device, the reduce-scatter and
        # the accumulation into the shard gradient run on the manager's reduce stream, overlapping the
        # rest of backward; record_stream keeps the caching allocator from reusing the buffers early and
        # the end-of-backward callback joins the stream. Host optimizer state needs the result on the
        # host, so that case stays on the current stream. Off CUDA the collective is issued with
        # ``async_op`` and finished later by the manager.
        stream = self.manager.reduce_stream if self.optim_on_device else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        stream_ctx = (lambda: torch.cuda.stream(stream)) if stream is not None else contextlib.nullcontext
        grad_full, work, divisor, shard_grad_bytes = self.grad_full, None, 1, 0
        with torch.no_grad(), stream_ctx():
            if self.world_size > 1:
                shard_grad_bytes = self.grad_full_bytes // self.world_size
                out = self.manager.grad_buffer(self.shard_numel, self.grad_dtype,
                                               f"reduce-scatter output of chunk {self.chunk_id}", zero=False, keep=self)
                work = reduce_scatter_single(out, grad_full, op=dist.ReduceOp.SUM, group=self.group,
                                             async_op=async_op)
                counters.reduce_scatter_bytes += self.grad_full_bytes
                divisor = self.world_size
            else:
                out = grad_full
                if self.replicate_group is not None:  # pre-divided: no pass after the all-reduce
                    work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.replicate_group, async_op=async_op)
                    counters.reduce_scatter_bytes += self.grad_full_bytes
        self.grad_full = None  # a gradient arriving later starts a new buffer
        self._mark_reduced()

        def finish() -> None:
            if work is not None and async_op:
                work.wait()
            with torch.no_grad(), stream_ctx():
                if divisor > 1:
                    out.div_(divisor)
                if self.optim_on_device:
                    grad_shard.add_(out.to(grad_shard.dtype))
                else:  # offload: a non-blocking device->host copy, added on the host ([Note: gradient offload])
                    self.manager.offload_grad(self, out, grad_shard)
                if stream is not None:
                    grad_full.record_stream(stream)
                    out.record_stream(stream)
            if shard_grad_bytes:
                self.manager.recycle_buffer(out)
            self.manager.recycle_buffer(grad_full)

        if async_op and work is not None:
            return finish
        finish()
        return None
