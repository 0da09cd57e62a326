"""Configuration search: the fastest plan that fits the device budget.

For each of the best few chunk sizes (:func:`search_chunk_size`) and each block-wise activation policy of a
small grid (only when activations live on the device: every block kept, or the first ``k`` blocks in forward
order recomputed or offloaded and the rest kept, for a few ``k``; ProTrain, arXiv 2406.08334, and
[Note: activation policy] in ``_activation_cost.py``), the search walks a finite grid over

* how many chunks stay resident (chunks ranked by how often the step uses them, first-use order on ties),
* how many cache blocks the other chunks borrow (from the fewest one module needs up to all of them),
* prefetch depth (only where copies overlap compute),

and fills the memory left over with device shards and device optimizer states greedily by predicted
seconds saved per byte. With several data-parallel ranks it also prices **replicated** data parallelism
(every chunk whole and resident on every rank, gradients all-reduced, no all-gathers; chunk sizes: DDP's
25 MiB bucket and the usual candidates packed for world size 1; the spare memory buys device optimizer
states): Elixir section 5 partitions parameters only when memory requires it, so replicated wins where it
fits and the measured all-reduce beats the sharded plan's all-gathers and reduce-scatters.

Then a local refinement hill-climbs from the best few distinct candidates by single moves (one chunk into or
out of a set, one chunk's bytes traded to another set, prefetch depth +-1, one block's activation policy) while
that makes the step faster ([Note: local refinement] in ``_refine.py``).

A forward-only profile (inference, ``hf_elixir.prepare(model, None, ...)``; [Note: forward-only pricing] in
``_cost.py``) is searched with the knobs that only matter for training fixed: every block keeps its activations
(a forward under ``torch.no_grad()`` saves none to recompute or offload) and no optimizer state to place (nothing
is trained). Prefetch depths are searched as for training: the runtime prefetches each forward by the previous
one's order ([Note: forward steps] in ``hf_elixir/chunk/_steps.py``), priced in steady state.

Every point is priced by :func:`hf_elixir.search._cost.predict`; points whose device bytes exceed
``budget * (1 - safety_margin)``, or whose host bytes times the ranks per machine exceed its host memory,
are dropped. The fastest remaining point becomes the :class:`~hf_elixir.plan.ElixirPlan`, with its
reasons; the runners-up are returned too.

Source: Elixir (arXiv 2212.05339) section 5 (search over chunk size, offloading and caching with a
profiled cost model); Gemini's placement policies for the resident/offloaded split.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from torch import nn

from hf_elixir.chunk.packing import replicated_chunk_size
from hf_elixir.plan import ElixirPlan, policy_summary
from hf_elixir.profiler import HardwareProfile, StepProfile, profile_step
from hf_elixir.runtime.activations import resolve_activation_policy
from hf_elixir.search._chunk_size import search_chunk_size
from hf_elixir.search._activation_cost import activation_bytes, moved_kind, policy_grid
from hf_elixir.search._cost import (DTYPE_BYTES, ChunkedStep, Knobs, Prediction, _uploaded_chunks,
                                    build_chunked_step, fixed_memory, host_copies_forced, optim_bytes_per_numel,
                                    predict, profile_blocks, refresh_staging_bytes)
from hf_elixir.search._refine import RefineContext, StepBudget, floor_bytes, refine
from hf_elixir.search._refine import _refill as _refill_knobs
from hf_elixir.search._refine import fits as _fits

__all__ = ["Candidate", "SearchResult", "auto_plan", "brute_force_grid", "search", "search_plan"]

logger = logging.getLogger(__name__)


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

    def summary(self) -> str:
        k = self.knobs
        return (f"{self.data_parallel} chunk={self.chunk_size_numel} resident={len(k.resident)} "
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


#: the local refinement's default bound on priced configurations: as many as the grid priced, within these
REFINE_MIN_PRICED, REFINE_MAX_PRICED = 500, 1000


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
        shard = step.chunk_numels[c] // ws
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
            cost -= step.chunk_numels[c] // ws * b
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
    uploaded from a host master), on the device ([Note: refresh cast] in ``optim/optimizer.py``)."""
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
                host_budget_bytes: int | None = None,
                overlap_host_optimizer: bool | None = None) -> tuple[list[Candidate], int]:
    """Grid over resident chunks x the share of the spare bytes spent on device optimizer states and
    shards (the rest is cache) x prefetch depth; keep points whose fixed parts plus working set fit
    ``limit_bytes`` and whose simulated peak fits ``pool_bytes``."""
    order = sorted(range(step.num_chunks), key=lambda c: (-step.accesses[c], c))
    found: list[Candidate] = []
    evaluated = 0
    seen: set[Knobs] = set()
    for num_resident in _spread(0, step.num_chunks, grid_points):
        resident = frozenset(order[:num_resident])
        base = Knobs(resident=resident, device_shard=resident if step.world_size == 1 else frozenset())
        fixed, _, _ = fixed_memory(step, base)
        held = base.resident | base.device_shard if step.world_size == 1 else base.resident
        floor = fixed + step.working_set_bytes(held)
        if floor > limit_bytes:
            break
        for depth in prefetch_depths:
            probe = predict(step, Knobs(resident=resident, device_shard=base.device_shard, prefetch_depth=depth),
                            hardware, pool_bytes=pool_bytes, activations_on_device=activations_on_device)
            evaluated += 1  # the probe is priced too (its onloads guide the fill)
            if probe is None:
                continue
            for fraction in _FILL_FRACTIONS:
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
                if fraction == _FILL_FRACTIONS[-1] and step.world_size > 1:
                    variants += _prefix_points(step, start, limit_bytes, order)
                for point in variants:
                    if point in seen:
                        continue
                    seen.add(point)
                    # with several ranks, each point with and without rank-local host copies (host RAM for
                    # all-gather traffic; the host limit filters the copies out where they do not fit)
                    # (with a pool that charges activations the runtime keeps them anyway: host_copies_forced)
                    priced = (point, replace(point, host_copies=True)) if step.world_size > 1 else (point,)
                    if host_copies_forced(step, activations_on_device):
                        priced = (replace(point, host_copies=True),)
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
                                                   activation_policy=dict(step.activation_policy)))
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


