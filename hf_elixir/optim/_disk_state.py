"""Which host optimizer chunks keep their fp32 master and optimizer states on disk, and their ordered step.

[Note: disk states] With ``ElixirConfig.offload_dir`` set, the optimizer prices what its host optimizer chunks
hold on the host (:func:`host_floor_bytes`): per chunk its fp32 gradient shard, its refresh staging buffer, its fp32
master (where it is not the chunk's own fp32 host shard), its element-wise states (``exp_avg``, ``exp_avg_sq``,
...), and every chunk's parameter host shard. When that exceeds ``ElixirConfig.host_memory_budget_bytes``, parts
move to one file per rank ([Note: disk tier] in ``hf_elixir/chunk/_disk.py``), chunk by chunk from the end of the
chunk order, until the rest plus the regions in flight (:func:`in_flight_bytes`) fits: first the masters and states;
then the fp32 gradient shards (read once and written once a step); then the parameter host shards (read at each
onload, written once a step; for an fp32 model whose shards live on the host the shard IS the chunk's master) --
[Note: disk parameters] in ``hf_elixir/chunk/_disk_pages.py`` keeps their pages out of host memory between uses.
The host shards of frozen chunks, rank-local refill copies and staging buffers stay in host memory. A budget that
cannot hold what stays even with every movable part on disk is refused naming the least that works (public as
``hf_elixir.min_host_budget_bytes``). With gradient shards on disk the host lane does not step chunks during
backward ([Note: host lane] in ``_overlap.py``: its speculative steps, norms and rollbacks read the gradient shards
outside this schedule); with the states alone on disk it does, and the step's regions and backward's are priced as
in flight at once. Nothing selects a collective, so the choice may differ per rank without harm.

The step (``InnerStepMixin._run_inner``) steps the host chunks first, then the disk chunks one by one in chunk
order: chunk ``i + 1`` (all its regions: moments, gradient shard, parameter shard) is read ahead while chunk ``i``
steps, and chunk ``i`` is written back (at most ``window`` regions in flight) as soon as its step is done. So the
file's pages in host memory during the step are at most two chunks' regions plus ``window`` regions, and during
forward and backward ``max(prefetch_depth, 1)`` parameter shards read ahead, the one being copied, and
``window`` regions written back (:func:`in_flight_bytes`). Each view's update is independent (torch's fused AdamW
runs per tensor), so the split changes no result. The fp32 masters of disk chunks are read again when the
compute copies refresh from them (the upload that the next forward waits for); those pages are clean page cache
(the kernel may reclaim them at will) until the chunk's next step writes it back and evicts it; chunks the step
does not touch are evicted at its end (:meth:`DiskStates.write_back_others`).

Source: ZeRO-Infinity (arXiv 2104.07857) section 5-6: optimizer states and fp32 masters on NVMe, stepped
partition by partition with the next one prefetched.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from hf_elixir.chunk import strict
from hf_elixir.chunk._disk import DiskFile, region_nbytes, scratch_bytes
from hf_elixir.chunk._disk_pages import DiskPages, grad_region, param_region
from hf_elixir.chunk.host_blocks import ALIGN_BYTES
from hf_elixir.chunk.memory import default_host_budget_bytes
from hf_elixir.optim._host_state import HostStates
from hf_elixir.optim._refresh import uploads_cast

__all__ = ["DiskStates", "GRAD_KEY", "HostFloor", "HostBudgetFloor", "MASTER_KEY", "PARAM_KEY", "WINDOW_CHUNKS",
           "host_floor_bytes", "in_flight_bytes", "min_host_budget_bytes"]

logger = logging.getLogger(__name__)

MASTER_KEY, GRAD_KEY, PARAM_KEY = "master", "grad", "param"
#: write-backs in flight at once (the bounded staging); one more chunk is read ahead
WINDOW_CHUNKS = 2
#: the spill order ([Note: disk states]; the planner's, [Note: disk tier pricing] in search/_disk_cost.py)
_KINDS = ("state", "grad", "param")


def _separate_master(chunk) -> bool:
    """The chunk's fp32 master is a tensor of its own (not its fp32 host shard): ``_build_chunk_shard``'s rule."""
    return not (chunk.dtype == torch.float32 and not chunk.shard_on_device)


def _aligned(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def _parts(chunk, keys: list[str]) -> dict[str, list[tuple]]:
    """What of ``chunk`` may live on disk, per kind: its master (if separate) and states, its fp32 gradient shard,
    its parameter host shard (``(key, numel[, dtype])`` entries of a :class:`DiskFile` region)."""
    n = chunk.shard_numel
    return {"state": ([(MASTER_KEY, n)] if _separate_master(chunk) else []) + [(key, n) for key in keys],
            "grad": [(GRAD_KEY, n)],
            "param": [] if chunk.shard_on_device else [(PARAM_KEY, n, chunk.dtype)]}


def _host_bytes(entries: list[tuple]) -> int:
    """Host-block bytes of ``entries`` kept in host memory (512-byte aligned slices, [Note: host blocks])."""
    return sum(_aligned(e[1] * (e[2].itemsize if len(e) > 2 else 4), ALIGN_BYTES) for e in entries)


def in_flight_bytes(regions: dict[int, list[int]], param_regions: list[int], depth: int, lane: bool) -> int:
    """The most bytes of the file in host memory at once ([Note: disk states]): in the step two chunks' regions
    (``regions``: chunk id -> its region bytes) and ``WINDOW_CHUNKS`` regions written back; in forward and backward
    ``depth`` parameter shards read ahead, one being copied, a gradient shard being written and ``WINDOW_CHUNKS``
    regions written back. ``lane``: the host lane steps during backward, so both at once."""
    if not regions:
        return 0
    largest = max(max(r) for r in regions.values())
    step = sum(sorted((sum(r) for r in regions.values()), reverse=True)[:2]) + WINDOW_CHUNKS * largest
    passes = (depth + 1) * max(param_regions, default=0) + (1 + WINDOW_CHUNKS) * largest
    scratch = scratch_bytes([n for r in regions.values() for n in r])  # the reader's buffer ([Note: disk tier])
    return (step + passes if lane else max(step, passes)) + scratch


@dataclass
class HostFloor:
    """One rank's host bytes under the disk tier ([Note: disk states]).

    Attributes:
        everything_bytes: host bytes with nothing on disk (the least budget without ``offload_dir``).
        least_bytes: the least budget with a disk: what cannot move plus the regions in flight with every movable
            part on disk, or ``everything_bytes`` where that is less (a few large chunks: nothing goes to disk).
        chosen: ``(kind, chunk id)`` of the parts to move for the budget asked, in spill order.
        parts: chunk id -> kind -> region entries.
    """

    everything_bytes: int
    least_bytes: int
    chosen: list[tuple[str, int]] = field(default_factory=list)
    parts: dict[int, dict[str, list[tuple]]] = field(default_factory=dict)


def _lane(config, manager) -> bool:
    """Whether the host lane steps chunks during backward (``speculates`` in ``_overlap.py``)."""
    overlap = config.overlap_host_optimizer
    return bool(overlap) if overlap is not None else manager.compute_device.type == "cuda"


def host_floor_bytes(manager, config, host: list, state_keys: dict[int, list[str]], refresh_cast: str,
                     budget: int | None = None) -> HostFloor:
    """This rank's host bytes with nothing on disk and the least with a disk, and (for ``budget``) the parts the
    spill order moves ([Note: disk states])."""
    parts = {c.chunk_id: _parts(c, state_keys.get(c.chunk_id, [])) for c in host}
    staging = sum(_aligned(c.shard_numel * c.element_size, ALIGN_BYTES) for c in host
                  if uploads_cast(c) and refresh_cast == "host")
    # the host shards (of every chunk, trained or frozen) and rank-local refill copies, then the gradient shards,
    # masters and states
    shards = sum(_aligned(c.shard_bytes, ALIGN_BYTES) for c in manager.chunks
                 if not c.shard_on_device and not c.shard_in_full)
    copies = sum(_aligned(c.full_bytes, ALIGN_BYTES) for c in manager.chunks if c.wants_host_copy)
    everything = shards + copies + staging + sum(
        _host_bytes(p["state"]) + _host_bytes(p["grad"]) for p in parts.values())
    order = [(kind, c.chunk_id) for kind in _KINDS for c in reversed(host) if parts[c.chunk_id][kind]]
    depth, lane = max(manager.prefetch_depth, 1), _lane(config, manager)

    def kept_and_flight(chosen):
        # the host lane steps during backward only while the gradient shards are in host memory
        spec = lane and all(kind == "state" for kind, _ in chosen)
        regions: dict[int, list[int]] = {}
        for kind, cid in chosen:
            regions.setdefault(cid, []).append(region_nbytes(parts[cid][kind]))
        params = [region_nbytes(parts[cid]["param"]) for kind, cid in chosen if kind == "param"]
        kept = everything - sum(_host_bytes(parts[cid][kind]) for kind, cid in chosen)
        grads = [parts[cid]["grad"] for kind, cid in chosen if kind == "grad"]
        if grads:  # the accumulation's staging buffer the gradient shards on disk share (chunk/_grad_shards.py)
            kept += max(_host_bytes(entries) for entries in grads)
        return kept, in_flight_bytes(regions, params, depth, spec)

    # a few large chunks: the regions in flight can cost more than the disk saves, and then nothing goes to disk
    least = min(everything, sum(kept_and_flight(order)))
    chosen: list[tuple[str, int]] = []
    if budget is not None:
        for part in order:
            if sum(kept_and_flight(chosen)) <= budget:
                break
            chosen.append(part)
    return HostFloor(everything, least, chosen, parts)


class DiskStates:
    """The disk chunks of one optimizer ([Note: disk states]) and their file.

    Args:
        file: the rank's :class:`~hf_elixir.chunk._disk.DiskFile`: a region per disk chunk's states (keyed by the
            chunk id), and per gradient / parameter shard on disk (``("grad", cid)``, ``("param", cid)``).
        pages: the chunk manager's :class:`~hf_elixir.chunk._disk_pages.DiskPages` over the same file.
    """

    def __init__(self, file: DiskFile, pages: DiskPages) -> None:
        self.file = file
        self.pages = pages
        self._regions: dict[int, list] = {}  # chunk id -> its regions, in the order a step reads them
        for region in file.regions:
            cid = region if isinstance(region, int) else region[1]
            self._regions.setdefault(cid, []).append(region)
        self.chunks = frozenset(self._regions)
        self.state_chunks = frozenset(r for r in file.regions if isinstance(r, int))
        self._stepped: set[int] = set()  # disk chunks stepped since the last write_back_others

    @classmethod
    def build(cls, manager, config, host: list, state_keys: dict[int, list[str]], refresh_cast: str):
        """The disk states for ``host`` (the host optimizer chunks) under ``config``; ``None`` when
        ``offload_dir`` is unset or everything fits ``host_memory_budget_bytes``.

        Raises:
            ValueError: the budget is below what must stay in host memory even with the disk (names the least).
        """
        if config.offload_dir is None or not host:
            return None
        budget = config.host_memory_budget_bytes or default_host_budget_bytes()
        floor = host_floor_bytes(manager, config, host, state_keys, refresh_cast, budget)
        if floor.least_bytes > budget and floor.least_bytes == floor.everything_bytes:
            raise ValueError(
                f"ElixirConfig.host_memory_budget_bytes={budget} is below the {floor.least_bytes} bytes of model data "
                f"this rank keeps in host memory, and offload_dir cannot lower that: with {len(host)} host chunks the "
                "disk's regions in flight cost more than they save; raise host_memory_budget_bytes to at least "
                f"{floor.least_bytes} (hf_elixir.min_host_budget_bytes gives it), or use a smaller chunk_size_numel")
        if floor.least_bytes > budget:
            raise ValueError(
                f"ElixirConfig.host_memory_budget_bytes={budget} is below the {floor.least_bytes} bytes this rank "
                f"keeps in host memory even with every optimizer state, gradient shard and parameter host shard on "
                f"disk under offload_dir (the regions in flight, and what cannot move); raise host_memory_budget_bytes "
                f"to at least {floor.least_bytes} (hf_elixir.min_host_budget_bytes gives it), or use a smaller "
                "chunk_size_numel (smaller regions in flight)")
        if not floor.chosen:
            return None
        regions: dict = {}
        for kind, cid in sorted(floor.chosen, key=lambda p: (p[1], _KINDS.index(p[0]))):
            key = cid if kind == "state" else (grad_region(cid) if kind == "grad" else param_region(cid))
            regions[key] = floor.parts[cid][kind]
        rank = dist.get_rank() if dist.is_initialized() else 0
        file = DiskFile(config.offload_dir, rank, regions, config.disk_budget_bytes, window=WINDOW_CHUNKS)
        for tensor in file.tensors.values():
            strict.register_host(tensor)
        kinds = {kind: sum(k == kind for k, _ in floor.chosen) for kind in _KINDS}
        logger.info("hf_elixir: rank %d keeps on disk the optimizer state of %d, the gradient shards of %d and the "
                    "parameter host shards of %d of %d host chunks (%d bytes in %s)", rank, kinds["state"],
                    kinds["grad"], kinds["param"], len(host), file.nbytes, os.path.dirname(file.path))
        pages = DiskPages(manager, file, [c for k, c in floor.chosen if k == "param"],
                          [c for k, c in floor.chosen if k == "grad"],
                          {c: c for k, c in floor.chosen if k == "state" and floor.parts[c]["state"][:1]
                           and floor.parts[c]["state"][0][0] == MASTER_KEY})
        _move_host_shards(manager, file, pages.params)
        manager.disk_pages = pages
        if pages.grads:  # the one accumulation staging buffer they share, in a block of its own
            largest = max(pages.grads, key=lambda cid: manager.chunks[cid].shard_numel)
            manager.host.reserve_for([(manager.chunks[largest].shard_numel, torch.float32)])
            manager._accumulation_staging(manager.chunks[largest])
        return cls(file, pages)

    @staticmethod
    def host_requests(host: list, state_keys: dict[int, list[str]], disk: "DiskStates | None") -> list:
        """The ``(numel, dtype)`` host-block requests of gradient shards, masters and states that stay on the
        host."""
        grads = disk.pages.grads if disk is not None else ()
        on_disk = disk.state_chunks if disk is not None else ()
        return ([(c.shard_numel, torch.float32) for c in host if c.chunk_id not in grads]
                + [(c.shard_numel, torch.float32) for c in host if _separate_master(c) and c.chunk_id not in on_disk]
                + [(c.shard_numel, torch.float32) for c in host if c.chunk_id not in on_disk
                   for _ in state_keys.get(c.chunk_id, ())])

    def tensor(self, cid: int, key: str) -> torch.Tensor | None:
        """Chunk ``cid``'s disk tensor ``key`` (``MASTER_KEY`` or a state key), ``None`` if it is not on disk."""
        return self.file.tensor(cid, key) if cid in self.state_chunks else None

    def grad_shard(self, cid: int) -> torch.Tensor | None:
        """Chunk ``cid``'s fp32 gradient shard in the file, ``None`` if it is in host memory."""
        return self.file.tensor(grad_region(cid), GRAD_KEY) if cid in self.pages.grads else None

    def pages_in(self, cid: int) -> None:
        """Wait every region of ``cid`` in (a write of its master or shard outside the step: the refresh)."""
        for region in self._regions.get(cid, ()):
            self.file.ready(region)

    def pages_out(self, cid: int) -> None:
        """Write every region of ``cid`` back and evict it (after its step, or after a state dict or a checkpoint
        read it: its clean pages are dropped without IO)."""
        for region in self._regions.get(cid, ()):
            self.file.write_back(region)

    def run(self, cids, step_one) -> None:
        """``step_one(cid)`` for every chunk id of ``cids``: host chunks first, then disk chunks in chunk order
        with the next one read ahead and each one written back after its step ([Note: disk states])."""
        cids = list(cids)
        for cid in cids:
            if cid not in self.chunks:
                step_one(cid)
        ordered = sorted(cid for cid in cids if cid in self.chunks)
        for region in self._regions[ordered[0]] if ordered else ():
            self.file.prefetch(region, _written_by_step(region))
        for i, cid in enumerate(ordered):
            for region in self._regions[cid]:
                self.file.ready(region, _written_by_step(region))
            if i + 1 < len(ordered):
                for region in self._regions[ordered[i + 1]]:
                    self.file.prefetch(region, _written_by_step(region))
            step_one(cid)
            self.pages_out(cid)
            self._stepped.add(cid)

    def write_back_others(self) -> None:
        """At the end of a step: write back and evict the disk chunks' states the step did not touch (no trainable
        element with a gradient in this rank's shard), whose masters the last refresh read in, and any parameter
        or gradient shard something outside the schedule read in ([Note: disk parameters])."""
        for cid in sorted(self.state_chunks - self._stepped):
            self.file.write_back(cid)
        self._stepped.clear()
        self.file.settle()
        self.pages.evict_idle()

    def close(self) -> None:
        """Wait for the IO in flight and remove the file."""
        if self.pages.manager.disk_pages is self.pages:
            self.pages.manager.disk_pages = None
        self.file.close()


