"""A chunk's gradients: accumulated into its gradient buffer (or straight into the optimizer's shard), spilled to
the host and back when the device is short ([Note: gradient spill] in ``_grad_buffers.py``), and reduced over
ranks into the gradient shard (reduce-scatter, or all-reduce when replicated; [Note: reduce overlap] and [Note:
pre-divided all-reduce] at :meth:`ChunkGradMixin.reduce_scatter_grad`). When and in which order chunks are
reduced is the manager's ([Note: reduce order] in ``_reduce.py``).

[Note: deferred gradient zeroing] (the all-resident step's overhead.) A chunk whose gradients are accumulated
straight into the optimizer's gradient shard (:meth:`Chunk.direct_grad_shard`: whole on this rank, optimizer
state on the device) is not zero-filled by ``zero_grad``: the shard is marked ``grad_zero_pending`` and the
first gradient of each parameter is *written* into it (``copy_``, or ``mul`` by ``1/world_size`` when
replicated) instead of added to zeros, as ``AccumulateGrad`` steals the first gradient instead of adding it
to a zero ``p.grad``. Before anything reads the shard as a whole, :meth:`Chunk.settle_grad_zero` zeroes what
backward did not write (parameters without a gradient, padding): at the chunk's reduce (before its
all-reduce) and in :meth:`ChunkManager.settle_grad_zeros`, which ``drain_reduces`` and the optimizer step call
(every reader of gradient shards calls ``drain_reduces`` first, [Note: late reduce waits] in _reduce.py). A
step's pass over the gradients shrinks from zero + add (write, then read + write) to one write per element.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hf_elixir._compat import reduce_scatter_single
from hf_elixir.chunk import strict
from hf_elixir.chunk._slot import ParamSlot
from hf_elixir.chunk.states import TensorState

__all__ = ["ChunkGradMixin"]


class ChunkGradMixin:
    """:class:`~hf_elixir.chunk.chunk.Chunk`'s gradient verbs (a mixin: they use the chunk's sizes, groups and
    slots, and the manager's buffers and counters)."""

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
        ``_grad_buffers.py``); :meth:`_restore_grad` brings it back before the next gradient or the reduce. No host
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
        """One copy of a gradient spill or restore ([Note: gradient spill] in ``_grad_buffers.py``), non-blocking on
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
                else:  # offload: a non-blocking device->host copy, added on the host ([Note: gradient offload]
                    # in _grad_shards.py)
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
