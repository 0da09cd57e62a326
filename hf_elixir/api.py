"""``hf_elixir.prepare``: pack a model's parameters into chunks, place them, install hooks, wrap the
optimizer. Also ``min_device_budget_bytes`` (``search/_floor.py``) and ``memory_stats`` (``runtime/_state.py``).

A façade: each phase lives in its layer, and ``prepare`` calls them in order:

1. checks: arguments, streamed init, the precision (``runtime/_checks.py``), parameters another prepared
   model manages (``runtime/_state.py``), the optimizer (``optim/_check.py``);
2. the budget: this rank's, then the smallest over the ranks (``placement/_agree.py``, [Note: ranks agree]);
3. the plan, loaded or searched (``search/_resolve.py``), rank 0's; the bytes placement keeps for
   activations (``placement/_layout.py``, [Note: activations in the budget] in ``chunk/memory.py``);
4. ``default_placement="auto"`` resolved (``placement/_device_placement.py``);
5. parameters in the plan's order, the chunk size (``search/_chunk_size.py``), rank 0's; chunks built, still
   empty (``chunk/_build.py``), the plan checked against them (``placement/_plan_check.py``);
6. each chunk placed (``placement/_device_placement.py``, from ``search/_floor.py``, which names the floor when
   it does not fit), rank 0's placement (``placement/_agree.py``), the activation policy (``runtime/activations.py``);

and only then, with everything checked, it changes the model (undone on any failure, see
[Note: all-or-nothing prepare] in ``runtime/_rollback.py``):

7. hooks and guards installed (``runtime/hooks.py``, ``runtime/guards.py``);
8. parameters copied into their chunks, or streamed from ``checkpoint`` (``chunk/_build.py``, ``_stream_load.py``);
9. the plan recorded (``placement/_layout.py``), optimizer wrapped (``optim/``), state-dict hooks, activation
   policy or checkpointing (``runtime/``), state attached (``runtime/_state.py``).

``prepare`` extends the given model in place and returns the same object (as FSDP2's ``fully_shard`` does),
so ``model.config``, ``generate()``, ``state_dict()`` and ``save_pretrained`` keep working.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from hf_elixir._logging import info_on_main_rank
from hf_elixir.chunk import _host_heap
from hf_elixir.chunk._build import (COMPUTE_DTYPES, build_chunks, element_bytes, materialize_chunks, new_manager,
                                    ordered_params, unique_params)
from hf_elixir.chunk._stream_load import StreamedInit, retie
from hf_elixir.config import ElixirConfig
from hf_elixir.optim._check import check_optimizer
from hf_elixir.optim.optimizer import ElixirOptimizer
from hf_elixir.parallel import get_parallel_state, placements_for_plan
from hf_elixir.parallel._expert_units import (fuse_tensors, fused_names, release_fused, split_fused_experts,
                                              split_optimizer_params, splittable_names, unsplit_fused_experts)
from hf_elixir.parallel._gather import assemble_full
from hf_elixir.parallel._groups import chunk_group_of, default_group, job_group_of
from hf_elixir.placement._agree import agree_budget, agree_object, agree_placements
from hf_elixir.placement._device_placement import resolve_default_placement
from hf_elixir.placement._layout import Layout, activation_reserve_bytes, prefetch_reasons, recorded_plan
from hf_elixir.placement._plan_check import check_plan, check_plan_placements, load_plan
from hf_elixir.profiler import _device
from hf_elixir.parallel._exit import end_gloo_group_at_exit
from hf_elixir.parallel._launch import check_launch_world_size
from hf_elixir.profiler._hardware import register_prepare
from hf_elixir.runtime._checks import check_arguments, check_streamed_init
from hf_elixir.runtime._checks import check_precision_supported as _check_precision_supported
from hf_elixir.runtime._rollback import ModelSnapshot
from hf_elixir.runtime.compile import apply_compile, mark_compiled_blocks
from hf_elixir.runtime._state import (ElixirState, attach_state, check_unclaimed, claim_parameters, get_state,
                                      memory_stats, reset_memory_stats)
from hf_elixir.runtime.activations import install_activation_policy, model_activation_policy
from hf_elixir.runtime.guards import install_guards
from hf_elixir.runtime.hooks import install_hooks
from hf_elixir.runtime.state_dict import install_state_dict_hooks
from hf_elixir.search._chunk_size import chunk_size_for
from hf_elixir.search._floor import min_device_budget_bytes, place_within_budget, split_needed
from hf_elixir.search._resolve import resolve_plan

__all__ = ["prepare", "memory_stats", "reset_memory_stats", "get_state", "min_device_budget_bytes", "ElixirState"]

logger = logging.getLogger(__name__)


def _compute_device() -> torch.device:
    """The device ``prepare`` computes on ([Note: device selection] in ``profiler/_device.py``)."""
    return _device.select_compute_device()  # looked up at each call (tests stand in for the machine)


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            config: ElixirConfig | None = None, *, sample_batch: dict | None = None,
            checkpoint: str | os.PathLike | None = None):
    """Put ``model`` under chunk memory management; wrap ``optimizer``.

    All or nothing: when ``prepare`` raises, the model is as it was (no hooks, the same parameter storage
    and ``requires_grad``, nothing attached), so fixing the cause and calling it again works.

    With ``ElixirConfig.split_fused_experts`` (``"auto"``, the default: where the budget is below the fused floor,
    or the plan was made split) the fused 3-D experts of MoE models (Mixtral,
    Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss) are first split into one child module per expert, each its own hook
    unit (``parallel/_expert_units.py``, [Note: split fused experts]); ``optimizer``'s param groups then hold
    the pieces in place of each fused parameter (undone, with the split, if ``prepare`` raises).

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
            ``from_pretrained(folder)`` + ``prepare`` bit for bit. A model rewritten by ``parallelize`` (on meta
            too) reads its ranks' slices: tensor-parallel slices of the full tensors, expert-parallel experts.
            Not with tensor and expert parallel together or ``search="auto"`` yet. See [Note: streamed init] in ``hf_elixir/chunk/_stream_load.py``.

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
    check_launch_world_size()  # [Note: silent single-process runs] in parallel/_launch.py
    check_arguments(model, optimizer, config)  # 1
    pstate = get_parallel_state(model)
    check_streamed_init(model, config, checkpoint,
                        is_parallel=pstate is not None and pstate.mesh.tp_size > 1 and bool(pstate.expert_containers))
    if checkpoint is not None:
        retie(model, optimizer)  # what from_pretrained does after loading (kept if prepare fails)
    # [Note: split fused experts] in parallel/_expert_units.py: one unit per expert; undone if prepare fails
    config = dataclasses.replace(config, split_fused_experts=_splits_experts(model, optimizer, config))
    split = split_fused_experts(model) if config.split_fused_experts else []
    restore_groups = lambda: None  # noqa: E731
    try:
        restore_groups = split_optimizer_params(optimizer, split)
        prepared = _prepare_split(model, optimizer, config, sample_batch, checkpoint, pstate)
    except BaseException:
        restore_groups()
        unsplit_fused_experts(split)
        raise
    release_fused(split)  # the fused tensors' storage can go (the pieces' values are in their chunks)
    _host_heap.after_prepare(get_state(prepared[0]).manager)  # which goes back to the system ([Note: host heap])
    end_gloo_group_at_exit()  # [Note: gloo group at exit] in parallel/_exit.py
    return prepared


