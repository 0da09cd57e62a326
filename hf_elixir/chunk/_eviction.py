"""Eviction: which unsharded chunk leaves the device when a charge needs room.

[Note: Belady eviction] The victim is the chunk whose next use in the access order recorded in the previous
step is furthest away (Belady/MIN over the warm-up trace, PatrickStar arXiv 2108.05818 section 5); least
recently used before a trace exists.

:meth:`EvictionMixin.make_room` frees, in this order: gradient buffers kept for reuse ([Note: buffer reuse] in
``_grad_buffers.py``), the buffers of in-flight gradient collectives (by finishing them, ``_reduce.py``), chunks
(Belady's victims), and last a partial gradient buffer spilled to the host ([Note: gradient spill] in
``_grad_buffers.py``). In backward a chunk the step uses no more is resharded as soon as it is released ([Note:
dead chunks]).
"""

from __future__ import annotations

from hf_elixir.chunk.chunk import Chunk
from hf_elixir.chunk.memory import DeviceBudgetExceededError
from hf_elixir.chunk.states import TensorState

__all__ = ["EvictionMixin"]


class EvictionMixin:
    """:class:`~hf_elixir.chunk.manager.ChunkManager`'s eviction policy (a mixin: it ranks the manager's chunks by
    the trace of ``_steps.py`` and frees the pool's bytes)."""

    def _victim(self, exclude: set[int], beyond: tuple[float, int] | None = None) -> Chunk | None:
        """The chunk to evict: Belady (farthest next use in the previous step's order, the least recently used
        of those never used again), else LRU.

        Args:
            exclude: chunk ids that must stay.
            beyond: only chunks Belady ranks above this ``(next use, -last access)`` key (:meth:`_kept_until`).
        """
        candidates = [c for c in self.chunks if c.evictable and c.chunk_id not in exclude]
        if beyond is not None:
            candidates = [c for c in candidates if self._belady_key(c) > beyond]
        if not candidates:
            return None
        if self.prev_trace:
            return max(candidates, key=self._belady_key)
        return min(candidates, key=lambda c: c.last_access)

    def _belady_key(self, chunk: Chunk, after: int | None = None) -> tuple[float, int]:
        """Belady's eviction rank of ``chunk`` (the largest goes first): its next use after ``after``
        (:meth:`_next_use`), ties (never used again) to the least recently used."""
        return self._next_use(chunk, after), -chunk.last_access

    def make_room(self, nbytes: int, what: str, exclude: set[int] | None = None) -> None:
        """Evict unpinned unsharded chunks until ``nbytes`` more fit the budget.

        Raises:
            DeviceBudgetExceededError: nothing left to evict and still no room.
        """
        exclude = exclude or set()
        if self.pool.charges_activations and not self.pool.fits(nbytes):
            self.sync_activation_bytes()  # activations freed since the last count give their room back
        while not self.pool.fits(nbytes) and (self.kept_buffer_bytes or self.reduces):
            if self.kept_buffer_bytes:
                # kept for reuse only: the first to go ([Note: buffer reuse] in _grad_buffers.py)
                self.drop_kept_buffers(nbytes)
            else:
                self.reduces.finish_oldest()  # finishing an in-flight reduce frees (keeps) its gradient buffers
        while not self.pool.fits(nbytes):
            victim = self._victim(exclude)
            if victim is None and self._spill_a_grad(exclude):
                self.drop_kept_buffers(nbytes)  # the spilled buffer is kept for reuse until dropped here
                continue
            if victim is None:
                try:
                    self.pool.charge(nbytes, what)  # raises with the numbers
                except DeviceBudgetExceededError as err:
                    raise DeviceBudgetExceededError(f"{err}. Device holds: {self.describe()}") from None
            victim.reshard()

    def _dead(self, chunk: Chunk) -> bool:
        """An evictable trainable chunk this step uses no more (the optimizer step makes its gathered copy
        stale, so evicting it now costs no all-gather)."""
        return chunk.evictable and chunk.trainable and self._next_use(chunk) == float("inf")

    def _dead_victim(self) -> Chunk | None:
        """The least recently used :meth:`_dead` chunk (Belady's first victim: none is used again)."""
        return min((c for c in self.chunks if self._dead(c)), key=lambda c: c.last_access, default=None)

    def _reshard_dead(self, chunk: Chunk) -> bool:
        """[Note: dead chunks] In backward, a :meth:`_dead` chunk (no later use in the previous step's order; the
        optimizer step makes its gathered copy stale) is resharded as soon as its last access is released,
        instead of holding its buffer until the next forward's make-room evicts it: what Belady would evict
        first, only earlier, so the device (and on CPU the process) does not carry stale copies through the
        end of backward and the step, where the tied embedding's gradients and the optimizer's work peak.
        Only for a chunk whole on one rank without a replica group: its refill is a local onload (no
        collective ranks could disagree on), and no gradient collective of it is in flight. With several
        ranks the room freed here would keep more reduces in flight ([Note: late reduce waits] in _reduce.py); not
        measured apart, so not there."""
        if chunk.world_size != 1 or chunk.replicate_group is not None or not self.prev_trace:
            return False
        if not self._dead(chunk):
            return False
        # a unit that released its pins without leaving COMPUTE (it leaves it at end_backward)
        return not any(slot.state is TensorState.COMPUTE for slot in chunk.slots)
