"""Parameter host shards and fp32 gradient shards in the disk tier's file: their pages read ahead in the step's
order and evicted after use, so host memory holds only the regions in flight.

[Note: disk parameters] When the fp32 masters and optimizer moments of every host optimizer chunk are on disk and
the rest still exceeds ``ElixirConfig.host_memory_budget_bytes``, the optimizer ([Note: disk states] in
``hf_elixir/optim/_disk_state.py``) also moves, chunk by chunk from the end of the chunk order, first the fp32
gradient shards (read once and written once a step), then the parameter host shards (read at each onload,
written once a step; for an fp32 model whose shards live on the host the shard IS the chunk's master) into the
same per-rank file ([Note: disk tier] in ``_disk.py``), each in its own region (``("grad", chunk id)``,
``("param", chunk id)``), so an onload reads the parameter shard only, not the chunk's moments. This object, the
chunk manager's ``disk_pages``, keeps their pages out of host memory between uses:

* **onload.** Before an onload reads a parameter shard from the host (``Chunk._fill``) its region is waited in
  (:meth:`DiskPages.onload`), mapped readable only (a huge region; a small one writable: [Note: disk tier]); right
  after the copy it is evicted (:meth:`DiskPages.onloaded`: a huge region's pages are clean, so the write-back is an
  ``msync`` with nothing to write and a drop). The
  chunk manager's ``access`` reads ahead (:meth:`DiskPages.read_ahead`, readable only too) the parameter shards of
  the chunks in the prefetch window of the previous step's order (:meth:`~hf_elixir.chunk.schedule.StepOrder.window`,
  depth ``max(prefetch_depth, 1)``) that will be filled from the shard, and evicts a read ahead that left the window
  unused, so at most that many regions are read ahead.
* **gradients.** A reduced gradient shard is written into the file's pages (:meth:`DiskPages.grad_in` waits its
  region in first: an accumulation adds to it) and written back right after (:meth:`DiskPages.grad_out`);
  ``zero_grad`` punches a disk gradient shard's blocks out of the file, so it reads as zeros without IO
  (:meth:`DiskPages.zero_grad`; where the file system cannot, it is zeroed region by region as above). The
  optimizer's passes over every gradient (the norm, the clip, the fp16 unscale) take them one at a time, the next
  one read ahead (:meth:`DiskPages.each_grad`); an accumulated micro-batch is added through one staging buffer
  they share (``ChunkManager._accumulation_staging``).
* **the step.** The optimizer steps a disk chunk with all its regions (moments, parameter shard, gradient shard)
  read in, the next chunk's read ahead, and writes them back after its step ([Note: disk states]).
* **refresh.** An upload of a device shard from its fp32 master in the file (the masters of chunks whose shard is on
  the device) waits the master's region in for the copy and evicts it after (:meth:`DiskPages.reading`).
* **anything else** that reads a shard between steps (a state dict, a checkpoint, parameter writes) faults its
  pages in through the mapping: correct, and evicted at the end of the next step (:meth:`DiskPages.evict_idle`).

The mapping is pageable memory, not pinned: on CUDA a copy from or to it is synchronous to the host (the driver
stages it), which the write-back right after relies on.

Source: ZeRO-Infinity (arXiv 2104.07857) section 6: parameters and gradients on NVMe, prefetched in the order the
previous iteration traced; ``madvise(2)``, ``posix_fadvise(2)``.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["DiskPages", "GRAD", "PARAM", "grad_region", "param_region"]

PARAM, GRAD = "param", "grad"


def param_region(cid: int) -> tuple[str, int]:
    """The file region of chunk ``cid``'s parameter host shard."""
    return (PARAM, cid)


def grad_region(cid: int) -> tuple[str, int]:
    """The file region of chunk ``cid``'s fp32 gradient shard."""
    return (GRAD, cid)


