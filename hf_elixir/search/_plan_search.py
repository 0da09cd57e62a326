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

The grid, the fill and the candidates' order live in ``_grid.py``, the plan and its reasons in
``_report.py``. Every point is priced by :func:`hf_elixir.search._cost.predict`; points whose device bytes exceed
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
from dataclasses import replace
from typing import Any, Callable, Iterable

from torch import nn

from hf_elixir.chunk.packing import replicated_chunk_size
from hf_elixir.parallel._mesh import check_tp_ep_sizes
from hf_elixir.plan import ElixirPlan
from hf_elixir.profiler import HardwareProfile, StepProfile, profile_step
from hf_elixir.runtime.activations import resolve_activation_policy
from hf_elixir.search._activation_cost import activation_bytes, moved_kind, policy_grid
from hf_elixir.search._chunk_size import search_chunk_size
from hf_elixir.search._coarse import (DegreePruned, coarse_effort, fine_steps_to_search, report_progress,
                                      step_lower_bound_s)
from hf_elixir.search._frozen_choice import searched_frozen_whole
from hf_elixir.search._cost import DTYPE_BYTES, Knobs, build_chunked_step, fixed_memory, profile_blocks
from hf_elixir.search._expert_parallel import expert_parallel_profile, rank_param_order
from hf_elixir.search._cost import predict  # noqa: F401 (importable from here, as before the grid moved out)
from hf_elixir.search._disk_cost import DiskTier, config_disk_tier, disk_reason, fit_host
from hf_elixir.search._grid import (Candidate, SearchResult, _grad_elem_bytes, _memory_not_binding, _policy_key,
                                    _ranking, _refined, _search_one, _search_replicated, brute_force_grid)
from hf_elixir.search._refine import RefineContext, StepBudget
from hf_elixir.search._tensor_parallel import tensor_parallel_profile
from hf_elixir.search._report import (_data_parallel_reasons, _default_replicated_placements,
                                      _policy_or_ckpt, _to_plan)

__all__ = ["Candidate", "SearchResult", "auto_plan", "brute_force_grid", "search", "search_plan"]

logger = logging.getLogger(__name__)


#: the local refinement's default bound on priced configurations: as many as the grid priced, within these
REFINE_MIN_PRICED, REFINE_MAX_PRICED = 500, 1000
#: a degree whose best is more than this fraction slower than another degree's best is not refined
#: ([Note: coarse to fine] in ``_coarse.py``)
REFINE_SLACK = 0.1


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


def _tensor_parallel_placements(model_or_profile: Any, tensor_parallel_size: int) -> dict[str, str]:
    """Every parameter-owning module's placement at that tensor-parallel degree (``resolve_placements``).

    Raises:
        ValueError: given a profile, which does not know the model's tensor-parallel spec.
    """
    if not isinstance(model_or_profile, nn.Module):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} on a StepProfile needs "
                         "tensor_parallel_placements= (resolve_placements(model, ElixirConfig(tensor_parallel_size="
                         f"{tensor_parallel_size})), or ElixirPlan.placements of such a plan)")
    from hf_elixir.config import ElixirConfig  # noqa: PLC0415
    from hf_elixir.placement import resolve_placements  # noqa: PLC0415

    return resolve_placements(model_or_profile, ElixirConfig(tensor_parallel_size=tensor_parallel_size))


_DATA_PARALLEL = ("auto", "sharded", "replicated")


def _data_parallel_modes(data_parallel: str, world_size: int) -> tuple[str, ...]:
    if data_parallel not in _DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r} must be one of {_DATA_PARALLEL}")
    if world_size == 1:
        return ("sharded",)  # one rank: a replicated chunk is a resident world-size-1 chunk
    return ("sharded", "replicated") if data_parallel == "auto" else (data_parallel,)


