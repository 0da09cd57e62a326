"""Runs of quiet events in a chunked step: what lets the replay (``_replay.py``) take many events at once.

[Note: quiet spans] Most events of a large model's step touch only chunks already on the device: DeepSeek-V3 at
61 chunks has about 2,500 events a step and about 90 fills and 60 reduces, and the search replays the step over a
thousand times. An event is *quiet* when nothing in it can change the pool, the gradients or the streams other than
the compute's, whatever the knobs (:func:`quiet_events`): no activations copied out or back, no gradient buffer
arriving and no reduce after it, no chunk left in COMPUTE, no chunk the runtime could reshard as dead after it
([Note: dead chunks] in ``hf_elixir/chunk/_eviction.py``), and not an event whose phase differs from the one before
it (the first backward event waits for every refresh upload; so a span is all forward or all backward). A quiet
event whose chunks are all on the device and whose refresh uploads are done by the span's start changes only:

* the compute clock: ``start = t_compute``, ``t_compute = start + event_compute_s[k] + hook_event_s`` (``ready`` is
  ``t_compute`` itself when each upload of its chunks is done by then, and ``t_compute`` only grows);
* ``starts[k]`` (read by later prefetches);
* per chunk, its last access (``recency``: the manager's clock, one tick per chunk of an event in id order), its
  next use and its place in it (``last_seen`` / ``place``, read only where room is made or a gather is judged);
* in backward, the early refresh uploads queued ([Note: early refresh pricing] in ``_cost.py``): event ``j``
  uploads the queued chunks used no more after ``j - 1`` that the host lane finished by the clock after ``j``.

So the replay takes a span of such events at once (:func:`take_span`): the clock with the same additions in the
same order (``itertools.accumulate`` over ``[compute, hook, compute, hook, ...]``: the same floats), each chunk's
state only at its last access in the span, and each early upload at the first event of the span where it is due
(a bisection over the span's clock, which never goes back while no compute time is negative; else event by
event). The span stops before the first event that needs a fill or whose chunk's upload is not done by the span's
start; that event is replayed whole. The result is the event-by-event replay's exactly (tests/test_search_speed.py
compares the two replays' whole state on every point a search prices).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate

from hf_elixir.search._chunked_step import _INF, ChunkedStep

__all__ = ["Span", "clock_increments", "ordered_groups", "quiet_events", "span_at", "span_updates",
           "take_span"]


@dataclass(frozen=True)
class Span:
    """The quiet events from ``start`` to ``end`` (exclusive) and, per chunk they use, its first event in them."""

    start: int
    end: int
    first: tuple[tuple[int, int], ...]  # (chunk, first event of the span that uses it)


def quiet_events(step: ChunkedStep) -> list[bool]:
    """Per event, whether it is quiet ([Note: quiet spans]); memoised on the step (a ``ChunkedStep`` is not changed
    once built)."""
    memo = step.__dict__.get("_quiet_events")
    if memo is None:
        memo = step.__dict__["_quiet_events"] = _quiet_events(step)
    return memo


def _quiet_events(step: ChunkedStep) -> list[bool]:
    next_use = step.next_places[0]
    phase = step.event_phase
    turns = {k for k in range(1, len(phase)) if phase[k] != phase[k - 1]}  # the first backward event among them
    busy = (set(step.offload_before) | set(step.offload_after) | set(step.arrive_at) | set(step.reduce_at)
            | set(step.compute_held) | turns)
    out = []
    for k, group in enumerate(step.groups):
        dead = (step.event_phase[k] == "bwd" and not step.replicated and k not in step.no_dead_release
                and any(step.trained_numels[c] and next_use[k][c] == _INF and step.group_size(c) == 1
                        for c in group))
        out.append(k not in busy and not dead)
    return out


def span_at(step: ChunkedStep, k: int) -> Span:
    """The span of quiet events that starts at event ``k`` (a quiet one) and runs to the next event that is not."""
    memo = step.__dict__.setdefault("_quiet_spans", {})
    span = memo.get(k)
    if span is None:
        quiet, end = quiet_events(step), k
        first: dict[int, int] = {}
        while end < len(quiet) and quiet[end]:
            for c in step.groups[end]:
                first.setdefault(c, end)
            end += 1
        span = memo[k] = Span(k, end, tuple(first.items()))
    return span


def clock_increments(step: ChunkedStep, hook_event_s: float) -> tuple[list[float], bool]:
    """What each event adds to the compute clock in a span, in the order event() adds it: ``[compute_0, hook,
    compute_1, hook, ...]``, and whether none is negative (then the clock never goes back, and a span's clock is
    searched by bisection); memoised on the step per hook cost."""
    memo = step.__dict__.setdefault("_quiet_increments", {})
    out = memo.get(hook_event_s)
    if out is None:
        increments = [x for compute_s in step.event_compute_s for x in (compute_s, hook_event_s)]
        out = memo[hook_event_s] = (increments, all(x >= 0.0 for x in increments))
    return out


def ordered_groups(step: ChunkedStep) -> list[list[int]]:
    """Each event's chunks by id (memoised on the step)."""
    return _ticks_and_uses(step)[2]


