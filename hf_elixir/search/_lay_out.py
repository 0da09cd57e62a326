"""The phases of ``hf_elixir.prepare`` that decide, before anything of the model changes ([Note: all-or-nothing
prepare] in ``runtime/_rollback.py``): whether the fused MoE experts are split (:func:`decide_split_experts`), and
the layout (:func:`lay_out`): the plan, the default placement, the parameters' order, the chunk size, the chunks
(sizes only) and where each one lives. ``hf_elixir/api.py`` calls them in order.

Every input that selects collectives is agreed over the model's group ([Note: ranks agree] in
``placement/_agree.py``): the budget once, before either phase (the caller passes the agreed config), the plan, the
default placement with the chunk size, and each chunk's placement.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from hf_elixir.chunk._build import COMPUTE_DTYPES, build_chunks, element_bytes, new_manager, ordered_params
from hf_elixir.chunk.manager import budget_error
from hf_elixir.config import ElixirConfig
from hf_elixir.parallel import get_parallel_state, placements_for_plan
from hf_elixir.parallel._expert_units import splittable_names
from hf_elixir.parallel._groups import chunk_group_of
from hf_elixir.placement._agree import agree_object, agree_placements
from hf_elixir.placement._device_placement import resolve_default_placement
from hf_elixir.placement._layout import Layout, activation_reserve_bytes, prefetch_reasons
from hf_elixir.placement._plan_check import check_plan, check_plan_placements, load_plan
from hf_elixir.runtime.activations import model_activation_policy
from hf_elixir.search._chunk_size import chunk_size_for
from hf_elixir.search._frozen_choice import frozen_whole, resolve_frozen_placement
from hf_elixir.search._floor import place_within_budget, searched_floor, split_needed
from hf_elixir.search._resolve import resolve_plan

__all__ = ["decide_split_experts", "lay_out"]

logger = logging.getLogger(__name__)


def _world_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def decide_split_experts(model, optimizer, config: ElixirConfig, group) -> ElixirConfig:
    """The config with ``split_fused_experts`` decided ([Note: split fused experts] in
    ``parallel/_expert_units.py``): ``True`` / ``False`` as given; ``"auto"`` compares the agreed device budget
    (``config`` carries it) with the fused model's floor (``search/_floor.py: split_needed``)."""
    split = config.split_fused_experts
    if not isinstance(split, bool):
        split = bool(splittable_names(model)) and split_needed(
            model, optimizer, config, config.device_memory_budget_bytes, _world_size(group), load_plan(config))
    return dataclasses.replace(config, split_fused_experts=split)


def _placements_and_chunk_size(model, config: ElixirConfig, plan, numels, world_size, agree_group, device):
    """The placements (resolved once from the config's default placement) and the chunk size, both rank 0's."""
    placements = placements_for_plan(model, config)
    chunk_size = chunk_size_for(config, plan, numels, placements, world_size, element_bytes(config.precision),
                                config.device_memory_budget_bytes)
    default_placement, chunk_size = agree_object((config.default_placement, chunk_size), agree_group, device)
    if default_placement != config.default_placement:  # this rank resolved 'auto' otherwise: rank 0's
        config = dataclasses.replace(config, default_placement=default_placement)
        placements = placements_for_plan(model, config)
    return config, placements, chunk_size


