"""A chunk's parameters as seen by user code: views into ``full`` while it holds this step's values ([Note:
parameters as views] in ``chunk.py``), stale placeholders that raise on any access when it does not ([Note:
stale placeholder] in ``params.py``), and the in-place writes user code makes through them, carried into the
shard and the optimizer's masters.

[Note: parameter writes] A managed parameter with a current copy is a plain view into ``full``, so user code may write
it in place between steps (``with torch.no_grad(): p.mul_(0.99)``, ``p[pad_id].zero_()``, ``p.copy_(ema)``), as it would
a plain PyTorch parameter. ``full`` is only a compute copy: the shard and the optimizer's fp32 master are the truth
([Note: shard authority] in chunk.py), so such a write used to be lost silently wherever they are separate buffers
(resharding frees ``full``; the step overwrites it from the master): two ranks with replicated chunks and host optimizer
states trained as if the write never happened (4% parameter difference after 4 steps of a manual weight decay), while
one rank without a budget, where ``full`` is the master, applied it. Every write through the parameter bumps its version
counter (``param._version``; set ``.data`` keeps it), so :meth:`Chunk.take_param_writes` finds the written parameters by
comparing it with ``ParamSlot.seen_version`` and copies this rank's slice of ``full`` into the shard (and into a
rank-local host copy); the manager's ``on_param_writes`` (the optimizer) then merges the shard into the master element
by element: elements whose compute value differs from the master's cast value take it, the others keep their fp32 master
value (so bf16 masters are not rounded by a write elsewhere in the chunk). It runs at every reshard, at the start of
each backward (before the host lane steps the masters and uploads them into the compute copies, [Note: early refresh] in
``hf_elixir/optim/optimizer.py``), at the start of ``step()`` and on entering ``full_parameters``: every way ``full`` is
freed or overwritten while current. A managed parameter's ``.data`` shares its version counter (``_ManagedMixin.data``
in params.py), so ``p.data.mul_()`` is seen too. Every rank takes its own writes (no collective); deterministic writes
on every rank, as under DDP, stay identical.
"""

from __future__ import annotations

import torch

from hf_elixir.chunk import strict
from hf_elixir.chunk.params import hide as hide_param
from hf_elixir.chunk.params import show as show_param

__all__ = ["ChunkParamsMixin"]


class ChunkParamsMixin:
    """:class:`~hf_elixir.chunk.chunk.Chunk`'s parameter views and parameter-write tracking (a mixin: it reads the
    chunk's buffers and versions)."""

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
        self.manager.listener.host_fence(self)  # the host optimizer may be stepping this shard in place
        with torch.no_grad(), strict.host_copies():
            if not self.full_alias and not self.shard_in_full:
                self.shard.copy_(self.full[self.shard_begin:self.shard_begin + self.shard_numel])
                if not self.shard_on_device:
                    self.manager.counters.d2h_bytes += self.shard_bytes
            if self.host_full is not None and self.host_full_version == self.version:
                self.host_full.copy_(self.full)
                self.manager.counters.d2h_bytes += self.full_bytes
        if self.manager.disk_pages is not None:
            self.manager.disk_pages.onloaded(self)  # written: back to the file ([Note: disk parameters])
        self.params_written = True
        return True