def _written_by_step(region) -> bool:
    """Whether a step writes ``region`` (its states, master, parameter shard), so that it is read in writable; the
    gradient shard it only reads (the clip's factor is paid before, in a pass of its own), so that its pages stay
    clean and its write-back writes nothing ([Note: disk tier]: a write there still lands, it only faults)."""
    return region != grad_region(region[1]) if isinstance(region, tuple) else True


def _move_host_shards(manager, file: DiskFile, cids) -> None:
    """Move the host shards of ``cids`` into ``file`` and give their host-block slices back; the other host shards
    move into a block of their own (the old block, sized for all of them, is then returned whole)."""
    if not cids:
        return
    chunks = [c for c in manager.chunks if not c.shard_on_device and not c.shard_in_full
              and manager.host.owns(c.shard)]  # (a shard not sliced from the host blocks stays as it is)
    kept = {c.chunk_id: c.shard.clone() for c in chunks if c.chunk_id not in cids}
    for chunk in chunks:
        old = chunk.shard
        if chunk.chunk_id in cids:
            chunk.shard = file.tensor(param_region(chunk.chunk_id), PARAM_KEY)
            with torch.no_grad(), strict.host_copies():
                chunk.shard.copy_(old)
            file.write_back(param_region(chunk.chunk_id))
        manager.host_free(old)
    manager.host.reserve_for([(t.numel(), t.dtype) for t in kept.values()])
    for chunk in chunks:
        if chunk.chunk_id in kept:
            chunk.shard = manager.host_empty(chunk.shard_numel, chunk.dtype)
            with torch.no_grad(), strict.host_copies():
                chunk.shard.copy_(kept[chunk.chunk_id])


