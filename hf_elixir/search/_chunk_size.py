"""Chunk-size search: little padding, few chunk moves.

Candidates are a finite grid between the largest parameter (a parameter never spans two chunks) and
an upper bound, so the search always terminates (the reference implementation's open-ended sweep can
loop forever). Each candidate is packed with :func:`hf_elixir.chunk.pack_chunks` (the same packing the
chunk manager uses); its padding waste is measured, and, for a given device cache size, the number of
chunk onloads an optimal offline eviction (:func:`belady_schedule`) makes over the profiled access order.

Source: Elixir (arXiv 2212.05339) section 5.1 (chunk-size search minimising waste); PatrickStar (arXiv
2108.05818) section 4.1 (chunk packing in first-use order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from hf_elixir.chunk import ChunkLayout, pack_chunks, round_up
from hf_elixir.chunk.packing import replicated_chunk_size
from hf_elixir.search._belady import belady_schedule

__all__ = ["ChunkSizeCandidate", "ChunkSizeResult", "candidate_grid", "chunk_groups", "chunk_size_for",
           "default_chunk_size", "search_chunk_size"]


@dataclass(frozen=True)
class ChunkSizeCandidate:
    """One chunk size and how it scored.

    Attributes:
        chunk_size_numel: elements per chunk.
        num_chunks: chunks the packing makes.
        waste_fraction: padding elements / all chunk elements (0..1).
        moves: chunk onloads Belady's MIN makes with the given cache (``None``: no cache size given;
            ``-1``: the cache cannot hold one module's chunks).
        moved_bytes: ``moves * chunk bytes`` (``None`` / ``-1`` likewise).
    """

    chunk_size_numel: int
    num_chunks: int
    waste_fraction: float
    moves: int | None = None
    moved_bytes: int | None = None


@dataclass
class ChunkSizeResult:
    """The chosen chunk size, the candidates in ranking order (best first) and why."""

    chunk_size_numel: int
    candidates: list[ChunkSizeCandidate] = field(default_factory=list)
    reason: str = ""
    lo: int = 0
    hi: int = 0
    cache_bytes: int | None = None

    def describe(self, chunk_size_numel: int) -> str:
        """One line on ``chunk_size_numel`` (this search's choice or another of its candidates, e.g. the
        one a plan search picked by predicted step time); ``reason`` is this line for the choice."""
        ranked = [c.chunk_size_numel for c in self.candidates]
        if chunk_size_numel not in ranked:
            return f"chunk_size_numel={chunk_size_numel} (not among the chunk-size search's candidates)"
        c = self.candidates[ranked.index(chunk_size_numel)]
        least_waste = min(x.waste_fraction for x in self.candidates)
        line = (f"chunk_size_numel={c.chunk_size_numel}: {c.num_chunks} chunks, {100 * c.waste_fraction:.1f}% "
                f"padding (least of {len(self.candidates)} candidates in [{self.lo}, {self.hi}]: "
                f"{100 * least_waste:.1f}%)")
        if c.moves is not None and c.moves >= 0 and self.cache_bytes is not None:
            line += f", {c.moves} Belady onloads with a {self.cache_bytes / 2**20:.0f} MiB cache"
        if chunk_size_numel != self.chunk_size_numel:
            line += (f"; ranked {ranked.index(chunk_size_numel) + 1} of {len(ranked)} by padding and traffic, "
                     f"the fastest predicted step")
        return line


def chunk_groups(layout: ChunkLayout, param_trace: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Map a parameter trace (per access, the parameter indices used) to a chunk trace (per access,
    the chunk ids needed at once, in first-needed order; accesses with no parameters are dropped)."""
    chunk_of: dict[int, int] = {}
    for chunk_id, members in enumerate(layout.members):
        for index in members:
            chunk_of[index] = chunk_id
    groups = []
    for params in param_trace:
        chunks: list[int] = []
        for index in params:
            chunk_id = chunk_of[index]
            if chunk_id not in chunks:
                chunks.append(chunk_id)
        if chunks:
            groups.append(tuple(chunks))
    return groups


