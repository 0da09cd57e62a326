"""Candidate generation for the configuration search (``_plan_search.py``): the grid of points priced at one
chunk size and activation policy, the greedy fill of the spare device bytes, the replicated variant, the order
of the priced candidates, the local refinement's starts ([Note: local refinement] in ``_refine.py``), and the
exhaustive grid that checks the search on small models.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from hf_elixir.plan import ElixirPlan, policy_summary
from hf_elixir.profiler import HardwareProfile, StepProfile
from hf_elixir.search._cost import (DTYPE_BYTES, ChunkedStep, Knobs, Prediction, _uploaded_chunks,
                                    build_chunked_step, fixed_memory, host_copies_forced, optim_bytes_per_numel,
                                    predict, refresh_staging_bytes)
from hf_elixir.search._memory_cost import resolve_host_copies
from hf_elixir.search._refine import RefineContext, floor_bytes, refine
from hf_elixir.search._refine import _refill as _refill_knobs
from hf_elixir.search._refine import fits as _fits

__all__ = ["Candidate", "SearchResult", "brute_force_grid"]


@dataclass
class Candidate:
    """One priced configuration."""

    chunk_size_numel: int
    activation_checkpointing: bool
    knobs: Knobs
    prediction: Prediction
    data_parallel: str = "sharded"  # "sharded" (ZeRO-3 chunks) or "replicated" (whole chunks, all-reduce)
    num_chunks: int = 0
    activation_policy: dict[str, str] = field(default_factory=dict)  # block -> keep / recompute / offload
    # MoE experts spread over this many ranks ([Note: expert parallel pricing] in _expert_parallel.py)
    expert_parallel_size: int = 1
    # the split modules' weights over this many ranks ([Note: tensor parallel pricing] in _tensor_parallel.py)
    tensor_parallel_size: int = 1
    # chunks whole on their rank although the step has several (expert chunks at ep = world size): no host copy
    whole_chunks: frozenset[int] = frozenset()

    def summary(self) -> str:
        k = self.knobs
        ep = f" ep={self.expert_parallel_size}" if self.expert_parallel_size > 1 else ""
        ep += f" tp={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        return (f"{self.data_parallel}{ep} chunk={self.chunk_size_numel} resident={len(k.resident)} "
                f"cache_blocks={k.cache_blocks} "
                f"device_shards={len(k.device_shard)} device_optim={len(k.device_optim)} "
                f"prefetch={k.prefetch_depth} host_copies={k.host_copies} refresh_cast={k.refresh_cast} "
                f"act={policy_summary(self.activation_policy)}: "
                f"{self.prediction.step_s:.4g} s, {self.prediction.device_peak_bytes / 2**30:.3g} GiB")


@dataclass
class SearchResult:
    """The chosen plan, the runners-up (best first, distinct knob settings) and the search's own cost."""

    plan: ElixirPlan
    best: Candidate
    alternatives: list[Candidate] = field(default_factory=list)
    evaluated: int = 0
    search_s: float = 0.0
    profile: StepProfile | None = None
    best_by_mode: dict[str, Candidate] = field(default_factory=dict)  # fastest "sharded" / "replicated"
    # search_expert_parallel: per expert-parallel degree tried, its fastest candidate, or why none fits
    best_by_expert_parallel: dict[int, Candidate | str] = field(default_factory=dict)
    # search_tensor_parallel: the same per tensor-parallel degree
    best_by_tensor_parallel: dict[int, Candidate | str] = field(default_factory=dict)
    # search_parallel: per (tensor, expert) parallel pair tried together, its fastest candidate, or why none fits
    best_by_tensor_expert_parallel: dict[tuple[int, int], Candidate | str] = field(default_factory=dict)


def _whole_chunks(step: ChunkedStep) -> frozenset[int]:
    """Chunks whole on their rank in a step of several ranks (``Candidate.whole_chunks``)."""
    if step.world_size == 1:
        return frozenset()
    return frozenset(c for c in range(step.num_chunks) if step.group_size(c) == 1)