def lay_out(model, optimizer, config: ElixirConfig, sample_batch, names, params, *, group, agree_group,
            device: torch.device, charges_activations: bool, runtime_probe=None) -> Layout:
    """The plan, placements, chunks and their placement (``prepare``'s phases 4-7); the model is not changed.

    Args:
        config: the config with the agreed budget and the split decided.
        names / params: ``{parameter: its names}`` and the floating-point parameters to pack.
        group / agree_group: the data-parallel group and the group every rank of the job agrees over.
        charges_activations: whether the budget covers activations (from the budget's agreement).
        runtime_probe: what the hardware probe of ``search="auto"`` times hf_elixir's overheads with ([Note: runtime
            probe] in ``profiler/_runtime_probe.py``).
    """
    world_size = _world_size(group)
    # [Note: whole frozen chunks] in chunk/_frozen_whole.py: decided once (rank 0's), before the search packs chunks
    config, frozen_reason = resolve_frozen_placement(params, config, world_size,
                                                     is_parallel=get_parallel_state(model) is not None)
    config = dataclasses.replace(config, frozen_placement=agree_object(config.frozen_placement, agree_group, device))
    # search="auto" under a budget: exact at min_device_budget_bytes ([Note: the searched floor] in _floor.py)
    searched = searched_floor(model, optimizer, config, world_size)
    if searched is not None and config.device_memory_budget_bytes < searched[0]:
        raise budget_error(searched[0], config.device_memory_budget_bytes,
                           "the smallest working set at any chunk size search='auto' can choose (the largest pair "
                           "of adjacent modules' unsharded chunks and gradient buffers)")
    plan = agree_object(_resolved_plan(model, config, sample_batch, optimizer, searched, runtime_probe), agree_group,
                        device)
    if len(params) != len(names):
        logger.warning("%d non-floating-point parameters are left unmanaged", len(names) - len(params))
    if plan is None and searched is not None:
        config = dataclasses.replace(config, chunk_size_numel=searched[1])
    args = (model, optimizer, names, params, world_size, group, agree_group, device, charges_activations)
    try:
        layout = _lay_out_with(config, plan, *args)
    except ValueError as err:
        if plan is None or searched is None:
            raise
        logger.info("search='auto': the searched plan does not place in device_memory_budget_bytes=%d (%s); laid "
                    "out without it at chunk_size_numel=%d, the smallest floor's", config.device_memory_budget_bytes,
                    err, searched[1])
        layout = _lay_out_with(dataclasses.replace(config, chunk_size_numel=searched[1]), None, *args)
    if frozen_reason:
        layout.reasons.insert(0, frozen_reason)
    return layout


def _resolved_plan(model, config: ElixirConfig, sample_batch, optimizer, searched, runtime_probe):
    """:func:`resolve_plan`, or ``None`` where the search finds nothing in a budget at or above its floor (``prepare``
    then lays out at the floor's chunk size, [Note: the searched floor] in ``_floor.py``)."""
    try:
        return resolve_plan(model, config, sample_batch, optimizer, runtime_probe=runtime_probe)
    except ValueError as err:
        # the search's refusal ("no configuration fits ..."): its cost model keeps a safety margin and prices
        # activations; the floor, which prepare's placement holds, is met
        if searched is None or sample_batch is None or not str(err).startswith("no configuration fits"):
            raise
        logger.info("search='auto' found no plan in device_memory_budget_bytes=%d (%s); laying out at "
                    "chunk_size_numel=%d, the smallest floor's", config.device_memory_budget_bytes, err, searched[1])
        return None


def _lay_out_with(config: ElixirConfig, plan, model, optimizer, names, params, world_size, group, agree_group,
                  device, charges_activations) -> Layout:
    """:func:`lay_out` for a resolved ``plan`` (or none)."""
    activation_bytes = activation_reserve_bytes(plan, config, charges_activations)  # from the agreed plan
    auto_config = config
    config, placement_reason = resolve_default_placement(
        config, plan, [p.numel() for p in params], optimizer, world_size, element_bytes(config.precision),
        is_parallel=get_parallel_state(model) is not None, placements_of=lambda c: placements_for_plan(model, c),
        group=agree_group, device=device, activation_bytes=activation_bytes)
    params = ordered_params(plan, params, names)
    numels = [p.numel() for p in params]
    config, placements, chunk_size = _placements_and_chunk_size(model, config, plan, numels, world_size,
                                                                agree_group, device)
    manager = new_manager(config, plan, device, agree_group, charges_activations, activation_bytes)
    chunks = build_chunks(manager, params, names, placements, chunk_group_of(model, group), chunk_size,
                          COMPUTE_DTYPES[config.precision], device, frozen_whole=frozen_whole(config))
    if plan is not None:  # checked on rank 0's counts: uneven tensor-parallel slices are shorter on other ranks
        num_params, num_chunks = agree_object((sum(numels), len(chunks)), agree_group, device)
        check_plan(plan, model, num_params, world_size, config.precision, num_chunks,
                   config.device_memory_budget_bytes, config.reduce_dtype)
        check_plan_placements(plan, placements)
    reasons = place_within_budget(model, manager, plan, config, auto_config, optimizer, world_size,
                                  activation_bytes)
    if get_parallel_state(model) is None:  # a mesh's ranks hold different chunks: placed from agreed inputs
        agree_placements(chunks, agree_group, device)
    return Layout(config, plan, manager, params, placements, chunk_size, world_size,
                  ([placement_reason] if placement_reason else []) + reasons + prefetch_reasons(manager, optimizer),
                  model_activation_policy(model, plan, config))