def _resolve_profile(model_or_profile: Any, sample_batch: Any, hardware: HardwareProfile) -> StepProfile:
    if isinstance(model_or_profile, StepProfile):
        return model_or_profile
    if isinstance(model_or_profile, nn.Module):
        if sample_batch is None:
            raise ValueError("search_plan(model, ...) needs sample_batch= to profile a step (or pass a StepProfile)")
        param = next(model_or_profile.parameters(), None)
        device = param.device.type if param is not None else "cpu"
        return _profile_for(model_or_profile, sample_batch, device, hardware)
    raise TypeError(f"search_plan expects an nn.Module or a StepProfile, got {type(model_or_profile).__name__}")


def _profile_for(model: nn.Module, sample_batch: Any, device: str, hardware: HardwareProfile,
                 forward_only: bool = False) -> StepProfile:
    """Profile one step on ``device`` (``forward_only``: an inference step, [Note: forward-only step] in
    ``hf_elixir/profiler/_step.py``); FLOPs are counted when ``hardware`` is another kind of device (a model
    still on the CPU priced for a GPU), since the measured seconds then say nothing about it."""
    return profile_step(model, sample_batch, device=device,
                        count_flops=True if device != hardware.device_kind else None, forward_only=forward_only)


def _forward_only_settings(activation_checkpointing: bool | None,
                           activation_policy: dict[str, str] | str | None) -> tuple[bool, str]:
    """``(activation_checkpointing, activation_policy)`` for a forward-only step ([Note: forward-only pricing] in
    ``_cost.py``): every block keeps (nothing is saved for backward, so recompute and offload change nothing). A
    warning names each setting of the caller's that this ignores."""
    ignored = []
    if activation_checkpointing:
        ignored.append("activation_checkpointing=True")
    if activation_policy is not None and set(
            activation_policy.values() if isinstance(activation_policy, dict) else [activation_policy]) - {"keep"}:
        ignored.append(f"activation_policy={activation_policy!r}")
    if ignored:
        logger.warning("search: %s ignored for a forward-only (inference) step: it saves no activations for "
                       "backward; priced with every block kept", ", ".join(ignored))
    return False, "keep"


_DATA_PARALLEL = ("auto", "sharded", "replicated")


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


def _data_parallel_modes(data_parallel: str, world_size: int) -> tuple[str, ...]:
    if data_parallel not in _DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r} must be one of {_DATA_PARALLEL}")
    if world_size == 1:
        return ("sharded",)  # one rank: a replicated chunk is a resident world-size-1 chunk
    return ("sharded", "replicated") if data_parallel == "auto" else (data_parallel,)