def _spread(lo: int, hi: int, count: int) -> list[int]:
    """At most ``count`` integers from ``lo`` to ``hi`` inclusive, denser near ``lo`` (log spacing)."""
    if hi <= lo:
        return [lo]
    if hi - lo + 1 <= count:
        return list(range(lo, hi + 1))
    values = {lo, hi}
    for i in range(1, count - 1):
        values.add(lo + int(round((hi - lo + 1) ** (i / (count - 1)))) - 1)
    return sorted(v for v in values if lo <= v <= hi)


def _fill(step: ChunkedStep, knobs: Knobs, spare: int, hardware: HardwareProfile, order: list[int],
          misses_per_chunk: dict[int, int]) -> Knobs:
    """Spend ``spare`` device bytes on device shards / device optimizer states, best seconds-per-byte first."""
    ws = step.world_size
    b = DTYPE_BYTES[step.precision]
    h2d = hardware.h2d_bytes_per_s or 1e10
    d2h = hardware.d2h_bytes_per_s or 1e10
    host_rate = hardware.host_adam_numel_per_s or 1e9
    dev_rate = hardware.device_adam_numel_per_s or 1e9
    items: list[tuple[float, int, str, int]] = []  # (-gain per byte, chunk, kind, bytes)
    for c in order:
        shard = step.shard_numel(c)
        held = c in knobs.resident or c in knobs.device_shard
        if step.trained_numels[c]:
            gain = shard / host_rate - shard / dev_rate + shard * 4 / d2h + shard * b / h2d
            cost = shard * optim_bytes_per_numel(step.precision, False, step.optim_states)
            if not held and ws > 1:  # needs the shard on the device too
                gain += misses_per_chunk.get(c, 0) * shard * b / h2d
                cost += shard * b
                kind = "shard+optim"
            elif not held:
                continue
            else:
                kind = "optim"
            items.append((-gain / cost, c, kind, cost))
        if not held and ws > 1 and misses_per_chunk.get(c, 0):
            cost = shard * b
            gain = misses_per_chunk[c] * shard * b / h2d
            items.append((-gain / cost, c, "shard", cost))
    items.sort()
    shard_set, optim_set = set(knobs.device_shard), set(knobs.device_optim)
    for _, c, kind, cost in items:
        if kind == "shard" and c in shard_set:
            continue
        if kind == "shard+optim" and c in shard_set:
            cost -= step.shard_numel(c) * b
        if "optim" in kind and c in optim_set:
            continue
        if cost <= spare:
            spare -= cost
            if "shard" in kind:
                shard_set.add(c)
            if "optim" in kind:
                optim_set.add(c)
    return Knobs(resident=knobs.resident, device_shard=frozenset(shard_set), device_optim=frozenset(optim_set),
                 cache_blocks=knobs.cache_blocks, prefetch_depth=knobs.prefetch_depth)


_FILL_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _cast_variants(step: ChunkedStep, knobs: Knobs) -> tuple[Knobs, ...]:
    """``knobs`` with the refresh cast on the host and, where there is something to cast (bf16/fp16, some chunk
    uploaded from a host master), on the device ([Note: refresh cast] in ``optim/_refresh.py``)."""
    if step.precision == "fp32" or not _uploaded_chunks(step, knobs):
        return (knobs,)
    return knobs, replace(knobs, refresh_cast="device")


def _prefix_points(step: ChunkedStep, start: Knobs, limit_bytes: int, order: list[int]) -> list[Knobs]:
    """Several ranks: the grid's shape of point beside the fill's, device shards a prefix of ``order`` (a few
    lengths) and then as many device optimizer states as fit, with the refresh cast on each side where there is
    something to cast. The fill spends bytes by gain per byte against the probe's misses, and where the probe
    caches nearly everything it offers few shard-only items, so it never reaches "every shard on the device,
    little cache" (OPT-30B on two H200s: the fill's best 4.06 s against 3.70 s for such a point)."""
    cache: dict = {}
    out = []
    free = [c for c in order if c not in start.resident]
    casts = ("host", "device") if step.precision != "fp32" else ("host",)
    for count in _spread(0, len(free), 4):
        shards = replace(start, device_shard=start.device_shard | frozenset(free[:count]))
        for cast in casts:
            knobs = replace(shards, refresh_cast=cast)
            if floor_bytes(step, knobs, cache) > limit_bytes:
                continue
            knobs = _refill_knobs(step, knobs, "device_optim", limit_bytes, order, cache)
            if cast == "host" or _uploaded_chunks(step, knobs):
                out.append(knobs)
    return out


