"""Which process group each parameter's chunk is sharded over, as the chunk layer asks for it
(``group_of(name) -> (group, replicas)``; see :func:`hf_elixir.chunk._build.comm_buckets`)."""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from hf_elixir.parallel._state import get_parallel_state

__all__ = ["chunk_group_of", "default_group", "group_size", "job_group_of", "planned_chunk_groups"]


def default_group(config) -> Any:
    """The data-parallel group ``prepare`` shards over: ``ElixirConfig.process_group``, else the world when
    ``torch.distributed`` runs more than one rank, else ``None`` (one rank)."""
    if config.process_group is not None:
        return config.process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def job_group_of(model: nn.Module, default_group: Any) -> Any:
    """The group of every rank training ``model``, over which the optimizer reduces the gradient norm
    and the overflow flag: ``default_group`` (the data-parallel group; ``None``: one rank), or the whole
    mesh, i.e. the world, of a model rewritten by :func:`~hf_elixir.parallel.parallelize`. Never WORLD
    for a plain model given its own ``ElixirConfig.process_group`` (two jobs may share one world)."""
    return dist.group.WORLD if get_parallel_state(model) is not None else default_group


def chunk_group_of(model: nn.Module, default_group: Any) -> Callable[[str], tuple[Any, int]]:
    """``name -> (group, replicas)`` for ``model``'s parameters.

    Plain data parallel: ``default_group`` (``None``: one rank) and one replica. A model rewritten by
    :func:`~hf_elixir.parallel.parallelize` (see [Note: gradient groups] in ``_mesh.py``): expert
    parameters over the expert-data-parallel group, the rest over the data-parallel group; a non-expert
    parameter replicated across tensor-parallel ranks counts ``tp`` times in the global gradient norm.
    """
    pstate = get_parallel_state(model)
    if pstate is None:
        return lambda name: (default_group, 1)
    mesh = pstate.mesh

    def group_of(name: str) -> tuple[Any, int]:
        if pstate.is_expert_param(name):  # one ep index holds it: counted once ([Note: tp x ep mesh])
            return mesh.expert_dp_group, 1
        return mesh.dp_group, mesh.tp_size if mesh.tp_size > 1 and name not in pstate.tp_layouts else 1

    return group_of


def planned_chunk_groups(model: nn.Module, world_size: int) -> tuple[Callable[[str], tuple[Any, int]],
                                                                   Callable[[Any], int]]:
    """``(group_of, group_size)`` for a run of ``world_size`` ranks that need not have started: a plain
    model's default group stands for ``world_size`` ranks; a parallelized model uses its mesh's groups
    (:func:`chunk_group_of`)."""
    if get_parallel_state(model) is None:
        default = _PLANNED_DEFAULT_GROUP if world_size > 1 else None
        return chunk_group_of(model, default), lambda group: world_size if group is not None else 1
    return chunk_group_of(model, None), group_size


def group_size(group: Any) -> int:
    """Ranks in ``group`` (``None``: one rank)."""
    return dist.get_world_size(group) if group is not None else 1


#: stands for the default process group of a run that has not started
_PLANNED_DEFAULT_GROUP = "planned default group"