def _chunk_sizes(profile: StepProfile, world_size: int, b: int, limit: int, chunk_size_numel: int | None,
                 num_chunk_sizes: int, replicated: bool) -> tuple[list[int], Callable[[int], str]]:
    """Chunk sizes to try, and a function saying why for the size that wins: the caller's; else the
    chunk-size search's best few; replicated chunks (packed for world size 1) try DDP's 25 MiB bucket,
    which ``prepare`` defaults to, and the same few (smaller chunks: smaller gradient buffers in flight)."""
    if chunk_size_numel is not None:
        return [chunk_size_numel], lambda size: f"chunk_size_numel={size} given by the caller"
    result = search_chunk_size(profile.param_numels, [e.params for e in profile.events], world_size=world_size,
                               element_bytes=b, cache_bytes=max(1, limit // 4))
    sizes = [c.chunk_size_numel for c in result.candidates[:max(1, num_chunk_sizes)]]
    if not replicated:
        return sizes, result.describe
    bucket = replicated_chunk_size(profile.param_numels, b)

    def why(size: int) -> str:
        if size == bucket:
            return (f"chunk_size_numel={bucket}: DDP's 25 MiB gradient bucket, the fastest predicted step among "
                    f"it and the chunk-size search's best {len(sizes)}")
        # every reason names the size first, as the sharded path's does: "chunk_size_numel=N: ..."
        return f"{result.describe(size)} (the chunk-size search's candidate, packed as replicated chunks)"

    return [bucket] + [n for n in sizes if n != bucket], why


def _ranks_per_host(world_size: int, ranks_per_host: int | None) -> int:
    if ranks_per_host is None:
        ranks_per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, min(world_size, ranks_per_host))


def search(model_or_profile: Any, hardware: HardwareProfile, *, world_size: int = 1, precision: str = "fp32",
           device_memory_budget_bytes: int | None = None, sample_batch: Any = None, safety_margin: float = 0.05,
           activations_on_device: bool | None = None, activation_checkpointing: bool | None = None,
           activation_policy: dict[str, str] | str | None = None, chunk_size_numel: int | None = None,
           num_chunk_sizes: int = 3, grid_points: int = 12,
           prefetch_depths: Iterable[int] | None = None, host_memory_bytes: int | None = None,
           max_alternatives: int = 4, optim_states: int = 2, data_parallel: str = "auto",
           replicated_placements: dict[str, str] | None = None, ranks_per_host: int | None = None,
           overlap_host_optimizer: bool | None = None, snapshot_rollback: bool = False,
           refine_starts: int = 6, refine_max_priced: int | None = None,
           reduce_dtype: str | None = "fp32") -> SearchResult:
    """Profile (if given a model) and search; see :func:`search_plan` for the arguments.

    Returns:
        :class:`SearchResult` with the plan and the runners-up.
    """
    started = time.perf_counter()
    if precision not in DTYPE_BYTES:
        raise ValueError(f"precision={precision!r} must be one of {tuple(DTYPE_BYTES)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    if not 0.0 <= safety_margin < 1.0:
        raise ValueError(f"safety_margin={safety_margin} must be in [0, 1), e.g. 0.05")
    if overlap_host_optimizer is not None and not isinstance(overlap_host_optimizer, bool):
        raise TypeError(f"overlap_host_optimizer={overlap_host_optimizer!r} must be True, False or None "
                        "(as ElixirConfig.overlap_host_optimizer)")
    if not isinstance(snapshot_rollback, bool):
        raise TypeError(f"snapshot_rollback={snapshot_rollback!r} must be True (AMSGrad or a non-Adam optimizer: the "
                        "host lane keeps snapshots) or False (Adam/AdamW: rolled back by the inverse update)")
    grad_elem_bytes = _grad_elem_bytes(reduce_dtype, precision)
    modes = _data_parallel_modes(data_parallel, world_size)
    profile = _resolve_profile(model_or_profile, sample_batch, hardware)
    if activations_on_device is None:
        activations_on_device = hardware.device_kind == "cuda"
    if profile.forward_only:
        activation_checkpointing, activation_policy = _forward_only_settings(activation_checkpointing,
                                                                             activation_policy)
    budget = device_memory_budget_bytes
    if budget is None:
        budget = hardware.device_free_bytes or hardware.device_total_bytes
    if budget is None or budget <= 0:
        raise ValueError(f"device_memory_budget_bytes={budget!r} must be > 0")
    limit = int(budget * (1.0 - safety_margin))
    b = DTYPE_BYTES[precision]
    if prefetch_depths is None:
        # local copies overlap on CUDA; all-gathers are issued ahead on any device ([Note: overlap])
        prefetch_depths = (0, 1, 2) if hardware.can_overlap or world_size > 1 else (0,)
    policies = policy_grid(profile, activations_on_device, activation_checkpointing, activation_policy)
    host_limit = host_memory_bytes if host_memory_bytes is not None else (hardware.host_total_bytes or None)
    per_host = _ranks_per_host(world_size, ranks_per_host)
    if not isinstance(refine_starts, int) or refine_starts < 0:
        raise ValueError(f"refine_starts={refine_starts!r} must be an int >= 0 (0: no local refinement)")
    if refine_max_priced is not None and (not isinstance(refine_max_priced, int) or refine_max_priced < 0):
        raise ValueError(f"refine_max_priced={refine_max_priced!r} must be None or an int >= 0 (0: no local "
                         "refinement)")
    found: list[Candidate] = []
    evaluated = over_host = 0
    size_reasons: dict[str, Callable[[int], str]] = {}
    steps: dict[tuple, StepBudget] = {}  # (mode, chunk size, policy key) -> step, for the local refinement
    tried_sizes: set[int] = set()  # every chunk size priced, for the smallest need when none fits
    for mode in modes:
        replicated = mode == "replicated"
        sizes: list[int] = []
        # chunk sizes for the cache the activations leave (they do not depend on the chunk size): the
        # least and the most activation-saving policy of the grid bound what the cache can be
        for policy in {id(p): p for p in (policies[0], policies[-1])}.values():
            act_bytes = activation_bytes(profile, precision, _policy_or_ckpt(policy, activation_checkpointing))
            room = limit - (act_bytes if activations_on_device else 0)
            more_sizes, why = _chunk_sizes(profile, world_size, b, max(1, room), chunk_size_numel, num_chunk_sizes,
                                           replicated)
            size_reasons.setdefault(mode, why)
            sizes += [n for n in more_sizes if n not in sizes]
            tried_sizes.update(more_sizes)
        for size in sizes:
            settled: set[str] = set()  # policy kinds whose fewer moved blocks already leave memory unbound
            for policy in policies:
                kind = moved_kind(policy)
                if kind in settled or "keep" in settled:
                    continue
                step = build_chunked_step(profile, size, world_size=world_size, precision=precision,
                                          hardware=hardware, optim_states=optim_states, replicated=replicated,
                                          snapshot_rollback=snapshot_rollback, grad_elem_bytes=grad_elem_bytes,
                                          activation_checkpointing=bool(activation_checkpointing),
                                          activation_policy=policy)
                act = step.activation_bytes if activations_on_device else 0
                # the pool prepare() gets: the budget when activations are outside it (a model-data budget,
                # ElixirConfig.budget_covers_activations=False), what the activations leave of the
                # margin-reduced budget when they are charged to it
                pool = budget if not activations_on_device else limit - act
                rank_host = host_limit // per_host if host_limit is not None else None  # bounds the lane's snapshots
                steps[(mode, size, _policy_key(step.activation_policy))] = StepBudget(step, pool, limit - act)
                if replicated:
                    more, count = _search_replicated(step, hardware, pool, limit - act, activations_on_device,
                                                     rank_host, overlap_host_optimizer)
                else:
                    more, count = _search_one(step, hardware, pool, limit - act, activations_on_device, grid_points,
                                              tuple(prefetch_depths), rank_host, overlap_host_optimizer)
                if host_limit is not None:  # host memory is per machine: every local rank holds its part
                    kept = [c for c in more if c.prediction.host_bytes * per_host <= host_limit]
                    over_host += len(more) - len(kept)
                    more = kept
                found += more
                evaluated += count
                if any(_memory_not_binding(step, c) for c in more):
                    settled.add(kind)  # everything on the device already: moving more blocks only costs time
    if not found:
        if over_host:
            raise ValueError(
                f"no configuration fits host memory {host_limit} bytes with {per_host} rank(s) per host (and "
                f"device_memory_budget_bytes={budget}); {over_host} fitting the device need more host memory. "
                "Use more machines, a larger budget, or pass host_memory_bytes= if the host is larger")
        # the least over every chunk size the search priced (the first candidate for the whole limit alone overstated
        # it: a tiny GPT-2 was told 676356 bytes where a budget of 512500 fitted, with a smaller chunk), and as a
        # budget: the margin comes off whatever is given
        # (smaller rooms pick smaller chunks, whose working set is smaller: the candidates for a few of them count too)
        for room in (limit >> k for k in range(6)):
            tried_sizes.update(_chunk_sizes(profile, world_size, b, max(1, room), chunk_size_numel, num_chunk_sizes,
                                            False)[0])
        need = min(_minimum_bytes(profile, world_size, precision, size, activations_on_device, hardware, policies,
                                  grad_elem_bytes) for size in tried_sizes)
        # and the candidates the search would try at about that need (GPT-2 8x1024 told from 100 MB: 7% less)
        for _ in range(2):
            for room in (need >> k for k in range(3)):
                tried_sizes.update(_chunk_sizes(profile, world_size, b, max(1, room), chunk_size_numel,
                                                num_chunk_sizes, False)[0])
            need = min(_minimum_bytes(profile, world_size, precision, size, activations_on_device, hardware, policies,
                                      grad_elem_bytes) for size in tried_sizes)
        need_budget = math.ceil(need / (1.0 - safety_margin))
        raise ValueError(
            f"no configuration fits device_memory_budget_bytes={budget} (with safety_margin={safety_margin}: "
            f"{limit} bytes); the smallest needs about {need} bytes per rank (a device_memory_budget_bytes of about "
            f"{need_budget}). Use more ranks (world_size), a smaller batch or sequence, activation checkpointing, "
            "or a larger budget"
        )
    found.sort(key=_ranking(profile))
    if refine_max_priced is None:  # about what the grid priced (at least 500: a small grid says little here)
        refine_max_priced = min(REFINE_MAX_PRICED, max(REFINE_MIN_PRICED, evaluated))
    if refine_starts and refine_max_priced:
        def step_for(mode: str, size: int, policy: dict[str, str] | None) -> StepBudget:
            key = (mode, size, _policy_key(policy))
            if key not in steps:  # a policy the refinement moved to: built as the loop above builds its steps
                step = build_chunked_step(profile, size, world_size=world_size, precision=precision,
                                          hardware=hardware, optim_states=optim_states,
                                          replicated=mode == "replicated", snapshot_rollback=snapshot_rollback,
                                          grad_elem_bytes=grad_elem_bytes,
                                          activation_checkpointing=bool(activation_checkpointing),
                                          activation_policy=policy)
                act = step.activation_bytes if activations_on_device else 0
                steps[key] = StepBudget(step, budget if not activations_on_device else limit - act, limit - act)
            return steps[key]

        ctx = RefineContext(hardware=hardware, step_for=step_for, activations_on_device=activations_on_device,
                            prefetch_depths=tuple(prefetch_depths), policy_searched=len(policies) > 1,
                            host_budget_bytes=host_limit // per_host if host_limit is not None else None,
                            host_limit_bytes=host_limit, ranks_per_host=per_host,
                            overlap_host_optimizer=overlap_host_optimizer)
        found += _refined(found, ctx, refine_starts, refine_max_priced)
        evaluated += ctx.priced
        found.sort(key=_ranking(profile))
    best = found[0]
    best_by_mode: dict[str, Candidate] = {}
    for cand in found:
        best_by_mode.setdefault(cand.data_parallel, cand)
    alternatives: list[Candidate] = []
    seen = {best.summary()}
    for cand in found[1:]:
        if len(alternatives) >= max_alternatives:
            break
        if cand.summary() not in seen:
            seen.add(cand.summary())
            alternatives.append(cand)
    plan = _to_plan(profile, best, world_size, precision, budget, limit,
                    size_reasons[best.data_parallel](best.chunk_size_numel), evaluated,
                    host_limit, activations_on_device, per_host, reduce_dtype)
    plan.reasons[2:2] = _data_parallel_reasons(modes, best, best_by_mode, world_size)
    if best.data_parallel == "replicated":
        modules = replicated_placements if replicated_placements is not None else (
            _default_replicated_placements(model_or_profile, profile))
        plan.placements = dict(modules)
        if not modules:
            logger.warning("search: replicated data parallelism won, but the profile does not name the modules; "
                           "set ElixirPlan.placements to resolve_placements(model, ElixirConfig("
                           "default_placement='replicated')) before hf_elixir.prepare")
            plan.reasons.append("placements unknown (an old profile): set them before hf_elixir.prepare")
    return SearchResult(plan=plan, best=best, alternatives=alternatives, evaluated=evaluated,
                        search_s=time.perf_counter() - started, profile=profile, best_by_mode=best_by_mode)


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
                             activation_policy=dict(step.activation_policy)))
    return out


