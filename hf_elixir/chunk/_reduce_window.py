"""The in-flight gradient collectives of backward and the window that bounds them ([Note: reduce window], [Note:
late reduce waits] and [Note: in-place reduces] in ``_reduce.py``).

:class:`ReduceWindow` is an object the manager owns (``ChunkManager.reduces``), as FSDP2's ``FSDPParamGroup`` owns
its reduce-scatter state: the backward's sequencing (``_reduce.py``) issues into it, eviction finishes the oldest
for room (``_eviction.py``), the has-gradient flags' all-reduce rides in it (``_rank_checks.py``), and every reader
of gradient shards drains it. Finishing never issues a collective, so the order of collectives is the order of
:meth:`ReduceWindow.issue`, the same on every rank.
"""

from __future__ import annotations

import time
from typing import Callable

from hf_elixir.chunk.memory import MemoryCounters

__all__ = ["FLAGS_IN_FLIGHT", "ReduceWindow"]

# ``ReduceWindow.in_flight`` id of the has-gradient flags' all-reduce ([Note: late reduce waits] in _reduce.py)
FLAGS_IN_FLIGHT = -1


class ReduceWindow:
    """Collectives issued and not yet finished, in issue order, each with the callable that finishes it.

    Args:
        counters: the manager's counters (``reduce_wait_s`` takes the seconds a finish blocks).
        async_op: whether gradient collectives are issued asynchronously and finished later (off CUDA; on CUDA
            they run on the reduce stream and finish at once).

    Attributes:
        max_pending: the window during backward where some chunk can leave the device or the host lane steps in
            backward (2, [Note: reduce window]).
        host_steps_in_backward: set by the optimizer when its host lane steps chunks during backward.
    """

    def __init__(self, counters: MemoryCounters, async_op: bool) -> None:
        self.counters = counters
        self.async_op = async_op
        self.max_pending = 2
        self.host_steps_in_backward = False
        self._pending: list[tuple[int, Callable[[], None]]] = []  # (chunk id, finishes its collective)
        # ids in ``_pending`` whose collective holds no buffer ([Note: in-place reduces] in _reduce.py)
        self._bufferless: set[int] = set()

    def __bool__(self) -> bool:
        """Whether a collective is in flight."""
        return bool(self._pending)

    def limit(self, chunks) -> int | None:
        """How many gradient collectives stay in flight during backward; ``None``: as many as the budget holds
        (every chunk stays on the device and no host lane steps in backward, [Note: reduce window])."""
        if not self.host_steps_in_backward and all(c.resident or c.full_alias for c in chunks):
            return None
        return self.max_pending

    def issue(self, chunk_id: int, finish: Callable[[], None], *, timed: bool, in_place: bool = False) -> None:
        """Add a collective just issued for ``chunk_id`` (:data:`FLAGS_IN_FLIGHT` for the flags); ``timed``:
        its finish adds the seconds it blocks to ``reduce_wait_s``; ``in_place``: it holds no buffer."""
        self._pending.append((chunk_id, self._timed(finish) if timed else finish))
        if in_place:
            self._bufferless.add(chunk_id)

    def shrink_to(self, window: int | None) -> None:
        """Finish the oldest until at most ``window`` collectives that hold a buffer stay in flight (``None``: no
        limit)."""
        while window is not None and len(self._pending) - len(self._bufferless) > window:
            self.finish_oldest()

    def finish_oldest(self) -> None:
        """Finish the collective issued first."""
        cid, finish = self._pending.pop(0)
        self._bufferless.discard(cid)  # a chunk has at most one in-place reduce per backward, issued first
        finish()

    def finish_through(self, chunk_id: int) -> None:
        """Finish in issue order up to and including ``chunk_id``'s collective (none if it is not in flight)."""
        while any(cid == chunk_id for cid, _ in self._pending):
            self.finish_oldest()

    def drain(self) -> None:
        """Finish every collective in flight."""
        while self._pending:
            self.finish_oldest()

    def in_flight(self) -> set[int]:
        """Ids of the collectives still to be finished."""
        return {cid for cid, _ in self._pending}

    def _timed(self, finish: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            started = time.perf_counter()
            finish()
            self.counters.reduce_wait_s += time.perf_counter() - started
        return timed
