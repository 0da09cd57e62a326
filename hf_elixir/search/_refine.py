"""Local refinement of searched plans: deterministic hill climbing over single moves, priced by the cost model.

[Note: local refinement] The main search (``_plan_search.py``) walks a coarse grid: prefixes of the
chunks ranked by use for the resident set, a greedy fill (:func:`~hf_elixir.search._grid._fill`, seconds
saved per byte as estimated *before* pricing) for device shards and device optimizer states, and "the first
``k`` blocks" for the activation policy. Its estimate of what a byte buys ignores overlap, so it can spend the
spare bytes on the wrong set: on OPT-30B over 2 x H200 it put 7 chunks' optimizer states on the device where
the brute-force grid (every prefix of every set) finds it faster to hold every chunk's shard and 6 chunks'
optimizer states (4.17 s against 3.96 s predicted).

:func:`refine` starts from the best few distinct candidates of the search and, from each, repeats: price every
*move* below from the current point with :func:`~hf_elixir.search._cost.predict` and go to the fastest one
that fits (device budget and host memory, the same checks as the search), if it is faster than the current
point; stop when no move improves (a local optimum) or when ``max_priced`` configurations have been priced
(all starts together). The moves, for the chunk sets ``resident``, ``device_shard`` and ``device_optim``
(invariant kept: a chunk's optimizer state is on the device only where its shard is; with one rank
``resident`` and ``device_shard`` are one set, the held chunks; a replicated step holds every chunk, so only
``device_optim`` moves):

* **toggle**: add one chunk to a set or remove one (removing a held chunk also removes its device optimizer
  state; adding a device optimizer state to a chunk not held also holds its shard, as the fill does);
* **transfer**: remove one chunk from a set, then add chunks to a set (the same or another) in the search's
  order (most used first) while the fixed bytes plus working set stay within what they were: trading the
  bytes of one set for another at a constant budget. A single toggle cannot do that when the budget is full
  (the add does not fit, the removal alone is slower); it is what took the OPT-30B case above to the grid's
  plan;
* **prefetch** depth ``+1`` / ``-1`` within the depths the search prices; **host copies** on / off (several
  ranks);
* **activation policy** of one block (only where the search chose the policy): for each pair of kinds
  ``from -> to`` among ``keep`` / ``recompute`` / ``offload``, the first and the last block in forward order
  that has ``from`` (the blocks of a transformer are alike; the ends are where a "first ``k`` blocks" policy
  grows or shrinks), alone and followed by the transfer's refill of each set with the bytes the policy frees
  or takes (the slack below the limit kept as it was).

Each improvement lowers the predicted step by more than a rounding error (relative ``TIE``), so the climb ends;
the order of moves and the tie-break (step seconds within ``TIE``, then device peak bytes, then move order: a
policy move that keeps the moved blocks first in forward order comes first) are fixed, so the result is
deterministic.
Points already priced (in any climb) are remembered and not priced again; ``max_priced`` counts only real
calls to :func:`predict` (points ruled out by the fixed bytes alone are not priced, as in the search).
Every accepted point passed the search's own fit checks, and the search keeps its starting candidates, so
refinement never returns a slower or an over-budget plan.

Source: local search after a coarse grid, as in Elixir (arXiv 2212.05339) section 5's search refining the
profiled cost model's best configuration; hill climbing (steepest ascent) over neighbourhood moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from hf_elixir.profiler import HardwareProfile
from hf_elixir.search._cost import ChunkedStep, Knobs, Prediction, _uploaded_chunks, fixed_memory, predict
from hf_elixir.search._disk_cost import DiskTier, spill

__all__ = ["RefineContext", "StepBudget", "fits", "refine"]

POLICY_KINDS = ("keep", "recompute", "offload")
TIE = 1e-9  # step times this close (relative) are equal: the earlier move, or the lower device peak, wins


@dataclass(frozen=True)
class StepBudget:
    """A chunked step and the device bytes it may use: ``pool_bytes`` the pool given to :func:`predict`,
    ``work_limit_bytes`` what the fixed parts plus the working set may take (the margin-reduced budget less the
    activations when they count)."""

    step: ChunkedStep
    pool_bytes: int
    work_limit_bytes: int


@dataclass
class RefineContext:
    """What :func:`refine` needs from the search (one search call).

    ``step_for(data_parallel, chunk_size_numel, policy)`` returns the :class:`StepBudget` of that step (cached
    by the caller; ``policy`` is a block -> kind mapping, or ``None`` for the step the search built without
    blocks). ``host_limit_bytes`` / ``ranks_per_host``: a point whose host bytes times the ranks per host exceed
    the host limit is rejected, as in the search. ``policy_searched``: the activation policy is the search's
    choice (``False``: the caller fixed it, so no policy moves).
    """

    hardware: HardwareProfile
    step_for: Callable[[str, int, dict[str, str] | None], StepBudget]
    activations_on_device: bool
    prefetch_depths: tuple[int, ...]
    policy_searched: bool
    host_budget_bytes: int | None = None  # per rank: bounds the host lane's snapshots (predict's argument)
    host_limit_bytes: int | None = None  # per machine
    ranks_per_host: int = 1
    overlap_host_optimizer: bool | None = None
    disk: DiskTier | None = None  # holds what the host does not ([Note: disk tier pricing] in _disk_cost.py)
    # (data_parallel, chunk size, policy key, knobs) -> prediction or None; shared by every climb
    memo: dict[tuple, Prediction | None] = field(default_factory=dict)
    priced: int = 0
    working_sets: dict = field(default_factory=dict)  # floor_bytes' cache (steps live as long as step_for's)


def fits(step: ChunkedStep, knobs: Knobs, pred: Prediction, pool_bytes: int, limit_bytes: int,
         cache: dict | None = None) -> bool:
    """The search's device check: the simulated model-data peak within the pool, and the fixed parts plus
    the working set within ``limit_bytes``."""
    return pred.device_model_bytes <= pool_bytes and floor_bytes(step, knobs, cache) <= limit_bytes


def floor_bytes(step: ChunkedStep, knobs: Knobs, cache: dict | None = None) -> int:
    """Fixed device bytes of ``knobs`` plus the working set the step needs beside them (``cache``: working
    sets by (step, held chunks), for the many calls of one refinement)."""
    fixed, _, _ = fixed_memory(step, knobs)
    held = _held(step, knobs)
    if cache is None:
        return fixed + step.working_set_bytes(held)
    key = (id(step), held)
    if key not in cache:
        cache[key] = step.working_set_bytes(held)
    return fixed + cache[key]


def _held(step: ChunkedStep, knobs: Knobs) -> frozenset[int]:
    """Chunks that need no fill (one rank: resident or device shard; several: resident, and the device shards of
    chunks whole on their rank, :meth:`ChunkedStep.never_filled`)."""
    return step.never_filled(knobs)


def _policy_key(policy: dict[str, str] | None) -> tuple | None:
    return None if policy is None else tuple(sorted(policy.items()))


def _order(step: ChunkedStep) -> list[int]:
    """The search's chunk order: most used first, first chunk id on ties."""
    return sorted(range(step.num_chunks), key=lambda c: (-step.accesses[c], c))


