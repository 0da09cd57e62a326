"""One description of a step's chunk schedule, shared by the runtime and the cost model.

[Note: one step description] The runtime (the chunk manager and its :class:`~hf_elixir.chunk._prefetch.
PrefetchScheduler`) and the cost model (``hf_elixir/search/_cost.py``'s ``predict``) both work from a
:class:`StepOrder`: the chunk ids of one step in access order (a unit's chunks by id, as the hooks access them), with
the positions where each forward (micro-batch) and backward ended. The runtime's is the previous step's recorded trace
(``ChunkManager.prev_order``), the model's is built from the profiled events (:meth:`StepOrder.from_events`); in a
steady step of a model whose units run in the profiled order they are the same list. Both ask it the same questions:

* :meth:`StepOrder.next_use`: Belady's victim choice ([Note: Belady eviction] in ``_eviction.py``);
* :meth:`StepOrder.window`: the chunks a prefetch issued at a position fetches ahead (the next ``prefetch_depth``
  distinct chunks not pinned now, FSDP2's prefetch), and :meth:`StepOrder.window_end`, where all-gathers ahead
  must stop (the end of the phase running, [Note: gather prefetch] in ``_prefetch.py``);
* :meth:`StepOrder.issue_position`: where the runtime's scheduler first sees a chunk in its window, i.e. where a
  fill ahead is issued.

What one step does to its chunks is a list of :class:`StepEvent` (fill, evict, reduce; each with the phase and the
position in the step's order it serves). The runtime records the events it executes into an :class:`EventRecorder`
(``ChunkManager.recorder``: ``None`` by default, and then nothing is recorded: one ``is None`` test per event), the
cost model emits the events it prices into one (``predict(..., recorder=...)``), and a test compares the two lists
exactly (``tests/test_step_description.py``): a change to what the runtime does to its chunks that the model does
not follow fails there, not only in a benchmark. What the model still prices apart from the runtime's order: a fill
issued ahead is priced at its use (its seconds on the stream it runs on, [Note: overlap] in ``search/_cost.py``),
while the scheduler issues it where :meth:`StepOrder.window` first holds it (the same fills and evictions, earlier;
the test checks those places); and at several ranks a backward all-gather issued ahead may evict a chunk the step
uses no more that the model leaves cached (no fill follows from it).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

__all__ = ["EventRecorder", "StepEvent", "StepOrder", "EVENT_KINDS"]

_INF = float("inf")

#: the kinds of :class:`StepEvent`: a chunk made current on the device (onload or all-gather, in its hook or ahead of
#: it), a current gathered copy freed (an eviction, or a chunk resharded after its last use), a chunk's gradient
#: reduce issued (reduce-scatter, all-reduce, or the local add on one rank)
EVENT_KINDS = ("fill", "evict", "reduce")


class StepEvent(NamedTuple):
    """One thing a step does to one chunk.

    Attributes:
        phase: ``"fwd"`` or ``"bwd"``.
        kind: one of :data:`EVENT_KINDS`.
        chunk: the chunk id.
        at: the position in the step's order (:class:`StepOrder`) the event serves: a fill or eviction the
            position of the access it makes room for (a fill ahead: of its chunk's use), a reduce the number of
            accesses made before it was issued.
    """

    phase: str
    kind: str
    chunk: int
    at: int


@dataclass
class EventRecorder:
    """Collects :class:`StepEvent` in the order they happen (the runtime's ``ChunkManager.recorder``, the cost
    model's ``predict(recorder=...)``). ``clear`` at a step's start to keep one step."""

    events: list[StepEvent] = field(default_factory=list)

    def record(self, phase: str, kind: str, chunk: int, at: int) -> None:
        assert kind in EVENT_KINDS, kind
        self.events.append(StepEvent(phase, kind, chunk, at))

    def clear(self) -> None:
        self.events = []


@dataclass(frozen=True)
class StepOrder:
    """The chunk ids a step accesses, in order, with the phase ends ([Note: one step description]).

    Attributes:
        trace: chunk ids in access order.
        forward_ends: positions where each forward (micro-batch) ended (the first position after it).
        backward_ends: the same for each backward.
    """

    trace: tuple[int, ...] = ()
    forward_ends: tuple[int, ...] = ()
    backward_ends: tuple[int, ...] = ()
    positions: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.positions:
            for i, cid in enumerate(self.trace):
                self.positions.setdefault(cid, []).append(i)

    @classmethod
    def from_events(cls, groups: Sequence[Iterable[int]], phases: Sequence[str]) -> StepOrder:
        """The order of a profiled step: per event (a unit's access), its chunks by id; a phase ends where the next
        event is of the other phase or the step ends."""
        trace: list[int] = []
        ends: dict[str, list[int]] = {"fwd": [], "bwd": []}
        for k, group in enumerate(groups):
            trace.extend(sorted(set(group)))
            if k + 1 == len(groups) or phases[k + 1] != phases[k]:
                ends[phases[k]].append(len(trace))
        return cls(tuple(trace), tuple(ends["fwd"]), tuple(ends["bwd"]))

    def __len__(self) -> int:
        return len(self.trace)

    def next_use(self, chunk: int, after: int) -> float:
        """The first position after ``after`` that uses ``chunk``; ``inf`` if none."""
        positions = self.positions.get(chunk)
        if not positions:
            return _INF
        i = bisect.bisect_right(positions, after)
        return positions[i] if i < len(positions) else _INF

    def window(self, pos: int, pinned: Iterable[int], depth: int) -> list[tuple[int, int]]:
        """The prefetch window at ``pos`` (the number of accesses made so far): ``(position, chunk id)`` of the next
        ``depth`` distinct chunks from ``pos`` on that are not in ``pinned``, looking at most ``8 * depth``
        positions ahead."""
        seen = set(pinned)
        upcoming: list[tuple[int, int]] = []
        if depth <= 0:
            return upcoming
        for index in range(pos, min(len(self.trace), pos + 8 * depth)):
            cid = self.trace[index]
            if cid not in seen:
                seen.add(cid)
                upcoming.append((index, cid))
            if len(upcoming) == depth:
                break
        return upcoming

    def window_end(self, pos: int, backward: bool) -> int:
        """The end of the phase running at ``pos`` (forward, or backward when ``backward``): all-gathers ahead stop
        there; ``pos`` itself when the step had no such phase (its order says nothing about it)."""
        ends = self.backward_ends if backward else self.forward_ends
        if not ends:
            return pos
        i = bisect.bisect_right(ends, pos)
        return ends[i] if i < len(ends) else len(self.trace)

    def issue_position(self, index: int, depth: int, pinned_at: Sequence[Iterable[int]] = ()) -> int:
        """The first position ``pos <= index`` whose prefetch window (:meth:`window`, with ``pinned_at[pos]`` pinned
        where given) holds position ``index``: where the scheduler first asks to fill that chunk ahead; ``index``
        when none does."""
        for pos in range(max(0, index - 8 * depth), index):
            pinned = pinned_at[pos] if pos < len(pinned_at) else ()
            if any(i == index for i, _ in self.window(pos, pinned, depth)):
                return pos
        return index