def _search_one(step: ChunkedStep, hardware: HardwareProfile, pool_bytes: int, limit_bytes: int,
                activations_on_device: bool, grid_points: int, prefetch_depths: Iterable[int],
                host_budget_bytes: int | None = None, overlap_host_optimizer: bool | None = None,
                fill_fractions: tuple[float, ...] | None = None) -> tuple[list[Candidate], int]:
    """Grid over resident chunks x the share of the spare bytes spent on device optimizer states and
    shards (the rest is cache; ``fill_fractions``, default five shares from none to all) x prefetch depth; keep
    points whose fixed parts plus working set fit ``limit_bytes`` and whose simulated peak fits ``pool_bytes``."""
    fill_fractions = fill_fractions or _FILL_FRACTIONS
    order = sorted(range(step.num_chunks), key=lambda c: (-step.accesses[c], c))
    found: list[Candidate] = []
    evaluated = 0
    seen: set[Knobs] = set()
    for num_resident in _spread(0, step.num_chunks, grid_points):
        resident = frozenset(order[:num_resident])
        base = Knobs(resident=resident, device_shard=resident if step.world_size == 1 else frozenset())
        fixed, _, _ = fixed_memory(step, base)
        floor = fixed + step.working_set_bytes(step.never_filled(base))
        if floor > limit_bytes:
            break
        for depth in prefetch_depths:
            probe = predict(step, Knobs(resident=resident, device_shard=base.device_shard, prefetch_depth=depth),
                            hardware, pool_bytes=pool_bytes, activations_on_device=activations_on_device)
            evaluated += 1  # the probe is priced too (its onloads guide the fill)
            if probe is None:
                continue
            for fraction in fill_fractions:
                start = Knobs(resident=resident, device_shard=base.device_shard, prefetch_depth=depth)
                spare = int((limit_bytes - floor) * fraction)
                knobs = _fill(step, start, spare, hardware, order, probe.chunk_onloads)
                variants = list(_cast_variants(step, knobs))
                if len(variants) > 1:
                    # the device cast's staging buffer takes room the fill gave away: fill again without it
                    # ([Note: refresh cast]), else a full fill never fits the device cast
                    staging = refresh_staging_bytes(step, variants[1])
                    roomy = _fill(step, start, max(0, spare - staging), hardware, order, probe.chunk_onloads)
                    if _uploaded_chunks(step, roomy):
                        variants.append(replace(roomy, refresh_cast="device"))
                if fraction == fill_fractions[-1] and step.world_size > 1:
                    variants += _prefix_points(step, start, limit_bytes, order)
                for point in variants:
                    if point in seen:
                        continue
                    seen.add(point)
                    # with several ranks, each point with and without rank-local host copies (host RAM for
                    # all-gather traffic; the host limit filters the copies out where they do not fit)
                    # (with a pool that charges activations the runtime keeps them anyway: host_copies_forced)
                    priced = (point, replace(point, host_copies=True)) if step.world_size > 1 else (point,)
                    if host_copies_forced(step, activations_on_device):  # where they fit the host, else none
                        priced = (resolve_host_copies(step, point, activations_on_device, host_budget_bytes),)
                    for variant in priced:
                        pred = predict(step, variant, hardware, pool_bytes=pool_bytes,
                                       activations_on_device=activations_on_device,
                                       host_budget_bytes=host_budget_bytes,
                                       overlap_host_optimizer=overlap_host_optimizer)
                        evaluated += 1
                        if pred is not None and _fits(step, variant, pred, pool_bytes, limit_bytes):
                            found.append(Candidate(step.chunk_size_numel, step.activation_checkpointing,
                                                   replace(variant, cache_blocks=pred.cache_blocks), pred,
                                                   num_chunks=step.num_chunks,
                                                   activation_policy=dict(step.activation_policy),
                                                   expert_parallel_size=step.expert_parallel_size,
                                                   tensor_parallel_size=step.tensor_parallel_size,
                                                   whole_chunks=_whole_chunks(step)))
    return found, evaluated