def _chunk_sizes(profile: StepProfile, world_size: int, b: int, limit: int, chunk_size_numel: int | None,
                 num_chunk_sizes: int, replicated: bool, memo: dict | None = None) -> tuple[list[int],
                                                                                      Callable[[int], str]]:
    """Chunk sizes to try, and a function saying why for the size that wins: the caller's; else the
    chunk-size search's best few; replicated chunks (packed for world size 1) try DDP's 25 MiB bucket,
    which ``prepare`` defaults to, and the same few (smaller chunks: smaller gradient buffers in flight)."""
    if chunk_size_numel is not None:
        return [chunk_size_numel], lambda size: f"chunk_size_numel={size} given by the caller"
    result = search_chunk_size(profile.param_numels, [e.params for e in profile.events], world_size=world_size,
                               element_bytes=b, cache_bytes=max(1, limit // 4), memo=memo)
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
           reduce_dtype: str | None = "fp32", host_memory_name: str = "host_memory_bytes=",
           expert_parallel_size: int = 1, tensor_parallel_size: int = 1,
           tensor_parallel_placements: dict[str, str] | None = None, parallelized: bool = False,
           incumbent_s: float | None = None, disk: DiskTier | None = None, frozen_whole: bool = False) -> SearchResult:
    """Profile (if given a model) and search; see :func:`search_plan` for the arguments.

    ``frozen_whole``: the frozen parameters' chunks are whole on every rank (``ElixirConfig.frozen_placement``
    resolved to ``"whole"``, [Note: whole frozen chunks] in ``hf_elixir/chunk/_frozen_whole.py``): packed and priced
    as ``prepare`` builds them.

    ``expert_parallel_size`` / ``tensor_parallel_size`` price one rank of that degree ([Note: expert parallel
    pricing] in ``_expert_parallel.py``, [Note: tensor parallel pricing] in ``_tensor_parallel.py``); both above 1
    for tensor and expert parallel together ([Note: tp x ep pricing] in ``_expert_parallel.py``).
    ``tensor_parallel_placements``: module FQN -> placement at that degree (default, for a model:
    ``resolve_placements(model, ElixirConfig(tensor_parallel_size=...))``). ``parallelized``: the model (or profile)
    is already one rank's, rewritten by ``hf_elixir.parallel.parallelize`` at those degrees: nothing is divided
    again, the chunk groups and collectives are priced.

    ``incumbent_s``: the step seconds (at this degree's tokens per step) of a plan another degree already found;
    steps that cannot beat it are skipped, and a degree none of whose steps can raises :class:`DegreePruned`
    ([Note: coarse to fine] in ``_coarse.py``: a coarse pass over every step, the fine grid for the few best).

    ``disk``: a :class:`~hf_elixir.search._disk_cost.DiskTier` that holds what host memory does not (fp32 masters
    and optimizer moments first, then parameter chunks), its traffic priced under the step ([Note: disk tier
    pricing] in ``_disk_cost.py``); ``None``: host memory is the last tier.

    ``host_memory_name`` is how the caller's user sets the host memory (the CLI's ``--host-memory``,
    ``ElixirConfig.host_memory_budget_bytes``); the error when nothing fits the host names it.

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
    ep, tp = expert_parallel_size, tensor_parallel_size
    for name, size in (("expert_parallel_size", ep), ("tensor_parallel_size", tp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r} must be an int >= 1")
        if size > 1 and data_parallel == "replicated":
            raise ValueError(f"{name}={size} needs data_parallel='sharded' (or 'auto'), not 'replicated'")
        if world_size % size:
            raise ValueError(f"{name}={size} must divide world_size={world_size}")
    if ep > 1 and tp > 1:  # dense view (dp, tp) and expert view (edp, ep): [Note: tp x ep mesh]
        check_tp_ep_sizes(tp, ep, world_size)
    modes = _data_parallel_modes("sharded" if max(ep, tp) > 1 else data_parallel, world_size)
    profile = _resolve_profile(model_or_profile, sample_batch, hardware)
    if tp > 1 and tensor_parallel_placements is None and not parallelized:
        tensor_parallel_placements = _tensor_parallel_placements(model_or_profile, tp)
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
    # [Note: expert parallel pricing] in _expert_parallel.py: each step is one rank's (its experts, its chunk groups,
    # its all-to-alls, across machines where the expert-parallel group spans more than the ranks of one)
    # and [Note: tensor parallel pricing] in _tensor_parallel.py (its split weights, every chunk over the ranks of its
    # data-parallel group, the split layers' collectives)
    steps_for = {"expert_parallel_size": ep, "gpus_per_node": per_host, "tensor_parallel_size": tp,
                 "tensor_parallel_placements": tensor_parallel_placements, "parallelized": parallelized,
                 "frozen_whole": frozen_whole}
    rank_profile = profile  # what one rank packs (chunk-size search)
    if not parallelized:
        rank_profile = tensor_parallel_profile(expert_parallel_profile(profile, ep)[0], tp,
                                               tensor_parallel_placements or {})
    pack_world_size = world_size // tp  # the chunks' data-parallel group (every chunk's, under tensor parallel)
    if not isinstance(refine_starts, int) or refine_starts < 0:
        raise ValueError(f"refine_starts={refine_starts!r} must be an int >= 0 (0: no local refinement)")
    if refine_max_priced is not None and (not isinstance(refine_max_priced, int) or refine_max_priced < 0):
        raise ValueError(f"refine_max_priced={refine_max_priced!r} must be None or an int >= 0 (0: no local "
                         "refinement)")
    found: list[Candidate] = []
    evaluated = over_host = 0
    least_host = math.inf  # the least host bytes per rank of a candidate the host limit dropped
    size_reasons: dict[str, Callable[[int], str]] = {}
    steps: dict[tuple, StepBudget] = {}  # (mode, chunk size, policy key) -> step, for the local refinement
    tried_sizes: set[int] = set()  # every chunk size priced, for the smallest need when none fits
    rank_host = host_limit // per_host if host_limit is not None else None  # bounds the lane's snapshots
    planned: list[tuple[str, int, Any]] = []  # (mode, chunk size, policy) in the order the grid walks them
    chunk_memo: dict = {}  # the chunk-size search's packings and onloads, shared by its calls here
    for mode in modes:
        replicated = mode == "replicated"
        sizes: list[int] = []
        # chunk sizes for the cache the activations leave (they do not depend on the chunk size): the
        # least and the most activation-saving policy of the grid bound what the cache can be
        for policy in {id(p): p for p in (policies[0], policies[-1])}.values():
            act_bytes = activation_bytes(rank_profile, precision, _policy_or_ckpt(policy, activation_checkpointing))
            room = limit - (act_bytes if activations_on_device else 0)
            more_sizes, why = _chunk_sizes(rank_profile, pack_world_size, b, max(1, room), chunk_size_numel,
                                           num_chunk_sizes, replicated, chunk_memo)
            size_reasons.setdefault(mode, why)
            sizes += [n for n in more_sizes if n not in sizes]
            tried_sizes.update(more_sizes)
        planned += [(mode, size, policy) for size in sizes for policy in policies]

    def budget_for(mode: str, size: int, policy: Any) -> StepBudget:
        key = (mode, size, _policy_key(policy))
        if key not in steps:  # memoised: the coarse pass, the fine pass and the refinement share each step
            step = build_chunked_step(profile, size, world_size=world_size, precision=precision,
                                      hardware=hardware, optim_states=optim_states, replicated=mode == "replicated",
                                      snapshot_rollback=snapshot_rollback, grad_elem_bytes=grad_elem_bytes,
                                      activation_checkpointing=bool(activation_checkpointing),
                                      activation_policy=policy, **steps_for)
            act = step.activation_bytes if activations_on_device else 0
            # the pool prepare() gets: the budget when activations are outside it (a model-data budget,
            # ElixirConfig.budget_covers_activations=False), what the activations leave of the
            # margin-reduced budget when they are charged to it
            steps[key] = StepBudget(step, budget if not activations_on_device else limit - act, limit - act)
        return steps[key]

    def price(mode: str, size: int, policy: Any, effort: dict) -> list[Candidate]:
        """The step's grid at ``effort`` (the coarse or the fine pass, [Note: coarse to fine]), host-filtered."""
        nonlocal evaluated, over_host, least_host
        sb = budget_for(mode, size, policy)
        if mode == "replicated":
            more, count = _search_replicated(sb.step, hardware, sb.pool_bytes, sb.work_limit_bytes,
                                             activations_on_device, rank_host, overlap_host_optimizer)
        else:
            more, count = _search_one(sb.step, hardware, sb.pool_bytes, sb.work_limit_bytes, activations_on_device,
                                      effort["grid_points"], effort["prefetch_depths"], rank_host,
                                      overlap_host_optimizer, fill_fractions=effort["fill_fractions"])
        if host_limit is not None:  # host memory is per machine: every local rank holds its part (the disk the
            # rest, [Note: disk tier pricing] in _disk_cost.py)
            more, over, least = fit_host(more, sb.step, host_limit, per_host, disk, activations_on_device, rank_host)
            over_host, least_host = over_host + over, min(least_host, least)
        evaluated += count
        return more

    def floor_exceeds(sb: StepBudget) -> bool:
        """The step's least device bytes (nothing resident but what replicated chunks must be, no device optimizer
        state) exceed what it may use: no configuration of it fits."""
        step = sb.step
        base = (Knobs(resident=frozenset(range(step.num_chunks)), device_shard=frozenset(range(step.num_chunks)))
                if step.replicated else Knobs(resident=frozenset(), device_shard=frozenset()))
        return fixed_memory(step, base)[0] + step.working_set_bytes(step.never_filled(base)) > sb.work_limit_bytes

    coarse = coarse_effort(grid_points, tuple(prefetch_depths))
    fine = {"grid_points": grid_points, "prefetch_depths": tuple(prefetch_depths), "fill_fractions": None}
    step_best: dict[tuple, float] = {}  # (mode, size, policy key) -> its coarse best step seconds
    settled: set[tuple] = set()  # (mode, size, kind) whose fewer moved blocks already leave memory unbound
    pruned = 0
    # the policies that leave the fewest activations on the device (every block recomputed or offloaded)
    extremes = [p for p in policies if p is None or all(v != "keep" for v in p.values())] or policies[:1]
    hopeless: dict[tuple[str, int], bool] = {}  # (mode, size) -> no policy can fit its floor
    for done, (mode, size, policy) in enumerate(planned):
        kind = moved_kind(policy)
        if (mode, size, kind) in settled or (mode, size, "keep") in settled:
            continue
        if (mode, size) not in hopeless:  # two steps built instead of every policy's where nothing fits
            hopeless[(mode, size)] = all(floor_exceeds(budget_for(mode, size, p)) for p in extremes)
        if hopeless[(mode, size)]:
            continue
        incumbent = min([c.prediction.step_s for c in found] + ([incumbent_s] if incumbent_s else []), default=None)
        if incumbent is not None and step_lower_bound_s(budget_for(mode, size, policy).step, hardware) >= incumbent:
            pruned += 1  # its compute alone is slower than a plan already found ([Note: coarse to fine])
            continue
        more = price(mode, size, policy, coarse)
        found += more
        if more:
            step_best[(mode, size, _policy_key(policy))] = min(c.prediction.step_s for c in more)
        if any(_memory_not_binding(budget_for(mode, size, policy).step, c) for c in more):
            settled.add((mode, size, kind))  # everything on the device already: moving more blocks only costs time
        report_progress(what="coarse pass", done=done + 1, total=len(planned), priced=evaluated,
                        best_s=min((c.prediction.step_s for c in found), default=None))
    for mode, size, policy in fine_steps_to_search(planned, step_best, incumbent_s):
        found += price(mode, size, policy, fine)
        report_progress(what="fine pass", done=1, total=1, priced=evaluated,
                        best_s=min((c.prediction.step_s for c in found), default=None))
    if not found and pruned and not over_host:
        raise DegreePruned(f"pruned: the compute alone of each of its {pruned} steps is slower than the "
                           f"{incumbent_s:.4g} s step already found at another degree")
    if not found:
        if over_host:
            raise ValueError(
                f"no configuration fits host memory {host_limit} bytes ({host_limit / 2**30:.1f} GiB"
                f"{'' if host_memory_bytes is not None else ', measured on this machine'}) with {per_host} rank(s) "
                f"per host (and device_memory_budget_bytes={budget}); {over_host} fitting the device need more host "
                f"memory, the least {int(least_host)} bytes per rank ({int(least_host) * per_host / 2**30:.1f} GiB "
                f"per host{'' if disk is None else f' beside a {disk.capacity_bytes}-byte disk'}). Use more machines, "
                f"a larger budget, {'a disk tier' if disk is None else 'a larger disk'}, or raise {host_memory_name} "
                "if the host is larger"
                f"{'' if host_memory_bytes is not None else ' (the target host, not this one)'}")
        # the least over every chunk size the search priced (the first candidate for the whole limit alone overstated
        # it: a tiny GPT-2 was told 676356 bytes where a budget of 512500 fitted, with a smaller chunk), and as a
        # budget: the margin comes off whatever is given
        # (smaller rooms pick smaller chunks, whose working set is smaller: the candidates for a few of them count too)
        for room in (limit >> k for k in range(6)):
            tried_sizes.update(_chunk_sizes(rank_profile, pack_world_size, b, max(1, room), chunk_size_numel,
                                            num_chunk_sizes, False, chunk_memo)[0])
        largest = max(rank_profile.param_numels, default=1)  # replicated buckets may be smaller: they pack otherwise
        # the least-activation policies bound the need (every block recomputed or offloaded; keep for a grid of one):
        # the others only add activations, and each step built here is memoised for the next size's

        def need_at(size: int) -> int:
            return min(budget_for("sharded", size, p).step.working_set_bytes() + (
                budget_for("sharded", size, p).step.activation_bytes if activations_on_device else 0)
                for p in extremes)

        need = min(need_at(size) for size in tried_sizes if size >= largest)
        # and the candidates the search would try at about that need (GPT-2 8x1024 told from 100 MB: 7% less)
        for _ in range(2):
            for room in (need >> k for k in range(3)):
                tried_sizes.update(_chunk_sizes(rank_profile, pack_world_size, b, max(1, room), chunk_size_numel,
                                                num_chunk_sizes, False, chunk_memo)[0])
            need = min(need_at(size) for size in tried_sizes if size >= largest)
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
    # the refinement polishes a degree that can win: not one whose best is well behind another degree's
    competitive = incumbent_s is None or found[0].prediction.step_s <= incumbent_s * (1.0 + REFINE_SLACK)
    if refine_starts and refine_max_priced and competitive:
        report_progress(what="local refinement", done=0, total=1, priced=evaluated, best_s=found[0].prediction.step_s)
        ctx = RefineContext(hardware=hardware, step_for=budget_for, activations_on_device=activations_on_device,
                            prefetch_depths=tuple(prefetch_depths), policy_searched=len(policies) > 1,
                            host_budget_bytes=host_limit // per_host if host_limit is not None else None,
                            host_limit_bytes=host_limit, ranks_per_host=per_host,
                            overlap_host_optimizer=overlap_host_optimizer, disk=disk)
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
    plan.reasons[2:2] = _data_parallel_reasons(modes, best, best_by_mode, world_size, tp)
    plan.reasons += [r for r in (disk_reason(best.prediction, per_host),) if r]
    # the frozen layout priced ([Note: whole frozen chunks] in chunk/_frozen_whole.py; plain data parallelism only)
    plan.frozen_whole = frozen_whole and best.data_parallel == "sharded" and ep == 1 and tp == 1
    if ep > 1 or tp > 1:  # what prepare sees on each rank after parallelize ([Note: expert parallel pricing])
        plan.num_params, plan.param_order = rank_profile.num_params, rank_param_order(rank_profile)
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
              optimizer: Any = None, inference: bool = False, runtime_probe: Any = None) -> ElixirPlan:
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
    ``optimizer`` is then unused. ``runtime_probe``: what :func:`~hf_elixir.profiler.probe_hardware` times hf_elixir's
    own overheads with (``prepare`` passes one: [Note: runtime probe] in ``profiler/_runtime_probe.py``).

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
                                  process_group=getattr(config, "process_group", None), runtime_probe=runtime_probe)
    profile = _profile_for(model, sample_batch, device.type if device is not None else "cpu", hardware,
                           forward_only=inference)
    budget = config.device_memory_budget_bytes
    if budget is None and hardware.device_kind != "cuda":
        budget = hardware.device_total_bytes
    data_parallel, replicated_placements, note = _auto_data_parallel(model, config, world_size)
    mesh_world_size, parallel_kwargs = _parallel_search_args(model, config, world_size)
    frozen_whole = searched_frozen_whole(model, config, world_size, hardware)
    host_budget = getattr(config, "host_memory_budget_bytes", None)  # per rank; the search limits per machine
    per_host = _ranks_per_host(mesh_world_size, None)
    # an explicit budget charges activations on any device (the simulated pool too) unless the config opts
    # out; None: the device decides (the card on CUDA covers them, the unlimited simulated pool does not)
    explicit = config.device_memory_budget_bytes is not None
    covers = bool(getattr(config, "budget_covers_activations", True)) if explicit else None
    user_policy = getattr(config, "activation_policy", None)  # the user's choice is priced, not searched
    fixed_policy = (resolve_activation_policy(profile_blocks(profile), {}, False, user_policy)
                    if user_policy is not None else None)
    result = search(profile, hardware, world_size=mesh_world_size, precision=config.precision,
                    device_memory_budget_bytes=budget, chunk_size_numel=config.chunk_size_numel,
                    activations_on_device=covers, activation_policy=fixed_policy,
                    data_parallel=data_parallel, replicated_placements=replicated_placements,
                    host_memory_bytes=host_budget * per_host if host_budget else None, ranks_per_host=per_host,
                    host_memory_name="ElixirConfig.host_memory_budget_bytes (per rank)",
                    overlap_host_optimizer=getattr(config, "overlap_host_optimizer", None),
                    reduce_dtype=getattr(config, "reduce_dtype", "fp32"), **optimizer_cost_terms(optimizer, config),
                    disk=config_disk_tier(config, hardware, per_host), frozen_whole=frozen_whole, **parallel_kwargs)
    plan = result.plan
    plan.world_size = world_size  # prepare's group (the data-parallel one when given as ElixirConfig.process_group)
    if note:
        plan.reasons.append(note)
    if result.best.data_parallel == "sharded":  # a parallelized model's: those parallelize applied
        from hf_elixir.parallel import placements_for_plan  # noqa: PLC0415

        plan.placements = placements_for_plan(model, config)
    if world_size > 1:
        # each rank profiled its own step: timings differ, and ranks with different plans (one replicated,
        # one sharded) would issue different collectives and hang. Every rank takes rank 0's plan.
        group = getattr(config, "process_group", None)
        box = [plan]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        plan = box[0]
    return plan


def _parallel_search_args(model: nn.Module, config: Any, world_size: int) -> tuple[int, dict[str, Any]]:
    """``(ranks, search kwargs)`` for :func:`auto_plan`: a model rewritten by ``hf_elixir.parallel.parallelize`` is
    priced as one rank of its mesh (all its ranks, its tensor- and expert-parallel sizes, the placements it applied;
    ``parallelized=True``: the profiled step is already that rank's, [Note: tensor parallel pricing] and [Note:
    expert parallel pricing]); any other model as ``world_size`` data-parallel ranks."""
    from hf_elixir.parallel import get_parallel_state  # noqa: PLC0415

    state = get_parallel_state(model)
    if state is None:
        return world_size, {}
    mesh = state.mesh
    return mesh.world_size, dict(
        expert_parallel_size=mesh.ep_size, tensor_parallel_size=mesh.tp_size, parallelized=True,
        tensor_parallel_placements=dict(state.placements) if mesh.tp_size > 1 else None)


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