def span_updates(step: ChunkedStep, span: Span, stop: int) -> tuple[int, list[tuple[int, int, float, tuple]]]:
    """Events ``span.start`` to ``stop`` (exclusive, within the span) taken at once: (the manager's clock ticks they
    take, and per chunk they use ``(chunk, ticks before its last access, its next use, its place in that use)``);
    memoised on the step."""
    memo = step.__dict__.setdefault("_quiet_updates", {})
    out = memo.get((span.start, stop))
    if out is None:
        out = memo[(span.start, stop)] = _span_updates(step, span, stop)
    return out


def _span_updates(step: ChunkedStep, span: Span, stop: int) -> tuple[int, list[tuple[int, int, float, tuple]]]:
    ticks, uses, ordered = _ticks_and_uses(step)
    next_use, next_place, _ = step.next_places
    base = ticks[span.start]
    out = []
    for c, first in span.first:
        if first < stop:
            events = uses[c]
            j = events[bisect_left(events, stop) - 1]  # its last event before ``stop``
            tick = ticks[j] - base + bisect_right(ordered[j], c) - 1  # its tick in the event: chunks by id
            out.append((c, tick, next_use[j][c], next_place[j][c]))
    return ticks[stop] - base, out


def _ticks_and_uses(step: ChunkedStep) -> tuple[list[int], dict[int, list[int]], list[list[int]]]:
    """The manager's clock ticks before each event (one per chunk of an event, in id order: :meth:`StepReplay.event`),
    each chunk's events in order, and each event's chunks by id; memoised on the step."""
    memo = step.__dict__.get("_quiet_ticks")
    if memo is None:
        ticks, uses, ordered = [0], {}, []
        for j, group in enumerate(step.groups):
            ticks.append(ticks[-1] + len(group))
            ordered.append(sorted(group))
            for c in dict.fromkeys(group):
                uses.setdefault(c, []).append(j)
        memo = step.__dict__["_quiet_ticks"] = (ticks, uses, ordered)
    return memo


# -- taking a span (the replay's state: ``_replay.py``'s StepReplay) ----------------------------------------------

def take_span(replay, k: int) -> int:
    """Take the quiet events from ``k`` on up to the first that needs a fill or waits for a refresh upload
    ([Note: quiet spans]); returns the event to go on from (``k``: none taken). The cache does not change in the
    span and is never above ``cache_peak`` between events (only a fill grows it, and event() raises
    ``cache_peak`` right after its fills), so ``cache_peak`` stays as it is."""
    step, cached, on_device, refresh = replay.step, replay.cached, replay.on_device, replay.refresh_done
    span = span_at(step, k)
    t = replay.t_compute
    stop = span.end
    for c, first in span.first:
        if first < stop and ((c not in on_device and c not in cached) or (refresh and refresh.get(c, 0.0) > t)):
            stop = first
    if stop == k:
        return k
    increments, monotone = clock_increments(step, replay.hardware.hook_event_s)
    if monotone:  # the clock after each event, summed in C: t, t + compute, (t + compute) + hook, ...
        clock = list(accumulate(increments[2 * k:2 * stop], initial=t))
        replay.starts += clock[0:-1:2]
        t = clock[-1]
        if replay.early_queue and step.event_phase[k] == "bwd":  # a span is all forward or all backward
            _span_uploads(replay, k, clock[2::2])
    else:  # a negative compute time somewhere: the clock is not monotone, event by event
        t = _span_by_event(replay, k, stop, t)
    replay.t_compute = t
    ticks, updates = span_updates(step, span, stop)
    last_seen, place, recency, clock = replay.last_seen, replay.place, replay.recency, replay.clock
    for c, tick, next_use, next_place in updates:
        last_seen[c] = next_use
        place[c] = next_place
        recency[c] = clock + tick
    replay.clock = clock + ticks
    replay.serving = (stop - 1, replay.event_at[stop])
    return stop


def _span_uploads(replay, k: int, after: list[float]) -> None:
    """The early uploads of a backward span from event ``k`` (``after[i]``: the compute clock after event ``k + i``,
    non-decreasing). Event ``j`` uploads a queued chunk (``StepReplay._early_uploads``) when the chunk is used no
    more after ``j - 1`` and the lane stepped it at or before the clock after ``j``: each chunk's first such event is
    a search over ``after``; ``_early_uploads`` runs at each of them in order (at the others it uploads nothing),
    with the clock there."""
    last = replay.step.last_access
    due = set()
    for c, done in replay.early_queue.items():
        at = bisect_left(after, done, max(0, last[c] + 1 - k))
        if at < len(after):
            due.add(at)
    for at in sorted(due):
        replay.t_compute = after[at]
        replay._early_uploads(k + at)


def _span_by_event(replay, k: int, stop: int, t: float) -> float:
    """:func:`take_span`'s clock one event at a time (and the early uploads, as event() prices them)."""
    compute_s, phase, hook = replay.step.event_compute_s, replay.step.event_phase, replay.hardware.hook_event_s
    for j in range(k, stop):
        replay.starts.append(t)
        t = t + compute_s[j] + hook  # as event(): start + compute + hook, in that order
        if replay.early_queue and phase[j] == "bwd":
            replay.t_compute = t
            replay._early_uploads(j)
    return t
