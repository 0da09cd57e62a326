"""``ChunkManager``: owns every chunk of a model and coordinates what happens to them in a step: which are on the
device, which gathers run ahead of their use, when gradients are reduced, and what every rank must agree on.

The manager is a coordinator; each concept lives in a file of its own with its design notes, as FSDP2 gives its
concepts a file each (``torch/distributed/fsdp/_fully_shard/``):

* ``_steps.py``: the access trace, the step / forward bookkeeping ([Note: forward steps]);
* ``_eviction.py``: Belady eviction, ``make_room``: :class:`Eviction` (``eviction``) ([Note: Belady eviction], [Note:
  dead chunks]);
* ``_grad_buffers.py``: gradient buffers, their reuse and spill ([Note: buffer reuse], [Note: gradient spill]);
* ``_prefetch.py``: all-gathers and onloads issued ahead, the :class:`PrefetchScheduler` (``prefetcher``) executing
  the previous step's order ([Note: gather prefetch], [Note: backward gather prefetch], [Note: Belady-consistent
  gather ahead]; [Note: one step description] in ``schedule.py``);
* ``_agreed_gathers.py``: gathers ahead agreed over ranks where the pool charges activations ([Note: agreed
  gathers ahead]);
* ``_reduce.py``: backward's gradient reduces: their order, late waits ([Note: reduce order], [Note: late reduce
  waits], [Note: reduce window], [Note: in-place reduces]); the collectives in flight and their window are a
  :class:`ReduceWindow` (``reduces``, ``_reduce_window.py``);
* ``_grad_shards.py``: the reduced gradient shards: host offload, zeroing ([Note: gradient offload]);
* ``_rank_checks.py``: the has-gradient flags' all-reduce and the cross-rank checks riding it: :class:`GradFlags`
  (``flags``) with its :class:`RankChecks` ([Note: has-gradient flags], [Note: reduce order check], [Note:
  hyperparameter check]);
* ``_listener.py``: the one interface through which the manager tells its optimizer the step's events
  (:class:`ChunkStepListener`, ``listener``);
* ``_activations.py``: activations charged to the pool ([Note: pack without a cycle]);
* ``_external.py``: parameters read outside their own module's forward ([Note: external reads]).

Eviction, the reduce window and the flags with their rank checks are objects the manager owns, as FSDP2's
``FSDPParamGroup`` owns its ``FSDPParam`` objects: each keeps its own state and offers explicit methods, and what it reads
of the manager is passed in or declared (:class:`~hf_elixir.chunk._eviction.EvictionHost`). The others are still
mixins of :class:`ChunkManager` that read and write the same chunks and trace, each initialising its own state
(``_init_*``).
One chunk's own verbs (unshard, reshard, gradient accumulation and reduce, refresh) are in ``chunk.py`` and its
``_chunk_*.py`` files.

Refreshes of device shards from host masters ([Note: overlapped refresh] in ``hf_elixir/optim/_refresh.py``)
are uploads on the copy stream issued by the optimizer step; :meth:`access` waits for each chunk's own
(:meth:`Chunk.wait_ready`), :meth:`start_backward` drains the rest (:meth:`drain_refreshes`).
"""

from __future__ import annotations

import logging
import time

import torch

from hf_elixir.chunk._activations import ActivationAccountingMixin
from hf_elixir.chunk._agreed_gathers import AgreedGathersMixin
from hf_elixir.chunk._eviction import Eviction
from hf_elixir.chunk._external import ExternalReadsMixin
from hf_elixir.chunk._grad_buffers import GradBufferMixin
from hf_elixir.chunk._grad_shards import GradShardMixin
from hf_elixir.chunk._listener import ChunkStepListener
from hf_elixir.chunk._prefetch import PrefetchScheduler
from hf_elixir.chunk._rank_checks import GradFlags
from hf_elixir.chunk._reduce import FLAGS_IN_FLIGHT, ReduceMixin
from hf_elixir.chunk._steps import StepTraceMixin
from hf_elixir.chunk.chunk import Chunk, ParamSlot
from hf_elixir.chunk import strict
from hf_elixir.chunk.host_blocks import HostBlockAllocator
from hf_elixir.chunk.memory import DeviceBudgetExceededError, DevicePool, MemoryCounters

__all__ = ["ChunkManager", "FLAGS_IN_FLIGHT", "DeviceBudgetExceededError", "budget_error"]

logger = logging.getLogger(__name__)


