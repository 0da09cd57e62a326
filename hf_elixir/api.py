"""``hf_elixir.prepare``: pack a model's parameters into chunks, place them, install hooks, wrap the
optimizer. Also ``min_device_budget_bytes``, and (from ``hf_elixir.runtime``) ``memory_stats``.

A façade: each phase lives in its layer, and ``prepare`` calls them in order:

1. checks: arguments, meta parameters, parameters another prepared model manages
   (``runtime/_state.py``), the optimizer (``optim/_check.py``); the ranks agree on the budget (the
   smallest), and take rank 0's plan, default placement, chunk size and per-chunk placement
   (``placement/_agree.py``, [Note: ranks agree]); the plan (``placement/_plan_check.py``; the search
   for ``search="auto"``);
2. ``default_placement="auto"`` resolved (``placement/_device_placement.py``);
3. chunk size (``search/_chunk_size.py``), chunks built, still empty (``chunk/_build.py``);
4. working set sized and each chunk placed (``placement/_device_placement.py``), in the budget less the
   plan's ``activation_peak_bytes`` when the budget covers activations ([Note: activations in the budget]
   in ``chunk/memory.py``);

and only then, with everything checked, it changes the model (undone on any failure, see
[Note: all-or-nothing prepare] in ``runtime/_rollback.py``):

5. hooks and guards installed (``runtime/``);
6. parameters copied into their chunks (``chunk/_build.py``);
7. optimizer wrapped (``optim/``), state-dict hooks, activation checkpointing, state attached
   (``runtime/_state.py``).

``prepare`` extends the given model in place and returns the same object (as FSDP2's
``fully_shard`` does), so ``model.config``, ``generate()``, ``state_dict()`` and ``save_pretrained``
keep working.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from hf_elixir._logging import info_on_main_rank
from hf_elixir.chunk import _host_heap
from hf_elixir.chunk._build import build_chunks, chunk_specs, materialize_chunks
from hf_elixir.chunk._stream_load import StreamedInit, meta_parameter_names, retie
from hf_elixir.chunk.manager import ChunkManager, budget_error
from hf_elixir.chunk.memory import resolve_budget_bytes
from hf_elixir.chunk.packing import replicated_chunk_size
from hf_elixir.config import ElixirConfig
from hf_elixir.optim._check import check_optimizer
from hf_elixir.optim.optimizer import ElixirOptimizer
from hf_elixir.parallel import get_parallel_state, placements_for_plan
from hf_elixir.parallel._groups import chunk_group_of, job_group_of, planned_chunk_groups
from hf_elixir.placement._agree import agree_min, agree_object, agreement_group_size
from hf_elixir.placement._device_placement import (default_host_budget_bytes, device_floor_bytes, place_chunks,
                                                   replicated_bytes, resolve_default_placement)
from hf_elixir.placement._plan_check import check_plan, check_plan_placements, load_plan
from hf_elixir.plan import ElixirPlan
from hf_elixir.profiler._hardware import register_prepare
from hf_elixir.runtime._rollback import ModelSnapshot
from hf_elixir.runtime.activations import apply_activation_policy, resolve_activation_policy, transformer_blocks
from hf_elixir.runtime._state import (ElixirState, attach_state, check_unclaimed, claim_parameters, get_state,
                                      is_prepared, memory_stats, reset_memory_stats)
from hf_elixir.runtime.guards import install_guards
from hf_elixir.runtime.hooks import _units, install_hooks, mark_subtree_chunks
from hf_elixir.runtime.state_dict import install_state_dict_hooks

__all__ = ["prepare", "memory_stats", "reset_memory_stats", "get_state", "min_device_budget_bytes", "ElixirState"]

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _compute_device() -> torch.device:
    from hf_elixir.profiler._device import select_compute_device  # noqa: PLC0415 (see [Note: device selection])

    return select_compute_device()


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


def _agree_budget(config: ElixirConfig, group, device: torch.device) -> ElixirConfig:
    """The config with the smallest ``device_memory_budget_bytes`` over ``group`` ([Note: ranks agree]):
    a rank given (or measuring) less memory than its peers makes every rank place for that figure."""
    budget = agree_min(config.device_memory_budget_bytes, group, device)
    if budget != config.device_memory_budget_bytes:
        logger.info("hf_elixir: device_memory_budget_bytes %s on this rank; %s, the smallest over the ranks, "
                    "is used", config.device_memory_budget_bytes, budget)
        config = dataclasses.replace(config, device_memory_budget_bytes=budget)
    if agreement_group_size(group) > 1:  # the host budget picks rank-local host copies (no re-all-gather)
        host = agree_min(config.host_memory_budget_bytes or default_host_budget_bytes(), group, device)
        config = dataclasses.replace(config, host_memory_budget_bytes=host)
    return config


def _agree_placements(chunks, group, device: torch.device) -> None:
    """Every rank takes rank 0's per-chunk placement (resident, shard and optimizer states on the device,
    rank-local host copy)."""
    flags = agree_object([(c.resident, c.shard_on_device, c.optim_on_device, c.keep_host_copy) for c in chunks],
                         group, device)
    assert len(flags) == len(chunks), (f"rank {dist.get_rank()}: {len(chunks)} chunks, rank 0 placed "
                                       f"{len(flags)}")
    for chunk, (resident, shard_on_device, optim_on_device, keep_host_copy) in zip(chunks, flags):
        chunk.resident, chunk.shard_on_device, chunk.optim_on_device = resident, shard_on_device, optim_on_device
        chunk.keep_host_copy = keep_host_copy


def _unique_params(model: torch.nn.Module) -> dict[torch.nn.Parameter, list[str]]:
    names: dict[torch.nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return names


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
    info_on_main_rank(logger, "hf_elixir: activation checkpointing enabled, as the plan assumes")


def _check_streamed_init(model, config: ElixirConfig, checkpoint) -> None:
    """Refuse what streamed init does not support, and a meta model without ``checkpoint=``."""
    meta = meta_parameter_names(model)
    if checkpoint is None:
        if meta:
            raise ValueError(f"parameters {meta[:5]}{' and more' if len(meta) > 5 else ''} are on the meta device "
                             "(no data): pass hf_elixir.prepare(model, optimizer, config, checkpoint='path/to/"
                             "hf_folder') to load them from a Hugging Face folder, or build the model with real "
                             "weights (from_pretrained)")
        return
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"hf_elixir.prepare(checkpoint={checkpoint!r}) must be a path to a Hugging Face folder")
    if (pstate := get_parallel_state(model)) is not None and pstate.mesh.tp_size > 1:  # expert parallel streams
        raise ValueError("hf_elixir.prepare(checkpoint=...) does not support tensor-parallel models yet "
                         "(parallelize needs real weights to split): load the model with from_pretrained, "
                         "parallelize it, and call prepare without checkpoint=")
    if config.search == "auto" and config.plan is None:
        raise ValueError("ElixirConfig.search='auto' profiles a real training step, which a model streamed from "
                         "checkpoint= cannot run before prepare: write a plan first (`hf-elixir plan`) and pass "
                         "ElixirConfig(plan=...), or leave search='off'")


def _check_arguments(model, optimizer, config) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"hf_elixir.prepare(model=...) got {type(model).__name__}; pass a torch.nn.Module "
                        "(e.g. a transformers model)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"hf_elixir.prepare(optimizer=...) got {type(optimizer).__name__}; pass a torch.optim "
                        "optimizer built on model.parameters(), or None for inference")
    if not isinstance(config, ElixirConfig):
        raise TypeError(f"hf_elixir.prepare(config={config!r}) must be an ElixirConfig")
    if is_prepared(model):
        raise ValueError("this model is already prepared by hf_elixir.prepare; prepare it only once")


def _activation_reserve(plan: ElixirPlan | None, config: ElixirConfig, charges_activations: bool) -> int:
    """Bytes of the budget placement keeps for activations: the plan's ``activation_peak_bytes`` when the
    budget covers activations and is bounded ([Note: activations in the budget] in ``chunk/memory.py``)."""
    if not charges_activations or config.device_memory_budget_bytes is None or plan is None:
        return 0
    return plan.activation_peak_bytes or 0


def _resolve_plan(model, config: ElixirConfig, sample_batch, optimizer=None) -> ElixirPlan | None:
    plan = load_plan(config)
    if plan is None and config.search == "auto":
        if sample_batch is None:
            raise ValueError(
                "ElixirConfig.search='auto' profiles one training step: pass hf_elixir.prepare(model, optimizer, "
                "config, sample_batch=batch)" if optimizer is not None else
                "ElixirConfig.search='auto' without an optimizer (inference) profiles one forward under "
                "torch.no_grad(): pass hf_elixir.prepare(model, None, config, sample_batch=batch), a batch "
                "model(**batch) accepts (labels not needed)")
        _check_decoder_inputs(model, sample_batch, optimizer)
        from hf_elixir.search import auto_plan  # noqa: PLC0415 (optional heavy import)

        # priced with the optimizer's state bytes; without one, a forward-only (inference) step. The profiled
        # step (dropout) and the hardware probe draw random numbers: the caller's RNG streams are restored, so
        # training after a search draws what it would without one (data order, dropout masks); and its training
        # forwards update buffers (BatchNorm running statistics, num_batches_tracked): those are restored too
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices), _buffers_restored(model), _hf_checkpointing_off(model):
            plan = auto_plan(model, sample_batch, config, optimizer=optimizer, inference=optimizer is None)
    return plan


@contextlib.contextmanager
def _hf_checkpointing_off(model: torch.nn.Module):
    """Turn the Hugging Face gradient-checkpointing switches (``module.gradient_checkpointing``, set by
    ``model.gradient_checkpointing_enable()``, which ``Trainer(gradient_checkpointing=True)`` calls before
    ``prepare``) off for the block, back on after it.

    The search profiles every block as kept and prices recompute and offload per block from that profile
    (:mod:`hf_elixir.search._activation_cost`), and ``prepare`` then installs the plan's policy, turning the user's
    switch off on the blocks it keeps (:func:`~hf_elixir.runtime.activations.apply_activation_policy`). A profile
    taken with the switches on measured only the checkpoints' inputs, so "keep" looked nearly free: a tiny GPT-2
    under a 400000-byte budget got "keep" for both blocks priced at 70532 bytes of activations, then ran out of
    the budget in its first forward (263552 bytes saved)."""
    switched = [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]
    for module in switched:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in switched:
            module.gradient_checkpointing = True


@contextlib.contextmanager
def _buffers_restored(model: torch.nn.Module):
    """Put every buffer of ``model`` back to its values on entry when the block exits (a copy of each, same
    device and dtype: the buffers' bytes once more while the block runs).

    ``search="auto"`` profiles real training steps on the unprepared model (a warm-up, the traced step, repeats):
    a ``BatchNorm`` in train mode updates ``running_mean``/``running_var`` and ``num_batches_tracked`` on each,
    so without this the model ``prepare`` returned had statistics of batches it never trained on, and differed
    from a ``search="off"`` run (a tiny ResNet: 3 extra ``num_batches_tracked``, every running statistic moved,
    the evaluation loss after two steps 0.7785 against 0.8348). A buffer on the meta device has no values to
    keep and is left alone."""
    values: dict[int, torch.Tensor] = {}
    saved = []  # (module, name, buffer object, its values on entry): a forward may also replace a buffer object
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                if id(buffer) not in values:
                    values[id(buffer)] = buffer.detach().clone()
                saved.append((module, name, buffer, values[id(buffer)]))
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, value in saved:
                buffer.copy_(value)
                module._buffers[name] = buffer


def _check_decoder_inputs(model, sample_batch, optimizer) -> None:
    """An encoder-decoder model (Switch-Transformers, T5, BART) cannot run ``model(**sample_batch)`` without
    decoder inputs: ``generate`` makes them itself, the profiled forward does not. Raise before profiling, naming the
    keys to add, instead of the model's own error from deep inside the profiler ("You must specify exactly one of
    input_ids or inputs_embeds")."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or not isinstance(sample_batch, Mapping):
        return
    if any(sample_batch.get(k) is not None for k in ("decoder_input_ids", "decoder_inputs_embeds", "labels")):
        return
    start = getattr(config, "decoder_start_token_id", None)
    fix = ("labels (the training step computes the loss from them)" if optimizer is not None else
           f"decoder_input_ids, e.g. torch.full((batch_size, 1), {start}) (model.config.decoder_start_token_id: "
           "the first decoder step of generate), or labels")
    raise ValueError(
        f"sample_batch={sorted(sample_batch)} for {type(model).__name__}, an encoder-decoder model, has no "
        "decoder_input_ids, decoder_inputs_embeds or labels, so model(**sample_batch) cannot run its decoder; "
        f"add {fix}")


def _ordered_params(plan: ElixirPlan | None, params: list, names: dict) -> list:
    """``params`` in the plan's packing order (the rest after it, in model order)."""
    if plan is None or not plan.param_order:
        return params
    by_name = {names[p][0]: p for p in params}
    unknown = [n for n in plan.param_order if n not in by_name]
    if unknown:
        raise ValueError(f"ElixirConfig.plan.param_order names parameters this model lacks: {unknown[:5]}; "
                         "re-run the search for this model")
    ordered = [by_name[n] for n in plan.param_order]
    seen = set(ordered)
    return ordered + [p for p in params if p not in seen]


def _chunk_size(config: ElixirConfig, plan: ElixirPlan | None, numels: list[int], placements: dict[str, str],
                world_size: int, element_bytes: int, budget_bytes: int | None) -> int:
    """The config's chunk size, else the plan's, else the replicated one, else the default."""
    from hf_elixir.search import default_chunk_size  # noqa: PLC0415 (optional heavy import)

    chunk_size = config.chunk_size_numel or (plan.chunk_size_numel if plan and plan.chunk_size_numel else None)
    if not chunk_size and world_size > 1 and placements and all(v == "replicated" for v in placements.values()):
        chunk_size = replicated_chunk_size(numels, element_bytes)
    return chunk_size or default_chunk_size(numels, budget_bytes, world_size, element_bytes)


def _unit_chunks(model: torch.nn.Module, chunk_of: dict) -> list[list]:
    """Per unit ``install_hooks`` will hook, the chunks (or chunk specs) its parameters live in, by id."""
    units = []
    for _, _, params, _ in _units(model, set(chunk_of)):
        by_id = {chunk_of[p].chunk_id: chunk_of[p] for p in params}
        units.append([by_id[c] for c in sorted(by_id)])
    return units


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            config: ElixirConfig | None = None, *, sample_batch: dict | None = None,
            checkpoint: str | os.PathLike | None = None):
    """Put ``model`` under chunk memory management; wrap ``optimizer``.

    All or nothing: when ``prepare`` raises, the model is as it was (no hooks, the same parameter storage
    and ``requires_grad``, nothing attached), so fixing the cause and calling it again works.

    Args:
        model: a ``torch.nn.Module`` (typically a ``transformers.PreTrainedModel``), on CPU or on the
            compute device, identical on every rank (rank 0's values are broadcast anyway).
        optimizer: a ``torch.optim`` optimizer on ``model.parameters()`` (element-wise kinds only), or
            ``None`` for inference (no gradient buffers are kept or counted in the budget).
        config: :class:`~hf_elixir.config.ElixirConfig`; default all-resident fp32.
        sample_batch: a batch to profile one step with, required by ``ElixirConfig(search="auto")``: with an
            optimizer one training step (``model(**sample_batch)`` returns ``.loss``); with ``optimizer=None``
            one forward under ``torch.no_grad()`` (any batch ``model(**sample_batch)`` accepts, no labels
            needed), and the plan is searched for inference (no backward, gradient buffers or optimizer
            states; [Note: forward-only pricing] in ``hf_elixir/search/_cost.py``).
        checkpoint: a Hugging Face folder (``model.safetensors``, or shards with
            ``model.safetensors.index.json``) to take the parameters' values from. The model may then be
            on the meta device (``torch.device("meta")`` or accelerate's ``init_empty_weights()``): each
            rank reads only its own shards' byte ranges and no rank holds the whole model (as DeepSpeed's
            ``zero.Init`` / FSDP2's meta-device init). Tied weights stay tied; buffers left on the meta
            device are read or rebuilt by the model's ``_init_weights``. The result equals
            ``from_pretrained(folder)`` + ``prepare`` bit for bit. Not with tensor/expert-parallel models
            or ``search="auto"`` yet. See [Note: streamed init] in ``hf_elixir/chunk/_stream_load.py``.


    Returns:
        ``(model, optimizer)``: the same model object, and an
        :class:`~hf_elixir.optim.optimizer.ElixirOptimizer` (or ``None``).

    Raises:
        ValueError: the model is already prepared, or shares a module with another prepared model;
            parameters on the meta device without ``checkpoint=`` (names them); a checkpoint missing
            parameters or with other shapes; the budget is below :func:`min_device_budget_bytes` (with
            the plan's ``activation_peak_bytes`` as ``activation_bytes``; names the bytes needed); the plan was made for another model/world size/precision; the optimizer
            holds parameters outside the model; ``search="auto"`` with an encoder-decoder model's ``sample_batch``
            that has no ``decoder_input_ids``/``labels`` (names the keys to add).
        FileNotFoundError: ``checkpoint`` is not a folder with safetensors weights.
        TypeError: an unsupported optimizer.
    """
    config = config or ElixirConfig()
    _check_arguments(model, optimizer, config)
    _check_streamed_init(model, config, checkpoint)
    if checkpoint is not None:
        retie(model, optimizer)  # what from_pretrained does after loading (kept if prepare fails)
    names = _unique_params(model)
    check_unclaimed(model, names)
    params = [p for p in names if p.is_floating_point()]
    if optimizer is not None:
        check_optimizer(optimizer, {p: names[p] for p in params})
    snapshot = ModelSnapshot(model)  # the profiled step of search="auto" runs the model too
    try:
        layout = _lay_out(model, optimizer, config, sample_batch, names, params)
        stream = (StreamedInit(model, checkpoint, {p: names[p] for p in params}, layout.manager.compute_device)
                  if checkpoint else None)
        try:
            prepared = _apply_layout(model, optimizer, names, layout, stream)
        finally:
            if stream is not None:
                stream.close()
    except BaseException:
        snapshot.restore()
        raise
    del snapshot  # the last reference to the parameters' original storage
    _host_heap.after_prepare(get_state(prepared[0]).manager)  # which goes back to the system ([Note: host heap])
    return prepared


