"""The budget floor: the smallest ``device_memory_budget_bytes`` ``hf_elixir.prepare`` accepts for a model,
computed without preparing it (the same packing, placements, units and floor as ``prepare``:
``placement/_device_placement.py: device_floor_bytes``), and the error ``prepare`` raises when
``default_placement="auto"`` sharded a model that a budget which replicates it would have fit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from hf_elixir.chunk._build import chunk_specs, element_bytes, ordered_params, unique_params
from hf_elixir.chunk._nf4 import packed_nf4
from hf_elixir.chunk._shared_budget import current_shared_budget
from hf_elixir.chunk.manager import budget_error
from hf_elixir.config import ElixirConfig
from hf_elixir.parallel import get_parallel_state, placements_for_plan
from hf_elixir.parallel._expert_units import splittable_names, temporarily_split
from hf_elixir.parallel._groups import planned_chunk_groups
from hf_elixir.placement._device_placement import (committed_bytes, device_floor_bytes, place_chunks, replicated_bytes,
                                                   wanted_bytes)
from hf_elixir.plan import ElixirPlan
from hf_elixir.runtime._state import is_prepared
from hf_elixir.runtime.compile import compiled_units
from hf_elixir.runtime.hooks import mark_subtree_chunks, unit_chunks
from hf_elixir.search._chunk_size import candidate_grid, chunk_size_for
from hf_elixir.search._frozen_choice import frozen_whole, resolve_frozen_placement

__all__ = ["min_device_budget_bytes", "place_within_budget", "raise_if_replicating_needs_less", "searched_floor",
           "split_needed"]

logger = logging.getLogger(__name__)


def min_device_budget_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                            config: ElixirConfig | None = None, world_size: int = 1, *,
                            activation_bytes: int = 0) -> int:
    """Smallest ``device_memory_budget_bytes`` that ``prepare`` accepts for this model, computed without
    preparing it (no data moves): the same chunk packing, placements, units and budget floor
    (``placement/_device_placement.py: device_floor_bytes``) as :func:`prepare`, plus the room kept for
    activations.

    Args:
        model: the model ``prepare`` will get (after :func:`hf_elixir.parallel.parallelize`, if used). With
            ``ElixirConfig.split_fused_experts`` ``True`` or ``"auto"`` (the default: ``prepare`` splits at a
            budget below the fused floor) its fused MoE experts are counted split per expert, as ``prepare`` splits them (the model is split and put back while this runs; nothing is copied).
        optimizer: the optimizer ``prepare`` will get, or ``None`` for inference (no gradient buffers:
            a smaller floor). Its kind sizes the optimizer states kept on the device with
            ``ElixirConfig(offload_optimizer=False)``; otherwise they go to the host and do not count.
        config: the ``ElixirConfig`` ``prepare`` will get. ``default_placement="auto"`` resolves as
            ``prepare`` resolves it (replicated where the whole model with its gradients and optimizer
            states fits the budget, else sharded); ``"replicated"`` modules count whole on every rank
            (world size > 1). With ``search="auto"`` and neither ``plan`` nor ``chunk_size_numel``: the least
            floor over the chunk sizes the search can choose ([Note: the searched floor]); ``prepare`` refuses
            a budget below it naming it, and at it trains the searched plan, or that chunk size where no
            searched plan fits. Frozen parameters' chunks are laid out as ``frozen_placement`` resolves (whole on every
            rank and packed as buckets, or sharded: [Note: whole frozen chunks] in ``hf_elixir/chunk/_frozen_whole.py``),
            "auto" from the rates cached on this machine, as ``prepare`` resolves it.
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
    # the model prepare will lay out: fused MoE experts split per expert ([Note: split fused experts])
    with temporarily_split(model, config.split_fused_experts is not False and not is_prepared(model)), \
            packed_nf4(model, config):  # NF4 weights priced as the packed bytes prepare stores ([Note: NF4 in chunks])
        return _model_data_floor_bytes(model, optimizer, config, world_size) + activation_bytes


def split_needed(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, config: ElixirConfig,
                 budget_bytes: int | None, world_size: int, plan: ElixirPlan | None) -> bool:
    """Whether ``prepare`` splits ``model``'s fused MoE experts per expert ([Note: split fused experts] in
    ``hf_elixir/parallel/_expert_units.py``) under ``ElixirConfig.split_fused_experts``.

    ``True`` / ``False``: as given. ``"auto"``: a model without splittable fused experts, no; a ``plan`` made for
    the split model (none of the fused parameter names in ``plan.param_order``; ``hf-elixir plan`` splits by
    default) or for the fused one (they are there): as the plan was made; else split when ``budget_bytes`` (the
    agreed device budget, bytes per rank; ``None``: no budget, everything resident) is below the fused model's
    :func:`min_device_budget_bytes` plus the plan's activation room, so the fused layout, which runs each layer's
    experts as one call, is kept wherever it fits.
    """
    if config.split_fused_experts is not True and config.split_fused_experts is not False:  # "auto"
        fused = splittable_names(model)
        if not fused:
            return False
        if plan is not None and plan.param_order:
            return not set(fused) & set(plan.param_order)
        if budget_bytes is None:
            return False
        activation = plan.activation_peak_bytes if plan is not None and config.budget_covers_activations else 0
        kept = dataclasses.replace(config, split_fused_experts=False, search="off")  # the fused floor, no warning
        return budget_bytes < min_device_budget_bytes(model, optimizer, kept, world_size,
                                                      activation_bytes=int(activation or 0))
    return config.split_fused_experts


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
    numels = [p.numel() for p in unique_params(model) if p.is_floating_point()]
    replicate_from = replicated_bytes(numels, config, optimizer, element_bytes(config.precision))
    if sharded < replicate_from:
        return sharded
    replicated = dataclasses.replace(config, default_placement="replicated")
    return max(replicate_from, _placed_floor_bytes(model, optimizer, replicated, world_size))