def _default_replicated_placements(model_or_profile: Any, profile: StepProfile) -> dict[str, str]:
    """Every parameter-owning module replicated (no user overrides known here)."""
    if isinstance(model_or_profile, nn.Module):
        from hf_elixir.config import ElixirConfig  # noqa: PLC0415
        from hf_elixir.placement import resolve_placements  # noqa: PLC0415

        return resolve_placements(model_or_profile, ElixirConfig(default_placement="replicated"))
    return {fqn: "replicated" for fqn in profile.param_modules}


def _data_parallel_reasons(modes: tuple[str, ...], best: Candidate, best_by_mode: dict[str, Candidate],
                           world_size: int) -> list[str]:
    """Why sharded or replicated data parallelism won (Elixir section 5: partition only when needed)."""
    if len(modes) == 1:
        return [f"data parallel over {world_size} rank(s): {modes[0]} only"] if world_size > 1 else []
    other = "sharded" if best.data_parallel == "replicated" else "replicated"
    mine = best.prediction
    if other not in best_by_mode:
        why = ("no replicated configuration fits the budget (whole model + gradient buffers per rank)"
               if other == "replicated" else "no sharded configuration fits")
        return [f"{best.data_parallel} data parallelism: {why}; predicted {mine.step_s:.4g} s"]
    theirs = best_by_mode[other].prediction
    return [f"{best.data_parallel} data parallelism wins: predicted {mine.step_s:.4g} s vs {theirs.step_s:.4g} s for "
            f"the best {other} plan ({other} device peak {theirs.device_peak_bytes} bytes, "
            f"{best.data_parallel} {mine.device_peak_bytes} bytes)"]