class HostBudgetFloor(NamedTuple):
    """:func:`min_host_budget_bytes`'s answer (bytes per rank).

    Attributes:
        with_disk_bytes: the least ``host_memory_budget_bytes`` with ``offload_dir`` set.
        without_disk_bytes: the least without a disk (everything in host memory).
    """

    with_disk_bytes: int
    without_disk_bytes: int


def min_host_budget_bytes(model: torch.nn.Module, optimizer, config=None) -> HostBudgetFloor:
    """The least ``ElixirConfig.host_memory_budget_bytes`` this rank's model and optimizer state need, with the disk
    tier and without it ([Note: disk states]): with a disk, what stays in host memory when every master, moment,
    gradient shard and parameter host shard of the host optimizer chunks is on disk (the regions in flight, the
    host shards of frozen chunks, refresh staging); without, all of it. ``prepare`` refuses a budget below
    ``with_disk_bytes`` (with ``offload_dir``) naming it, and trains at it.

    Args:
        model: the prepared model.
        optimizer: the optimizer ``hf_elixir.prepare`` returned for it (or an accelerate wrapper around it).
        config: the ``ElixirConfig`` to price (its ``overlap_host_optimizer`` decides whether the step's and
            backward's regions are in flight at once); ``None``: the one ``prepare`` got.

    Returns:
        :class:`HostBudgetFloor` ``(with_disk_bytes, without_disk_bytes)``, bytes per rank.

    Raises:
        TypeError: ``optimizer`` is not one ``hf_elixir.prepare`` returned.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    if not hasattr(inner, "_host_floor"):
        raise TypeError(f"min_host_budget_bytes(optimizer={type(optimizer).__name__}): pass the optimizer "
                        "hf_elixir.prepare(model, optimizer, config) returned")
    floor = inner._host_floor(config if config is not None else inner.config)
    return HostBudgetFloor(floor.least_bytes, floor.everything_bytes)
