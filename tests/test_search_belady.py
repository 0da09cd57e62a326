"""Belady/MIN onload counts against exhaustive search on small traces."""

import random

import pytest

from hf_elixir.search import belady_moves, belady_schedule, brute_force_moves


@pytest.mark.parametrize("seed", range(4))
def test_belady_equals_brute_force_on_single_item_traces(seed):
    rng = random.Random(seed)
    for _ in range(60):
        trace = [rng.randrange(rng.randint(1, 6)) for _ in range(rng.randint(1, 12))]
        capacity = rng.randint(1, 4)
        assert belady_moves(trace, capacity) == brute_force_moves([[x] for x in trace], capacity), (trace, capacity)


def test_belady_grouped_requests_never_beat_brute_force_and_match_it_here():
    rng = random.Random(7)
    for _ in range(150):
        groups = [rng.sample(range(5), rng.randint(1, 2)) for _ in range(rng.randint(1, 8))]
        capacity = rng.randint(2, 4)
        got = sum(len(m) for m in belady_schedule(groups, capacity))
        assert got == brute_force_moves(groups, capacity), (groups, capacity)


def test_belady_known_example_and_lru_is_worse():
    # classic: with 3 blocks MIN makes 7 misses on this trace where LRU makes 10
    trace = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]
    assert belady_moves(trace, 3) == 7
    assert belady_moves(trace, 4) == 6
    assert belady_moves(trace, 5) == 5  # only compulsory misses
    assert belady_moves([], 0) == 0


def test_belady_schedule_names_the_onloaded_items_and_rejects_small_caches():
    misses = belady_schedule([[0, 1], [2], [0, 1]], 2)
    assert misses == [[0, 1], [2], [0]] or misses == [[0, 1], [2], [1]]
    with pytest.raises(ValueError, match="capacity=1"):
        belady_schedule([[0, 1]], 1)