def _splits_experts(model, optimizer, config: ElixirConfig) -> bool:
    """Whether ``prepare`` splits the fused MoE experts (``ElixirConfig.split_fused_experts``; ``"auto"`` compares
    the agreed device budget with the fused model's floor: ``search/_floor.py: split_needed``)."""
    if isinstance(config.split_fused_experts, bool) or not splittable_names(model):
        return config.split_fused_experts is True
    group = default_group(config)
    agreed, _ = agree_budget(config, job_group_of(model, group), _compute_device())
    world_size = dist.get_world_size(group) if group is not None else 1
    return split_needed(model, optimizer, config, agreed.device_memory_budget_bytes, world_size, load_plan(config))


def _prepare_split(model, optimizer, config: ElixirConfig, sample_batch, checkpoint, pstate):
    """``prepare`` once the fused experts are split (if they are): checks, layout, then the model changes."""
    names = unique_params(model)
    check_unclaimed(model, names)
    params = [p for p in names if p.is_floating_point()]
    if optimizer is not None:
        check_optimizer(optimizer, {p: names[p] for p in params})
    snapshot = ModelSnapshot(model)  # the profiled step of search="auto" runs the model too
    try:
        mark_compiled_blocks(model, config.compile)  # compiled blocks are hook units ([Note: compiled blocks])
        layout = _lay_out(model, optimizer, config, sample_batch, names, params)
        fused = fused_names(model)  # a split expert's piece reads its rows of the fused checkpoint tensor
        extra = dict(shards=pstate.stream_shards(), expected=pstate.full_shapes) if pstate is not None else {}
        stream = (StreamedInit(model, checkpoint, {p: [fused[n][0] if n in fused else n for n in names[p]] for p in
                               params}, layout.manager.compute_device, allow_missing=config.allow_missing_keys, **extra)
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
    return prepared


def _lay_out(model, optimizer, config: ElixirConfig, sample_batch, names, params) -> Layout:
    """Phases 1-6 of ``prepare``: budget, plan, placements, chunks and their placement; the model is not changed."""
    placements_for_plan(model, config)  # validates tp/ep sizes and placement globs
    device = _compute_device()
    _check_precision_supported(config.precision, device)
    group = default_group(config)
    agree_group = job_group_of(model, group)
    config, charges_activations = agree_budget(config, agree_group, device)  # 2
    plan = agree_object(resolve_plan(model, config, sample_batch, optimizer), agree_group, device)  # 3
    activation_bytes = activation_reserve_bytes(plan, config, charges_activations)  # from the agreed plan
    world_size = dist.get_world_size(group) if group is not None else 1
    if len(params) != len(names):
        logger.warning("%d non-floating-point parameters are left unmanaged", len(names) - len(params))
    auto_config = config
    config, placement_reason = resolve_default_placement(  # 4
        config, plan, [p.numel() for p in params], optimizer, world_size, element_bytes(config.precision),
        is_parallel=get_parallel_state(model) is not None, placements_of=lambda c: placements_for_plan(model, c),
        group=agree_group, device=device, activation_bytes=activation_bytes)
    params = ordered_params(plan, params, names)  # 5
    numels = [p.numel() for p in params]
    chunk_size = chunk_size_for(config, plan, numels, placements_for_plan(model, config), world_size,
                                element_bytes(config.precision), config.device_memory_budget_bytes)
    default_placement, chunk_size = agree_object((config.default_placement, chunk_size), agree_group, device)
    config = dataclasses.replace(config, default_placement=default_placement)
    placements = placements_for_plan(model, config)
    manager = new_manager(config, plan, device, agree_group, charges_activations, activation_bytes)
    chunks = build_chunks(manager, params, names, placements, chunk_group_of(model, group), chunk_size,
                          COMPUTE_DTYPES[config.precision], device)
    if plan is not None:  # checked on rank 0's counts: uneven tensor-parallel slices are shorter on other ranks
        num_params, num_chunks = agree_object((sum(numels), len(chunks)), agree_group, device)
        check_plan(plan, model, num_params, world_size, config.precision, num_chunks,
                   config.device_memory_budget_bytes, config.reduce_dtype)
        check_plan_placements(plan, placements)
    reasons = place_within_budget(model, manager, plan, config, auto_config, optimizer, world_size,  # 6
                                  activation_bytes)
    if get_parallel_state(model) is None:  # a mesh's ranks hold different chunks: placed from agreed inputs
        agree_placements(chunks, agree_group, device)
    return Layout(config, plan, manager, params, placements, chunk_size, world_size,
                  ([placement_reason] if placement_reason else []) + reasons + prefetch_reasons(manager, optimizer),
                  model_activation_policy(model, plan, config))


def _apply_layout(model, optimizer, names, layout: Layout, stream: StreamedInit | None):
    """Phases 7-9 of ``prepare``: the model changes (``prepare`` undoes them all if one fails); with
    ``stream``, each chunk is filled from the checkpoint instead of the parameters."""
    manager, config = layout.manager, layout.config
    handles = install_hooks(model, manager)  # 7
    install_guards(model, manager)
    fp32_masters = {} if optimizer is not None else None  # [Note: fp32 masters at prepare] in chunk/_build.py
    materialize_chunks(manager, stream.fill_for if stream is not None else None, fp32_masters)  # 8
    plan = recorded_plan(model, names, layout)  # 9
    state = ElixirState(manager=manager, handles=handles, config=config, plan=plan,
                        assemble_full=assemble_full if get_parallel_state(model) is not None else None,
                        fuse_experts=fuse_tensors if fused_names(model) else None)
    if optimizer is not None:
        state.optimizer = ElixirOptimizer(optimizer, manager, config, refresh_cast=plan.refresh_cast,
                                          fp32_masters=fp32_masters)
    else:  # no optimizer step: each forward is a step ([Note: forward steps] in chunk/_steps.py)
        manager.forward_steps = True
    install_state_dict_hooks(model, manager, on_loaded=(
        state.optimizer.sync_masters_from_params if state.optimizer is not None else (lambda: None)))
    state.compiled = apply_compile(model, config.compile, handles)  # before the activation policy wraps forwards
    install_activation_policy(model, layout.activation_policy, plan.activation_checkpointing, manager, handles)
    attach_state(model, state)
    claim_parameters(layout.params, model)
    info_on_main_rank(logger, "hf_elixir: %d params in %d chunks of %d elements; %s",  # one line per job
                      sum(p.numel() for p in layout.params), len(manager.chunks), layout.chunk_size,
                      "; ".join(layout.reasons))
    return model, state.optimizer


register_prepare(prepare, memory_stats, min_device_budget_bytes)