@dataclasses.dataclass
class _Layout:
    """Everything ``prepare`` decided before touching the model: chunks built (empty) and placed."""

    config: ElixirConfig
    plan: ElixirPlan | None
    manager: ChunkManager
    params: list[torch.nn.Parameter]
    placements: dict[str, str]
    chunk_size: int
    world_size: int
    reasons: list[str]
    activation_policy: dict[str, str] = dataclasses.field(default_factory=dict)


def _activation_policy(model, plan: ElixirPlan | None, config: ElixirConfig) -> dict[str, str]:
    """Each transformer block's activation policy (``runtime/activations.py``): the config's over the plan's.

    Raises:
        ValueError: a plan entry or a config glob names no block of ``model``.
    """
    blocks = transformer_blocks(model)
    modules = dict(model.named_modules())
    own = frozenset(b for b in blocks if getattr(modules[b], "gradient_checkpointing", False) is True)
    if plan is None:
        return resolve_activation_policy(blocks, {}, False, config.activation_policy, own)
    return resolve_activation_policy(blocks, plan.activation_policy, plan.activation_checkpointing,
                                     config.activation_policy, own)


def _lay_out(model, optimizer, config: ElixirConfig, sample_batch, names, params) -> _Layout:
    """Phases 1-4 of ``prepare``: plan, placements, chunks and their placement; the model is not changed.

    Raises:
        ValueError: as :func:`prepare`.
    """
    placements_for_plan(model, config)  # validates tp/ep sizes and placement globs
    device = _compute_device()
    _check_precision_supported(config.precision, device)
    group = _default_group(config)
    agree_group = job_group_of(model, group)
    # this rank's figure (on CUDA the free memory less the reserve), then the smallest over the ranks
    budget, charges_activations = resolve_budget_bytes(config.device_memory_budget_bytes, device, None,
                                                       config.budget_covers_activations)
    config = _agree_budget(dataclasses.replace(config, device_memory_budget_bytes=budget), agree_group, device)
    plan = agree_object(_resolve_plan(model, config, sample_batch, optimizer), agree_group, device)
    activation_bytes = _activation_reserve(plan, config, charges_activations)  # from the agreed plan
    world_size = dist.get_world_size(group) if group is not None else 1
    if len(params) != len(names):
        logger.warning("%d non-floating-point parameters are left unmanaged", len(names) - len(params))
    auto_config = config
    config, placement_reason = resolve_default_placement(
        config, plan, [p.numel() for p in params], optimizer, world_size, _element_bytes(config),
        is_parallel=get_parallel_state(model) is not None, placements_of=lambda c: placements_for_plan(model, c),
        group=agree_group, device=device, activation_bytes=activation_bytes)
    params = _ordered_params(plan, params, names)
    numels = [p.numel() for p in params]
    chunk_size = _chunk_size(config, plan, numels, placements_for_plan(model, config), world_size,
                             _element_bytes(config), config.device_memory_budget_bytes)
    # decided once: rank 0's default placement and chunk size ([Note: ranks agree])
    default_placement, chunk_size = agree_object((config.default_placement, chunk_size), agree_group, device)
    config = dataclasses.replace(config, default_placement=default_placement)
    placements = placements_for_plan(model, config)
    manager = ChunkManager(compute_device=device, budget_bytes=config.device_memory_budget_bytes,
                           reduce_dtype=torch.float32 if config.reduce_dtype == "fp32" else None,
                           prefetch_depth=plan.prefetch_depth if plan else config.prefetch_depth)
    manager.job_group = agree_group
    manager.pool.charges_activations = charges_activations
    manager.pool.activation_reserve_bytes = activation_bytes  # what placement keeps for them (its errors say so)
    chunks = build_chunks(manager, params, names, placements, chunk_group_of(model, group), chunk_size,
                          _DTYPES[config.precision], device)
    if plan is not None:
        check_plan(plan, model, sum(numels), world_size, config.precision, len(chunks),
                   config.device_memory_budget_bytes, config.reduce_dtype)
        check_plan_placements(plan, placements)
    try:
        mark_subtree_chunks(model, manager)  # MoE-expert chunks need rank-local host copies (placement reads it)
        reasons = place_chunks(chunks, _unit_chunks(model, manager.chunk_of), plan, config, optimizer, world_size,
                               activation_bytes)
    except ValueError as err:
        if plan is None and auto_config is not config and config.default_placement == "sharded":
            _raise_if_replicating_needs_less(model, optimizer, auto_config, world_size, err, activation_bytes)
        raise
    if get_parallel_state(model) is None:  # a mesh's ranks hold different chunks: placed from agreed inputs
        _agree_placements(chunks, agree_group, device)
    offloaded = any(c.world_size > 1 and not c.resident for c in chunks)
    if manager.prefetch_depth and offloaded and manager.pool.charges_activations and optimizer is not None \
            and manager.gather_prefetch_mode() == "agreed":
        reasons.append("forward all-gathers are issued ahead from the third step on, those every rank had room "
                       "for in the step before (agreed at each optimizer step: the budget covers activations, "
                       "whose bytes can differ between ranks; [Note: agreed gathers ahead] in chunk/manager.py)")
    elif manager.prefetch_depth and offloaded and optimizer is None and manager.pool.charges_activations \
            and all(c.keep_host_copy for c in chunks if c.world_size > 1 and not c.resident):
        reasons.append("the first forward's all-gathers wait in their hooks (the budget covers activations, whose "
                       "bytes can differ between ranks, and there is no optimizer step at which the ranks could "
                       "agree on gathers ahead); later refills come from the rank-local host copies, no all-gather")
    elif manager.prefetch_depth and offloaded and not manager.gather_prefetch_allowed():
        why = ("MoE-expert chunks" if any(c.host_copy_required for c in chunks) else
               "the budget covers activations, whose bytes can differ between ranks, and the rank-local host "
               "copies that would let the ranks agree on gathers ahead do not fit host_memory_budget_bytes; "
               "ElixirConfig(budget_covers_activations=False) with a budget for model data lets them run ahead")
        reasons.append("all-gathers wait in their hooks, none issued ahead ([Note: gather prefetch] in "
                       "chunk/manager.py): " + why)
    return _Layout(config, plan, manager, params, placements, chunk_size, world_size,
                   ([placement_reason] if placement_reason else []) + reasons,
                   _activation_policy(model, plan, config))