# -- moves: each is a function of (step, knobs) returning new knobs (or None where it does not apply) ------------

_SETS = ("resident", "device_shard", "device_optim")


def _sets_for(step: ChunkedStep) -> tuple[str, ...]:
    if step.replicated:
        return ("device_optim",)
    return ("resident", "device_optim") if step.world_size == 1 else _SETS


def _normal(step: ChunkedStep, knobs: Knobs) -> Knobs:
    """Keep the invariants: one rank holds resident and device-shard chunks alike (one set); a chunk's device
    optimizer state needs its shard on the device; ``cache_blocks`` is derived (reset)."""
    resident, shard = knobs.resident, knobs.device_shard
    if step.world_size == 1 and not step.replicated:
        resident = shard = resident | shard
    held = resident | shard
    optim = frozenset(c for c in knobs.device_optim if c in held and step.trained_numels[c])
    return Knobs(resident=resident, device_shard=shard, device_optim=optim, prefetch_depth=knobs.prefetch_depth,
                 host_copies=knobs.host_copies)


def _remove(step: ChunkedStep, knobs: Knobs, which: str, c: int) -> Knobs | None:
    members = getattr(knobs, which)
    if c not in members:
        return None
    if which == "resident" and step.world_size == 1:  # one rank: the held set
        return _normal(step, replace(knobs, resident=knobs.resident - {c}, device_shard=knobs.device_shard - {c}))
    return _normal(step, replace(knobs, **{which: members - {c}}))