def _minimum_bytes(profile: StepProfile, world_size: int, precision: str, size: int, act_on_device: bool,
                   hardware: HardwareProfile, policies: list | None = None, grad_elem_bytes: int = 4) -> int:
    """The smallest working set plus activations over ``policies`` (default: the uniform switch off)."""
    need = []
    for policy in policies or [None]:
        step = build_chunked_step(profile, size, world_size=world_size, precision=precision, hardware=hardware,
                                  activation_policy=policy, grad_elem_bytes=grad_elem_bytes)
        need.append(step.working_set_bytes() + (step.activation_bytes if act_on_device else 0))
    return min(need)


def _gather_reasons(profile: StepProfile, best: Candidate, world_size: int, act_on_device: bool) -> list[str]:
    """Where a sharded plan at several ranks issues its all-gathers ([Note: gather prefetch] in
    ``chunk/_prefetch.py``, priced as in [Note: overlap] in ``_cost.py``): MoE-expert chunks keep every gather in its
    hook; so does inference (prepare without an optimizer) under a budget covering activations; training under
    such a budget issues the forward ones ahead from the third step on, as the ranks agree at each optimizer step."""
    if world_size < 2 or best.data_parallel != "sharded":
        return []
    hooks = "so each gather waits in its hook where the ranks agree ([Note: gather prefetch] in chunk/_prefetch.py)"
    if profile.subtree_units:
        return ["all-gathers are not issued ahead: MoE-expert chunks are used only where experts got tokens and "
                f"the ranks' pools drift apart, {hooks}"]
    if not act_on_device:
        return []
    if profile.forward_only:
        return ["all-gathers are not issued ahead: the budget covers activations, whose bytes can differ between "
                "ranks, and inference (prepare without an optimizer) has no optimizer step at which the ranks "
                f"agree, {hooks}; ElixirConfig(budget_covers_activations=False) with a budget for model data lets "
                "them run ahead"]
    if best.knobs.prefetch_depth == 0:
        return []
    return [f"forward all-gathers are issued ahead ({best.knobs.prefetch_depth} events) from the third step on "
            "although the budget covers activations, whose bytes can differ between ranks: agreed by every rank at "
            "each optimizer step (each rank votes, per chunk, whether it had room in the previous step; [Note: "
            "agreed gathers ahead] in chunk/_agreed_gathers.py); backward refills are local copies of the rank-local "
            "host copies; MoE-expert models and inference (prepare without an optimizer) keep them in their hooks"]


