"""Ranks agree: the figures and decisions that choose collectives are the same on every rank.

[Note: ranks agree] Replicated vs sharded, the chunk size, the resident set, which shards and optimizer
states live on the device, and the searched plan each decide which collectives a rank issues (an
all-reduce or a reduce-scatter, how many all-gathers, over which chunks). A rank that decides alone,
from its own free memory, its own device budget or its own timings, can pick another branch than its
peers and the job hangs (or computes garbage). So every per-rank *input* of those decisions is reduced
once at ``prepare`` (:func:`agree_min`: the smallest budget / free memory over the ranks, the one every
rank can afford), and every *decision* is taken from one rank (:func:`agree_object`: rank 0 of the group
broadcasts it). docs/design/rules.md, *The simulation is as strict as the hardware*: decisions that select
collectives are identical on all ranks by construction.

The reductions run on the model's group (``ElixirConfig.process_group``, else the world; the whole mesh,
i.e. the world, for a model rewritten by ``hf_elixir.parallel.parallelize``), on a fresh tensor of the
compute device (NCCL takes device memory only; gloo takes CPU tensors), never on a manager buffer.
Source: ``torch.distributed.all_reduce`` (``ReduceOp.MIN``) and ``broadcast_object_list``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from hf_elixir.chunk._shared_budget import current_shared_budget
from hf_elixir.chunk.memory import default_host_budget_bytes, resolve_budget_bytes
from hf_elixir.config import ElixirConfig

__all__ = ["agree_budget", "agree_min", "agree_object", "agree_placements", "agreement_group_size"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_NONE = torch.iinfo(torch.int64).max  # ``None`` (no limit) is larger than every figure


def agreement_group_size(group: Any) -> int:
    """Ranks in ``group`` (``None``: this rank alone, 1)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _reduce_device(group: Any, device: torch.device | None) -> torch.device:
    if dist.get_backend(group) == "gloo" or device is None:
        return torch.device("cpu")
    return device


def agree_min(value: int | None, group: Any, device: torch.device | None = None) -> int | None:
    """The smallest of every rank's ``value`` in ``group`` (``None`` = no limit; all ``None`` gives ``None``).

    Every rank of ``group`` must call it (it is a collective). One ``all_reduce`` of one int64 on a fresh
    tensor of ``device`` (CPU under gloo), read back once: for ``prepare``, not for a step's hot path.

    Args:
        value: a byte figure (``int`` >= 0) or ``None``.
        group: the process group (``None``: this rank alone; returns ``value``).
        device: the compute device (``None``: CPU).

    Returns:
        ``int`` or ``None``.
    """
    if agreement_group_size(group) == 1:
        return value
    figure = torch.tensor([_NONE if value is None else int(value)], dtype=torch.int64,
                          device=_reduce_device(group, device))
    dist.all_reduce(figure, op=dist.ReduceOp.MIN, group=group)
    agreed = int(figure.item())
    return None if agreed == _NONE else agreed


def agree_object(obj: _T, group: Any, device: torch.device | None = None) -> _T:
    """Rank 0 of ``group``'s ``obj`` (picklable), on every rank of ``group``: a decision made once.

    Every rank of ``group`` must call it. ``group=None`` or one rank: returns ``obj``.
    """
    if agreement_group_size(group) == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    dist.broadcast_object_list(box, src=src, group=group,
                               device=None if device is None else _reduce_device(group, device))
    return box[0]


def agree_budget(config: ElixirConfig, group, device: torch.device) -> tuple[ElixirConfig, bool]:
    """The config with this rank's budget (``resolve_budget_bytes``: on CUDA the free memory less the
    reserve), then the smallest ``device_memory_budget_bytes`` over ``group`` ([Note: ranks agree]): a rank
    given (or measuring) less memory than its peers makes every rank place for that figure. Also returns
    whether the budget covers activations ([Note: activations in the budget] in ``chunk/memory.py``). Inside a
    :class:`~hf_elixir.chunk._shared_budget.SharedDeviceBudget` the budget is what the models prepared before
    left ([Note: one device budget for several models])."""
    measured = config.device_memory_budget_bytes is None
    budget, charges_activations = resolve_budget_bytes(config.device_memory_budget_bytes, device, None,
                                                       config.budget_covers_activations)
    config = dataclasses.replace(config, device_memory_budget_bytes=budget)
    budget = agree_min(config.device_memory_budget_bytes, group, device)
    if budget != config.device_memory_budget_bytes:
        logger.info("hf_elixir: device_memory_budget_bytes %s on this rank; %s, the smallest over the ranks, "
                    "is used", config.device_memory_budget_bytes, budget)
        config = dataclasses.replace(config, device_memory_budget_bytes=budget)
    shared = current_shared_budget()  # [Note: one device budget for several models] in chunk/_shared_budget.py
    if shared is not None:
        left = shared.budget_for(config.device_memory_budget_bytes, measured=measured)
        if left != config.device_memory_budget_bytes:
            config = dataclasses.replace(config, device_memory_budget_bytes=left)
    if agreement_group_size(group) > 1:  # the host budget picks rank-local host copies (no re-all-gather)
        host = agree_min(config.host_memory_budget_bytes or default_host_budget_bytes(), group, device)
        config = dataclasses.replace(config, host_memory_budget_bytes=host)
    return config, charges_activations


def agree_placements(chunks, group, device: torch.device) -> None:
    """Every rank takes rank 0's per-chunk placement (resident, shard and optimizer states on the device,
    rank-local host copy)."""
    flags = agree_object([(c.resident, c.shard_on_device, c.optim_on_device, c.keep_host_copy) for c in chunks],
                         group, device)
    assert len(flags) == len(chunks), (f"rank {dist.get_rank()}: {len(chunks)} chunks, rank 0 placed "
                                       f"{len(flags)}")
    for chunk, (resident, shard_on_device, optim_on_device, keep_host_copy) in zip(chunks, flags):
        chunk.resident, chunk.shard_on_device, chunk.optim_on_device = resident, shard_on_device, optim_on_device
        chunk.keep_host_copy = keep_host_copy