def _apply_layout(model, optimizer, names, layout: _Layout, stream: StreamedInit | None):
    """Phases 5-7 of ``prepare``: the model changes (``prepare`` undoes them all if one fails); with
    ``stream``, each chunk is filled from the checkpoint instead of the parameters."""
    manager, config, chunks = layout.manager, layout.config, layout.manager.chunks
    handles = install_hooks(model, manager)
    install_guards(model, manager)
    materialize_chunks(manager, stream.fill_for if stream is not None else None)
    plan = layout.plan or ElixirPlan(
        model_type=getattr(getattr(model, "config", None), "model_type", ""),
        num_params=sum(p.numel() for p in layout.params), world_size=layout.world_size, precision=config.precision,
        chunk_size_numel=layout.chunk_size, param_order=[names[p][0] for p in layout.params],
        resident_chunks=[c.chunk_id for c in chunks if c.resident],
        device_shard_chunks=[c.chunk_id for c in chunks if c.shard_on_device],
        device_optim_chunks=[c.chunk_id for c in chunks if c.optim_on_device],
        host_copy_chunks=[c.chunk_id for c in chunks if c.keep_host_copy],
        prefetch_depth=manager.prefetch_depth, reasons=layout.reasons)
    if not plan.placements:
        plan = dataclasses.replace(plan, placements=layout.placements)
    if layout.activation_policy:  # the plan records what runs, block by block
        plan = dataclasses.replace(plan, activation_policy=dict(layout.activation_policy))
    state = ElixirState(manager=manager, handles=handles, config=config, plan=plan)
    if optimizer is not None:
        state.optimizer = ElixirOptimizer(optimizer, manager, config, refresh_cast=plan.refresh_cast)
    else:  # no optimizer step: each forward is a step ([Note: forward steps] in chunk/manager.py)
        manager.forward_steps = True
    install_state_dict_hooks(model, manager, on_loaded=(
        state.optimizer.sync_masters_from_params if state.optimizer is not None else (lambda: None)))
    if layout.activation_policy:
        removables = apply_activation_policy(model, layout.activation_policy, manager)
        if handles:  # removed with the other hooks
            handles[0].removables += removables
    elif plan.activation_checkpointing:  # a model without repeated blocks: the model's own switch
        _enable_activation_checkpointing(model)
    attach_state(model, state)
    claim_parameters(layout.params, model)
    info_on_main_rank(logger, "hf_elixir: %d params in %d chunks of %d elements; %s",  # one line per job
                      sum(p.numel() for p in layout.params), len(chunks), layout.chunk_size, "; ".join(layout.reasons))
    return model, state.optimizer