def _to_plan(profile: StepProfile, best: Candidate, world_size: int, precision: str, budget: int, limit: int,
             size_reason: str, evaluated: int, host_memory_bytes: int | None, act_on_device: bool,
             ranks_per_host: int = 1, reduce_dtype: str | None = "fp32") -> ElixirPlan:
    k, p = best.knobs, best.prediction
    gib = 2**30
    reasons = [
        size_reason,
        f"searched {evaluated} configurations; fastest that fits {limit / gib:.3g} GiB "
        f"(budget {budget / gib:.3g} GiB minus safety margin) is {best.summary()}",
        "device bytes: " + ", ".join(f"{name} {v / gib:.3g} GiB" for name, v in p.breakdown.items() if v),
        f"predicted step {p.step_s:.4g} s = forward+backward {p.forward_backward_s:.4g} s "
        f"(compute {p.compute_s:.4g} s, {p.onloads} chunk onloads) + optimizer {p.optimizer_s:.4g} s"
        if not profile.forward_only else
        f"inference (no optimizer): predicted forward {p.step_s:.4g} s (compute {p.compute_s:.4g} s, {p.onloads} "
        "chunk onloads in the steady state of repeated forwards); no backward, gradient buffers or optimizer "
        "states, every block keeps its activations (none are saved)",
    ]
    if not act_on_device:
        reasons.append("activations are not counted in the device budget (the pool bounds model data only)")
    if best.activation_policy and policy_summary(best.activation_policy) != "keep":
        blocks = list(best.activation_policy)  # forward order
        moved = [b for b in blocks if best.activation_policy[b] != "keep"]
        where = "first blocks in forward order" if moved == blocks[:len(moved)] else "blocks: " + ", ".join(moved)
        reasons.append(f"activation policy {policy_summary(best.activation_policy)} blocks ({where}; "
                       f"activations {p.breakdown.get('activations', 0) / gib:.3g} GiB on the device): keeping "
                       "every block's activations does not leave room for a faster plan")
    elif best.activation_checkpointing:
        reasons.append("activation checkpointing on: without it the activations do not leave room for a faster plan")
    gathers = _gather_reasons(profile, best, world_size, act_on_device)
    reasons.extend(gathers)
    if not gathers and k.prefetch_depth == 0 and best.data_parallel == "sharded":
        reasons.append("prefetch depth 0: copies do not overlap compute here, or blocks are better spent on caching")
    if k.refresh_cast == "device":
        reasons.append(f"refresh cast on the device: uploading the fp32 masters (twice the PCIe bytes, "
                       f"{p.breakdown.get('refresh_staging', 0) / 2**20:.3g} MiB of device staging) beats casting them "
                       "in the host lane here")
    if host_memory_bytes is not None:
        reasons.append(f"host bytes {p.host_bytes / gib:.3g} GiB per rank x {ranks_per_host} rank(s) per host fit "
                       f"in host memory {host_memory_bytes / gib:.3g} GiB")
    return ElixirPlan(
        model_type=profile.model_type, num_params=profile.num_params, world_size=world_size, precision=precision,
        chunk_size_numel=best.chunk_size_numel, param_order=list(profile.param_names),
        resident_chunks=sorted(k.resident), device_shard_chunks=sorted(k.device_shard | k.resident),
        device_optim_chunks=sorted(k.device_optim), prefetch_depth=k.prefetch_depth,
        host_copy_chunks=sorted(set(range(best.num_chunks)) - set(k.resident)) if k.host_copies else [],
        refresh_cast=k.refresh_cast if precision != "fp32" else "host", reduce_dtype=reduce_dtype,
        activation_checkpointing=best.activation_checkpointing, activation_policy=dict(best.activation_policy),
        predicted_step_s=float(p.step_s), predicted_peak_device_bytes=int(p.device_peak_bytes),
        activation_peak_bytes=_activation_room_bytes(
            profile, precision, _policy_or_ckpt(best.activation_policy, best.activation_checkpointing)),
        reasons=reasons,
    )


def _policy_or_ckpt(policy: dict[str, str] | None, checkpointing: bool | None) -> dict[str, str] | bool:
    """The block policy, or the uniform ``activation_checkpointing`` when none (no blocks profiled)."""
    return policy if policy else bool(checkpointing)