def _search_replicated(step: ChunkedStep, hardware: HardwareProfile, pool_bytes: int, limit_bytes: int,
                       activations_on_device: bool, host_budget_bytes: int | None = None,
                       overlap_host_optimizer: bool | None = None) -> tuple[list[Candidate], int]:
    """Replicated data parallelism: every chunk resident (nothing to cache or prefetch); the spare bytes
    go to device optimizer states in a few shares (the rest stays on the host)."""
    everything = frozenset(range(step.num_chunks))
    base = Knobs(resident=everything, device_shard=everything)
    fixed, _, _ = fixed_memory(step, base)
    floor = fixed + step.working_set_bytes(everything)
    if floor > limit_bytes:
        return [], 0
    order = sorted(range(step.num_chunks), key=lambda c: (-step.accesses[c], c))
    found: list[Candidate] = []
    seen: set[Knobs] = set()
    evaluated = 0
    for fraction in _FILL_FRACTIONS:
        knobs = _fill(step, base, int((limit_bytes - floor) * fraction), hardware, order, {})
        if knobs in seen:
            continue
        seen.add(knobs)
        for variant in _cast_variants(step, knobs):
            pred = predict(step, variant, hardware, pool_bytes=pool_bytes, activations_on_device=activations_on_device,
                           host_budget_bytes=host_budget_bytes, overlap_host_optimizer=overlap_host_optimizer)
            evaluated += 1
            if pred is not None and _fits(step, variant, pred, pool_bytes, limit_bytes):
                found.append(Candidate(step.chunk_size_numel, step.activation_checkpointing,
                                       replace(variant, cache_blocks=pred.cache_blocks), pred, "replicated",
                                       activation_policy=dict(step.activation_policy)))
    return found, evaluated


def _memory_not_binding(step: ChunkedStep, cand: Candidate) -> bool:
    """Every chunk resident with its optimizer state on the device: more memory buys nothing."""
    trained = {c for c in range(step.num_chunks) if step.trained_numels[c]}
    return len(cand.knobs.resident) == step.num_chunks and trained <= cand.knobs.device_optim


def _ranking(profile: StepProfile) -> Callable[[Candidate], tuple]:
    """The order of candidates, best first: predicted step seconds, then the device peak. A forward-only step
    breaks a tie in step seconds by fewer bytes in the cache first: a forward leaves cached chunks valid, so in
    the steady state of repeated forwards a chunk kept cached costs no more than a resident one ([Note:
    forward-only pricing] in ``_cost.py``), but only a resident one is kept through the first forward,
    activations and a forward of another shape."""
    if not profile.forward_only:
        return lambda c: (c.prediction.step_s, c.prediction.device_peak_bytes)
    return lambda c: (c.prediction.step_s, c.prediction.breakdown.get("cache", 0), c.prediction.device_peak_bytes)


def _policy_key(policy: dict[str, str] | None) -> tuple | None:
    """A hashable key of a block policy (``None`` / empty: the step built without blocks)."""
    return tuple(sorted(policy.items())) if policy else None