def min_device_budget_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                            config: ElixirConfig | None = None, world_size: int = 1, *,
                            activation_bytes: int = 0) -> int:
    """Smallest ``device_memory_budget_bytes`` that ``prepare`` accepts for this model, computed without
    preparing it (no data moves): the same chunk packing, placements, units and budget floor
    (``placement/_device_placement.py: device_floor_bytes``) as :func:`prepare`, plus the room kept for
    activations.

    Args:
        model: the model ``prepare`` will get (after :func:`hf_elixir.parallel.parallelize`, if used).
        optimizer: the optimizer ``prepare`` will get, or ``None`` for inference (no gradient buffers:
            a smaller floor). Its kind sizes the optimizer states kept on the device with
            ``ElixirConfig(offload_optimizer=False)``; otherwise they go to the host and do not count.
        config: the ``ElixirConfig`` ``prepare`` will get. ``default_placement="auto"`` resolves as
            ``prepare`` resolves it (replicated where the whole model with its gradients and optimizer
            states fits the budget, else sharded); ``"replicated"`` modules count whole on every rank
            (world size > 1).
        world_size: ranks of the default process group ``prepare`` will see. A parallelized model
            uses its mesh's group sizes instead.
        activation_bytes: bytes per rank the step's activations and autograd temporaries need on the
            device, added to the floor when the budget covers them (``ElixirConfig.
            budget_covers_activations``, the default; [Note: activations in the budget] in
            ``hf_elixir/chunk/memory.py``). Take it from a searched plan's ``activation_peak_bytes``, a
            profiled step (``hf_elixir.profiler.profile_step(model, batch).activation_peak_bytes``), or
            ``memory_stats(model)["activation_peak_bytes"]`` of a step run at a roomy budget plus the
            largest parameter's gradient bytes (the temporary autograd holds before it lands in its chunk). ``prepare`` keeps the same bytes out of the placement when its plan
            carries them as ``ElixirPlan(activation_peak_bytes=...)``, so this floor is then exact too.
            ``0`` (the default): the model-data floor, which a step can only run at when its activations
            fit in what placement leaves spare.

    Returns:
        bytes per rank (int).

    Raises:
        ValueError: as ``prepare`` for bad placements or tensor/expert-parallel sizes; a negative
            ``activation_bytes``.
        TypeError: ``activation_bytes`` is not an int.
    """
    config = config or ElixirConfig()
    if isinstance(activation_bytes, bool) or not isinstance(activation_bytes, int):
        raise TypeError(f"min_device_budget_bytes(activation_bytes={activation_bytes!r}) must be an int of bytes")
    if activation_bytes < 0:
        raise ValueError(f"min_device_budget_bytes(activation_bytes={activation_bytes}) must be >= 0")
    if activation_bytes and not config.budget_covers_activations:
        logger.warning("min_device_budget_bytes: activation_bytes=%d ignored: ElixirConfig.budget_covers_activations="
                       "False makes the budget bound model data only", activation_bytes)
        activation_bytes = 0
    return _model_data_floor_bytes(model, optimizer, config, world_size) + activation_bytes