def _add(step: ChunkedStep, knobs: Knobs, which: str, c: int) -> Knobs | None:
    members = getattr(knobs, which)
    if c in members:
        return None
    if which == "device_optim":
        if not step.trained_numels[c]:
            return None
        held = knobs.resident | knobs.device_shard
        shard = knobs.device_shard if c in held else knobs.device_shard | {c}  # the fill's "shard+optim"
        return _normal(step, replace(knobs, device_shard=shard, device_optim=knobs.device_optim | {c}))
    if which == "device_shard" and c in knobs.resident:
        return None  # a resident chunk already holds its shard
    return _normal(step, replace(knobs, **{which: members | {c}}))


def _refill(step: ChunkedStep, knobs: Knobs, which: str, room_bytes: int, order: list[int], cache: dict,
            skip: int | None = None) -> Knobs:
    """Add chunks to ``which`` in ``order`` (not ``skip``) while the fixed bytes plus working set stay within
    ``room_bytes`` (up to the first that does not fit)."""
    for c in order:
        if c == skip:
            continue
        more = _add(step, knobs, which, c)
        if more is None:
            continue
        if floor_bytes(step, more, cache) > room_bytes:
            break
        knobs = more
    return knobs


def _chunk_moves(step: ChunkedStep, knobs: Knobs, cache: dict) -> list[Knobs]:
    """Toggles and transfers of single chunks, in a fixed order."""
    order = _order(step)
    sets = _sets_for(step)
    room = floor_bytes(step, knobs, cache)
    out: list[Knobs] = []
    for which in sets:
        for c in order:
            for move in (_add(step, knobs, which, c), _remove(step, knobs, which, c)):
                if move is not None:
                    out.append(move)
    for which in sets:
        for c in order:
            less = _remove(step, knobs, which, c)
            if less is None:
                continue
            for into in sets:
                out.append(_refill(step, less, into, room, order, cache, skip=c if into == which else None))
    return out


def _knob_moves(step: ChunkedStep, knobs: Knobs, depths: tuple[int, ...]) -> list[Knobs]:
    """Prefetch depth one up / one down within ``depths``; host copies on / off with several ranks; the refresh
    cast on the other side where there is something to cast ([Note: refresh cast] in ``optim/_refresh.py``)."""
    out = []
    if not step.replicated and depths:
        for depth in (knobs.prefetch_depth + 1, knobs.prefetch_depth - 1):
            if min(depths) <= depth <= max(depths):
                out.append(replace(knobs, prefetch_depth=depth))
        if step.world_size > 1:
            out.append(replace(knobs, host_copies=not knobs.host_copies))
    if step.precision != "fp32" and _uploaded_chunks(step, knobs):
        out.append(replace(knobs, refresh_cast="device" if knobs.refresh_cast == "host" else "host"))
    return out


def _policy_moves(policy: dict[str, str]) -> list[dict[str, str]]:
    """One block's kind changed: for each ``from -> to``, the first and the last block (forward order, the
    mapping's order) of kind ``from``; the one that keeps the moved blocks first in forward order (the search's
    shape) comes first, so that it wins ties."""
    blocks = list(policy)
    out: list[dict[str, str]] = []
    for old in POLICY_KINDS:
        having = [b for b in blocks if policy[b] == old]
        for new in POLICY_KINDS:
            if new == old or not having:
                continue
            ends = (having[0], having[-1]) if old == "keep" else (having[-1], having[0])
            for b in dict.fromkeys(ends):
                out.append({**policy, b: new})
    return out


# -- the climb --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Point:
    data_parallel: str
    chunk_size_numel: int
    policy: dict[str, str] | None
    knobs: Knobs
    prediction: Prediction

    def better_than(self, other: _Point) -> bool:
        """Faster by more than a rounding error (relative ``TIE``), or as fast with a lower device peak."""
        mine, theirs = self.prediction.step_s, other.prediction.step_s
        if abs(mine - theirs) > TIE * max(mine, theirs):
            return mine < theirs
        return self.prediction.device_peak_bytes < other.prediction.device_peak_bytes