class DiskPages:
    """The chunk manager's parameter and gradient shards on disk ([Note: disk parameters]).

    Args:
        manager: the :class:`~hf_elixir.chunk.manager.ChunkManager`.
        file: the rank's :class:`~hf_elixir.chunk._disk.DiskFile`.
        param_cids / grad_cids: chunks whose parameter host shard / gradient shard lives in ``file``.
    """

    def __init__(self, manager, file, param_cids, grad_cids, state_regions=None) -> None:
        self.manager = manager
        self.file = file
        self.params = frozenset(param_cids)
        self.grads = frozenset(grad_cids)
        self.state_regions = dict(state_regions or {})  # chunk id -> its state region (a separate fp32 master)

    # -- parameter shards ---------------------------------------------------------------------------
    def onload(self, chunk) -> None:
        """Before an onload reads ``chunk.shard`` on the host: wait its region in."""
        if chunk.chunk_id in self.params:
            self.file.ready(param_region(chunk.chunk_id), write=False)

    def onloaded(self, chunk) -> None:
        """After the onload (or a write of the shard): write the region back and evict it."""
        if chunk.chunk_id in self.params:
            self.file.write_back(param_region(chunk.chunk_id))

    def _reads_shard(self, chunk) -> bool:
        """Whether ``chunk``'s next fill reads its host shard (not a rank-local host copy, nothing filled)."""
        return (chunk.chunk_id in self.params and chunk.needs_fill()
                and (chunk.world_size == 1 or chunk.host_full_version != chunk.version))

    def read_ahead(self, pinned: set[int]) -> None:
        """At an access: read ahead the parameter shards the window of the previous step's order will onload, and
        evict those read ahead for a chunk that left it unused."""
        m = self.manager
        if not self.params or not m.prev_trace:
            return
        window = m.prev_order.window(len(m.trace), pinned, max(m.prefetch_depth, 1))
        wanted = {param_region(cid) for _, cid in window if self._reads_shard(m.chunks[cid])}
        for region in self.file.pending_reads():
            # (the optimizer's host lane reads its next chunk's regions ahead too: states are keyed by a chunk id)
            if isinstance(region, tuple) and region[0] == PARAM and region not in wanted and region[1] not in pinned:
                self.file.write_back(region)
        for _, cid in window:
            if param_region(cid) in wanted:
                self.file.prefetch(param_region(cid), write=False)

    @contextlib.contextmanager
    def reading(self, cid: int, source: torch.Tensor):
        """A refresh of chunk ``cid``'s device shard reading ``source``: when it is the fp32 master in the file, its
        region is waited in for the copy and written back and evicted after."""
        region = self.state_regions.get(cid)
        inside = region is not None and self.file.holds(source)
        if inside:
            self.file.ready(region, write=False)
        try:
            yield
        finally:
            if inside:
                self.file.write_back(region)

    # -- gradient shards ----------------------------------------------------------------------------
    def grad_in(self, cid: int, write: bool = True) -> None:
        """Before the gradient shard of ``cid`` is written or read on the host: wait its region in (mapped readable
        only unless ``write``)."""
        if cid in self.grads:
            self.file.ready(grad_region(cid), write)

    def grad_out(self, cid: int) -> None:
        """After that: write it back and evict it."""
        if cid in self.grads:
            self.file.write_back(grad_region(cid))

    def zero_grad(self, cid: int, grad_shard: torch.Tensor) -> bool:
        """``zero_grad`` of a gradient shard on disk: its blocks punched out (read as zeros, no IO: ``DiskFile.zero``),
        else region in, zeroed, written back; ``False`` if not on disk."""
        if cid not in self.grads:
            return False
        if not self.file.zero(grad_region(cid)):
            self.grad_in(cid)
            grad_shard.zero_()
            self.grad_out(cid)
        return True

    def each_grad(self, items: list, write: bool = True):
        """``items`` (``(chunk id, gradient shard)``) one by one for a pass over every gradient (the norm, the clip,
        the unscale): a shard on disk is waited in for its turn, the next one on disk read ahead, and written back
        after the caller's turn; a pass that does not ``write`` (the norm) maps them readable only (clean pages:
        their write-back writes nothing)."""
        on_disk = [cid for cid, _ in items if cid in self.grads]
        following = dict(zip(on_disk, on_disk[1:]))
        if on_disk:
            self.file.prefetch(grad_region(on_disk[0]), write)
        for cid, grad in items:
            if cid in self.grads:
                self.grad_in(cid, write)
                if cid in following:
                    self.file.prefetch(grad_region(following[cid]), write)
            yield cid, grad
            self.grad_out(cid)

    # -- between steps ------------------------------------------------------------------------------
    def evict_idle(self) -> None:
        """Write back and evict every parameter and gradient region that holds pages in host memory now (read by
        something outside the step's schedule: a state dict, a checkpoint, parameter writes)."""
        file = self.file
        for region in [param_region(cid) for cid in sorted(self.params)] + [grad_region(c) for c in sorted(self.grads)]:
            if file.resident_bytes(region):
                file.write_back(region)