def _activation_room_bytes(profile: StepProfile, precision: str, checkpointing: bool | dict[str, str]) -> int:
    """``ElixirPlan.activation_peak_bytes``: the profiled activation peak at ``precision`` (with or
    without checkpointing) plus the largest parameter's gradient, the temporary autograd holds before it
    lands in its chunk ([Note: activations in the budget] in ``hf_elixir/chunk/memory.py``); a forward-only step
    has no gradient, so only the forward's transient ([Note: forward-only step] in ``profiler/_step.py``)."""
    largest_grad = 0 if profile.forward_only else max(profile.param_numels, default=0) * DTYPE_BYTES[precision]
    return int(activation_bytes(profile, precision, checkpointing)) + largest_grad


def search_plan(model_or_profile: Any, hardware: HardwareProfile, *, world_size: int = 1, precision: str = "fp32",
                device_memory_budget_bytes: int | None = None, **kwargs: Any) -> ElixirPlan:
    """Profile (if needed) and return the fastest :class:`~hf_elixir.plan.ElixirPlan` that fits.

    Args:
        model_or_profile: an ``nn.Module`` (then ``sample_batch=`` is required and one step is profiled)
            or a :class:`~hf_elixir.profiler.StepProfile`.
        hardware: :func:`~hf_elixir.profiler.probe_hardware` output.
        world_size: data-parallel ranks (chunks are sharded over them, or replicated on each; all numbers
            are per rank).
        precision: ``"fp32" | "bf16" | "fp16"``.
        device_memory_budget_bytes: device bytes per rank; default: the hardware's free device memory.
            On CPU (activations not on the device) it bounds model data only, like the simulated pool.
        **kwargs: ``sample_batch``, ``safety_margin`` (fraction kept free, default 0.05),
            ``activations_on_device`` (default: CUDA), ``activation_checkpointing`` (``True`` / ``False``: every
            block recomputed / kept), ``activation_policy`` (a block -> ``"keep" | "recompute" | "offload"``
            mapping, or one policy for every block; with neither, and activations on the device, the search
            prices every block kept and the first ``k`` blocks recomputed or offloaded, see
            ``policy_grid`` in ``_activation_cost.py``),
            ``chunk_size_numel`` (``None``: search it), ``num_chunk_sizes``, ``grid_points``,
            ``prefetch_depths``, ``host_memory_bytes`` (host RAM per machine, bytes; default the hardware's
            ``host_total_bytes``: candidates whose host bytes times ``ranks_per_host`` exceed it are
            rejected), ``ranks_per_host`` (default ``$LOCAL_WORLD_SIZE``, else ``world_size``),
            ``data_parallel`` (``"auto"``: with ``world_size > 1`` price both sharded and replicated data
            parallelism, Elixir section 5; ``"sharded"`` / ``"replicated"``: only that),
            ``replicated_placements`` (``ElixirPlan.placements`` to record if replicated wins; default
            every parameter-owning module ``"replicated"``), ``overlap_host_optimizer``
            (``ElixirConfig.overlap_host_optimizer``: ``False`` prices the host update serially in the step,
            ``True`` on the host lane during backward, ``None`` as the runtime resolves it: on for CUDA, off
            on CPU; [Note: overlap] in ``_cost.py``), ``snapshot_rollback`` (default ``False``: Adam/AdamW, whose
            speculative updates the host lane undoes by the inverse update; ``True``: AMSGrad or another optimizer
            class, whose lane keeps snapshots, priced as copies and host bytes), ``refine_starts`` (default 6:
            hill-climb from the best 6 distinct candidates; 0: no local refinement) and ``refine_max_priced``
            (at most that many configurations priced by the refinement, all climbs together, counted in
            ``SearchResult.evaluated``; default ``None``: as many as the grid before it priced, at least 500
            and at most 1000; 0: no refinement); [Note: local refinement] in ``_refine.py``; ``reduce_dtype``
            (``ElixirConfig.reduce_dtype``: ``"fp32"``, the default, prices fp32 gradient buffers and reduces,
            4 bytes per element; ``None`` the compute precision's, as FSDP2's ``MixedPrecisionPolicy`` with no
            ``reduce_dtype`` and DeepSpeed's bf16 do).

    Returns:
        the plan; ``plan.reasons`` says why.

    Raises:
        ValueError: bad arguments, or nothing fits (naming the smallest requirement and fixes).
    """
    return search(model_or_profile, hardware, world_size=world_size, precision=precision,
                  device_memory_budget_bytes=device_memory_budget_bytes, **kwargs).plan


