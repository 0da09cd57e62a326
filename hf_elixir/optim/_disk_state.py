"""Which host optimizer chunks keep their fp32 master and optimizer states on disk, and their ordered step.

[Note: disk states] With ``ElixirConfig.offload_dir`` set, the optimizer prices what its host optimizer chunks
hold on the host: per chunk its fp32 gradient shard (always host: the reduce writes it during backward), its
refresh staging buffer, its fp32 master (where it is not the chunk's own fp32 host shard) and its element-wise
states (``exp_avg``, ``exp_avg_sq``, ...). When that, on top of what the manager already holds on the host
(host shards, ...), exceeds ``ElixirConfig.host_memory_budget_bytes``, the masters and states of chunks taken
from the end of the chunk order move to one file per rank ([Note: disk tier] in
``hf_elixir/chunk/_disk.py``) until the rest plus the chunks in flight (``window`` + 1 read ahead) fits.
A chunk whose master is its fp32 host shard keeps it (parameter chunks are not put on disk) and moves its
states only. Nothing selects a collective, so the choice may differ per rank without harm.

The step (``InnerStepMixin._run_inner``) steps the host chunks first, then the disk chunks one by one in chunk
order: chunk ``i + 1`` is read ahead while chunk ``i`` steps, and chunk ``i`` is written back (at most
``window`` in flight) as soon as its step is done. Each view's update is independent (torch's fused AdamW
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

import torch
import torch.distributed as dist

from hf_elixir.chunk import strict
from hf_elixir.chunk._disk import DiskFile
from hf_elixir.chunk.memory import default_host_budget_bytes
from hf_elixir.optim._refresh import uploads_cast

__all__ = ["DiskStates", "MASTER_KEY", "WINDOW_CHUNKS"]

logger = logging.getLogger(__name__)

MASTER_KEY = "master"
#: write-backs in flight at once (the bounded staging); one more region is read ahead
WINDOW_CHUNKS = 2


def _separate_master(chunk) -> bool:
    """The chunk's fp32 master is a tensor of its own (not its fp32 host shard): ``_build_chunk_shard``'s rule."""
    return not (chunk.dtype == torch.float32 and not chunk.shard_on_device)


def _movable(chunk, keys: list[str]) -> list[tuple[str, int]]:
    """What of ``chunk`` may live on disk: ``(key, numel)`` of its master (if separate) and its states."""
    return ([(MASTER_KEY, chunk.shard_numel)] if _separate_master(chunk) else []) + \
        [(key, chunk.shard_numel) for key in keys]


class DiskStates:
    """The disk chunks of one optimizer ([Note: disk states]) and their file.

    Args:
        file: the rank's :class:`~hf_elixir.chunk._disk.DiskFile`, one region per disk chunk.
    """

    def __init__(self, file: DiskFile) -> None:
        self.file = file
        self.chunks = frozenset(file.regions)
        self._stepped: set[int] = set()  # disk chunks stepped since the last write_back_others
        for tensor in file.tensors.values():
            strict.register_host(tensor)

    @classmethod
    def build(cls, manager, config, host: list, state_keys: dict[int, list[str]], refresh_cast: str):
        """The disk states for ``host`` (the host optimizer chunks) under ``config``; ``None`` when
        ``offload_dir`` is unset or everything fits ``host_memory_budget_bytes``."""
        if config.offload_dir is None or not host:
            return None
        budget = config.host_memory_budget_bytes or default_host_budget_bytes()
        fixed = manager.host.requested_bytes + sum(
            c.shard_numel * 4 + (c.shard_numel * torch.empty((), dtype=c.dtype).element_size() if uploads_cast(c) and refresh_cast == "host" else 0)
            for c in host)
        movable = {c.chunk_id: _movable(c, state_keys.get(c.chunk_id, [])) for c in host}
        nbytes = {cid: sum(n * 4 for _, n in entries) for cid, entries in movable.items()}
        kept = sum(nbytes.values())
        chosen: list[int] = []
        for chunk in reversed(host):
            in_flight = (WINDOW_CHUNKS + 1) * max([nbytes[c] for c in chosen], default=0)
            if fixed + kept + in_flight <= budget:
                break
            if nbytes[chunk.chunk_id]:
                chosen.append(chunk.chunk_id)
                kept -= nbytes[chunk.chunk_id]
        if not chosen:
            return None
        in_flight = (WINDOW_CHUNKS + 1) * max(nbytes[c] for c in chosen)
        if fixed + kept + in_flight > budget:
            logger.warning("hf_elixir: host_memory_budget_bytes=%d cannot hold this rank's gradient shards and host "
                           "state (%d bytes) even with every optimizer state on disk; parameter chunks are not put "
                           "on disk", budget, fixed + kept + in_flight)
        rank = dist.get_rank() if dist.is_initialized() else 0
        regions = {cid: movable[cid] for cid in sorted(chosen)}
        file = DiskFile(config.offload_dir, rank, regions, config.disk_budget_bytes, window=WINDOW_CHUNKS)
        logger.info("hf_elixir: rank %d keeps the optimizer state of %d of %d host chunks on disk (%d bytes in %s)",
                    rank, len(chosen), len(host), file.nbytes, os.path.dirname(file.path))
        return cls(file)

    @staticmethod
    def host_requests(host: list, state_keys: dict[int, list[str]], disk: "DiskStates | None") -> list:
        """The ``(numel, dtype)`` host-block requests of masters and states that stay on the host."""
        on_disk = disk.chunks if disk is not None else ()
        return ([(c.shard_numel, torch.float32) for c in host if _separate_master(c) and c.chunk_id not in on_disk]
                + [(c.shard_numel, torch.float32) for c in host if c.chunk_id not in on_disk
                   for _ in state_keys.get(c.chunk_id, ())])

    def tensor(self, cid: int, key: str) -> torch.Tensor | None:
        """Chunk ``cid``'s disk tensor ``key`` (``MASTER_KEY`` or a state key), ``None`` if it is not on disk."""
        return self.file.tensor(cid, key) if cid in self.chunks else None

    def run(self, cids, step_one) -> None:
        """``step_one(cid)`` for every chunk id of ``cids``: host chunks first, then disk chunks in chunk order
        with the next one read ahead and each one written back after its step ([Note: disk states])."""
        cids = list(cids)
        for cid in cids:
            if cid not in self.chunks:
                step_one(cid)
        ordered = sorted(cid for cid in cids if cid in self.chunks)
        if ordered:
            self.file.prefetch(ordered[0])
        for i, cid in enumerate(ordered):
            self.file.ready(cid)
            if i + 1 < len(ordered):
                self.file.prefetch(ordered[i + 1])
            step_one(cid)
            self.file.write_back(cid)
            self._stepped.add(cid)

    def write_back_others(self) -> None:
        """At the end of a step: write back and evict the disk chunks the step did not touch (no trainable element
        with a gradient in this rank's shard), whose masters the last refresh read in."""
        for cid in sorted(self.chunks - self._stepped):
            self.file.write_back(cid)
        self._stepped.clear()

    def close(self) -> None:
        """Wait for the IO in flight and remove the file."""
        self.file.close()
