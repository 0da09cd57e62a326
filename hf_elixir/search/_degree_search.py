"""The parallel degrees the configuration search (``_plan_search.py``) compares: :func:`search` at each
expert-parallel degree (:func:`search_expert_parallel`), at each tensor-parallel degree (:func:`search_tensor_parallel`),
or both (:func:`search_parallel`, what ``hf-elixir plan --tensor-parallel-size auto`` runs), and the reason the
winning degree gives ([Note: expert parallel pricing] in ``_expert_parallel.py``, [Note: tensor parallel pricing] in
``_tensor_parallel.py``).

The ranks of a tensor-parallel group read one batch, so degrees of tensor parallelism are compared per token of the
whole job: a degree-``tp`` step runs ``tp`` times fewer tokens over the same ranks than a degree-1 step.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from torch import nn

from hf_elixir.profiler import HardwareProfile
from hf_elixir.search._expert_parallel import expert_parallel_degrees
from hf_elixir.search._grid import Candidate, SearchResult, _ranking
from hf_elixir.search import _plan_search  # its search() looked up at each call (tests spy on it there)
from hf_elixir.search._coarse import DegreePruned, progress_scope
from hf_elixir.search._plan_search import _ranks_per_host, _resolve_profile, _tensor_parallel_placements
from hf_elixir.search._report import _default_replicated_placements
from hf_elixir.search._tensor_parallel import tensor_parallel_degrees

__all__ = ["search_expert_parallel", "search_parallel", "search_tensor_parallel", "tensor_expert_pairs"]


def search_expert_parallel(model_or_profile: Any, hardware: HardwareProfile, *, world_size: int = 1,
                           expert_parallel_sizes: Iterable[int] | None = None, sample_batch: Any = None,
                           incumbent_per_token: float | None = None, **kwargs: Any) -> SearchResult:
    """:func:`search` at each expert-parallel degree, and the fastest plan that fits any of them ([Note: expert
    parallel pricing] in ``_expert_parallel.py``).

    Args:
        model_or_profile, hardware, world_size, sample_batch, **kwargs: as :func:`search` (``expert_parallel_size``
            excepted).
        expert_parallel_sizes: the degrees to try; default :func:`expert_parallel_degrees`: 1 and the largest that
            divides ``world_size`` and every MoE layer's expert count (only 1 for a dense model).
        incumbent_per_token: the per-token seconds (step seconds times the tensor-parallel degree) of a plan found
            elsewhere; degrees that cannot beat it are pruned ([Note: coarse to fine] in ``_coarse.py``).

    Returns:
        the winning degree's :class:`SearchResult`; its ``alternatives`` include the other degrees' best, and
        ``best_by_expert_parallel`` maps every degree tried to its fastest candidate or to why nothing fitted.

    Raises:
        ValueError: bad arguments, or no degree fits (each degree's reason).
    """
    if "expert_parallel_size" in kwargs:
        raise TypeError("search_expert_parallel takes expert_parallel_sizes=, not expert_parallel_size=")
    started = time.perf_counter()
    profile = _resolve_profile(model_or_profile, sample_batch, hardware)
    degrees = (tuple(expert_parallel_sizes) if expert_parallel_sizes is not None
               else expert_parallel_degrees(profile, world_size))
    if isinstance(model_or_profile, nn.Module) and "replicated_placements" not in kwargs:
        kwargs["replicated_placements"] = _default_replicated_placements(model_or_profile, profile)
    results, failed = _over_degrees(
        "expert parallel", degrees, lambda ep, bound: _plan_search.search(
            profile, hardware, world_size=world_size, expert_parallel_size=ep, incumbent_s=bound, **kwargs),
        incumbent_per_token=incumbent_per_token)
    if not results:
        kind = DegreePruned if all(why.startswith("pruned:") for why in failed.values()) else ValueError
        raise kind("no expert-parallel degree fits: " + "; ".join(f"expert_parallel_size={ep}: {why}"
                                                                       for ep, why in failed.items()))
    winner = min(results, key=lambda ep: _ranking(profile)(results[ep].best))
    result = results[winner]
    others = [r.best for ep, r in results.items() if ep != winner]
    result.alternatives = sorted(result.alternatives + others, key=_ranking(profile))
    result.evaluated = sum(r.evaluated for r in results.values())
    result.search_s = time.perf_counter() - started
    result.best_by_expert_parallel = {ep: results[ep].best if ep in results else failed[ep] for ep in degrees}
    if len(degrees) > 1:
        result.plan.reasons.insert(2, _expert_parallel_reason(winner, result.best_by_expert_parallel))
    return result


def search_tensor_parallel(model_or_profile: Any, hardware: HardwareProfile, *, world_size: int = 1,
                           tensor_parallel_sizes: Iterable[int] | None = None,
                           tensor_parallel_placements: Callable[[int], dict[str, str]] | None = None,
                           sample_batch: Any = None, heads: tuple[int, ...] = (), **kwargs: Any) -> SearchResult:
    """:func:`search` at each tensor-parallel degree, and the fastest plan that fits any of them ([Note: tensor
    parallel pricing] in ``_tensor_parallel.py``).

    Args:
        model_or_profile, hardware, world_size, sample_batch, **kwargs: as :func:`search` (``tensor_parallel_size``
            and ``expert_parallel_size`` excepted: tensor parallelism is searched with expert parallel 1).
        tensor_parallel_sizes: the degrees to try; default :func:`tensor_parallel_degrees`: 1, 2, 4, 8 where they
            divide ``world_size`` and every count of ``heads`` and fit in a node (``ranks_per_host``).
        tensor_parallel_placements: degree -> module placements at it (default, for a model: ``resolve_placements``
            at that degree); a degree whose placements raise ``ValueError`` (heads not divisible) is skipped.
        heads: the attention head counts (query and key/value heads) the degrees must divide.

    Returns:
        the winning degree's :class:`SearchResult`; ``best_by_tensor_parallel`` maps every degree tried to its
        fastest candidate or to why nothing fitted.

    Raises:
        ValueError: bad arguments, or no degree fits (each degree's reason).
    """
    for name in ("tensor_parallel_size", "expert_parallel_size"):
        if name in kwargs:
            raise TypeError(f"search_tensor_parallel takes tensor_parallel_sizes=, not {name}=")
    started = time.perf_counter()
    profile = _resolve_profile(model_or_profile, sample_batch, hardware)
    degrees = (tuple(tensor_parallel_sizes) if tensor_parallel_sizes is not None else
               tensor_parallel_degrees(world_size, _ranks_per_host(world_size, kwargs.get("ranks_per_host")), heads))
    placements_at = tensor_parallel_placements or (lambda tp: _tensor_parallel_placements(model_or_profile, tp))

    def at(tp: int, bound: float | None) -> SearchResult:
        placements = placements_at(tp) if tp > 1 else None
        return _plan_search.search(profile, hardware, world_size=world_size, tensor_parallel_size=tp,
                                   tensor_parallel_placements=placements, incumbent_s=bound, **kwargs)

    results, failed = _over_degrees("tensor parallel", degrees, at, per_token=lambda tp: tp)
    if not results:
        raise ValueError("no tensor-parallel degree fits: " + "; ".join(f"tensor_parallel_size={tp}: {why}"
                                                                       for tp, why in failed.items()))
    # the tp ranks of a row read one batch: a degree's step runs tp times fewer tokens over the W ranks, so the
    # degrees are compared by seconds per token of the whole job (step seconds x tp), then by the device peak
    winner = min(results, key=lambda tp: _per_token_ranking(results[tp].best))
    result = results[winner]
    result.alternatives = sorted(result.alternatives + [r.best for tp, r in results.items() if tp != winner],
                                 key=_per_token_ranking)
    result.evaluated = sum(r.evaluated for r in results.values())
    result.search_s = time.perf_counter() - started
    result.best_by_tensor_parallel = {tp: results[tp].best if tp in results else failed[tp] for tp in degrees}
    if len(degrees) > 1:
        result.plan.reasons.insert(2, _degree_reason("tensor parallel", winner, result.best_by_tensor_parallel))
    return result


def search_parallel(model_or_profile: Any, hardware: HardwareProfile, *, world_size: int = 1,
                    tensor_parallel_placements: Callable[[int], dict[str, str]] | None = None,
                    heads: tuple[int, ...] = (), sample_batch: Any = None, **kwargs: Any) -> SearchResult:
    """The tensor-parallel degrees (:func:`search_tensor_parallel`) and, for a MoE model, the expert-parallel
    degrees above 1 (:func:`search_expert_parallel`; degree 1 is tensor parallel 1) and both together
    (:func:`tensor_expert_pairs`), and the fastest plan per token of the whole job that fits any of them (what
    ``hf-elixir plan --tensor-parallel-size auto`` runs).

    Args:
        as :func:`search_tensor_parallel` (``tensor_parallel_sizes`` may be given; ``expert_parallel_sizes``
        too, for the MoE side).

    Returns:
        the winner's :class:`SearchResult`; its reasons say what the other side's best was.

    Raises:
        ValueError: nothing fits at any degree (the tensor-parallel search's reason first).
    """
    started = time.perf_counter()
    profile = _resolve_profile(model_or_profile, sample_batch, hardware)
    ep_sizes = kwargs.pop("expert_parallel_sizes", None)
    ep_sizes = tuple(d for d in (ep_sizes if ep_sizes is not None else expert_parallel_degrees(profile, world_size))
                     if d > 1)
    results: dict[str, SearchResult] = {}
    errors: dict[str, ValueError] = {}
    try:
        placements_at = tensor_parallel_placements or (lambda tp: _tensor_parallel_placements(model_or_profile, tp))
        results["tensor"] = search_tensor_parallel(profile, hardware, world_size=world_size, heads=heads,
                                                   tensor_parallel_placements=placements_at, **kwargs)
    except ValueError as err:
        errors["tensor"] = err
    if ep_sizes:
        ep_kwargs = {k: v for k, v in kwargs.items() if k != "tensor_parallel_sizes"}
        try:
            incumbent = _per_token_ranking(results["tensor"].best)[0] if "tensor" in results else None
            results["expert"] = search_expert_parallel(profile, hardware, world_size=world_size,
                                                       expert_parallel_sizes=ep_sizes,
                                                       incumbent_per_token=incumbent, **ep_kwargs)
        except ValueError as err:
            errors["expert"] = err
    tp_tried = tuple(results["tensor"].best_by_tensor_parallel) if "tensor" in results else ()
    pairs = tensor_expert_pairs(profile, world_size, tp_tried, ep_sizes) if ep_sizes else ()
    tried_pairs: dict[tuple[int, int], Candidate | str] = {}
    if pairs:  # [Note: tp x ep pricing] in _expert_parallel.py
        try:
            bound = min((_per_token_ranking(r.best)[0] for r in results.values()), default=None)
            found, tried_pairs = _search_tensor_expert(profile, hardware, world_size, pairs, placements_at, bound,
                                                       kwargs)
            if found is not None:
                results["tensor x expert"] = found
        except ValueError as err:
            errors["tensor x expert"] = err
    if not results:
        raise next(iter(errors.values()))
    winner = min(results, key=lambda side: _per_token_ranking(results[side].best))
    result = results[winner]
    result.evaluated = sum(r.evaluated for r in results.values())  # one count: every side's configurations
    result.search_s = time.perf_counter() - started
    # every degree tried, on both sides (a side that failed: its reason for each of its degrees)
    result.best_by_tensor_parallel = (results["tensor"].best_by_tensor_parallel if "tensor" in results else
                                      {1: str(errors.get("tensor", ""))})
    result.best_by_expert_parallel = (results["expert"].best_by_expert_parallel if "expert" in results else
                                      {ep: str(errors.get("expert", "")) for ep in ep_sizes})
    result.best_by_tensor_expert_parallel = tried_pairs
    if len(results) >= 2:
        other = min((r.best for side, r in results.items() if side != winner), key=_per_token_ranking)
        mine = result.best
        result.plan.reasons.insert(2, (
            f"tensor parallel {mine.tensor_parallel_size} x expert parallel {mine.expert_parallel_size} wins per "
            f"token: predicted {mine.prediction.step_s * mine.tensor_parallel_size:.4g} s for the tokens of one "
            f"tensor-parallel-1 step, against {other.prediction.step_s * other.tensor_parallel_size:.4g} s at tensor "
            f"parallel {other.tensor_parallel_size} x expert parallel {other.expert_parallel_size}"))
        result.alternatives = sorted(result.alternatives + [r.best for side, r in results.items() if side != winner],
                                     key=_per_token_ranking)
    elif errors:
        why = str(next(iter(errors.values()))).split(";")[0]
        side = next(iter(errors))
        result.plan.reasons.insert(2, f"the {side}-parallel degrees cannot win: {why}" if "pruned:" in why else
                                   f"the {side}-parallel degrees do not fit: {why}")
    return result


def tensor_expert_pairs(profile: Any, world_size: int, tp_degrees: Iterable[int],
                        ep_degrees: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """The ``(tp, ep)`` pairs, both above 1, that the search prices together for a MoE profile: ``tp`` from the
    tensor-parallel degrees tried, ``ep`` from the expert-parallel ones and ``tp`` itself (the ep group is the tp
    group), where ``ep`` is a multiple of ``tp`` dividing the world and every layer's expert count ([Note: tp x ep
    mesh] in ``hf_elixir/parallel/_mesh.py``)."""
    counts = [layer["num_experts"] for layer in profile.moe_layers.values()]
    if not counts:
        return ()
    return tuple((tp, ep) for tp in sorted({t for t in tp_degrees if t > 1})
                 for ep in sorted({e for e in ep_degrees if e > 1} | {tp})
                 if not ep % tp and not world_size % ep and all(not c % ep for c in counts))


def _search_tensor_expert(profile: Any, hardware: HardwareProfile, world_size: int, pairs: tuple[tuple[int, int], ...],
                          placements_at: Callable[[int], dict[str, str]], incumbent_per_token: float | None,
                          kwargs: dict[str, Any]) -> tuple[SearchResult | None, dict[tuple[int, int], Any]]:
    """:func:`search` at each ``(tp, ep)`` pair: the fastest per token of the whole job (the tp ranks of a row share
    one batch, as tensor parallel alone), ``None`` when no pair fits or can win, and each pair's fastest candidate or
    why it has none."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("tensor_parallel_sizes", "expert_parallel_sizes")}
    results, failed = _over_degrees(
        "tensor x expert parallel", pairs, lambda pair, bound: _plan_search.search(
            profile, hardware, world_size=world_size, tensor_parallel_size=pair[0], expert_parallel_size=pair[1],
            tensor_parallel_placements=placements_at(pair[0]), incumbent_s=bound, **kwargs),
        per_token=lambda pair: pair[0], incumbent_per_token=incumbent_per_token)
    tried = {pair: results[pair].best if pair in results else failed[pair] for pair in pairs}
    if not results:
        return None, tried
    winner = min(results, key=lambda pair: _per_token_ranking(results[pair].best))
    result = results[winner]
    result.alternatives = sorted(result.alternatives + [r.best for pair, r in results.items() if pair != winner],
                                 key=_per_token_ranking)
    result.evaluated = sum(r.evaluated for r in results.values())
    return result, tried


def _over_degrees(what: str, degrees: tuple[int, ...], search_at: Callable[[int, float | None], SearchResult],
                  per_token: Callable[[int], int] = lambda degree: 1, incumbent_per_token: float | None = None,
                  ) -> tuple[dict[int, SearchResult], dict[int, str]]:
    """``search_at(degree, incumbent step seconds or None)`` at each degree, in order, each told the best per-token
    seconds found so far (``per_token(degree)``: the tokens of a tensor-parallel-1 step over this degree's, so the
    bound is in this degree's step seconds); ``(results, why each other degree has none)``. A degree with nothing
    that fits, or nothing that can win (:class:`DegreePruned`), is recorded; with one degree its error is raised."""
    results: dict[int, SearchResult] = {}
    failed: dict[int, str] = {}
    best = incumbent_per_token
    for i, degree in enumerate(degrees):
        with progress_scope(f"{what} {degree} ({i + 1} of {len(degrees)})"):
            try:
                result = search_at(degree, None if best is None else best / per_token(degree))
            except ValueError as err:
                if len(degrees) == 1 and not isinstance(err, DegreePruned):
                    raise
                failed[degree] = str(err)
                continue
        results[degree] = result
        mine = result.best.prediction.step_s * per_token(degree)
        best = mine if best is None else min(best, mine)
    return results, failed


def _per_token_ranking(cand: Candidate) -> tuple:
    """Candidates of different tensor-parallel degrees, best first: step seconds times the degree (the seconds the
    W ranks take for the tokens tensor parallel 1 runs in one step), then the device peak."""
    return cand.prediction.step_s * cand.tensor_parallel_size, cand.prediction.device_peak_bytes


def _expert_parallel_reason(winner: int, tried: dict[int, Candidate | str]) -> str:
    """Why the winning expert-parallel degree won, against each other degree tried."""
    return _degree_reason("expert parallel", winner, tried)


def _degree_reason(what: str, winner: int, tried: dict[int, Candidate | str]) -> str:
    """Why the winning ``what`` (``"expert parallel"`` / ``"tensor parallel"``) degree won, against each other
    degree tried."""
    mine = tried[winner]
    assert isinstance(mine, Candidate), f"the winning degree {winner} has a candidate"

    def seconds(cand: Candidate, degree: int) -> str:  # tensor parallel: per the tokens of a tp = 1 step first
        if what != "tensor parallel":
            return f"{cand.prediction.step_s:.4g} s a step"
        return (f"{cand.prediction.step_s * degree:.4g} s for the tokens of one tensor-parallel-1 step ("
                f"{cand.prediction.step_s:.4g} s a step" + (f", which runs 1/{degree} of them)" if degree > 1 else ")"))

    parts = []
    for degree, other in tried.items():
        if degree == winner:
            continue
        if isinstance(other, Candidate):
            parts.append(f"{seconds(other, degree)} and {other.prediction.host_bytes / 2**30:,.2f} GiB of host "
                         f"memory per rank at {what} {degree}")
        elif other.startswith("pruned:"):
            parts.append(f"{what} {degree} not searched in full ({other.split(';')[0]})")
        else:
            parts.append(f"nothing fits at {what} {degree} ({other.split(';')[0]})")
    return (f"{what} {winner} wins{' per token' if what == 'tensor parallel' else ''}: predicted "
            f"{seconds(mine, winner)} and "
            f"{mine.prediction.host_bytes / 2**30:,.2f} GiB of host memory per rank, against " + "; ".join(parts))
