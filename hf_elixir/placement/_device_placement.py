"""Where each chunk lives: the working set a step needs on the device, and the decision per chunk
(resident, shard on the device or the host, optimizer states on the device or the host), from a plan
or from the budget; and what ``default_placement="auto"`` resolves to.

The chunks come from the chunk layer (built :class:`~hf_elixir.chunk.chunk.Chunk` objects, or
:class:`~hf_elixir.chunk._build.ChunkSpec` sizes when no data may move); what a tensor/expert-parallel
mesh decides comes in as arguments, so this layer imports neither the parallel nor the runtime layer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import psutil
import torch

from hf_elixir.chunk.manager import budget_error
from hf_elixir.config import ElixirConfig
from hf_elixir.optim.optimizer import optimizer_state_numel_factor
from hf_elixir.placement._agree import agree_min
from hf_elixir.plan import ElixirPlan

__all__ = ["Sizes", "choose_host_copies", "default_host_budget_bytes", "place", "place_chunks", "replicated_fits",
           "resolve_default_placement", "working_set", "working_set_bytes"]


class Sizes:
    """Byte sizes the placement policy needs, per chunk."""

    def __init__(self, chunks, optim_factor: int, precision: str) -> None:
        self.full = {c.chunk_id: c.full_bytes for c in chunks}
        self.shard = {c.chunk_id: c.shard_bytes for c in chunks}
        self.grad = {c.chunk_id: (c.grad_full_bytes if c.trainable else 0) for c in chunks}
        master = 0 if precision == "fp32" else 4
        self.optim = {c.chunk_id: (c.shard_numel * 4 * (1 + optim_factor) + c.shard_numel * master
                                   if c.trainable else 0) for c in chunks}


def working_set_bytes(per_unit_full: list[int], grad_bytes: list[int], staging_bytes: int) -> int:
    """Device bytes needed by two adjacent units at once (backward overlaps the previous unit's release),
    plus two gradient buffers and, with several ranks, an onload staging shard or reduce-scatter output."""
    per_unit = per_unit_full or [0]
    pairs = [a + b for a, b in zip(per_unit, per_unit[1:])] or per_unit
    return max(pairs) + sum(sorted(grad_bytes, reverse=True)[:2]) + staging_bytes


def working_set(units_chunks: list[list], sizes: Sizes, chunks: list) -> int:
    """:func:`working_set_bytes` of the units' chunks (``units_chunks``: per hooked unit, its chunks)."""
    # replicated chunks never leave the device: counted once, not per unit
    replicated = sum(sizes.full[c.chunk_id] for c in chunks if c.replicate_group is not None)
    per_unit = [sum(sizes.full[c.chunk_id] for c in cs if c.replicate_group is None) for cs in units_chunks]
    # onload staging of a host shard, or the reduce-scatter output shard; a chunk's own group decides
    # (a tensor-parallel model's chunks are sharded over the data-parallel axis only)
    staging = max([max(sizes.shard[c.chunk_id], sizes.grad[c.chunk_id] // c.world_size)
                   for c in chunks if c.world_size > 1] or [0])
    return working_set_bytes(per_unit, list(sizes.grad.values()), staging) + replicated


def _from_plan(chunks, plan: ElixirPlan) -> list[str]:
    resident, dev_shard, dev_optim = map(set, (plan.resident_chunks, plan.device_shard_chunks,
                                               plan.device_optim_chunks))
    for c in chunks:
        c.resident = c.chunk_id in resident
        c.shard_on_device = c.chunk_id in dev_shard or c.resident
        c.optim_on_device = c.chunk_id in dev_optim
    return ["placement taken from ElixirConfig.plan"]


def _working_set_error(chunks, needed: int, budget: int, optim_dev: int) -> ValueError:
    err = budget_error(needed, budget, "the largest pair of adjacent modules (unsharded chunks, two "
                       "gradient buffers" + (", device optimizer states" if optim_dev else "") + ")")
    largest = max((s.numel for c in chunks for s in c.slots), default=0)
    size = max((c.chunk_numel for c in chunks), default=0)
    if largest and size > largest:
        err = ValueError(f"{err}; or a smaller ElixirConfig.chunk_size_numel (now {size}; at least the largest "
                         f"parameter, {largest}) shrinks that working set")
    return err


def place(chunks, plan: ElixirPlan | None, config: ElixirConfig, sizes: Sizes, working_set: int,
          world_size: int) -> list[str]:
    """Decide resident / shard location / optimizer location per chunk. Returns reasons.

    Raises:
        ValueError: the budget is below the working set (names the bytes needed).
    """
    budget = config.device_memory_budget_bytes
    if plan is not None and (plan.resident_chunks or plan.device_shard_chunks or plan.device_optim_chunks
                             or budget is not None):
        return _from_plan(chunks, plan)
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
        raise _working_set_error(chunks, needed, budget, optim_dev)
    spare = budget - needed
    reasons = [f"working set {working_set} bytes reserved; optimizer states on "
               f"{'device' if offload_opt is False else 'host'}"]
    # shards on the device first (first-use order), up to half the spare; the rest is cache
    used = 0
    for c in chunks:
        cost = sizes.full if c.world_size == 1 else sizes.shard
        if c.replicate_group is not None:  # whole on the device, already in the working set
            c.resident = c.shard_on_device = True
            c.optim_on_device = offload_opt is False
            continue
        c.resident = False
        c.optim_on_device = offload_opt is False
        c.shard_on_device = used + cost[c.chunk_id] <= spare // 2
        if c.shard_on_device:
            used += cost[c.chunk_id]
    on_dev = sum(c.shard_on_device for c in chunks)
    reasons.append(f"{on_dev}/{len(chunks)} chunk shards on the device, {spare - used} bytes of cache")
    return reasons


def place_chunks(chunks, units_chunks: list[list], plan: ElixirPlan | None, config: ElixirConfig, optimizer,
                 world_size: int) -> list[str]:
    """Size the working set of ``units_chunks`` and :func:`place` the chunks; replicated chunks stay
    whole on the device, and without an optimizer no optimizer states are placed. Returns reasons.

    Raises:
        ValueError: the budget is below the working set.
    """
    optim_factor = optimizer_state_numel_factor(optimizer) if optimizer is not None else 0
    sizes = Sizes(chunks, optim_factor, config.precision)
    reasons = place(chunks, plan, config, sizes, working_set(units_chunks, sizes, chunks), world_size)
    for chunk in chunks:
        if chunk.replicate_group is not None:  # "replicated": whole on every rank, kept on the device
            chunk.resident = chunk.shard_on_device = True
    if optimizer is None:
        for c in chunks:
            c.optim_on_device = False
    return reasons + choose_host_copies(chunks, plan, config, sizes)


def default_host_budget_bytes() -> int:
    """80% of this machine's RAM divided by the ranks on it (``LOCAL_WORLD_SIZE``, set by torchrun and
    ``accelerate launch``; 1 when unset)."""
    local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    return int(0.8 * psutil.virtual_memory().total) // local_ranks


def host_bytes_without_copies(chunks, sizes: Sizes) -> int:
    """Host bytes of this rank's model data other than refill copies: host shards and host optimizer
    states (gradient shard, fp32 master where separate, moments)."""
    shards = sum(sizes.shard[c.chunk_id] for c in chunks if not c.shard_on_device)
    optim = sum(sizes.optim[c.chunk_id] for c in chunks if not c.optim_on_device)
    return shards + optim


def choose_host_copies(chunks, plan: ElixirPlan | None, config: ElixirConfig, sizes: Sizes) -> list[str]:
    """Decide which chunks keep a rank-local host copy of their gathered chunk
    ([Note: rank-local refill] in ``hf_elixir/chunk/chunk.py``). Returns reasons.

    Candidates are chunks sharded over several ranks and not resident. Chunks holding MoE-expert
    parameters (``host_copy_required``) need one: whether a rank re-needs them in backward depends on
    its tokens. In a model with such chunks every candidate keeps one (the rank-local eviction of the
    other chunks may then differ between ranks too, since expert gradient buffers do). Otherwise only
    the plan's ``host_copy_chunks`` keep one, as long as they fit ``host_memory_budget_bytes`` (default:
    :func:`default_host_budget_bytes`) next to the host shards and host optimizer states.
    """
    candidates = [c for c in chunks if c.world_size > 1 and not c.resident]
    for c in chunks:
        c.keep_host_copy = False
    if not candidates:
        return []
    if any(c.host_copy_required for c in candidates):
        for c in candidates:
            c.keep_host_copy = True
        return [f"rank-local host copies of all {len(candidates)} offloadable chunks (MoE experts: their use "
                "differs between ranks)"]
    wanted = set(plan.host_copy_chunks) if plan is not None else set()
    if not wanted:
        return ["no rank-local host copies (a re-unshard in the same step all-gathers again)"]
    budget = config.host_memory_budget_bytes or default_host_budget_bytes()
    used = host_bytes_without_copies(chunks, sizes)
    kept = []
    for c in candidates:
        if c.chunk_id in wanted and used + sizes.full[c.chunk_id] <= budget:
            c.keep_host_copy = True
            used += sizes.full[c.chunk_id]
            kept.append(c.chunk_id)
    return [f"rank-local host copies of chunks {kept} (plan), {used} host bytes of budget {budget}"]


def replicated_fits(numels: list[int], config: ElixirConfig, optimizer, element_bytes: int, *,
                    group=None, device: torch.device | None = None) -> tuple[bool, str]:
    """Would the whole model, its gradients and its optimizer states fit each rank's device budget
    (what ``DistributedDataParallel`` needs)? Without a budget on CUDA, half the free memory, the
    smallest over ``group`` (a collective: every rank of ``group`` calls it; [Note: ranks agree] in
    ``placement/_agree.py``). Returns ``(fits, reason)``."""
    total = sum(numels)
    grad_bytes = 4 if config.reduce_dtype == "fp32" else element_bytes
    optim = 0
    if optimizer is not None and config.offload_optimizer is not True:
        master = 0 if config.precision == "fp32" else 4
        optim = total * (4 * (1 + optimizer_state_numel_factor(optimizer)) + master)
    needed = total * (element_bytes + grad_bytes) + optim
    budget = config.device_memory_budget_bytes
    if budget is None and torch.cuda.is_available():
        # leave half of the free memory to activations; every rank decides from the same figure
        budget = agree_min(torch.cuda.mem_get_info()[0] // 2, group, device)
    if budget is None:
        return True, f"replicated: no device budget (model, gradients, optimizer states: {needed} bytes)"
    fits = needed <= budget
    return fits, (f"{'replicated' if fits else 'sharded'}: model, gradients and optimizer states need {needed} "
                  f"bytes per rank replicated; budget {budget} bytes")


def resolve_default_placement(config: ElixirConfig, plan: ElixirPlan | None, numels: list[int], optimizer,
                              world_size: int, element_bytes: int, *, is_parallel: bool,
                              placements_of: Callable[[ElixirConfig], dict[str, str]], group=None,
                              device: torch.device | None = None) -> tuple[ElixirConfig, str]:
    """Turn ``default_placement="auto"`` into "sharded" or "replicated" (see ElixirConfig).

    Args:
        is_parallel: the model is tensor/expert parallel (always sharded).
        placements_of: the model's per-module placements under a config (to recognise a replicated plan).
        group, device: the group whose ranks must agree (see :func:`replicated_fits`) and the compute device.

    Returns:
        ``(config, reason)``: the config with a concrete ``default_placement``; the reason ("" when
        nothing was decided).
    """
    if config.default_placement != "auto":
        return config, ""
    sharded = dataclasses.replace(config, default_placement="sharded")
    if world_size == 1 or is_parallel:
        return sharded, ""
    replicated = dataclasses.replace(config, default_placement="replicated")
    if plan is not None and plan.placements:
        if dict(plan.placements) == placements_of(replicated):
            return replicated, "replicated: the plan's placements"
        return sharded, ""
    fits, reason = replicated_fits(numels, config, optimizer, element_bytes, group=group, device=device)
    return (replicated if fits else sharded), "default_placement='auto' -> " + reason
