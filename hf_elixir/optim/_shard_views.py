"""The shard views: this rank's part of every trainable parameter, its fp32 master and its gradient shard.

[Note: shard views] For every trainable parameter, the part of it that falls into this rank's shard of
its chunk is a 1-D view of the chunk's fp32 master shard, and its gradient is the same view of the
chunk's reduced fp32 gradient shard. An *inner* instance of the user's optimizer class runs on these
views with the user's hyperparameters (``_inner.py``; device Adam/AdamW chunks take the fused device step
instead, [Note: fused device step] in ``_fused_device.py``), so the update is the same code as plain
PyTorch's (AdamW, Adam, SGD, ...) and param groups apply per parameter even when one chunk mixes groups.
Only element-wise optimizers are equivalent under this slicing, hence the allow-list
(``SUPPORTED_OPTIMIZERS`` in ``_support.py``). The user's ``param_groups`` dicts are shared, so LR
schedulers built on the user's optimizer keep driving the learning rate. The inner optimizer's states of
host optimizer chunks are views into the manager's host blocks ([Note: host optimizer state] in
``_host_state.py``), not tensors ``torch.optim`` allocates lazily.

Source: ZeRO (arXiv 1910.02054) stage 3 sharded optimizer states; Gemini's hybrid Adam (host shards
updated on the host, device shards on the device).
"""

from __future__ import annotations

import logging

import torch

from hf_elixir.chunk import strict
from hf_elixir.chunk.chunk import Chunk, ParamSlot
from hf_elixir.optim._disk_state import MASTER_KEY, DiskStates, HostFloor, host_floor_bytes
from hf_elixir.optim._host_state import HostStates
from hf_elixir.optim._refresh import uploads_cast

__all__ = ["ShardStateMixin"]

logger = logging.getLogger(__name__)


class _ShardView:
    """One parameter's part of this rank's shard: ``param_flat[start:stop]`` = shard ``[lo:hi]``."""

    __slots__ = ("slot", "chunk", "group_index", "start", "stop", "lo", "hi", "tensor")

    def __init__(self, slot: ParamSlot, chunk: Chunk, group_index: int, start: int, stop: int,
                 lo: int, hi: int, tensor: torch.nn.Parameter) -> None:
        self.slot, self.chunk, self.group_index = slot, chunk, group_index
        self.start, self.stop, self.lo, self.hi, self.tensor = start, stop, lo, hi, tensor


