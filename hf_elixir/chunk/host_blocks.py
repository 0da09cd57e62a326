"""Host memory for chunk shards, refill copies, host optimizer shards and states: a few large blocks, sliced.

[Note: host blocks] PyTorch's pinned host allocator (``CachingHostAllocator``) rounds every request up
to a power of two and pins each allocation separately (one ``cudaHostAlloc`` per buffer, slow and up to
2x the bytes). Chunk shards of a 2^k-element chunk over 3 ranks, fp32 masters and gradient shards are
rarely powers of two. So the manager takes host memory in a few large blocks and slices one per
request (aligned to :data:`ALIGN_BYTES`), as DeepSpeed's pinned buffers and ColossalAI's chunk host
memory do. Blocks are pinned when the compute device is CUDA (asynchronous copies need it) and
ordinary memory otherwise, so the same code path runs in the CPU-only tests.

Callers that know their total ahead ``reserve`` it as one block. Otherwise block sizes grow
geometrically (each new block at least twice the last, up to :data:`MAX_BLOCK_BYTES`, and at least the
request): a small model gets small blocks, a large one a few large blocks. Pinned blocks are sized to
a power of two (the pinned allocator's rounding is then used, not hidden). A block
whose slices are all freed is returned. ``reserved_bytes`` (what the blocks hold, i.e. what is really
allocated) is what ``memory_stats()["host_bytes"]`` reports, not the sum of the requests.

[Note: zero pages] An unpinned block is allocated zeroed by the C library (``calloc``, through
``numpy.zeros``): a large one is fresh pages of the system's, which occupy no memory until written.
:meth:`HostBlockAllocator.zeros` hands out a range of such a block that was never handed out before
without writing it, so a zero-initialised buffer (the optimizer's gradient shards; its element-wise
states, [Note: host optimizer state] in ``hf_elixir/optim/_host_state.py``) costs resident memory only
from its first real write (the first backward; the first step), as a lazily allocated one would, and a
rank's loading peak does not include it. A range handed out before, and any pinned block (pinned
memory is not zeroed), is zeroed by writing.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["HostBlockAllocator", "ALIGN_BYTES", "MIN_BLOCK_BYTES", "MAX_BLOCK_BYTES"]

ALIGN_BYTES = 512
MIN_BLOCK_BYTES = 1 << 16
MAX_BLOCK_BYTES = 1 << 30


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _Block:
    """One allocation: ``data`` (uint8 ``[nbytes]``) and its free ranges ``[(offset, nbytes)]`` by offset."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        if pin:
            self.data = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
        else:  # calloc: zero pages, resident only once written ([Note: zero pages])
            self.data = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
        self.nbytes = nbytes
        self.free = [(0, nbytes)]
        self.used_bytes = 0
        # bytes from here on were never handed out: still zero in an unpinned block
        self.zero_from = nbytes if pin else 0

    def take(self, nbytes: int) -> int | None:
        """First fit: the offset of ``nbytes`` carved from a free range, or None."""
        for i, (offset, size) in enumerate(self.free):
            if size >= nbytes:
                if size == nbytes:
                    del self.free[i]
                else:
                    self.free[i] = (offset + nbytes, size - nbytes)
                self.used_bytes += nbytes
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Return a range, merging it with adjacent free ranges."""
        self.used_bytes -= nbytes
        ranges = sorted(self.free + [(offset, nbytes)])
        merged = [ranges[0]]
        for off, size in ranges[1:]:
            last_off, last_size = merged[-1]
            if last_off + last_size == off:
                merged[-1] = (last_off, last_size + size)
            else:
                merged.append((off, size))
        self.free = merged


class HostBlockAllocator:
    """Hands out 1-D host tensors sliced from a few large (pinned on CUDA) blocks.

    Args:
        pin: pin the blocks (page-locked, for asynchronous host<->device copies); only with CUDA.
        on_change: called with the change in :attr:`reserved_bytes` whenever a block is taken or
            returned (the manager adds it to ``MemoryCounters.host_bytes``).
    """

    def __init__(self, pin: bool, on_change=None) -> None:
        self.pin = pin
        self.on_change = on_change or (lambda delta: None)
        self.blocks: list[_Block] = []
        self._where: dict[int, tuple[_Block, int, int]] = {}  # data_ptr -> (block, offset, nbytes)
        self._last_block_bytes = 0

    @property
    def reserved_bytes(self) -> int:
        """Bytes the blocks hold (what is really allocated)."""
        return sum(b.nbytes for b in self.blocks)

    @property
    def requested_bytes(self) -> int:
        """Bytes handed out and not yet freed (aligned sizes)."""
        return sum(b.used_bytes for b in self.blocks)

    def _aligned(self, nbytes: int) -> int:
        return max(-(-nbytes // ALIGN_BYTES) * ALIGN_BYTES, ALIGN_BYTES)

    def _new_block(self, nbytes: int) -> _Block:
        if self.pin:  # the pinned allocator rounds up to a power of two anyway: use (and report) all of it
            nbytes = _next_pow2(nbytes)
        block = _Block(nbytes, self.pin)
        self.blocks.append(block)
        self._last_block_bytes = nbytes
        self.on_change(nbytes)
        return block

    def reserve(self, nbytes: int) -> None:
        """Make sure one block has ``nbytes`` free in one range (take a block of exactly that size if not):
        callers that know their total ahead (``prepare``, the optimizer's host shards) get one block."""
        nbytes = self._aligned(nbytes)
        if not any(size >= nbytes for b in self.blocks for _, size in b.free):
            self._new_block(nbytes)

    def reserve_for(self, requests: list[tuple[int, torch.dtype]]) -> None:
        """:meth:`reserve` room for ``(numel, dtype)`` requests about to be made (one block)."""
        total = sum(self._aligned(n * torch.empty((), dtype=d).element_size()) for n, d in requests)
        if total:
            self.reserve(total)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor ``[numel]`` of ``dtype`` viewing a slice of a block."""
        return self._take(numel, dtype)[0]

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`empty` filled with zeros; a never-used range of an unpinned block is zero already and is
        not written ([Note: zero pages])."""
        tensor, fresh = self._take(numel, dtype)
        if not fresh:
            tensor.zero_()
        return tensor

    def _take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        """A slice for ``numel`` elements of ``dtype``, and whether it was never handed out before."""
        element = torch.empty((), dtype=dtype).element_size()
        nbytes = self._aligned(numel * element)
        for block in self.blocks:
            offset = block.take(nbytes)
            if offset is not None:
                break
        else:
            block = self._new_block(max(MIN_BLOCK_BYTES, min(MAX_BLOCK_BYTES, 2 * self._last_block_bytes), nbytes))
            offset = block.take(nbytes)
        fresh = offset >= block.zero_from
        block.zero_from = max(block.zero_from, offset + nbytes)
        # not a view of ``block.data`` (whose version counter every slice would share: a write to any buffer
        # would look like a write to all of them) but a tensor of its own over the block's storage, with its own
        # version counter ([Note: strict refresh source] in _chunk_refresh.py); ``offset`` is a multiple of ALIGN_BYTES
        tensor = torch.empty(0, dtype=dtype).set_(block.data.untyped_storage(), offset // element, (numel,))
        self._where[tensor.data_ptr()] = (block, offset, nbytes)
        return tensor, fresh

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a slice :meth:`empty` or :meth:`zeros` gave and nobody freed yet."""
        return tensor.data_ptr() in self._where

    def free(self, tensor: torch.Tensor) -> None:
        """Return ``tensor``'s slice (a tensor :meth:`empty` gave); an emptied block is released.

        The caller drops its references: the slice may be handed out again at once.
        """
        block, offset, nbytes = self._where.pop(tensor.data_ptr())
        block.give(offset, nbytes)
        if block.used_bytes == 0:
            self.blocks.remove(block)
            self.on_change(-block.nbytes)