def raise_if_replicating_needs_less(model, optimizer, config: ElixirConfig, world_size: int,
                                     err: ValueError, activation_bytes: int = 0) -> None:
    """``default_placement="auto"`` chose sharded because a replicated copy did not fit, and the sharded
    floor does not fit either: when a budget that replicates is the smaller minimum, name that one."""
    need = min_device_budget_bytes(model, optimizer, config, world_size, activation_bytes=activation_bytes)
    if f"needs {need} bytes" not in str(err):
        raise budget_error(need, config.device_memory_budget_bytes,
                           "a replicated copy of the model (default_placement='auto' replicates where the whole model"
                           + (", its gradients and optimizer states" if optimizer is not None else "")
                           + " fits; less than the sharded working set)") from err


def _placed_floor_bytes(model, optimizer, config: ElixirConfig, world_size: int) -> int:
    """:func:`min_device_budget_bytes` for a concrete ``default_placement``."""
    return min(_placed_floors(model, optimizer, config, world_size).values())


# [Note: the searched floor]
# With search="auto" (no plan, no chunk_size_numel) prepare's search picks a chunk size for the budget it gets,
# from the grid search_chunk_size scores (search/_chunk_size.py: candidate_grid; the plan search ranks that grid
# by padding and traffic and prices the best few), so a floor at the default chunk size overstated what it
# accepts (a tiny Mixtral at expert parallel 2 trained at half of it). The floor is therefore the least over that
# grid and the default size, each packed and placed as prepare packs and places it (device_floor_bytes), and
# prepare keeps it exact both ways (search/_lay_out.py): a budget below it is refused naming it, before the
# search runs; at or above it, where the search finds no plan or its plan does not place, prepare lays the model
# out without a plan at the chunk size of the least floor that fits (searched_floor), which the floor covers.
def _placed_floors(model, optimizer, config: ElixirConfig, world_size: int) -> dict[int, int]:
    """``{chunk size: floor}`` for a concrete ``default_placement``: the default chunk size's, and with
    ``search="auto"`` (no plan, no ``chunk_size_numel``) every size of the search's grid ([Note: the searched
    floor])."""
    placements = placements_for_plan(model, config)
    names = unique_params(model)
    # [Note: LoRA floor] packed in the plan's order (else module order) and split as prepare packs
    # (``search/_lay_out.py``, ``chunk_specs``): a LoRA model's frozen base in chunks apart from its adapters
    # ([Note: frozen chunks apart] in ``hf_elixir/chunk/_frozen_apart.py``), so only the adapters' chunks count
    # gradient buffers and optimizer state.
    # (a plan naming parameters this layout lacks, e.g. made for the fused experts, is not prepare's here: model order)
    known = {ns[0] for ns in names.values()}
    plan = config.plan if config.plan is not None and set(config.plan.param_order) <= known else None
    params = ordered_params(plan, [p for p in names if p.is_floating_point()], names)
    numels = [p.numel() for p in params]
    esize = element_bytes(config.precision)
    gsize = 4 if config.reduce_dtype == "fp32" else esize
    # prepare will get a budget (this one): its default chunk size is the budgeted one, whatever the config says
    sizes = {chunk_size_for(config, None, numels, placements, world_size, esize, 1)}
    if _searching(config) and numels:
        sizes.update(candidate_grid(numels))
    group_of, size_of = planned_chunk_groups(model, world_size)
    # [Note: whole frozen chunks] in hf_elixir/chunk/_frozen_whole.py: frozen chunks whole, packed as buckets
    config, _ = resolve_frozen_placement(params, config, world_size, is_parallel=get_parallel_state(model) is not None)
    floors = {}
    with compiled_units(model, config.compile):  # a compiled block is one unit ([Note: compiled blocks])
        for size in sorted(sizes):
            specs, chunk_of = chunk_specs(params, names, placements, group_of, size_of, size, esize, gsize,
                                          frozen_whole=frozen_whole(config))
            floors[size] = device_floor_bytes(specs, unit_chunks(model, chunk_of), config, optimizer)
    return floors


