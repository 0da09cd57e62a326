"""The reduced gradient shards of the chunk manager (fp32 ``[shard_numel]`` per trainable chunk, where the
optimizer state lives): a host-optimizer chunk's reduced shard offloaded to the host, and zeroing, whole or per
parameter ([Note: deferred gradient zeroing] in ``_chunk_grads.py``).

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

import contextlib

import torch

from hf_elixir.chunk import strict
from hf_elixir.chunk.chunk import Chunk

__all__ = ["GradShardMixin"]


class GradShardMixin:
    """:class:`~hf_elixir.chunk.manager.ChunkManager`'s gradient shards (a mixin: every reader first finishes the
    manager's in-flight reduces, ``drain_reduces``)."""

    def _init_grad_shards(self) -> None:
        self.grad_shards: dict[int, torch.Tensor] = {}  # chunk id -> fp32 [shard_numel]
        self._grad_staging: dict[int, torch.Tensor] = {}  # chunk id -> fp32 host [shard_numel]
        self._offload_done: dict[int, object] = {}  # chunk id -> callable waiting for its last host add

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
            staging = target = self._accumulation_staging(chunk)
        stream, event = self.offload_stream, None
        if self.disk_pages is not None and target is grad_shard:  # [Note: disk parameters] in _disk_pages.py
            self.disk_pages.grad_in(cid)
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
        if self.disk_pages is not None and cid in self.disk_pages.grads:
            self._grad_to_disk(cid, grad_shard, staging, event)
            staging = event = None
        if self.listener.takes_offloaded_grads:
            waiting = self.listener.on_grad_offloaded(chunk, staging, event)
            if waiting is not None:
                self._offload_done[cid] = waiting
            return
        if event is not None:  # no host lane (no optimizer): finish here
            event.synchronize()
        if staging is not None:
            grad_shard.add_(staging)

    def _accumulation_staging(self, chunk: Chunk) -> torch.Tensor:
        """The host buffer a later micro-batch's gradient shard is copied into before it is added: the chunk's own
        (kept for the next), or for gradient shards on disk one buffer shared by all of them (their add ends in
        :meth:`offload_grad`, [Note: disk parameters] in ``_disk_pages.py``)."""
        pages = self.disk_pages
        key = -1 if pages is not None and chunk.chunk_id in pages.grads else chunk.chunk_id
        staging = self._grad_staging.get(key)
        if staging is None:
            numel = max(self.chunks[c].shard_numel for c in pages.grads) if key == -1 else chunk.shard_numel
            staging = self._grad_staging[key] = self.host_empty(numel, torch.float32)
        return staging[:chunk.shard_numel]

    def _grad_to_disk(self, cid: int, grad_shard: torch.Tensor, staging, event) -> None:
        """A gradient shard in the disk tier's file ([Note: disk parameters] in ``_disk_pages.py``): finish the copy
        (and the accumulation's add) here, then write the region back; the host lane gets nothing left to add."""
        if event is not None:
            event.synchronize()
        if staging is not None:
            self.disk_pages.grad_in(cid)
            with torch.no_grad():
                grad_shard.add_(staging)
        self.disk_pages.grad_out(cid)

    def settle_grad_zeros(self) -> None:
        """Make every gradient shard whose zeroing ``zero_grad`` deferred whole again ([Note: deferred
        gradient zeroing] in _chunk_grads.py): a no-op for the chunks reduced since (their reduce settled them)."""
        for cid in self.grad_shards:
            self.chunks[cid].settle_grad_zero()

    def zero_grad(self, keep_has_grad: bool = False) -> None:
        """Zero every gradient shard; ``keep_has_grad``: parameters that had a gradient keep a (zero)
        one for the next step (``zero_grad(set_to_none=False)``), else they have none until backward."""
        self.drain_reduces(settle_zeros=False)
        self.listener.host_fence(None)  # host work on the gradient shards ends (and speculative steps are undone)
        for chunk in self.chunks:
            chunk.grad_shard_clean = True
        for cid, grad_shard in self.grad_shards.items():
            # [Note: deferred gradient zeroing] in _chunk_grads.py: a direct shard is zeroed as backward writes it
            if not self.chunks[cid].defer_grad_zero() and not (
                    self.disk_pages is not None and self.disk_pages.zero_grad(cid, grad_shard)):
                grad_shard.zero_()
        self.flags.zero(keep_has_grad)  # the gradients a mismatched order reduced are gone, and its mismatch
        self.grads_pending = False
        self.grads_stepped = False
        self.listener.on_zero_grad()

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
        self.listener.host_fence(None)
        if grad_shard is not None:
            lo = max(slot.offset, chunk.shard_begin) - chunk.shard_begin
            hi = min(slot.offset + slot.numel, chunk.shard_begin + chunk.shard_numel) - chunk.shard_begin
            if hi > lo:
                grad_shard[lo:hi].zero_()
        if not keep_has_grad:
            self.flags.clear(slot.flag_index)
