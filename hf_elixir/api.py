"""``hf_elixir.prepare``: pack a model's parameters into chunks, place them, install hooks, wrap the
optimizer. Also ``memory_stats`` and ``min_device_budget_bytes``.

``prepare`` extends the given model in place and returns the same object (as FSDP2's
``fully_shard`` does), so ``model.config``, ``generate()``, ``state_dict()`` and ``save_pretrained``
keep working.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hf_elixir.chunk.chunk import Chunk, ChunkBytes, ParamSlot
from hf_elixir.chunk.manager import ChunkManager, budget_error
from hf_elixir.chunk.packing import ChunkLayout, pack_chunks, replicated_chunk_size
from hf_elixir.config import ElixirConfig
from hf_elixir.optim.optimizer import ElixirOptimizer, optimizer_state_numel_factor
from hf_elixir.plan import ElixirPlan
from hf_elixir.runtime.guards import install_guards
from hf_elixir.runtime.hooks import ModuleHandle, install_hooks
from hf_elixir.runtime.state_dict import install_state_dict_hooks

__all__ = ["prepare", "memory_stats", "reset_memory_stats", "get_state", "min_device_budget_bytes", "ElixirState"]

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ATTR = "_hf_elixir_state"


@dataclass
class ElixirState:
    """What ``prepare`` attached to a model (``get_state(model)``)."""

    manager: ChunkManager
    handles: list[ModuleHandle]
    config: ElixirConfig
    plan: ElixirPlan
    optimizer: ElixirOptimizer | None = None


def _refuse_deepcopy(memo) -> None:
    """Set as the prepared model's ``__deepcopy__`` (``copy.deepcopy`` looks it up on the instance), so
    a copy fails at once instead of cloning every parameter first and failing at its first forward."""
    raise TypeError(
        "copy.deepcopy of a model prepared by hf_elixir.prepare is not supported: its parameters are views "
        "into chunk buffers (sharded, offloaded) that a copy cannot own. Copy the model before prepare, or "
        "build a plain copy from its full weights: `other = type(model)(model.config); "
        "other.load_state_dict(model.state_dict())`")


def get_state(model: torch.nn.Module) -> ElixirState:
    """The :class:`ElixirState` of a prepared model.

    Raises:
        ValueError: the model was not prepared by :func:`prepare`.
    """
    state = getattr(model, _ATTR, None)
    if state is None:
        raise ValueError("this model was not prepared by hf_elixir.prepare(model, ...); call that first")
    return state


def _compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_precision_supported(precision: str, device: torch.device) -> None:
    """Raise ``ValueError`` for a precision the compute device cannot run (bf16 before Ampere)."""
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"ElixirConfig.precision='bf16' is not supported by this GPU ({name}); use "
                         "precision='fp16' (with loss scaling) or 'fp32'")


def _default_group(config: ElixirConfig):
    if config.process_group is not None:
        return config.process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def _job_group(model: torch.nn.Module, group):
    """The group of every rank training this model (the optimizer's norm and overflow reductions): the
    data-parallel group, or the whole mesh (the world) of a tensor/expert-parallel model."""
    from hf_elixir.parallel import get_parallel_state  # noqa: PLC0415 (avoid an import cycle)

    return dist.group.WORLD if get_parallel_state(model) is not None else group


def _unique_params(model: torch.nn.Module) -> dict[torch.nn.Parameter, list[str]]:
    names: dict[torch.nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return names


def _default_chunk_size(numels: list[int], budget_bytes: int | None, world_size: int, element_bytes: int) -> int:
    """Chunk size when neither the config nor a plan gives one.

    Without a budget, few large chunks (an eighth of the model, at least the largest parameter): fewer
    collectives. Under a budget the working set (two units' chunks) must fit, so the smallest size with
    near-least padding between the largest parameter and twice it (the search's waste ranking); a
    default that grew with the model would stop fitting a fixed budget as the model grows.
    """
    numels = [n for n in numels] or [1]
    largest, total = max(max(numels), 1), sum(numels)
    if budget_bytes is None:
        return max(largest, -(-total // 8))
    from hf_elixir.search import search_chunk_size  # noqa: PLC0415 (keeps import order acyclic)

    upper = min(max(total, largest), max(2 * largest, 2**16))
    result = search_chunk_size(numels, world_size=world_size, element_bytes=element_bytes, upper_bound_numel=upper)
    least = min(c.waste_fraction for c in result.candidates)
    return min(c.chunk_size_numel for c in result.candidates if c.waste_fraction <= least + 0.05)


def _replicated_fits(numels: list[int], config: ElixirConfig, optimizer, element_bytes: int) -> tuple[bool, str]:
    """Would the whole model, its gradients and its optimizer states fit each rank's device budget
    (what ``DistributedDataParallel`` needs)? Returns ``(fits, reason)``."""
    total = sum(numels)
    grad_bytes = 4 if config.reduce_dtype == "fp32" else element_bytes
    optim = 0
    if optimizer is not None and config.offload_optimizer is not True:
        master = 0 if config.precision == "fp32" else 4
        optim = total * (4 * (1 + optimizer_state_numel_factor(optimizer)) + master)
    needed = total * (element_bytes + grad_bytes) + optim
    budget = config.device_memory_budget_bytes
    if budget is None and torch.cuda.is_available():
        budget = torch.cuda.mem_get_info()[0] // 2  # leave half of the free memory to activations
    if budget is None:
        return True, f"replicated: no device budget (model, gradients, optimizer states: {needed} bytes)"
    fits = needed <= budget
    return fits, (f"{'replicated' if fits else 'sharded'}: model, gradients and optimizer states need {needed} "
                  f"bytes per rank replicated; budget {budget} bytes")


def _resolve_default_placement(model, config: ElixirConfig, plan: ElixirPlan | None, numels: list[int],
                               optimizer, world_size: int, element_bytes: int) -> tuple[ElixirConfig, str]:
    """Turn ``default_placement="auto"`` into "sharded" or "replicated" (see ElixirConfig)."""
    from hf_elixir.parallel import get_parallel_state, placements_for_plan  # noqa: PLC0415

    if config.default_placement != "auto":
        return config, ""
    sharded = dataclasses.replace(config, default_placement="sharded")
    if world_size == 1 or get_parallel_state(model) is not None:
        return sharded, ""
    replicated = dataclasses.replace(config, default_placement="replicated")
    if plan is not None and plan.placements:
        if dict(plan.placements) == placements_for_plan(model, replicated):
            return replicated, "replicated: the plan's placements"
        return sharded, ""
    fits, reason = _replicated_fits(numels, config, optimizer, element_bytes)
    return (replicated if fits else sharded), "default_placement='auto' -> " + reason


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """The plan's memory peak assumes activation checkpointing: turn it on (Hugging Face models)."""
    enable = (getattr(model, "activation_checkpointing_enable", None)
              or getattr(model, "gradient_checkpointing_enable", None))
    if enable is None:
        logger.warning("ElixirConfig.plan assumes activation checkpointing, but %s has no "
                       "gradient_checkpointing_enable(); its activations may not fit the plan's peak",
                       type(model).__name__)
        return
    enable()
    logger.info("hf_elixir: activation checkpointing enabled, as the plan assumes")


def _load_plan(config: ElixirConfig) -> ElixirPlan | None:
    plan = config.plan
    if plan is None or isinstance(plan, ElixirPlan):
        return plan
    if isinstance(plan, (str, Path)):
        if not Path(plan).is_file():
            raise FileNotFoundError(f"ElixirConfig.plan={str(plan)!r} is not a file; write one with "
                                    "`hf-elixir plan ... --output plan.yaml` or pass an ElixirPlan")
        return ElixirPlan.load(plan)
    raise TypeError(f"ElixirConfig.plan={plan!r} must be an ElixirPlan, a path to a plan file, or None")


def _check_plan(plan: ElixirPlan, model: torch.nn.Module, num_params: int, world_size: int,
                precision: str, num_chunks: int, budget: int | None = None) -> None:
    if plan.precision != precision:  # the one mismatch the user fixes in the config, not by re-planning
        raise ValueError(f"ElixirConfig.plan was made for precision={plan.precision!r} but ElixirConfig.precision="
                         f"{precision!r} (the default is 'fp32'; `hf-elixir plan` defaults to bf16): set "
                         f"ElixirConfig(precision={plan.precision!r}), or re-run `hf-elixir plan --precision "
                         f"{precision}`")
    if budget is not None and plan.predicted_peak_device_bytes and plan.predicted_peak_device_bytes > budget:
        raise ValueError(f"ElixirConfig.plan predicts a device peak of {plan.predicted_peak_device_bytes} bytes but "
                         f"device_memory_budget_bytes={budget}: the plan was made for a larger budget. Re-run the "
                         "search (`hf-elixir plan --gpu-memory ...`) for this budget, or raise the budget")
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    problems = []
    if plan.model_type and model_type and plan.model_type != model_type:
        problems.append(f"model_type {plan.model_type!r} (this model is {model_type!r})")
    if plan.num_params and plan.num_params != num_params:
        problems.append(f"num_params {plan.num_params} (this model has {num_params})")
    if plan.world_size != world_size:
        problems.append(f"world_size {plan.world_size} (this run has {world_size})")
    bad = [c for c in plan.resident_chunks + plan.device_shard_chunks + plan.device_optim_chunks if c >= num_chunks]
    if bad:
        problems.append(f"chunk ids {sorted(set(bad))} (this model packs into {num_chunks} chunks)")
    if problems:
        raise ValueError("ElixirConfig.plan was made for another run: it has " + "; ".join(problems)
                         + ". Re-run the search (`hf-elixir plan`) for this model and world size")


class _Sizes:
    """Byte sizes the placement policy needs, per chunk."""

    def __init__(self, chunks: list[Chunk], optim_factor: int, precision: str) -> None:
        self.full = {c.chunk_id: c.full_bytes for c in chunks}
        self.shard = {c.chunk_id: c.shard_bytes for c in chunks}
        self.grad = {c.chunk_id: (c.grad_full_bytes if c.trainable else 0) for c in chunks}
        master = 0 if precision == "fp32" else 4
        self.optim = {c.chunk_id: (c.shard_numel * 4 * (1 + optim_factor) + c.shard_numel * master
                                   if c.trainable else 0) for c in chunks}


def _working_set_bytes(per_unit_full: list[int], grad_bytes: list[int], staging_bytes: int) -> int:
    """Device bytes needed by two adjacent units at once (backward overlaps the previous unit's release),
    plus two gradient buffers and, with several ranks, an onload staging shard or reduce-scatter output."""
    per_unit = per_unit_full or [0]
    pairs = [a + b for a, b in zip(per_unit, per_unit[1:])] or per_unit
    return max(pairs) + sum(sorted(grad_bytes, reverse=True)[:2]) + staging_bytes


def _working_set(handles_chunks: list[list[Chunk]], sizes: _Sizes, chunks: list[Chunk]) -> int:
    # replicated chunks never leave the device: counted once, not per unit
    replicated = sum(sizes.full[c.chunk_id] for c in chunks if c.replicate_group is not None)
    per_unit = [sum(sizes.full[c.chunk_id] for c in cs if c.replicate_group is None) for cs in handles_chunks]
    # onload staging of a host shard, or the reduce-scatter output shard; a chunk's own group decides
    # (a tensor-parallel model's chunks are sharded over the data-parallel axis only)
    staging = max([max(sizes.shard[c.chunk_id], sizes.grad[c.chunk_id] // c.world_size)
                   for c in chunks if c.world_size > 1] or [0])
    return _working_set_bytes(per_unit, list(sizes.grad.values()), staging) + replicated


def _place(chunks: list[Chunk], plan: ElixirPlan | None, config: ElixirConfig, sizes: _Sizes,
           working_set: int, world_size: int) -> list[str]:
    """Decide resident / shard location / optimizer location per chunk. Returns reasons."""
    budget = config.device_memory_budget_bytes
    if plan is not None and (plan.resident_chunks or plan.device_shard_chunks or plan.device_optim_chunks
                             or budget is not None):
        resident, dev_shard, dev_optim = map(set, (plan.resident_chunks, plan.device_shard_chunks,
                                                   plan.device_optim_chunks))
        for c in chunks:
            c.resident = c.chunk_id in resident
            c.shard_on_device = c.chunk_id in dev_shard or c.resident
            c.optim_on_device = c.chunk_id in dev_optim
        return ["placement taken from ElixirConfig.plan"]
    ids = [c.chunk_id for c in chunks]
    shard_all = sum(sizes.shard[c.chunk_id] for c in chunks if c.world_size > 1)
    everything = sum(sizes.full.values()) + shard_all + sum(sizes.optim.values()) + sum(
        sorted(sizes.grad.values(), reverse=True)[:2])
    offload_opt = config.offload_optimizer
    if budget is None or (everything <= budget and offload_opt is not True):
        for c in chunks:
            c.resident, c.shard_on_device, c.optim_on_device = True, True, offload_opt is not True
        return [f"everything resident ({everything} bytes fit the budget {budget})"]
    optim_dev = sum(sizes.optim.values()) if offload_opt is False else 0
    needed = working_set + optim_dev
    if budget < needed:
        err = budget_error(needed, budget, "the largest pair of adjacent modules (unsharded chunks, two "
                           "gradient buffers" + (", device optimizer states" if optim_dev else "") + ")")
        largest = max((s.numel for c in chunks for s in c.slots), default=0)
        size = max((c.chunk_numel for c in chunks), default=0)
        if largest and size > largest:
            err = ValueError(f"{err}; or a smaller ElixirConfig.chunk_size_numel (now {size}; at least the largest "
                             f"parameter, {largest}) shrinks that working set")
        raise err
    spare = budget - needed
    reasons = [f"working set {working_set} bytes reserved; optimizer states on "
               f"{'device' if offload_opt is False else 'host'}"]
    # shards on the device first (first-use order), up to half the spare; the rest is cache
    used = 0
    for cid in ids:
        c = chunks[cid]
        cost = sizes.full if c.world_size == 1 else sizes.shard
        if c.replicate_group is not None:  # whole on the device, already in the working set
            c.resident = c.shard_on_device = True
            c.optim_on_device = offload_opt is False
            continue
        c.resident = False
        c.optim_on_device = offload_opt is False
        c.shard_on_device = used + cost[cid] <= spare // 2
        if c.shard_on_device:
            used += cost[cid]
    on_dev = sum(c.shard_on_device for c in chunks)
    reasons.append(f"{on_dev}/{len(chunks)} chunk shards on the device, {spare - used} bytes of cache")
    return reasons


def _comm_buckets(model, params, names, config: ElixirConfig, placements: dict[str, str]):
    """Split ``params`` (order kept) by (process group, grad-norm replicas, replicated).

    Plain data parallel: one bucket over the default group. A model rewritten by
    :func:`hf_elixir.parallel.parallelize` gets the groups of its mesh (see [Note: gradient groups] in
    ``hf_elixir/parallel/_mesh.py``): expert parameters are sharded over the expert-data-parallel group,
    the rest over the data-parallel group; parameters replicated across tensor-parallel ranks count
    once in the global gradient norm (``replicas = tp``). Parameters of modules placed ``"replicated"``
    go to chunks every rank keeps whole (no all-gather), whose gradients are all-reduced over the group.

    Returns:
        list of ``(group, replicas, replicated, params)``.
    """
    from hf_elixir.parallel import get_parallel_state  # noqa: PLC0415 (avoid an import cycle)

    pstate = get_parallel_state(model)
    mesh = pstate.mesh if pstate is not None else None
    default = _default_group(config)
    buckets: dict[tuple[int, int, bool], tuple] = {}
    for p in params:
        name = names[p][0]
        module_name = name.rsplit(".", 1)[0] if "." in name else ""
        replicated = placements.get(module_name) == "replicated"
        if mesh is None:
            group, replicas = default, 1
        else:
            group = mesh.expert_dp_group if pstate.is_expert_param(name) else mesh.dp_group
            replicas = mesh.tp_size if mesh.tp_size > 1 and name not in pstate.tp_layouts else 1
        key = (id(group), replicas, replicated)
        if key not in buckets:
            buckets[key] = (group, replicas, replicated, [])
        buckets[key][3].append(p)
    return list(buckets.values())


def _build_chunks(params_in_order, names, layout: ChunkLayout, dtype, group, device, manager,
                  first_id: int = 0, first_flag: int = 0, replicas: int = 1):
    chunks: list[Chunk] = []
    flag_index = first_flag
    for local_id, (members, offsets) in enumerate(zip(layout.members, layout.offsets)):
        cid = first_id + local_id
        slots = []
        for i, (member, offset) in enumerate(zip(members, offsets)):
            param = params_in_order[member]
            trainable = param.requires_grad
            slot = ParamSlot(name=names[param][0], param=param, offset=offset, numel=param.numel(),
                             shape=param.shape, trainable=trainable,
                             flag_index=flag_index if trainable else -1, index_in_chunk=i,
                             aliases=names[param][1:])
            flag_index += int(trainable)
            slots.append(slot)
            manager.slot_of[param] = slot
        chunk = Chunk(cid, slots, layout.chunk_numels[local_id], dtype, group, device, manager)
        chunk.norm_replicas = replicas
        for slot in slots:
            manager.chunk_of[slot.param] = chunk
        chunks.append(chunk)
    return chunks, flag_index


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            config: ElixirConfig | None = None, *, sample_batch: dict | None = None):
    """Put ``model`` under chunk memory management; wrap ``optimizer``.

    Args:
        model: a ``torch.nn.Module`` (typically a ``transformers.PreTrainedModel``), on CPU or on the
            compute device, identical on every rank (rank 0's values are broadcast anyway).
        optimizer: a ``torch.optim`` optimizer on ``model.parameters()`` (element-wise kinds only), or
            ``None`` for inference.
        config: :class:`~hf_elixir.config.ElixirConfig`; default all-resident fp32.
        sample_batch: a batch (``model(**sample_batch)`` returns ``.loss``) to profile one step with,
            required by ``ElixirConfig(search="auto")``.

    Returns:
        ``(model, optimizer)``: the same model object, and an
        :class:`~hf_elixir.optim.optimizer.ElixirOptimizer` (or ``None``).

    Raises:
        ValueError: the model is already prepared; the budget is too small (names the bytes needed);
            the plan was made for another model/world size/precision.
        TypeError: an unsupported optimizer.
    """
    config = config or ElixirConfig()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"hf_elixir.prepare(model=...) got {type(model).__name__}; pass a torch.nn.Module "
                        "(e.g. a transformers model)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"hf_elixir.prepare(optimizer=...) got {type(optimizer).__name__}; pass a torch.optim "
                        "optimizer built on model.parameters(), or None for inference")
    if not isinstance(config, ElixirConfig):
        raise TypeError(f"hf_elixir.prepare(config={config!r}) must be an ElixirConfig")
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("this model is already prepared by hf_elixir.prepare; prepare it only once")
    from hf_elixir.parallel import placements_for_plan  # noqa: PLC0415 (avoid an import cycle)

    placements_for_plan(model, config)  # validates tp/ep sizes and placement globs before anything moves
    plan = _load_plan(config)
    if plan is None and config.search == "auto":
        if sample_batch is None:
            raise ValueError("ElixirConfig.search='auto' profiles one training step: pass "
                             "hf_elixir.prepare(model, optimizer, config, sample_batch=batch)")
        from hf_elixir.search import auto_plan  # noqa: PLC0415 (optional heavy import)

        plan = auto_plan(model, sample_batch, config)
    if plan is not None and plan.activation_checkpointing:
        _enable_activation_checkpointing(model)
    device = _compute_device()
    _check_precision_supported(config.precision, device)
    group = _default_group(config)
    world_size = dist.get_world_size(group) if group is not None else 1
    dtype = _DTYPES[config.precision]
    names = _unique_params(model)
    params = [p for p in names if p.is_floating_point()]
    if len(params) != len(names):
        logger.warning("%d non-floating-point parameters are left unmanaged", len(names) - len(params))
    element_bytes = torch.empty((), dtype=dtype).element_size()
    config, placement_reason = _resolve_default_placement(model, config, plan, [p.numel() for p in params],
                                                          optimizer, world_size, element_bytes)
    placements = placements_for_plan(model, config)
    if plan is not None and plan.param_order:
        by_name = {names[p][0]: p for p in params}
        unknown = [n for n in plan.param_order if n not in by_name]
        if unknown:
            raise ValueError(f"ElixirConfig.plan.param_order names parameters this model lacks: {unknown[:5]}; "
                             "re-run the search for this model")
        ordered = [by_name[n] for n in plan.param_order]
        seen = set(ordered)
        params = ordered + [p for p in params if p not in seen]
    numels = [p.numel() for p in params]
    chunk_size = config.chunk_size_numel or (plan.chunk_size_numel if plan and plan.chunk_size_numel else None)
    if not chunk_size and world_size > 1 and placements and all(v == "replicated" for v in placements.values()):
        chunk_size = replicated_chunk_size(numels, element_bytes)
    chunk_size = chunk_size or _default_chunk_size(numels, config.device_memory_budget_bytes, world_size,
                                                   element_bytes)
    manager = ChunkManager(compute_device=device, budget_bytes=config.device_memory_budget_bytes,
                           reduce_dtype=torch.float32 if config.reduce_dtype == "fp32" else None,
                           prefetch_depth=plan.prefetch_depth if plan else config.prefetch_depth)
    manager.job_group = _job_group(model, group)
    chunks: list[Chunk] = []
    num_flags = 0
    flag_groups = []
    for bucket_group, replicas, replicated, bucket in _comm_buckets(model, params, names, config, placements):
        bucket_ws = dist.get_world_size(bucket_group) if bucket_group is not None else 1
        storage_group = None if replicated else bucket_group
        layout = pack_chunks([p.numel() for p in bucket], chunk_size, 1 if replicated else bucket_ws)
        new, end_flag = _build_chunks(bucket, names, layout, dtype, storage_group, device, manager,
                                      first_id=len(chunks), first_flag=num_flags,
                                      replicas=replicas * (bucket_ws if replicated else 1))
        if replicated and bucket_ws > 1:
            for chunk in new:
                chunk.replicate_group = bucket_group
        if bucket_ws > 1 and end_flag > num_flags:
            flag_groups.append((bucket_group, torch.arange(num_flags, end_flag)))
        chunks += new
        num_flags = end_flag
    manager.chunks = chunks
    manager.init_flags(num_flags, flag_groups)
    num_params = sum(numels)
    if plan is not None:
        _check_plan(plan, model, num_params, world_size, config.precision, len(chunks),
                    config.device_memory_budget_bytes)
    handles = install_hooks(model, manager)
    install_guards(model, manager)
    optim_factor = optimizer_state_numel_factor(optimizer) if optimizer is not None else 0
    sizes = _Sizes(chunks, optim_factor if optimizer is not None else 0, config.precision)
    working_set = _working_set([h.chunks for h in handles], sizes, chunks)
    reasons = _place(chunks, plan, config, sizes, working_set, world_size)
    if placement_reason:
        reasons.insert(0, placement_reason)
    for chunk in chunks:
        if chunk.replicate_group is not None:  # "replicated": whole on every rank, kept on the device
            chunk.resident = chunk.shard_on_device = True
    if optimizer is None:
        for c in chunks:
            c.optim_on_device = False
    for chunk in chunks:
        manager.make_room(chunk.full_bytes + chunk.shard_bytes, f"materialising chunk {chunk.chunk_id}")
        chunk.materialize()
        if not chunk.resident and not chunk.full_alias:
            chunk.reshard()
    manager.hide_stale()  # resharded parameters read NaN until their first use (not freed memory)
    manager._trainable_chunks = [c for c in chunks if c.trainable]
    if plan is None:
        plan = ElixirPlan(
            model_type=getattr(getattr(model, "config", None), "model_type", ""), num_params=num_params,
            world_size=world_size, precision=config.precision, chunk_size_numel=chunk_size,
            param_order=[names[p][0] for p in params],
            resident_chunks=[c.chunk_id for c in chunks if c.resident],
            device_shard_chunks=[c.chunk_id for c in chunks if c.shard_on_device],
            device_optim_chunks=[c.chunk_id for c in chunks if c.optim_on_device],
            prefetch_depth=manager.prefetch_depth, reasons=reasons)
    if not plan.placements:
        plan = dataclasses.replace(plan, placements=placements)
    elif dict(plan.placements) != placements:
        changed = sorted(k for k in set(plan.placements) | set(placements)
                         if plan.placements.get(k) != placements.get(k))
        raise ValueError(f"ElixirConfig.plan.placements differ from this model's placements at {changed[:5]}; "
                         "re-run the search (`hf-elixir plan`) with the same ElixirConfig.placements and "
                         "tensor/expert-parallel sizes")
    state = ElixirState(manager=manager, handles=handles, config=config, plan=plan)
    elixir_optimizer = None
    if optimizer is not None:
        elixir_optimizer = ElixirOptimizer(optimizer, manager, config)
        state.optimizer = elixir_optimizer
    install_state_dict_hooks(model, manager,
                             on_loaded=elixir_optimizer.sync_masters_from_params if elixir_optimizer else (lambda: None))
    counters = manager.counters
    for name in ("h2d_bytes", "d2h_bytes", "allgather_bytes", "reduce_scatter_bytes", "num_evictions",
                 "num_onloads", "num_prefetches", "num_unshards"):
        setattr(counters, name, 0)
    manager.reset_peak()
    manager._step_start = counters.as_dict()
    setattr(model, _ATTR, state)
    model.__deepcopy__ = _refuse_deepcopy
    logger.info("hf_elixir: %d params in %d chunks of %d elements; %s", num_params, len(chunks), chunk_size,
                "; ".join(reasons))
    return model, elixir_optimizer


def memory_stats(model: torch.nn.Module) -> dict[str, int | float]:
    """Counters of the chunk manager: cumulative since ``prepare`` plus ``step_*`` deltas of the last
    optimizer step; bytes are ints. Keys: ``device_used_bytes``, ``device_peak_bytes``, ``host_bytes``,
    ``h2d_bytes``, ``d2h_bytes``, ``allgather_bytes``, ``reduce_scatter_bytes``, ``num_evictions``,
    ``num_onloads``, ``num_prefetches``, ``num_unshards``, ``device_budget_bytes`` (-1 = unlimited),
    ``num_chunks``, ``chunk_size_numel``, ``loss_scale`` (float, when an optimizer is attached).

    Raises:
        ValueError: the model was not prepared.
    """
    state = get_state(model)
    manager = state.manager
    stats: dict[str, int | float] = dict(manager.counters.as_dict())
    stats.update(manager.last_step)
    stats["device_budget_bytes"] = -1 if manager.pool.budget_bytes is None else manager.pool.budget_bytes
    stats["num_chunks"] = len(manager.chunks)
    stats["chunk_size_numel"] = max((c.chunk_numel for c in manager.chunks), default=0)
    if state.optimizer is not None:
        stats["loss_scale"] = state.optimizer.loss_scale
        stats["num_skipped_steps"] = state.optimizer.scaler.num_skipped_steps
    return stats


def reset_memory_stats(model: torch.nn.Module) -> None:
    """Zero the traffic counters and set the peak to the current use."""
    manager = get_state(model).manager
    for name in ("h2d_bytes", "d2h_bytes", "allgather_bytes", "reduce_scatter_bytes", "num_evictions",
                 "num_onloads", "num_prefetches", "num_unshards"):
        setattr(manager.counters, name, 0)
    manager.reset_peak()
    manager._step_start = manager.counters.as_dict()


@dataclass
class _ChunkSpec(ChunkBytes):
    """The sizes of a chunk ``prepare`` would build (what :class:`_Sizes` and :func:`_working_set` read)."""

    chunk_id: int
    chunk_numel: int
    world_size: int
    element_size: int
    grad_element_size: int
    trainable: bool
    replicate_group: object = None  # not None: a "replicated" chunk (kept whole on every rank)

    @property
    def shard_numel(self) -> int:
        return self.chunk_numel // self.world_size

    @property
    def grad_full_bytes(self) -> int:
        return self.chunk_numel * self.grad_element_size


def min_device_budget_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                            config: ElixirConfig | None = None, world_size: int = 1) -> int:
    """Smallest ``device_memory_budget_bytes`` that ``prepare`` accepts for this model (optimizer
    states offloaded), computed without preparing it (no data moves): the same chunk packing, placements
    and working-set rule as :func:`prepare`.

    Args:
        model: the model ``prepare`` will get (after :func:`hf_elixir.parallel.parallelize`, if used).
        optimizer: unused for the minimum (optimizer states go to the host); kept for symmetry.
        config: the ``ElixirConfig`` ``prepare`` will get. ``default_placement="auto"`` counts as
            ``"sharded"`` (at the smallest budget a replicated copy does not fit); ``"replicated"``
            modules count whole on every rank (world size > 1).
        world_size: ranks of the default process group ``prepare`` will see. A parallelized model
            uses its mesh's group sizes instead.

    Returns:
        bytes per rank (int).

    Raises:
        ValueError: as ``prepare`` for bad placements or tensor/expert-parallel sizes.
    """
    from hf_elixir.parallel import get_parallel_state, placements_for_plan  # noqa: PLC0415 (import cycle)
    from hf_elixir.runtime.hooks import _units  # noqa: PLC0415

    config = config or ElixirConfig()
    if config.default_placement == "auto":
        config = dataclasses.replace(config, default_placement="sharded")
    placements = placements_for_plan(model, config)
    names = _unique_params(model)
    params = [p for p in names if p.is_floating_point()]
    numels = [p.numel() for p in params]
    esize = torch.empty((), dtype=_DTYPES[config.precision]).element_size()
    gsize = 4 if config.reduce_dtype == "fp32" else esize
    pstate = get_parallel_state(model)
    if pstate is not None:
        world_size = pstate.mesh.world_size
    chunk_size = config.chunk_size_numel
    if not chunk_size and world_size > 1 and placements and all(v == "replicated" for v in placements.values()):
        chunk_size = replicated_chunk_size(numels, esize)
    # prepare will get a budget (this one): its default chunk size is the budgeted one, whatever the config says
    chunk_size = chunk_size or _default_chunk_size(numels, 1, world_size, esize)
    buckets: dict[tuple[int, bool], list[torch.nn.Parameter]] = {}
    for p in params:  # as _comm_buckets: (group size, replicated), parameter order kept
        name = names[p][0]
        replicated = placements.get(name.rsplit(".", 1)[0] if "." in name else "") == "replicated"
        if pstate is None:
            group_size = world_size
        else:
            group = pstate.mesh.expert_dp_group if pstate.is_expert_param(name) else pstate.mesh.dp_group
            group_size = dist.get_world_size(group) if group is not None else 1
        buckets.setdefault((group_size, replicated), []).append(p)
    specs: list[_ChunkSpec] = []
    chunk_of: dict[torch.nn.Parameter, int] = {}
    for (group_size, replicated), bucket in buckets.items():
        layout = pack_chunks([p.numel() for p in bucket], chunk_size, 1 if replicated else group_size)
        for members, chunk_numel in zip(layout.members, layout.chunk_numels):
            cid = len(specs)
            specs.append(_ChunkSpec(cid, chunk_numel, 1 if replicated else group_size, esize, gsize,
                                    any(bucket[m].requires_grad for m in members),
                                    replicate_group=group_size if replicated and group_size > 1 else None))
            for m in members:
                chunk_of[bucket[m]] = cid
    units = [[specs[c] for c in sorted({chunk_of[p] for p in ps})] for _, _, ps, _ in _units(model, set(params))]
    return _working_set(units, _Sizes(specs, 0, config.precision), specs)