class ChunkManager(StepTraceMixin, GradBufferMixin, AgreedGathersMixin, ReduceMixin, GradShardMixin,
                   ActivationAccountingMixin, ExternalReadsMixin):
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
        # device->host copies of reduced gradient shards of host-optimizer chunks ([Note: gradient offload] in
        # _grad_shards.py)
        self.offload_stream = torch.cuda.Stream() if compute_device.type == "cuda" else None
        self.chunks: list[Chunk] = []
        self.slot_of: dict[torch.nn.Parameter, ParamSlot] = {}
        self.chunk_of: dict[torch.nn.Parameter, Chunk] = {}
        # every rank training this model (``None``: one rank): the optimizer's norm and overflow
        # reductions run over it, never over WORLD by default (two jobs can share one world)
        self.job_group = None
        # the optimizer, told of the step's events through one interface (_listener.py); without one, no-ops
        self.listener = ChunkStepListener()
        # each concept's own state
        self.eviction = Eviction(self)  # which chunk leaves the device for room (_eviction.py)
        self._init_trace()
        self._init_grad_buffers()
        self.prefetcher = PrefetchScheduler(self)  # gathers and onloads ahead (_prefetch.py)
        self._init_agreed_gathers()
        self._init_reduces()
        self._init_grad_shards()
        self.flags = GradFlags(compute_device)  # has-gradient flags and the rank checks riding them (_rank_checks.py)
        self._init_activations()
        self._init_external()
        # parameter and gradient shards in the disk tier's file ([Note: disk parameters] in _disk_pages.py)
        self.disk_pages = None

    def set_listener(self, listener: ChunkStepListener) -> None:
        """Register the optimizer (one per manager): it hears the step's events from now on."""
        assert type(self.listener) is ChunkStepListener, "a chunk manager has one optimizer"
        self.listener = listener

    # -- host memory ---------------------------------------------------------------------------
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

    def host_free(self, tensor: torch.Tensor) -> None:
        """Give back a tensor :meth:`host_empty` returned (drop every reference to it)."""
        self.host.free(tensor)

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
                if self.recorder is not None:
                    self.record_event("fill", chunk)
                chunk.unshard()
            if chunk.wait_ready() or gather:  # a gather issued ahead, or one issued just now
                self.counters.gather_wait_s += time.perf_counter() - started
            if gather:
                self.counters.num_blocking_gathers += 1
        if self.prefetch_depth and self.prev_trace and not gathered:
            self.prefetcher.issue(pinned)
        if self.disk_pages is not None and not gathered:
            self.disk_pages.read_ahead(pinned)

    def drain_gathers(self) -> None:
        """Wait for every all-gather issued ahead (:meth:`PrefetchScheduler.drain`)."""
        self.prefetcher.drain()

    def gather_prefetch_mode(self) -> str | None:
        """How all-gathers may be issued ahead (:meth:`PrefetchScheduler.mode`)."""
        return self.prefetcher.mode()

    def gather_prefetch_allowed(self) -> bool:
        """Whether any all-gather may be issued ahead (:meth:`PrefetchScheduler.allowed`)."""
        return self.prefetcher.allowed()

    def release(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            assert chunk.pins > 0, f"chunk {chunk.chunk_id} released more often than accessed"
            chunk.pins -= 1
            if self.backward_pending and self.eviction.reshard_dead(chunk):
                chunk.reshard()

    # -- eviction (_eviction.py) ---------------------------------------------------------------
    def make_room(self, nbytes: int, what: str, exclude: set[int] | None = None) -> None:
        """Evict until ``nbytes`` more fit the budget (:meth:`Eviction.make_room`)."""
        self.eviction.make_room(nbytes, what, exclude)

    # eviction's ranking as the prefetch reads it (:class:`Eviction`)
    def _victim(self, exclude: set[int], beyond: tuple[float, int] | None = None) -> Chunk | None:
        return self.eviction.victim(exclude, beyond)

    def _belady_key(self, chunk: Chunk, after: int | None = None) -> tuple[float, int]:
        return self.eviction.belady_key(chunk, after)

    def _dead(self, chunk: Chunk) -> bool:
        return self.eviction.dead(chunk)

    def _dead_victim(self) -> Chunk | None:
        return self.eviction.dead_victim()

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

    # -- whole-model verbs ---------------------------------------------------------------------
    def drain_refreshes(self) -> None:
        """Wait for every refresh of a device shard issued ahead ([Note: overlapped refresh] in
        ``hf_elixir/optim/optimizer.py``; on CUDA a stream wait, no host sync): at the start of backward, after
        which the host lane writes the masters and staging buffers those uploads read, and before anything
        reads or writes the compute copies outside an access."""
        for chunk in self.chunks:
            chunk.wait_refresh()

    def join_side_streams(self) -> None:
        """Order the current CUDA stream after the prefetch, reduce and offload streams, without waiting on
        the host (the optimizer step's one host read then covers their work too); wait for the all-gathers
        issued ahead off CUDA (the step writes shards, which may be views into ``full``)."""
        self.drain_gathers()
        for stream in (self.copy_stream, self.reduce_stream, self.offload_stream):
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)

    def take_param_writes(self) -> None:
        """Take what user code wrote in place into parameters with a current copy (``with torch.no_grad():
        p.mul_(0.99)`` between backward and step) into the shards, and give every chunk whose shard holds such
        writes to the listener's ``on_param_writes`` (the optimizer's masters take them) ([Note: parameter writes] in
        ``_chunk_params.py``).
        Called at the start of each backward, at the step and on entering ``full_parameters``; each reshard takes
        its chunk's. No collective: each rank takes its own writes. Costs one version-counter read per parameter
        when nothing was written."""
        for chunk in self.chunks:
            chunk.take_param_writes()
        written = [c for c in self.chunks if c.params_written]
        if written:
            self.listener.on_param_writes(written)

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


def budget_error(needed: int, budget: int, what: str) -> ValueError:
    return ValueError(
        f"ElixirConfig.device_memory_budget_bytes={budget} is too small: {what} needs {needed} bytes on "
        f"the device; set device_memory_budget_bytes >= {needed} (or leave it None for all the device has)"
    )