def _price(ctx: RefineContext, mode: str, size: int, policy: dict[str, str] | None, knobs: Knobs,
           budget: StepBudget, max_priced: int) -> Prediction | None:
    """The prediction of a fitting point (memoised), else ``None`` (does not fit, or the budget is spent)."""
    key = (mode, size, _policy_key(policy), knobs)
    if key in ctx.memo:
        return ctx.memo[key]
    step = budget.step
    if floor_bytes(step, knobs, ctx.working_sets) > budget.work_limit_bytes:
        ctx.memo[key] = None  # ruled out by the fixed bytes alone: not priced
        return None
    if ctx.priced >= max_priced:
        return None  # not remembered: a later climb with budget left may price it
    pred = predict(step, knobs, ctx.hardware, pool_bytes=budget.pool_bytes,
                   activations_on_device=ctx.activations_on_device, host_budget_bytes=ctx.host_budget_bytes,
                   overlap_host_optimizer=ctx.overlap_host_optimizer)
    ctx.priced += 1
    ok = pred is not None and fits(step, knobs, pred, budget.pool_bytes, budget.work_limit_bytes, ctx.working_sets)
    if ok and ctx.host_limit_bytes is not None:  # the host, then the disk ([Note: disk tier pricing])
        pred = (spill(step, knobs, pred, ctx.disk, ctx.host_limit_bytes, ctx.ranks_per_host,
                      ctx.activations_on_device, ctx.host_budget_bytes) if ctx.disk is not None
                else pred if pred.host_bytes * ctx.ranks_per_host <= ctx.host_limit_bytes else None)
        ok = pred is not None
    ctx.memo[key] = pred if ok else None
    return ctx.memo[key]


def _neighbours(ctx: RefineContext, point: _Point) -> list[tuple[dict[str, str] | None, Knobs]]:
    """Every move from ``point``, in a fixed order: (policy, knobs)."""
    here = ctx.step_for(point.data_parallel, point.chunk_size_numel, point.policy)
    knobs = point.knobs
    moves = _chunk_moves(here.step, knobs, ctx.working_sets) + _knob_moves(here.step, knobs, ctx.prefetch_depths)
    out = [(point.policy, k) for k in moves]
    if ctx.policy_searched and point.policy:
        slack = here.work_limit_bytes - floor_bytes(here.step, knobs, ctx.working_sets)
        for policy in _policy_moves(point.policy):
            there = ctx.step_for(point.data_parallel, point.chunk_size_numel, policy)
            room = there.work_limit_bytes - slack
            order = _order(there.step)
            moved = _normal(there.step, knobs)
            out.append((policy, moved))
            for into in _sets_for(there.step):
                out.append((policy, _refill(there.step, moved, into, room, order, ctx.working_sets)))
    return out


def _climb(ctx: RefineContext, start: _Point, max_priced: int) -> _Point:
    current = start
    while ctx.priced < max_priced:
        best: _Point | None = None
        for policy, knobs in _neighbours(ctx, current):
            budget = ctx.step_for(current.data_parallel, current.chunk_size_numel, policy)
            pred = _price(ctx, current.data_parallel, current.chunk_size_numel, policy, knobs, budget, max_priced)
            if pred is None:
                continue
            cand = _Point(current.data_parallel, current.chunk_size_numel, policy, knobs, pred)
            if best is None or cand.better_than(best):
                best = cand
        if best is None or best.prediction.step_s >= current.prediction.step_s * (1 - TIE):
            break
        current = best
    return current


def refine(starts: list[tuple[str, int, dict[str, str] | None, Knobs, Prediction]], ctx: RefineContext, *,
           max_priced: int) -> list[tuple[str, int, dict[str, str] | None, Knobs, Prediction]]:
    """Hill-climb from each start (see [Note: local refinement]); returns each climb's end point that is faster
    than its start, as ``(data_parallel, chunk_size_numel, policy, knobs, prediction)`` with ``knobs.cache_blocks``
    set from the prediction.

    Args:
        starts: the points to climb from, best first, as the same tuples (``knobs.cache_blocks`` ignored).
        ctx: the search's context; ``ctx.priced`` counts the configurations priced (add it to the search's count).
        max_priced: stop pricing after this many configurations, all climbs together (``0``: no refinement).
    """
    out = []
    for mode, size, policy, knobs, pred in starts:
        step = ctx.step_for(mode, size, policy).step
        start = _Point(mode, size, policy, _normal(step, knobs), pred)
        ctx.memo.setdefault((mode, size, _policy_key(policy), start.knobs), pred)
        end = _climb(ctx, start, max_priced)
        if end.prediction.step_s < pred.step_s:
            out.append((end.data_parallel, end.chunk_size_numel, end.policy,
                        replace(end.knobs, cache_blocks=end.prediction.cache_blocks), end.prediction))
    return out