def _refined(found: list[Candidate], ctx: RefineContext, starts: int, max_priced: int) -> list[Candidate]:
    """[Note: local refinement] in ``_refine.py``: hill-climb from the best ``starts`` distinct candidates of
    ``found`` (sorted, best first; distinct up to prefetch depth, rank-local host copies and where the refresh
    casts, which the climb moves, and cache blocks, which it derives) and return the faster points it reaches as
    candidates."""
    chosen: list[Candidate] = []
    seen: set[tuple] = set()
    for cand in found:
        key = (cand.data_parallel, cand.chunk_size_numel, _policy_key(cand.activation_policy),
               replace(cand.knobs, prefetch_depth=0, cache_blocks=0, host_copies=False, refresh_cast="host"))
        if key not in seen:
            seen.add(key)
            chosen.append(cand)
        if len(chosen) >= starts:
            break
    points = [(c.data_parallel, c.chunk_size_numel, c.activation_policy or None, c.knobs, c.prediction)
              for c in chosen]
    out = []
    for mode, size, policy, knobs, pred in refine(points, ctx, max_priced=max_priced):
        step = ctx.step_for(mode, size, policy).step
        out.append(Candidate(size, step.activation_checkpointing, knobs, pred, mode,
                             num_chunks=step.num_chunks if mode == "sharded" else 0,
                             activation_policy=dict(step.activation_policy),
                             expert_parallel_size=step.expert_parallel_size,
                             tensor_parallel_size=step.tensor_parallel_size, whole_chunks=_whole_chunks(step)))
    return out


def _grad_elem_bytes(reduce_dtype: str | None, precision: str) -> int:
    """Bytes per gradient element, as ``ElixirConfig.reduce_dtype`` sets the runtime's gradient buffers and their
    reduce (``Chunk.grad_dtype``): ``"fp32"`` 4, ``None`` the compute precision's.

    Raises:
        ValueError: ``reduce_dtype`` is neither.
    """
    if reduce_dtype not in (None, "fp32"):
        raise ValueError(f"reduce_dtype={reduce_dtype!r} must be 'fp32' or None (the compute precision), as "
                         "ElixirConfig.reduce_dtype")
    return 4 if reduce_dtype == "fp32" else DTYPE_BYTES[precision]


def brute_force_grid(profile: StepProfile, hardware: HardwareProfile, *, world_size: int = 1, precision: str = "fp32",
                     device_memory_budget_bytes: int, chunk_size_numel: int, safety_margin: float = 0.05,
                     activations_on_device: bool = False, prefetch_depths: Iterable[int] = (0,),
                     optim_states: int = 2, activation_checkpointing: bool = False,
                     activation_policy: dict[str, str] | None = None, reduce_dtype: str | None = "fp32") -> list[Candidate]:
    """Every (resident prefix, device-shard prefix, device-optimizer prefix, prefetch, refresh cast) point that fits,
    priced with the same pool as :func:`search` (for small models; used to check the search against
    exhaustive enumeration), at one chunk size and one ``activation_checkpointing`` setting. Sorted
    fastest first."""
    step = build_chunked_step(profile, chunk_size_numel, world_size=world_size, precision=precision,
                              hardware=hardware, optim_states=optim_states,
                              grad_elem_bytes=_grad_elem_bytes(reduce_dtype, precision),
                              activation_checkpointing=activation_checkpointing, activation_policy=activation_policy)
    limit = int(device_memory_budget_bytes * (1.0 - safety_margin))
    act = step.activation_bytes if activations_on_device else 0
    pool = device_memory_budget_bytes if not activations_on_device else limit - act
    order = sorted(range(step.num_chunks), key=lambda c: (-step.accesses[c], c))
    out: list[Candidate] = []
    n = step.num_chunks
    for nr in range(n + 1):
        resident = frozenset(order[:nr])
        shard_counts = [nr] if world_size == 1 else range(nr, n + 1)
        for ns in shard_counts:
            shard = frozenset(order[:ns])
            held = [c for c in order if c in shard]
            for no in range(len(held) + 1):
                for depth in prefetch_depths:
                    point = Knobs(resident=resident, device_shard=shard, device_optim=frozenset(held[:no]),
                                  prefetch_depth=depth, host_copies=host_copies_forced(step, activations_on_device))
                    for knobs in _cast_variants(step, point):  # the refresh cast on the host, and on the device
                        pred = predict(step, knobs, hardware, pool_bytes=pool,
                                       activations_on_device=activations_on_device)
                        if pred is not None and _fits(step, knobs, pred, pool, limit - act):
                            out.append(Candidate(chunk_size_numel, step.activation_checkpointing,
                                                 replace(knobs, cache_blocks=pred.cache_blocks),
                                                 pred, activation_policy=dict(step.activation_policy)))
    out.sort(key=lambda c: c.prediction.step_s)
    return out