def _searching(config: ElixirConfig) -> bool:
    return config.search == "auto" and config.plan is None and not config.chunk_size_numel


def searched_floor(model, optimizer, config: ElixirConfig, world_size: int) -> tuple[int, int] | None:
    """``(floor, chunk size)`` of a prepare that searches under a budget ([Note: the searched floor]): the model-data
    floor :func:`min_device_budget_bytes` reports, and the chunk size of the least sharded floor (the smallest such
    size); ``None`` when ``prepare`` does not
    search (a plan, a ``chunk_size_numel``, ``search="off"``) or has no budget. ``model`` is as ``prepare`` lays it
    out (split experts already split)."""
    budget = config.device_memory_budget_bytes
    if not _searching(config) or budget is None:
        return None
    pstate = get_parallel_state(model)
    if pstate is not None:
        world_size = pstate.mesh.world_size
    floor = _model_data_floor_bytes(model, optimizer, config, world_size)
    sharded = config if config.default_placement != "auto" else dataclasses.replace(config,
                                                                                    default_placement="sharded")
    floors = _placed_floors(model, optimizer, sharded, world_size)
    return floor, min(floors, key=lambda size: (floors[size], size))


def place_within_budget(model: torch.nn.Module, manager, plan: ElixirPlan | None, config: ElixirConfig,
                        auto_config: ElixirConfig, optimizer, world_size: int, activation_bytes: int) -> list[str]:
    """Place ``manager``'s chunks (``placement/_device_placement.py: place_chunks``) in the budget less
    ``activation_bytes``, and return the reasons. ``auto_config`` is the config before ``default_placement="auto"``
    was resolved: when that chose sharded and even the sharded floor does not fit, the error names the smaller
    budget that replicates, if there is one (:func:`raise_if_replicating_needs_less`).

    Raises:
        ValueError: the budget is below the floor (naming the bytes needed), or a plan's placement does not fit.
    """
    units = unit_chunks(model, manager.chunk_of)
    shared = current_shared_budget()
    try:
        mark_subtree_chunks(model, manager)  # MoE-expert chunks need rank-local host copies (placement reads it)
        placed = config
        if shared is not None and shared.members() and shared.budget_bytes is not None:
            placed = _allotted(manager, units, config, optimizer, activation_bytes, shared)
        reasons = place_chunks(manager.chunks, units, plan, placed, optimizer, world_size, activation_bytes)
    except ValueError as err:
        if shared is not None and shared.members():
            raise _shared_budget_error(model, optimizer, config, world_size, activation_bytes, shared) from err
        if plan is None and auto_config is not config and config.default_placement == "sharded":
            raise_if_replicating_needs_less(model, optimizer, auto_config, world_size, err, activation_bytes)
        raise
    manager.pool.recommit = functools.partial(committed_bytes, manager.chunks, units, config, optimizer,
                                              activation_bytes)
    manager.pool.committed_bytes = manager.pool.recommit(frozenset())
    if shared is not None and shared.members():
        shared.divide(manager, f"{type(model).__name__} ({'trained' if optimizer is not None else 'frozen'})")
    return reasons


def _allotted(manager, units, config: ElixirConfig, optimizer, activation_bytes: int, shared) -> ElixirConfig:
    """``config`` with the budget a model joining ``shared`` is placed in ([Note: re-placing for a newcomer] in
    ``chunk/_shared_budget.py``); raises a ``ValueError`` (caught by the caller) when the floors do not fit."""
    floor = device_floor_bytes(manager.chunks, units, config, optimizer) + activation_bytes
    allot = shared.allot(floor, wanted_bytes(manager.chunks, units, config, optimizer, activation_bytes))
    if allot is None:
        raise ValueError("the models' floors do not fit the shared device budget")
    budget = config.device_memory_budget_bytes
    return dataclasses.replace(config, device_memory_budget_bytes=allot if budget is None else min(allot, budget))


def _shared_budget_error(model, optimizer, config: ElixirConfig, world_size: int, activation_bytes: int,
                         shared) -> ValueError:
    """The refusal of a model that does not fit beside the others of its :class:`SharedDeviceBudget`: every
    model's need, their sum and the fixes ([Note: one device budget for several models] in
    ``chunk/_shared_budget.py``)."""
    need = _placed_floor_bytes(model, optimizer, config, world_size) + activation_bytes
    others = shared.committed_by_others()
    label = f"{type(model).__name__} ({'trained' if optimizer is not None else 'frozen'})"
    return ValueError(
        f"{label} does not fit the device budget it shares with the models prepared before it: "
        f"ElixirConfig.device_memory_budget_bytes={shared.budget_bytes} is the whole device for all of them; "
        f"{shared.needs()}, and {label} needs at least {need} bytes, {others + need} in all. Raise "
        f"device_memory_budget_bytes to at least {others + need}, or leave room when the earlier models are "
        f"placed: prepare them with device_memory_budget_bytes={max(0, (shared.budget_bytes or 0) - need)} of "
        "their own (the rest of the device stays for this one), or offload_optimizer=True")
