"""Optimal offline eviction (Belady's MIN) over a chunk access trace.

With the whole step's access order known from the profile, the eviction that makes the fewest
onloads is Belady's: on a miss with a full cache, evict the cached chunk whose next use is farthest
in the future (Belady 1966; Mattson et al. 1970 prove it optimal for single-item requests).

A module call may need several chunks at once (a *group*); the members of the group being served
are pinned (cannot be evicted to make room for each other). With singleton groups this is exactly
MIN; with larger groups it is MIN restricted to unpinned victims.

A *move* is one onload of a chunk into a cache block (the evictions are implied and cost nothing:
parameters are not modified between onloads, so the host copy is still valid).
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Sequence

__all__ = ["belady_moves", "belady_schedule", "brute_force_moves"]

_NEVER = float("inf")


def _normalise(groups: Iterable[Iterable[Hashable]]) -> list[list[Hashable]]:
    out = []
    for group in groups:
        seen: list[Hashable] = []
        for item in group:
            if item not in seen:
                seen.append(item)
        out.append(seen)
    return out


def belady_schedule(groups: Sequence[Iterable[Hashable]], capacity: int) -> list[list[Hashable]]:
    """Which items each request onloads under Belady's MIN with ``capacity`` cache blocks.

    Args:
        groups: the requests in order; each is the set of items (chunk ids) needed at once.
        capacity: cache blocks (int >= the largest group).

    Returns:
        per request, the items that missed (were onloaded), in request order.

    Raises:
        ValueError: ``capacity`` smaller than a request (the step could not run).
    """
    requests = _normalise(groups)
    largest = max((len(g) for g in requests), default=0)
    if capacity < largest:
        raise ValueError(f"capacity={capacity} cache blocks cannot serve a request for {largest} chunks at once")
    # next use of each item after each request, computed backwards
    next_after: list[dict[Hashable, float]] = [dict() for _ in requests]
    upcoming: dict[Hashable, float] = {}
    for index in range(len(requests) - 1, -1, -1):
        for item in requests[index]:
            next_after[index][item] = upcoming.get(item, _NEVER)
        for item in requests[index]:
            upcoming[item] = index
    cache: dict[Hashable, float] = {}  # item -> its next use (index of the request using it)
    heap: list[tuple[float, int, Hashable]] = []  # (-next use, tie, item), lazily invalidated
    tie = 0
    misses: list[list[Hashable]] = []
    for index, group in enumerate(requests):
        loaded: list[Hashable] = []
        for item in group:  # pin: members are needed now, the nearest possible use
            if item in cache:
                cache[item] = index
        for item in group:
            if item in cache:
                continue
            while len(cache) >= capacity:
                neg_use, _, victim = heapq.heappop(heap)
                if cache.get(victim) == -neg_use and -neg_use > index:
                    del cache[victim]
            cache[item] = index
            loaded.append(item)
        for item in group:
            cache[item] = next_after[index][item]
            tie += 1
            heapq.heappush(heap, (-cache[item], tie, item))
        misses.append(loaded)
    return misses


def belady_moves(trace: Sequence[Hashable], capacity: int) -> int:
    """Onloads Belady's MIN makes over ``trace`` (one item per request) with ``capacity`` blocks.

    Args:
        trace: item ids (e.g. chunk ids) in access order.
        capacity: cache blocks, >= 1 for a non-empty trace.

    Returns:
        number of misses (compulsory ones included).

    Raises:
        ValueError: ``capacity`` < 1 with a non-empty trace.
    """
    return sum(len(m) for m in belady_schedule([[item] for item in trace], capacity))


def brute_force_moves(groups: Sequence[Iterable[Hashable]], capacity: int) -> int:
    """The fewest onloads over *every* eviction choice (exponential; for tests on small traces).

    Explores all reachable cache states request by request and keeps the cheapest way to reach each.
    """
    requests = _normalise(groups)
    states: dict[frozenset, int] = {frozenset(): 0}
    for group in requests:
        pinned = set(group)
        new_states: dict[frozenset, int] = {}
        for state, cost in states.items():
            partial = [(state, cost)]
            for item in group:
                nxt = []
                for cache, c in partial:
                    if item in cache:
                        nxt.append((cache, c))
                    elif len(cache) < capacity:
                        nxt.append((cache | {item}, c + 1))
                    else:
                        for victim in cache:
                            if victim not in pinned:
                                nxt.append(((cache - {victim}) | {item}, c + 1))
                partial = nxt
            for cache, c in partial:
                if c < new_states.get(cache, 1 << 60):
                    new_states[cache] = c
        if not new_states:
            raise ValueError(f"capacity={capacity} cannot serve request {group}")
        states = new_states
    return min(states.values())