def _candidate_sizes(lo: int, hi: int, num_candidates: int, step: int) -> list[int]:
    hi = max(hi, lo)
    sizes = {lo}
    if num_candidates > 1 and hi > lo:
        for i in range(num_candidates):
            sizes.add(min(hi, max(lo, round_up(lo + (hi - lo) * i // (num_candidates - 1), step))))
    sizes.add(hi)
    return sorted(sizes)


def candidate_grid(numels: Sequence[int], upper_bound_numel: int | None = None, num_candidates: int = 32,
                   step_numel: int = 1024) -> list[int]:
    """The chunk sizes :func:`search_chunk_size` scores for parameters of ``numels`` (its arguments' defaults):
    from the largest parameter to ``upper_bound_numel`` (default ``min(total, max(4 * largest, 2**20))``)."""
    lo = max(int(n) for n in numels)
    hi = upper_bound_numel if upper_bound_numel is not None else min(sum(numels), max(4 * lo, 2**20))
    return _candidate_sizes(lo, max(lo, int(hi)), num_candidates, max(1, step_numel))


def search_chunk_size(numels: Sequence[int], param_trace: Sequence[Sequence[int]] = (), *,
                      world_size: int = 1, element_bytes: int = 2, cache_bytes: int | None = None,
                      upper_bound_numel: int | None = None, num_candidates: int = 32, step_numel: int = 1024,
                      waste_tolerance: float = 0.05, memo: dict | None = None) -> ChunkSizeResult:
    """Pick a chunk size for parameters of ``numels`` (in packing order).

    Args:
        numels: element counts in packing order (tied parameters once).
        param_trace: per access, indices into ``numels`` (the profiled order); empty: waste only.
        world_size: ranks a chunk is sharded over.
        element_bytes: bytes per element of the compute dtype (to turn ``cache_bytes`` into blocks).
        cache_bytes: device bytes for cache blocks; ``None``: rank by waste only.
        upper_bound_numel: largest candidate; default ``min(total, max(4 * largest, 2**20))``.
        num_candidates: grid points between the bounds (the grid is finite: the search terminates).
        step_numel: candidates are rounded up to a multiple of this.
        waste_tolerance: candidates whose waste is within this (absolute fraction) of the least waste
            compete on moved bytes; the rest are ranked after them.
        memo: a dict shared by calls with the same ``numels`` and ``param_trace`` (the configuration search calls
            this for several cache sizes): each size's packing and chunk trace, and its onloads per cache capacity,
            are computed once.

    Returns:
        :class:`ChunkSizeResult`.

    Raises:
        ValueError: no parameters, or ``num_candidates`` < 1.
    """
    numels = [int(n) for n in numels]
    if not numels or sum(numels) == 0:
        raise ValueError("search_chunk_size needs at least one non-empty parameter")
    if num_candidates < 1:
        raise ValueError(f"num_candidates={num_candidates} must be >= 1")
    grid = candidate_grid(numels, upper_bound_numel, num_candidates, step_numel)
    lo, hi = grid[0], grid[-1]
    candidates: list[ChunkSizeCandidate] = []
    memo = {} if memo is None else memo
    for size in grid:
        if ("layout", size, world_size) not in memo:
            layout = pack_chunks(numels, size, world_size)
            groups = chunk_groups(layout, param_trace) if param_trace else []
            memo[("layout", size, world_size)] = (layout, groups, len({c for g in groups for c in g}))
        layout, groups, distinct = memo[("layout", size, world_size)]
        waste = layout.padding_numel / max(1, sum(layout.chunk_numels))
        moves = moved = None
        if cache_bytes is not None and param_trace:
            capacity = cache_bytes // max(1, round_up(size, world_size) * element_bytes)
            if capacity >= max(len(g) for g in groups):
                moves = memo.get(("moves", size, world_size, min(capacity, distinct)))
                if moves is None:  # a cache that holds every chunk never evicts: one onload each
                    moves = distinct if capacity >= distinct else sum(len(m) for m in belady_schedule(groups, capacity))
                    memo[("moves", size, world_size, min(capacity, distinct))] = moves
                moved = moves * round_up(size, world_size) * element_bytes
            else:
                moves = moved = -1
        candidates.append(ChunkSizeCandidate(size, layout.num_chunks, waste, moves, moved))
    least_waste = min(c.waste_fraction for c in candidates)

    def key(c: ChunkSizeCandidate) -> tuple:
        within = c.waste_fraction <= least_waste + waste_tolerance
        infeasible = c.moved_bytes is not None and c.moved_bytes < 0
        moved = c.moved_bytes if c.moved_bytes is not None and c.moved_bytes >= 0 else 0
        return (infeasible, not within, moved, c.waste_fraction, c.chunk_size_numel)

    candidates.sort(key=key)
    best = candidates[0]
    result = ChunkSizeResult(best.chunk_size_numel, candidates, lo=lo, hi=hi, cache_bytes=cache_bytes)
    result.reason = result.describe(best.chunk_size_numel)
    return result


def default_chunk_size(numels: Sequence[int], budget_bytes: int | None, world_size: int, element_bytes: int) -> int:
    """Chunk size ``prepare`` uses when neither the config nor a plan gives one.

    Without a budget, few large chunks (an eighth of the model, at least the largest parameter): fewer
    collectives. Under a budget the working set (two units' chunks) must fit, so the smallest size with
    near-least padding between the largest parameter and twice it (:func:`search_chunk_size`'s waste
    ranking); a default that grew with the model would stop fitting a fixed budget as the model grows.

    Args:
        numels: element counts of the parameters in packing order.
        budget_bytes: the device budget (bytes), or ``None`` for none.
        world_size: ranks a chunk is sharded over.
        element_bytes: bytes per element of the compute dtype.

    Returns:
        elements per chunk (int).
    """
    numels = list(numels) or [1]
    largest, total = max(max(numels), 1), sum(numels)
    if budget_bytes is None:
        return max(largest, -(-total // 8))
    upper = min(max(total, largest), max(2 * largest, 2**16))
    result = search_chunk_size(numels, world_size=world_size, element_bytes=element_bytes, upper_bound_numel=upper)
    least = min(c.waste_fraction for c in result.candidates)
    return min(c.chunk_size_numel for c in result.candidates if c.waste_fraction <= least + 0.05)


def chunk_size_for(config, plan, numels: list[int], placements: dict[str, str],
                   world_size: int, element_bytes: int, budget_bytes: int | None) -> int:
    """The config's chunk size, else the plan's, else the replicated one, else the default."""
    chunk_size = config.chunk_size_numel or (plan.chunk_size_numel if plan and plan.chunk_size_numel else None)
    if not chunk_size and world_size > 1 and placements and all(v == "replicated" for v in placements.values()):
        chunk_size = replicated_chunk_size(numels, element_bytes)
    return chunk_size or default_chunk_size(numels, budget_bytes, world_size, element_bytes)
