"""Parameter writes taken into the fp32 masters (``ElixirOptimizer``'s part).

Outside the step, the compute copies can be written: ``model.load_state_dict``, an in-place write to a
parameter (``p.data.copy_``, ``torch.nn.init``), a tied weight set by the user. The masters must then follow, or
the next step would update the old values and its refresh would overwrite the write. The manager notices such
writes ([Note: parameter writes] in ``hf_elixir/chunk/_chunk_params.py``) and calls :meth:`ParamWritesMixin.merge_param_writes`
before anything reads the masters; :meth:`ParamWritesMixin.sync_masters_from_params` takes the compute copies of
what a load wrote.
"""

from __future__ import annotations

import torch

from hf_elixir.chunk import strict
from hf_elixir.chunk.chunk import Chunk

__all__ = ["ParamWritesMixin"]


class ParamWritesMixin:
    """``ElixirOptimizer``'s intake of parameter writes into its masters."""

    def merge_param_writes(self, chunks: list[Chunk]) -> None:
        """The manager's ``on_param_writes``: merge the compute shards of ``chunks`` (which hold parameter writes)
        into their fp32 masters element by element: an element whose compute value differs from its master cast
        to the compute dtype was written and takes that value; the others keep their master value, so a bf16
        chunk's masters are not rounded to bf16 by a write elsewhere in it. Speculative host steps are undone
        first (the step redoes them from the merged masters), as :meth:`sync_masters_from_params` does."""
        self.settle_host_steps()
        self._release_master_reads()  # pending uploads may read the masters written below
        self.manager.drain_refreshes()
        counters = self.manager.counters
        for chunk in chunks:
            chunk.params_written = False
            master = self.masters.get(chunk.chunk_id)
            source = chunk.full if chunk.full_alias else chunk.shard
            if master is None or master is source:
                continue  # no optimizer state, or the shard is the master: the write is in already
            self._staged.discard(chunk.chunk_id)
            moved = strict.is_host(source) != strict.is_host(master)
            with torch.no_grad(), strict.host_copies():
                values = source.to(master.device, copy=moved)
                written = values != master.to(values.dtype)
                master.copy_(torch.where(written, values.to(master.dtype), master))
            if moved:
                if strict.is_host(master):
                    counters.d2h_bytes += chunk.shard_bytes
                else:
                    counters.h2d_bytes += chunk.shard_bytes

    def sync_masters_from_params(self, params=None) -> None:
        """Refresh fp32 masters from the compute shards: every trainable chunk whole (``params=None``), or only the
        elements of ``params`` (an iterable of managed parameters: what ``model.load_state_dict`` loaded; the other
        elements keep their master values, so a partial load does not round them to the compute dtype)."""
        self.settle_host_steps()
        self.manager.drain_refreshes()
        self._staged.clear()
        if params is None:
            ranges = {chunk.chunk_id: [(0, None)] for chunk in self.manager.chunks if chunk.trainable}
        else:
            ranges = {}
            for param in params:
                slot = self.manager.slot_of[param]
                ranges.setdefault(self.manager.chunk_of[param].chunk_id, []).append((slot.offset, slot.numel))
        for chunk in self.manager.chunks:
            if not chunk.trainable or chunk.chunk_id not in ranges:
                continue
            master = self.masters[chunk.chunk_id]
            source = chunk.full if chunk.full_alias else chunk.shard
            if master is source:
                continue
            begin = chunk.shard_begin if master.numel() == chunk.shard_numel else 0
            for offset, numel in ranges[chunk.chunk_id]:
                lo = max(offset, begin)
                hi = begin + master.numel() if numel is None else min(offset + numel, begin + master.numel())
                if hi > lo:
                    with strict.host_copies():
                        master[lo - begin:hi - begin].copy_(source[lo - begin:hi - begin])

    def release_disk_pages(self, chunk_id: int | None = None) -> None:
        """Write back and evict the pages of the disk tier's file that a load, an edit or an export outside the
        step brought into host memory ([Note: disk states] in ``_disk_state.py``): every region, or only chunk
        ``chunk_id``'s; nothing without ``offload_dir``."""
        if self._disk is None:
            return
        if chunk_id is None:
            self._disk.file.evict_all()
        else:
            self._disk.pages_out(chunk_id)
