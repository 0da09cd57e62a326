"""Host<->device traffic: the Belady/MIN lower bound and what all-offload designs move by construction.

``belady_moves`` is taken from ``hf_elixir.search`` when that module provides it; otherwise the small
private implementation below is used (same contract: ``(trace, capacity) -> number of onloads``).
Belady's MIN (Belady 1966) evicts, on a miss with a full cache, the cached item whose next use is
farthest in the future; for single-item requests no eviction policy makes fewer onloads.

All byte counts are per rank per training step.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Sequence

__all__ = ["belady_moves", "belady_misses", "belady_onload_bytes", "belady_source", "all_offload_bytes"]


def _private_belady_moves(trace: Sequence[Hashable], capacity: int) -> int:
    """Onloads Belady's MIN makes serving ``trace`` (one item per access) with ``capacity`` slots.

    Raises:
        ValueError: ``capacity`` < 1 with a non-empty trace.
    """
    return len(belady_misses(trace, capacity))


def belady_misses(trace: Sequence[Hashable], capacity: int) -> list[Hashable]:
    """The items Belady's MIN onloads (in order) serving ``trace`` with ``capacity`` slots.

    Raises:
        ValueError: ``capacity`` < 1 with a non-empty trace.
    """
    if trace and capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1 to serve a non-empty trace")
    never = len(trace) + 1
    next_use = [never] * len(trace)
    last_seen: dict[Hashable, int] = {}
    for index in range(len(trace) - 1, -1, -1):
        next_use[index] = last_seen.get(trace[index], never)
        last_seen[trace[index]] = index
    cached: dict[Hashable, int] = {}  # item -> index of its next use
    heap: list[tuple[int, int, Hashable]] = []  # (-next use, seq, item); stale entries skipped
    misses: list[Hashable] = []
    for index, item in enumerate(trace):
        if item not in cached:
            misses.append(item)
            while len(cached) >= capacity:
                neg_use, _, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg_use:
                    del cached[victim]
        cached[item] = next_use[index]
        heapq.heappush(heap, (-next_use[index], index, item))
    return misses


def _find_library_belady():
    import importlib

    for module in ("hf_elixir.search", "hf_elixir.search._belady"):
        try:
            found = getattr(importlib.import_module(module), "belady_moves", None)
        except ImportError:
            found = None
        if found is not None:
            return found, f"{module}.belady_moves"
    return None, ""


belady_moves, belady_source = _find_library_belady()  # prefer the library's once it is on main
if belady_moves is None:
    belady_moves = _private_belady_moves
    belady_source = "benchmarks/_traffic.py (private; hf_elixir.search.belady_moves was not on main)"


def all_offload_bytes(peer: str, num_params: int, world_size: int, bytes_per_elem: int = 4) -> dict[str, int]:
    """Host<->device bytes per rank per step that an offloading design moves by construction.

    - ZeRO-3-style parameter offload (``fsdp2_offload``, ``ds_zero3_offload``): each rank onloads its
      parameter shard for forward and again for backward (``2 * P / world``) and offloads its gradient
      shard (``P / world``); the all-gather / reduce-scatter happen on the device.
    - ZeRO-2 with optimizer offload (``ds_zero2_offload``): gradients offloaded (``P / world``) and the
      updated parameter shard onloaded (``P / world``); parameters stay on the device.
    - anything else: nothing by construction (0).

    Args:
        peer: a ``benchmarks.peers.PEERS`` key. num_params: parameters (tied ones once).
        world_size: ranks. bytes_per_elem: 4 for fp32.

    Returns:
        ``{"h2d_bytes": int, "d2h_bytes": int}``.
    """
    shard = num_params * bytes_per_elem // world_size
    if peer in ("fsdp2_offload", "ds_zero3_offload"):
        return {"h2d_bytes": 2 * shard, "d2h_bytes": shard}
    if peer == "ds_zero2_offload":
        return {"h2d_bytes": shard, "d2h_bytes": shard}
    return {"h2d_bytes": 0, "d2h_bytes": 0}


def belady_onload_bytes(trace: Sequence[int], capacity: int, bytes_of: dict[int, int],
                        refill_bytes_of: dict[int, int] | None = None) -> tuple[int, int]:
    """Host->device bytes Belady's MIN needs for the streamed chunks of ``trace``.

    Args:
        trace: chunk ids in access order (every access, repeats included).
        capacity: cache blocks (gathered chunks the device can hold at once besides what stays put).
        bytes_of: chunk id -> bytes one onload moves (its shard); chunks not in it never move.
        refill_bytes_of: if given, chunk id -> bytes of every onload after the chunk's first one in the
            trace (a policy that refills from a host copy of the gathered chunk instead of re-gathering).

    Returns:
        ``(bytes, onloads)``; ``onloads`` is checked against ``belady_moves`` (the library's when it is
        available), which must agree.
    """
    streamed = [c for c in trace if c in bytes_of]
    if not streamed:
        return 0, 0
    misses = belady_misses(streamed, capacity)
    moves = belady_moves(streamed, capacity)
    assert moves == len(misses), f"Belady implementations disagree: {moves} vs {len(misses)} onloads"
    seen: set[int] = set()
    total = 0
    for chunk in misses:
        total += refill_bytes_of[chunk] if refill_bytes_of is not None and chunk in seen else bytes_of[chunk]
        seen.add(chunk)
    return total, len(misses)
