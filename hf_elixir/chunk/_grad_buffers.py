"""Gradient buffers of the chunk manager: the device buffers a chunk's gradients accumulate in until its reduce,
and the reduce-scatter outputs; charged to the pool, reused off CUDA ([Note: buffer reuse] at
:meth:`GradBufferMixin.grad_buffer`), and spilled to the host when nothing else can make room ([Note: gradient
spill] at :meth:`GradBufferMixin._spill_a_grad`; the copies are :meth:`Chunk.spill_grad` in ``_chunk_grads.py``).
Their live bytes are recorded at every access (``_steps.py``) for the backward gather prefetch's room rule
([Note: backward gather prefetch] in ``_prefetch.py``).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hf_elixir.chunk.chunk import Chunk

__all__ = ["GradBufferMixin"]


class GradBufferMixin:
    """:class:`~hf_elixir.chunk.manager.ChunkManager`'s gradient buffers (a mixin: they share the pool with the
    chunks, and the spill picks by the reduce order)."""

    def _init_grad_buffers(self) -> None:
        # off CUDA, gradient buffers whose reduce finished, kept for the next backward ([Note: buffer reuse])
        self._free_buffers: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.kept_buffer_bytes = 0  # their bytes, charged to the pool while kept
        # device bytes of gradient buffers and reduce outputs now and their peak since the last access
        # ([Note: backward gather prefetch] in _prefetch.py)
        self._grad_live_bytes = 0
        self._grad_peak_bytes = 0
        self.num_grad_spills = 0  # gradient buffers moved to the host for room ([Note: gradient spill])

    def grad_buffer(self, numel: int, dtype: torch.dtype, what: str, zero: bool = True,
                    keep: Chunk | None = None) -> torch.Tensor:
        """A device tensor ``[numel]`` of ``dtype`` for a gradient buffer or a reduce-scatter output, charged to
        the pool (counted for the backward gather prefetch's reserve, [Note: backward gather prefetch] in
        ``_prefetch.py``) until :meth:`recycle_buffer` takes it back; zero-filled unless ``zero`` is False.

        [Note: buffer reuse] On CUDA this is ``torch.zeros`` / ``torch.empty``: the caching allocator reuses
        freed blocks. Off CUDA a fresh tensor of a chunk's size is a new ``mmap`` every time, whose pages fault
        in as they are first written (~50-75 ms per 147 MiB buffer, each backward, for every chunk); the buffers
        :meth:`recycle_buffer` got back are kept and reused instead, as the caching allocator would. A kept
        buffer is device memory (it stays allocated), so it stays charged to the pool while kept
        (``kept_buffer_bytes``; in ``device_used_bytes`` and its peak), and :meth:`make_room` drops kept
        buffers before it finishes reduces or evicts a chunk: the pool never holds more than its budget, kept
        buffers included (docs/design/rules.md: *The simulation is as strict as the hardware*). Reusing a kept
        buffer moves its charge from kept to in use (no new charge, no room to make).

        Args:
            numel: elements of the buffer.
            dtype: its dtype (the chunk's gradient dtype).
            what: what the buffer is for (named in a budget error).
            zero: zero-fill it (a reduce-scatter output is written whole by the collective: ``False``).
            keep: a chunk whose gradient buffer is being read and must not be spilled to make room
                ([Note: gradient spill]).

        Raises:
            DeviceBudgetExceededError: nothing left to drop, finish or evict and still no room.
        """
        nbytes = numel * dtype.itemsize
        free = self._free_buffers.get((numel, dtype))
        if free:
            buffer = free.pop()
            self.kept_buffer_bytes -= nbytes  # its charge moves to the in-use gradient bytes
            buffer = buffer.zero_() if zero else buffer
        else:
            self.make_room(nbytes, what, exclude={keep.chunk_id} if keep is not None else None)
            self.pool.charge(nbytes, what)
            buffer = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=self.compute_device)
        self._grad_live_bytes += nbytes
        self._grad_peak_bytes = max(self._grad_peak_bytes, self._grad_live_bytes)
        return buffer

    def recycle_buffer(self, buffer: torch.Tensor) -> None:
        """Give back a :meth:`grad_buffer` tensor nothing reads any more: off CUDA it is kept for reuse, still
        charged ([Note: buffer reuse]); on CUDA it is dropped and its bytes released."""
        nbytes = buffer.numel() * buffer.element_size()
        self._grad_live_bytes -= nbytes
        if self.compute_device.type != "cuda":
            self._free_buffers[(buffer.numel(), buffer.dtype)].append(buffer)
            self.kept_buffer_bytes += nbytes
        else:
            self.pool.release(nbytes)

    def drop_kept_buffers(self, nbytes: int | None = None) -> None:
        """Free kept gradient buffers ([Note: buffer reuse]) and release their charge: until ``nbytes`` more
        fit the pool (largest first), or all of them when ``nbytes`` is ``None``."""
        for key in sorted(self._free_buffers, key=lambda k: k[0] * k[1].itemsize, reverse=True):
            free = self._free_buffers[key]
            while free and (nbytes is None or not self.pool.fits(nbytes)):
                buffer = free.pop()
                size = buffer.numel() * buffer.element_size()
                del buffer
                self.kept_buffer_bytes -= size
                self.pool.release(size)
            if not free:
                del self._free_buffers[key]
            if nbytes is not None and self.pool.fits(nbytes):
                return

    def _spill_a_grad(self, exclude: set[int]) -> bool:
        """[Note: gradient spill] A chunk's gradient buffer lives from its first gradient to its reduce, and a chunk
        whose parameters are used far apart in forward (packing follows registration order, which is not always
        the order of use: OPT registers the decoder's ``final_layer_norm`` between the position embedding and the
        first layer) keeps it through most of backward, beside the buffers of the chunks in between: three or
        more at once, where the budget floor (``device_floor_bytes``: two adjacent units and two gradient
        buffers) and the cost model count two. When nothing is left to evict, the partial buffer of the chunk
        reduced last (the one needed farthest ahead) goes to the host instead (:meth:`Chunk.spill_grad`) and
        comes back before its next gradient or its reduce: rank-local copies, the same collectives in the same
        order. So a step runs within the floor. Returns whether a buffer was spilled.

        Neither copy syncs the host (docs/design/rules.md: host syncs in the step's hot path are counted, one per
        step): the spill is a non-blocking device->host copy into the chunk's host buffer (:meth:`host_empty`:
        pinned on CUDA, so a real asynchronous DMA) queued on the current stream, the restore a non-blocking host->device copy on
        the current stream, and nothing on the host reads that buffer, so nothing waits for them (a blocking
        ``copy_`` would: ``memcpy_and_sync``, both ways). The device buffer goes to :meth:`recycle_buffer` right
        after its copy is queued: on CUDA that releases its pool charge and the chunk drops the last reference, so
        the caching allocator puts the block back in the free pool of the stream it was allocated on (the compute
        stream: gradient buffers are made by the backward hooks and the restore), where a later allocation is
        used only by work queued after the copy, which therefore reads it first. A spill can also be asked for on
        the reduce stream (the ``make_room`` of a reduce-scatter output, [Note: reduce overlap] in ``_chunk_grads.py``):
        its copy is then queued there, and ``record_stream`` on it keeps the allocator from handing the block to
        the compute stream before the copy ran (a no-op on the allocation stream). The host buffer is reused by
        the chunk's next spill: an event recorded after each copy and waited for by the next one (a stream wait)
        orders spill, restore and the next spill when they run on different streams. Off CUDA both are plain
        copies, the buffer is kept for reuse as before, the counters (``d2h_bytes``, ``h2d_bytes``,
        ``num_grad_spills``) are unchanged. ``tests/test_host_syncs.py`` counts the syncs of steps that spill."""
        if not self.backward_pending:
            return False
        order = {c.chunk_id: i for i, c in enumerate(self._reduce_order)}
        open_buffers = [c for c in self.chunks if c.grad_full is not None and c.chunk_id not in exclude]
        if not open_buffers:
            return False
        max(open_buffers, key=lambda c: (order.get(c.chunk_id, -1), c.chunk_id)).spill_grad()
        self.num_grad_spills += 1
        return True