def _model_data_floor_bytes(model, optimizer, config: ElixirConfig, world_size: int) -> int:
    """:func:`min_device_budget_bytes` without the activations' room (``prepare`` places model data, and
    ``default_placement="auto"`` compares a replicated copy, in the budget less that room)."""
    pstate = get_parallel_state(model)
    if pstate is not None:
        world_size = pstate.mesh.world_size
    if config.default_placement != "auto":
        return _placed_floor_bytes(model, optimizer, config, world_size)
    # "auto" as prepare resolves it: replicated from the budget a replicated copy fits, else sharded
    sharded = _placed_floor_bytes(model, optimizer, dataclasses.replace(config, default_placement="sharded"),
                                  world_size)
    if world_size == 1 or pstate is not None:
        return sharded
    numels = [p.numel() for p in _unique_params(model) if p.is_floating_point()]
    replicate_from = replicated_bytes(numels, config, optimizer, _element_bytes(config))
    if sharded < replicate_from:
        return sharded
    replicated = dataclasses.replace(config, default_placement="replicated")
    return max(replicate_from, _placed_floor_bytes(model, optimizer, replicated, world_size))


def _raise_if_replicating_needs_less(model, optimizer, config: ElixirConfig, world_size: int,
                                     err: ValueError, activation_bytes: int = 0) -> None:
    """``default_placement="auto"`` chose sharded because a replicated copy did not fit, and the sharded
    floor does not fit either: when a budget that replicates is the smaller minimum, name that one."""
    need = min_device_budget_bytes(model, optimizer, config, world_size, activation_bytes=activation_bytes)
    if f"needs {need} bytes" not in str(err):
        raise budget_error(need, config.device_memory_budget_bytes,
                           "a replicated copy of the model (default_placement='auto' replicates where the whole model"
                           + (", its gradients and optimizer states" if optimizer is not None else "")
                           + " fits; less than the sharded working set)") from err


def _element_bytes(config: ElixirConfig) -> int:
    return torch.empty((), dtype=_DTYPES[config.precision]).element_size()


def _placed_floor_bytes(model, optimizer, config: ElixirConfig, world_size: int) -> int:
    """:func:`min_device_budget_bytes` for a concrete ``default_placement``."""
    placements = placements_for_plan(model, config)
    names = _unique_params(model)
    params = [p for p in names if p.is_floating_point()]
    numels = [p.numel() for p in params]
    esize = _element_bytes(config)
    gsize = 4 if config.reduce_dtype == "fp32" else esize
    # prepare will get a budget (this one): its default chunk size is the budgeted one, whatever the config says
    chunk_size = _chunk_size(config, None, numels, placements, world_size, esize, 1)
    group_of, size_of = planned_chunk_groups(model, world_size)
    specs, chunk_of = chunk_specs(params, names, placements, group_of, size_of, chunk_size, esize, gsize)
    return device_floor_bytes(specs, _unit_chunks(model, chunk_of), config, optimizer)

register_prepare(prepare, memory_stats, min_device_budget_bytes)