class ShardStateMixin:
    """``ElixirOptimizer``'s construction of the masters (``masters``), the gradient shards
    (``manager.grad_shards``), the views (``views``) and the host optimizer states (``_host_states``)."""

    def _build_shard_state(self) -> None:
        """Reserve the host blocks, then build every trainable chunk's gradient shard, master and views."""
        manager = self.manager
        host, state_keys = self._host_chunks_and_keys()
        # [Note: disk states] in _disk_state.py: masters and states that do not fit the host budget go to disk
        self._disk = DiskStates.build(manager, self.config, host, state_keys, self.refresh_cast)
        self._say_unused_host_settings(host, state_keys)
        # gradient shards, masters and states that stay in host memory, and the refresh staging
        manager.host.reserve_for(DiskStates.host_requests(host, state_keys, self._disk)
                                 + [(c.shard_numel, c.dtype) for c in host if uploads_cast(c)
                                    and self.refresh_cast == "host"])  # staging
        self._init_refresh_buffers(host)  # [Note: overlapped refresh] in _refresh.py
        for chunk in manager.chunks:
            if chunk.trainable:
                self._build_chunk_shard(chunk)
        # [Note: host optimizer state] in _host_state.py: the host chunks' optimizer states, in the blocks
        self._host_states = HostStates(manager, type(self.user_optimizer),
                                       [v for v in self.views if not v.chunk.optim_on_device], state_keys, self._disk)
        if self._disk is not None:
            self._disk.file.evict_all()  # the masters just copied in go to the file

    def _host_chunks_and_keys(self) -> tuple[list[Chunk], dict[int, list[str]]]:
        """The host optimizer chunks and, per chunk, the keys of its element-wise optimizer states."""
        host = [c for c in self.manager.chunks if c.trainable and not c.optim_on_device]
        return host, HostStates.requests(type(self.user_optimizer), self.param_groups, self._groups_of_shards(host),
                                         {c.chunk_id: c.shard_numel for c in host})

    def _say_unused_host_settings(self, host: list[Chunk], state_keys: dict[int, list[str]]) -> None:
        """Warn where a host setting the user gave cannot act: ``offload_dir`` with no optimizer state on the host
        (nothing can go to disk), or ``host_memory_budget_bytes`` below the model data this rank keeps in host
        memory without a disk (it is exceeded; it bounds only the optional host copies there)."""
        config = self.config
        if config.offload_dir is not None and self._disk is None:
            if not host:
                logger.warning("hf_elixir: ElixirConfig.offload_dir=%r is unused: no optimizer state is on the host "
                               "(offload_optimizer=%r keeps it on the device while the device budget holds it), so "
                               "nothing goes to disk; set offload_optimizer=True to keep it on the host and spill "
                               "what does not fit host_memory_budget_bytes to offload_dir",
                               config.offload_dir, config.offload_optimizer)
            else:
                logger.info("hf_elixir: the host optimizer state fits host_memory_budget_bytes; nothing goes to "
                            "offload_dir=%r", config.offload_dir)
            return
        budget = config.host_memory_budget_bytes
        if config.offload_dir is None and budget is not None:
            floor = host_floor_bytes(self.manager, config, host, state_keys, self.refresh_cast)
            if floor.everything_bytes > budget:
                disk = (f", or give offload_dir (a directory on a local SSD; the least budget with it is "
                        f"{floor.least_bytes}: hf_elixir.min_host_budget_bytes)"
                        if floor.least_bytes < floor.everything_bytes else "")
                logger.warning("hf_elixir: ElixirConfig.host_memory_budget_bytes=%d is below the %d bytes of model "
                               "data this rank keeps in host memory without a disk, so it is exceeded; raise it to "
                               "at least %d%s", budget, floor.everything_bytes, floor.everything_bytes, disk)

    def _host_floor(self, config) -> HostFloor:
        """This rank's host bytes with and without the disk tier ([Note: disk states]; ``min_host_budget_bytes``)."""
        host, state_keys = self._host_chunks_and_keys()
        return host_floor_bytes(self.manager, config, host, state_keys, self.refresh_cast)

    def _build_chunk_shard(self, chunk: Chunk) -> None:
        """The chunk's fp32 gradient shard and master (the compute shard itself where it is fp32 on the optimizer
        state's side), and a view of the master per trainable parameter in this rank's shard."""
        manager = self.manager
        location = manager.compute_device if chunk.optim_on_device else torch.device("cpu")
        nbytes = chunk.shard_numel * 4
        if chunk.optim_on_device:
            manager.pool.charge(nbytes, f"gradient shard of chunk {chunk.chunk_id}")
            grad_shard = strict.register_device(torch.zeros(chunk.shard_numel, dtype=torch.float32,
                                                            device=location))
        else:  # a fresh file is zero ([Note: disk parameters] in hf_elixir/chunk/_disk_pages.py)
            on_disk = self._disk.grad_shard(chunk.chunk_id) if self._disk is not None else None
            grad_shard = on_disk if on_disk is not None else manager.host_zeros(chunk.shard_numel, torch.float32)
        manager.grad_shards[chunk.chunk_id] = grad_shard
        shard_view = chunk.shard if not chunk.full_alias else chunk.full
        source = self._fp32_init.pop(chunk.chunk_id, shard_view)  # fp32 values from before the cast
        if chunk.dtype == torch.float32 and chunk.optim_on_device == chunk.shard_on_device:
            master = shard_view  # fp32 compute copy is the master (no duplicate)
        else:
            if chunk.optim_on_device:
                manager.pool.charge(nbytes, f"fp32 master shard of chunk {chunk.chunk_id}")
                master = strict.register_device(strict.to_device(source.detach().float(), location).clone())
            else:
                on_disk = self._disk.tensor(chunk.chunk_id, MASTER_KEY) if self._disk is not None else None
                master = on_disk if on_disk is not None else manager.host_empty(chunk.shard_numel, torch.float32)
                with strict.host_copies():
                    master.copy_(source)
                if chunk.shard_on_device:
                    manager.counters.d2h_bytes += chunk.shard_bytes
        self.masters[chunk.chunk_id] = master
        begin, end = chunk.shard_begin, chunk.shard_begin + chunk.shard_numel
        for slot in chunk.slots:
            if not slot.trainable or slot.param not in self._param_group_of:
                continue
            lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, end)
            if hi <= lo:
                continue
            tensor = torch.nn.Parameter(master[lo - begin:hi - begin], requires_grad=True)
            tensor.grad = grad_shard[lo - begin:hi - begin]
            self.views.append(_ShardView(slot, chunk, self._param_group_of[slot.param],
                                         lo - slot.offset, hi - slot.offset, lo - begin, hi - begin, tensor))

    def _groups_of_shards(self, chunks: list[Chunk]) -> dict[int, set[int]]:
        """Chunk id -> the param groups of the trainable parameters in this rank's shard of it."""
        groups: dict[int, set[int]] = {}
        for chunk in chunks:
            begin, end = chunk.shard_begin, chunk.shard_begin + chunk.shard_numel
            groups[chunk.chunk_id] = {self._param_group_of[s.param] for s in chunk.slots
                                      if s.trainable and s.param in self._param_group_of
                                      and max(s.offset, begin) < min(s.offset + s.numel, end)}
        return groups
