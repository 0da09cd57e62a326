"""Eviction: which unsharded chunk leaves the device when a charge needs room.

[Note: Belady eviction] The victim is the chunk whose next use in the access order recorded in the previous
step is furthest away (Belady/MIN over the warm-up trace, PatrickStar arXiv 2108.05818 section 5); least
recently used before a trace exists.

:meth:`Eviction.make_room` frees, in this order: gradient buffers kept for reuse ([Note: buffer reuse] in
``_grad_buffers.py``), the buffers of in-flight gradient collectives (by finishing them, ``_reduce.py``), chunks
(Belady's victims), and last a partial gradient buffer spilled to the host ([Note: gradient spill] in
``_grad_buffers.py``). In backward a chunk the step uses no more is resharded as soon as it is released ([Note:
dead chunks]).

:class:`Eviction` is an object the manager owns (``ChunkManager.eviction``); it keeps no state of its own and reads
its manager only through :class:`EvictionHost`, the members named there (the chunks, the pool, the in-flight reduces,
the previous step's trace, the kept gradient buffers, the activations' count).
"""

from __future__ import annotations

from typing import Protocol

from hf_elixir.chunk._reduce_window import ReduceWindow
from hf_elixir.chunk.chunk import Chunk
from hf_elixir.chunk.memory import DeviceBudgetExceededError, DevicePool
from hf_elixir.chunk.states import TensorState

__all__ = ["Eviction", "EvictionHost"]


class EvictionHost(Protocol):
    """What :class:`Eviction` reads of the manager that owns it."""

    chunks: list[Chunk]
    pool: DevicePool
    reduces: ReduceWindow  # finishing an in-flight reduce frees its buffers
    prev_trace: list[int]  # the previous step's access order (``_steps.py``); empty before one exists
    kept_buffer_bytes: int  # gradient buffers kept for reuse (``_grad_buffers.py``)

    def _next_use(self, chunk: Chunk, after: int | None = None) -> float:
        """Position of ``chunk``'s next use in the previous step's order (``_steps.py``)."""

    def drop_kept_buffers(self, nbytes: int | None = None) -> None:
        """Free kept gradient buffers ([Note: buffer reuse] in ``_grad_buffers.py``)."""

    def _spill_a_grad(self, exclude: set[int]) -> bool:
        """Spill one partial gradient buffer to the host ([Note: gradient spill] in ``_grad_buffers.py``)."""

    def sync_activation_bytes(self) -> None:
        """Recount the activations charged to the pool (``_activations.py``)."""

    def describe(self) -> str:
        """What occupies the device, for error messages."""


class Eviction:
    """The manager's eviction policy: it ranks the chunks by the previous step's trace and frees the pool's bytes.

    Args:
        host: the manager (:class:`EvictionHost`).
    """

    def __init__(self, host: EvictionHost) -> None:
        self.host = host

    def victim(self, exclude: set[int], beyond: tuple[float, int] | None = None) -> Chunk | None:
        """The chunk to evict: Belady (farthest next use in the previous step's order, the least recently used
        of those never used again), else LRU.

        Args:
            exclude: chunk ids that must stay.
            beyond: only chunks Belady ranks above this ``(next use, -last access)`` key (the prefetch's
                ``_kept_until``).
        """
        candidates = [c for c in self.host.chunks if c.evictable and c.chunk_id not in exclude]
        if beyond is not None:
            candidates = [c for c in candidates if self.belady_key(c) > beyond]
        if not candidates:
            return None
        if self.host.prev_trace:
            return max(candidates, key=self.belady_key)
        return min(candidates, key=lambda c: c.last_access)

    def belady_key(self, chunk: Chunk, after: int | None = None) -> tuple[float, int]:
        """Belady's eviction rank of ``chunk`` (the largest goes first): its next use after ``after``
        (``_next_use``), ties (never used again) to the least recently used."""
        return self.host._next_use(chunk, after), -chunk.last_access

    def make_room(self, nbytes: int, what: str, exclude: set[int] | None = None) -> None:
        """Evict unpinned unsharded chunks until ``nbytes`` more fit the budget.

        Raises:
            DeviceBudgetExceededError: nothing left to evict and still no room.
        """
        host, pool = self.host, self.host.pool
        exclude = exclude or set()
        if pool.charges_activations and not pool.fits(nbytes):
            host.sync_activation_bytes()  # activations freed since the last count give their room back
        while not pool.fits(nbytes) and (host.kept_buffer_bytes or host.reduces):
            if host.kept_buffer_bytes:
                # kept for reuse only: the first to go ([Note: buffer reuse] in _grad_buffers.py)
                host.drop_kept_buffers(nbytes)
            else:
                host.reduces.finish_oldest()  # finishing an in-flight reduce frees (keeps) its gradient buffers
        while not pool.fits(nbytes):
            victim = self.victim(exclude)
            if victim is None and host._spill_a_grad(exclude):
                host.drop_kept_buffers(nbytes)  # the spilled buffer is kept for reuse until dropped here
                continue
            if victim is None:
                try:
                    pool.charge(nbytes, what)  # raises with the numbers
                except DeviceBudgetExceededError as err:
                    raise DeviceBudgetExceededError(f"{err}. Device holds: {host.describe()}") from None
            victim.reshard()

    def dead(self, chunk: Chunk) -> bool:
        """An evictable trainable chunk this step uses no more (the optimizer step makes its gathered copy
        stale, so evicting it now costs no all-gather)."""
        return chunk.evictable and chunk.trainable and self.host._next_use(chunk) == float("inf")

    def dead_victim(self) -> Chunk | None:
        """The least recently used :meth:`dead` chunk (Belady's first victim: none is used again)."""
        return min((c for c in self.host.chunks if self.dead(c)), key=lambda c: c.last_access, default=None)

    def reshard_dead(self, chunk: Chunk) -> bool:
        """[Note: dead chunks] In backward, a :meth:`dead` chunk (no later use in the previous step's order; the
        optimizer step makes its gathered copy stale) is resharded as soon as its last access is released,
        instead of holding its buffer until the next forward's make-room evicts it: what Belady would evict
        first, only earlier, so the device (and on CPU the process) does not carry stale copies through the
        end of backward and the step, where the tied embedding's gradients and the optimizer's work peak.
        Only for a chunk whole on one rank without a replica group: its refill is a local onload (no
        collective ranks could disagree on), and no gradient collective of it is in flight. With several
        ranks the room freed here would keep more reduces in flight ([Note: late reduce waits] in _reduce.py); not
        measured apart, so not there."""
        if chunk.world_size != 1 or chunk.replicate_group is not None or not self.host.prev_trace:
            return False
        if not self.dead(chunk):
            return False
        # a unit that released its pins without leaving COMPUTE (it leaves it at end_backward)
        return not any(slot.state is TensorState.COMPUTE for slot in chunk.slots)
