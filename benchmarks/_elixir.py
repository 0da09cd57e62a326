"""hf_elixir as a benchmark peer: prepare, step, and per-step traffic/memory counters.

Options read from ``RunSpec.options`` (at most one of the first three):
    budget_bytes (int): ``ElixirConfig.device_memory_budget_bytes``. None of the three = everything
        resident (``None`` budget).
    budget_fraction (float): the budget is this fraction of the device peak of an all-resident probe
        (one step on a deep copy of the model, in this same process, before the measured run).
    min_budget_probes (int): the budget is the smallest one found by bisecting bytes between 0 and the
        all-resident peak with this many one-step probes (each on a fresh deep copy); a probe passes if
        its step runs and its device peak stays within the budget. Every rank runs the same probes, so
        the collectives stay matched.
    chunk_size_numel (int | None): ``ElixirConfig.chunk_size_numel`` (None = the library's choice).
    default_placement (str): ``ElixirConfig.default_placement`` ("auto" unless given).
    overlap_host_optimizer (bool | None): ``ElixirConfig.overlap_host_optimizer`` (None unless given); the
        searched plan is priced with the same setting.
    search (bool): use the plan ``hf_elixir.search.auto_plan`` finds for that budget (else the core's
        heuristic placement).
    expert_parallel_size (int): ``ElixirConfig.expert_parallel_size`` (1 unless given). Above 1 the model is
        rewritten by ``hf_elixir.parallel.parallelize`` before its optimizer is built: each rank keeps
        ``experts / expert_parallel_size`` experts of every MoE layer (placed by the model config's own
        ``base_model_ep_plan``, or by ``placements``), and the rest is chunked over the data-parallel group.
        The budget can then only be ``budget_bytes``: the probes and the search price the unparallelized model.
    placements (dict[str, str]): ``ElixirConfig.placements`` (module-name glob -> placement; none unless given).
    profile_dir (str): on CUDA, profile the last timed step with ``torch.profiler`` and write its Chrome
        trace there; ``stats()`` then reports host->device copies per CUDA stream and how many of them
        overlapped a kernel on another stream (evidence of side-stream prefetch).

``stats()`` returns rank 0's ``hf_elixir.memory_stats(model)`` after the last step, plus the counters'
per-step averages over the timed steps (``h2d_bytes_per_step``, ``d2h_bytes_per_step``, ...) and the
chunk access trace of one step with the chunk size, for the Belady bound.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

__all__ = ["setup_elixir", "elixir_available", "buffers_to"]

_COUNTERS = ("h2d_bytes", "d2h_bytes", "allgather_bytes", "reduce_scatter_bytes", "num_evictions", "gather_wait_s",
             "reduce_wait_s")


def elixir_available() -> str:
    """'' when ``hf_elixir.prepare`` and ``hf_elixir.memory_stats`` exist, else why not."""
    try:
        import hf_elixir
    except ImportError as exc:
        return f"hf_elixir does not import: {exc}"
    missing = [name for name in ("prepare", "memory_stats") if not hasattr(hf_elixir, name)]
    return f"hf_elixir has no {', '.join(missing)} yet (the core has not landed)" if missing else ""


def _optimizer(model, spec) -> torch.optim.Optimizer:
    """The optimizer every Elixir run of the benchmark trains with (the peers' AdamW settings); the plan search and
    the budget floor are given it too, so they price its state bytes, not an assumed AdamW's."""
    from benchmarks._runner import ADAM_KW

    return torch.optim.AdamW(model.parameters(), lr=spec.lr, **ADAM_KW)


def _config(spec, budget_bytes, plan=None, default_placement=None):
    """The ``hf_elixir.ElixirConfig`` of a run: fp32, ``budget_bytes`` of model data, ``spec.options``' settings."""
    import hf_elixir

    # budgets here bound model data (the peers' budgets do too): activations outside them
    return hf_elixir.ElixirConfig(precision="fp32", device_memory_budget_bytes=budget_bytes,
                                  budget_covers_activations=False,
                                  chunk_size_numel=spec.options.get("chunk_size_numel"), plan=plan,
                                  default_placement=default_placement or spec.options.get("default_placement", "auto"),
                                  overlap_host_optimizer=spec.options.get("overlap_host_optimizer"),
                                  expert_parallel_size=_expert_parallel_size(spec),
                                  placements=dict(spec.options.get("placements") or {}))


def _expert_parallel_size(spec) -> int:
    """``options["expert_parallel_size"]`` (1 unless given).

    Raises:
        ValueError: above 1 together with ``budget_fraction`` / ``min_budget_probes`` / ``search``.
    """
    size = int(spec.options.get("expert_parallel_size", 1))
    clash = [k for k in ("budget_fraction", "min_budget_probes", "search") if spec.options.get(k)]
    if size > 1 and clash:
        raise ValueError(f"RunSpec.options expert_parallel_size={size} cannot be combined with {', '.join(clash)} "
                         "(their probes and the plan search price the model before parallelize); give budget_bytes")
    return size


def buffers_to(model, device: str) -> None:
    """Move ``model``'s buffers (position ids, masks) to ``device``: ``prepare()`` places only the parameters."""
    if device != "cpu":
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = buf.to(device)


def _prepare(model, spec, budget_bytes, plan=None, default_placement=None):
    import hf_elixir

    buffers_to(model, spec.device)
    config = _config(spec, budget_bytes, plan, default_placement)
    if config.expert_parallel_size > 1:  # experts sliced per rank before the optimizer sees the parameters
        from hf_elixir.parallel import parallelize

        parallelize(model, config)
    return hf_elixir.prepare(model, _optimizer(model, spec), config=config)


def _probe(model, spec, budget_bytes, default_placement=None) -> tuple[bool, int | None, str]:
    """One step of a deep copy of ``model`` at ``budget_bytes``: (passed, device peak, error)."""
    import copy

    import hf_elixir

    probe = copy.deepcopy(model)
    try:
        probe, optimizer = _prepare(probe, spec, budget_bytes, default_placement=default_placement)
        ids = torch.randint(0, spec.model.vocab_size, (spec.model.batch_size, spec.model.seq_len),
                            generator=torch.Generator().manual_seed(7)).to(spec.device)
        probe(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak = int(hf_elixir.memory_stats(probe)["device_peak_bytes"])
    except Exception as exc:  # a budget too small is an expected outcome of a probe
        return False, None, f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        del probe
    ok = budget_bytes is None or peak <= budget_bytes
    return ok, peak, "" if ok else f"device peak {peak} > budget {budget_bytes}"


def _find_budget(model, spec) -> tuple[int | None, dict[str, Any]]:
    options = spec.options
    if "budget_bytes" in options:
        return options["budget_bytes"], {}
    if "budget_fraction" not in options and "min_budget_probes" not in options:
        return None, {}
    # the sharded all-resident peak (replicating everything would need more): budgets stay comparable
    # across runs and with the peers' per-rank shares
    ok, resident_peak, error = _probe(model, spec, None, default_placement="sharded")
    if not ok or resident_peak is None:
        raise RuntimeError(f"the all-resident hf_elixir probe failed, so no budget can be derived: {error}")
    info: dict[str, Any] = {"resident_peak_bytes": resident_peak}
    if "budget_fraction" in options:
        # a fraction of the all-resident peak, but never below what prepare accepts (tiny models)
        budget = int(resident_peak * options["budget_fraction"])
        floor = _library_min_budget(model, spec)
        if floor is not None and budget < floor:
            info["raised_to_library_min_bytes"] = floor
            budget = floor
        return budget, info
    # start from the library's own minimum (hf_elixir.min_device_budget_bytes); if a step does not run
    # there, bisect between it and the all-resident peak
    floor = _library_min_budget(model, spec)
    info["library_min_budget_bytes"] = floor
    log = []
    if floor is not None:
        ok, peak, error = _probe(model, spec, floor)
        log.append([floor, ok, peak, error])
        if ok:
            info["min_budget_probes_log"] = log
            return floor, info
    lo, hi = (floor or 0), resident_peak
    for _ in range(int(options["min_budget_probes"])):
        mid = (lo + hi) // 2
        ok, peak, error = _probe(model, spec, max(mid, 1))
        log.append([mid, ok, peak, error])
        lo, hi = (lo, mid) if ok else (mid, hi)
    info["min_budget_probes_log"] = log
    return hi, info


def _searched_plan(model, spec, budget_bytes, info: dict[str, Any]):
    """``hf_elixir.search.auto_plan`` on one sample batch (profiles a step, probes the hardware, searches).

    Called directly because ``ElixirConfig(search="auto")`` in ``prepare`` has no sample batch to profile.
    """
    import time

    import hf_elixir
    from hf_elixir.search import auto_plan

    ids = torch.randint(0, spec.model.vocab_size, (spec.model.batch_size, spec.model.seq_len),
                        generator=torch.Generator().manual_seed(11)).to(spec.device)
    config = hf_elixir.ElixirConfig(precision="fp32", device_memory_budget_bytes=budget_bytes,
                                    budget_covers_activations=False,
                                    chunk_size_numel=spec.options.get("chunk_size_numel"),
                                    default_placement=spec.options.get("default_placement", "auto"),
                                    overlap_host_optimizer=spec.options.get("overlap_host_optimizer"))
    start = time.perf_counter()
    plan = auto_plan(model, {"input_ids": ids, "labels": ids}, config, optimizer=_optimizer(model, spec))
    model.zero_grad(set_to_none=True)
    info.update(search_s=round(time.perf_counter() - start, 2), plan_chunk_size_numel=plan.chunk_size_numel,
                plan_resident_chunks=len(plan.resident_chunks), plan_device_shard_chunks=len(plan.device_shard_chunks),
                plan_device_optim_chunks=len(plan.device_optim_chunks), plan_prefetch_depth=plan.prefetch_depth,
                plan_predicted_step_s=plan.predicted_step_s, plan_reasons=list(plan.reasons)[:6])
    return plan


def _library_min_budget(model, spec) -> int | None:
    import hf_elixir

    fn = getattr(hf_elixir, "min_device_budget_bytes", None)
    if fn is None:
        return None
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    config = hf_elixir.ElixirConfig(precision="fp32", chunk_size_numel=spec.options.get("chunk_size_numel"))
    return int(fn(model, _optimizer(model, spec), config=config, world_size=world_size))


def setup_elixir(model, spec, rank):
    import hf_elixir

    from benchmarks._runner import Runner

    _expert_parallel_size(spec)  # a bad combination raises here, not as a failed budget probe
    budget_bytes, budget_info = _find_budget(model, spec)
    plan = _searched_plan(model, spec, budget_bytes, budget_info) if spec.options.get("search") else None
    model, optimizer = _prepare(model, spec, budget_bytes, plan)
    state: dict[str, Any] = {"steps": 0, "start": None}

    def step(ids: torch.Tensor) -> float:
        if state["steps"] == spec.warmup_steps:
            state["start"] = dict(hf_elixir.memory_stats(model))
        last = state["steps"] == max(spec.warmup_steps + spec.steps - 1, 0)
        profiler = _start_profiler(spec) if last else None
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if profiler is not None:
            state["profile"] = _stop_profiler(profiler, spec, rank)
        state["steps"] += 1
        return loss.item()

    def stats() -> dict[str, Any]:
        end = dict(hf_elixir.memory_stats(model))
        out: dict[str, Any] = {k: v if isinstance(v, float) else int(v) for k, v in end.items()}
        out["budget_bytes"] = budget_bytes
        out.update(budget_info)
        timed = state["steps"] - spec.warmup_steps
        if state["start"] is not None and timed > 0:
            for key in _COUNTERS:
                if key in end and key in state["start"]:
                    out[f"{key}_per_step"] = (end[key] - state["start"][key]) / timed
        out.update(state.get("profile", {}))
        out.update(_belady_inputs(model))  # last: it reshards every evictable chunk
        return out

    return Runner(step, stats)


def _start_profiler(spec):
    if not spec.options.get("profile_dir") or not spec.device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    profiler.__enter__()
    return profiler


def _merged_intervals(events) -> dict[str, tuple[list[float], list[float]]]:
    by_stream: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        by_stream.setdefault(str(e.get("tid")), []).append((e["ts"], e["ts"] + e.get("dur", 0)))
    out = {}
    for stream, spans in by_stream.items():
        spans.sort()
        starts, ends = [], []
        for a, b in spans:
            if ends and a <= ends[-1]:
                ends[-1] = max(ends[-1], b)
            else:
                starts.append(a)
                ends.append(b)
        out[stream] = (starts, ends)
    return out


def _stop_profiler(profiler, spec, rank) -> dict[str, Any]:
    """Copies host->device per stream, and how many overlapped a kernel running on another stream."""
    import json
    from pathlib import Path

    torch.cuda.synchronize()
    profiler.__exit__(None, None, None)
    path = Path(spec.options["profile_dir"]) / f"{spec.key()}_rank{rank}_trace.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    events = json.loads(path.read_text()).get("traceEvents", [])
    copies = [e for e in events if e.get("ph") == "X" and "HtoD" in str(e.get("name", ""))]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    per_stream: dict[str, int] = {}
    merged = _merged_intervals(kernels)  # stream -> (starts, ends) of its busy intervals, sorted
    overlapped = 0
    for copy in copies:
        tid = str(copy.get("tid"))
        per_stream[tid] = per_stream.get(tid, 0) + 1
        start, end = copy["ts"], copy["ts"] + copy.get("dur", 0)
        for stream, (starts, ends) in merged.items():
            if stream == tid:
                continue
            i = bisect.bisect_left(starts, end) - 1  # last busy interval starting before the copy ends
            if i >= 0 and ends[i] > start:
                overlapped += 1
                break
    kernel_names = sorted({str(k.get("name")) for k in kernels})
    return {"profile_trace": str(path), "htod_copies_per_stream": per_stream,
            "htod_copies_overlapping_compute": overlapped, "num_htod_copies": len(copies),
            "kernel_names_sample": [n for n in kernel_names if "triton" in n.lower()][:20]}


def _belady_inputs(model) -> dict[str, Any]:
    """The library's recorded chunk access order of the last step and the cache it had, for the bound.

    Reads ``hf_elixir.api.get_state(model).manager``: ``prev_trace`` (chunk ids, one per module access,
    in order), each chunk's ``shard_bytes`` / ``full_bytes`` and whether it moves at all (not resident,
    shard on the host). The cache capacity is the budget minus the device bytes that stay put (measured
    after resharding every evictable chunk), in units of the largest streamed chunk. Ignoring the
    transient gradient buffers makes this capacity an over-estimate, so the bound stays a lower bound.
    ``optimizer_refresh_h2d_bytes``: parameters that stay on the device while their optimizer state is
    on the host come back after every update (hf_elixir's ``_refresh_compute_copies``); no eviction
    policy avoids that, so it is added to the bound.
    """
    try:
        from hf_elixir.api import get_state

        manager = get_state(model).manager
        trace = list(manager.prev_trace)
        chunks = manager.chunks
        budget = manager.pool.budget_bytes
        world_size = int(getattr(chunks[0], "world_size", 1)) if chunks else 1
        # chunks whose gathered copy can leave the device: at 1 rank those whose shard lives on the host
        # (a device shard *is* the gathered chunk there); at >1 ranks every non-resident chunk
        moving = [c for c in chunks if not c.resident and (world_size > 1 or not c.shard_on_device)]
        # bytes one onload moves: the first unshard of a step onloads the shard if it lives on the host
        # (0 if it is on the device: the all-gather does the rest); any later one in the same step can do
        # the same by re-gathering (strict bound), or, under hf_elixir's rank-local refill rule (see
        # hf_elixir/chunk/chunk.py [Note: rank-local refill]), copies the whole gathered chunk back
        streamed = {c.chunk_id: int(0 if c.shard_on_device else c.shard_bytes) for c in moving}
        refill = {c.chunk_id: int(c.full_bytes if world_size > 1 else c.shard_bytes) for c in moving}
        # a chunk whose parameters stay on the device but whose optimizer state is on the host must
        # bring its updated parameters back after every step, whatever the eviction policy
        refresh = sum(int(c.shard_bytes) for c in chunks
                      if getattr(c, "trainable", True) and (c.shard_on_device or c.resident)
                      and not c.optim_on_device)
        manager.reshard_all()
        persistent = int(manager.pool.used_bytes)
        largest = max((c.full_bytes for c in moving), default=0)
    except Exception as exc:  # the core's internals moved: say so instead of guessing
        return {"chunk_trace_error": f"cannot read the chunk manager: {type(exc).__name__}: {exc}"}
    if budget is None:
        return {"chunk_trace_len": len(trace), "num_streamed_chunks": len(streamed),
                "optimizer_refresh_h2d_bytes": refresh}
    capacity = max((budget - persistent) // largest, 1) if largest else 0
    return {"chunk_trace": trace, "streamed_chunk_bytes": {str(k): v for k, v in streamed.items()},
            "cache_blocks": int(capacity), "persistent_device_bytes": persistent,
            "largest_streamed_chunk_bytes": int(largest), "optimizer_refresh_h2d_bytes": refresh,
            "refill_chunk_bytes": {str(k): v for k, v in refill.items()}, "world_size": world_size}