def auto_plan(model: nn.Module, sample_batch: Any, config: Any, *, hardware: HardwareProfile | None = None,
              optimizer: Any = None, inference: bool = False) -> ElixirPlan:
    """What ``hf_elixir.prepare`` runs for ``ElixirConfig(search="auto")``: profile one step of ``model`` on
    ``sample_batch``, probe (or reuse) the hardware and search with the config's precision, budget,
    world size (the config's process group, else the default group, else 1), chunk size and
    ``overlap_host_optimizer`` (the host update priced as the runtime will run it), and the optimizer's state
    bytes per parameter and rollback kind (``optimizer``: the ``torch.optim`` optimizer ``prepare`` will wrap;
    :func:`hf_elixir.optim.optimizer.optimizer_cost_terms`: Adam/AdamW 8 B and the inverse rollback, SGD with
    momentum 4 B, plain SGD 0 B, AMSGrad and other classes snapshots; ``None``: priced as AdamW). ``inference=True``
    (what ``prepare`` passes for ``optimizer=None``): one forward under ``torch.no_grad()`` is profiled
    (``sample_batch`` needs no labels) and priced as the runtime runs it without an optimizer (no backward, gradient
    buffers or optimizer states; every block keeps; [Note: forward-only pricing] in ``_cost.py``);
    ``optimizer`` is then unused.

    The model must still be a plain module (before ``prepare`` installs its hooks); gradients the profiled
    step creates are cleared. With several ranks, replicated data parallelism is searched too (see
    :func:`search`'s ``data_parallel``) unless the model is tensor/expert parallel, the config's
    ``default_placement`` is ``"sharded"``, or its ``placements`` would mix the two; a replicated plan's
    ``placements`` are ``resolve_placements`` with ``default_placement="replicated"`` (the user's globs
    kept), which is how ``prepare`` recognises it. Every rank returns rank 0's plan.
    """
    import torch.distributed as dist

    from hf_elixir.optim.optimizer import optimizer_cost_terms  # noqa: PLC0415
    from hf_elixir.profiler import probe_hardware

    world_size = 1
    if dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size(getattr(config, "process_group", None))
    param = next(model.parameters(), None)
    device = param.device if param is not None else None
    if hardware is None:
        hardware = probe_hardware(device if device is not None and device.type == "cuda" else None,
                                  budget_bytes=config.device_memory_budget_bytes,
                                  process_group=getattr(config, "process_group", None))
    profile = _profile_for(model, sample_batch, device.type if device is not None else "cpu", hardware,
                           forward_only=inference)
    budget = config.device_memory_budget_bytes
    if budget is None and hardware.device_kind != "cuda":
        budget = hardware.device_total_bytes
    data_parallel, replicated_placements, note = _auto_data_parallel(model, config, world_size)
    host_budget = getattr(config, "host_memory_budget_bytes", None)  # per rank; the search limits per machine
    per_host = _ranks_per_host(world_size, None)
    # an explicit budget charges activations on any device (the simulated pool too) unless the config opts
    # out; None: the device decides (the card on CUDA covers them, the unlimited simulated pool does not)
    explicit = config.device_memory_budget_bytes is not None
    covers = bool(getattr(config, "budget_covers_activations", True)) if explicit else None
    user_policy = getattr(config, "activation_policy", None)  # the user's choice is priced, not searched
    fixed_policy = (resolve_activation_policy(profile_blocks(profile), {}, False, user_policy)
                    if user_policy is not None else None)
    result = search(profile, hardware, world_size=world_size, precision=config.precision,
                    device_memory_budget_bytes=budget, chunk_size_numel=config.chunk_size_numel,
                    activations_on_device=covers, activation_policy=fixed_policy,
                    data_parallel=data_parallel, replicated_placements=replicated_placements,
                    host_memory_bytes=host_budget * per_host if host_budget else None, ranks_per_host=per_host,
                    overlap_host_optimizer=getattr(config, "overlap_host_optimizer", None),
                    reduce_dtype=getattr(config, "reduce_dtype", "fp32"), **optimizer_cost_terms(optimizer, config))
    plan = result.plan
    if note:
        plan.reasons.append(note)
    if result.best.data_parallel == "sharded":
        from hf_elixir.placement import resolve_placements  # noqa: PLC0415

        plan.placements = resolve_placements(model, config)
    if world_size > 1:
        # each rank profiled its own step: timings differ, and ranks with different plans (one replicated,
        # one sharded) would issue different collectives and hang. Every rank takes rank 0's plan.
        group = getattr(config, "process_group", None)
        box = [plan]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        plan = box[0]
    return plan


def _auto_data_parallel(model: nn.Module, config: Any, world_size: int) -> tuple[str, dict[str, str] | None, str]:
    """``(data_parallel, replicated placements, note)`` for :func:`auto_plan`: both kinds for a plain data-parallel
    model under ``default_placement="auto"``; only sharded for tensor/expert-parallel models, for
    ``default_placement="sharded"``, and where the user's ``ElixirConfig.placements`` would mix the two
    (the cost model prices one kind per plan). The replicated placements keep the user's globs."""
    from hf_elixir.parallel import get_parallel_state  # noqa: PLC0415
    from hf_elixir.placement import resolve_placements  # noqa: PLC0415

    default = getattr(config, "default_placement", "sharded")
    parallel = (get_parallel_state(model) is not None or getattr(config, "tensor_parallel_size", 1) > 1
                or getattr(config, "expert_parallel_size", 1) > 1)
    if world_size == 1 or parallel or default == "sharded":
        return "sharded", None, ""
    placements = resolve_placements(model, replace(config, default_placement="replicated"))
    if set(placements.values()) != {"replicated"}:
        return "sharded", None, ("replicated data parallelism not searched: ElixirConfig.placements mixes "
                                 "placements (the search prices one kind per plan)")
    return ("replicated" if default == "replicated" else "auto"), placements, ""


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
