"""Where each chunk lives: the working set a step needs on the device, and the decision per chunk
(resident, shard on the device or the host, optimizer states on the device or the host), from a plan
or from the budget; and what ``default_placement="auto"`` resolves to.

The chunks come from the chunk layer (built :class:`~hf_elixir.chunk.chunk.Chunk` objects, or
:class:`~hf_elixir.chunk._build.ChunkSpec` sizes when no data may move); what a tensor/expert-parallel
mesh decides comes in as arguments, so this layer imports neither the parallel nor the runtime layer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from hf_elixir.chunk.manager import budget_error
from hf_elixir.chunk.memory import default_host_budget_bytes
from hf_elixir.config import ElixirConfig
from hf_elixir.optim.optimizer import optimizer_state_numel_factor
from hf_elixir.placement._agree import agree_min
from hf_elixir.plan import ElixirPlan

logger = logging.getLogger(__name__)

__all__ = ["Sizes", "choose_host_copies", "committed_bytes", "default_host_budget_bytes", "device_floor_bytes", "place", "place_chunks",
           "replicated_bytes", "replicated_fits", "resolve_default_placement", "run_sizes", "wanted_bytes",
           "working_set", "working_set_bytes"]


class Sizes:
    """Byte sizes the placement policy needs, per chunk. Without training (inference: no optimizer)
    there are no gradient buffers and no optimizer states."""

    def __init__(self, chunks, optim_factor: int, precision: str, training: bool = True) -> None:
        self.training = training
        self.full = {c.chunk_id: c.full_bytes for c in chunks}
        self.shard = {c.chunk_id: c.shard_bytes for c in chunks}
        self.grad = {c.chunk_id: (c.grad_full_bytes if c.trainable and training else 0) for c in chunks}
        master = 0 if precision == "fp32" else 4
        self.optim = {c.chunk_id: (c.shard_numel * 4 * (1 + optim_factor) + c.shard_numel * master
                                   if c.trainable and training else 0) for c in chunks}


def run_sizes(chunks, config: ElixirConfig, optimizer) -> Sizes:
    """:class:`Sizes` of a run with ``optimizer`` (``None``: inference)."""
    factor = optimizer_state_numel_factor(optimizer) if optimizer is not None else 0
    return Sizes(chunks, factor, config.precision, training=optimizer is not None)


def _device_optim_bytes(sizes: Sizes, config: ElixirConfig, chunks) -> int:
    """Optimizer states the budget must hold on the device at the floor (``offload_optimizer=False``: all
    of them). At the floor no shard stays on the device (nothing is spare), so an fp32 chunk's optimizer
    needs its own fp32 master shard there too (``ElixirOptimizer``: the compute shard is the master only
    when both live on the same side); a replicated chunk's shard is always on the device."""
    if config.offload_optimizer is not False:
        return 0
    masters = 0
    if config.precision == "fp32" and sizes.training:
        masters = sum(c.shard_numel * 4 for c in chunks if c.trainable and c.replicate_group is None)
    return sum(sizes.optim.values()) + masters


def _resident_bytes(sizes: Sizes, chunks) -> int:
    """Device bytes with every chunk resident: its full buffer, every optimizer state, two gradient buffers
    and, for a chunk sharded over several ranks, the reduce-scatter output shard its gradient is reduced into
    (the largest one: the manager finishes a reduce before it charges another when the pool is short). A
    resident chunk's shard costs nothing more: with one rank (or replicated) the full buffer is the shard
    (``Chunk.full_alias``), with several the shard is a view into it (``Chunk.shard_in_full``), and ``prepare``
    charges no more while it builds the chunks (``chunk/_build.py: materialize_chunks``)."""
    reduce_out = max((sizes.grad[c.chunk_id] // c.world_size for c in chunks if c.world_size > 1), default=0)
    return (sum(sizes.full.values()) + sum(sizes.optim.values()) + sum(sorted(sizes.grad.values(), reverse=True)[:2])
            + reduce_out)


def device_floor_bytes(chunks, units_chunks: list[list], config: ElixirConfig, optimizer) -> int:
    """The smallest device budget :func:`place` accepts: the working set of ``units_chunks`` plus the
    optimizer states kept on the device, or, when that is less, everything resident (optimizer states
    on the device: not with ``offload_optimizer=True``). ``prepare`` (built chunks) and
    ``min_device_budget_bytes`` (:class:`~hf_elixir.chunk._build.ChunkSpec` sizes) both call this, with
    the same chunks, units and sizes, so they cannot disagree.

    Args:
        chunks: the run's chunks, or their specs (``chunk_id``, byte sizes, ``trainable``,
            ``world_size``, ``replicate_group``).
        units_chunks: per hooked unit (``hf_elixir.runtime.hooks``), the chunks its parameters live in.
        config: the run's ``ElixirConfig`` (precision, ``offload_optimizer``).
        optimizer: the ``torch.optim`` optimizer, or ``None`` for inference (no gradient buffers).

    Returns:
        bytes per rank (int).
    """
    sizes = run_sizes(chunks, config, optimizer)
    budgeted = working_set(units_chunks, sizes, chunks) + _device_optim_bytes(sizes, config, chunks)
    if config.offload_optimizer is True:
        return budgeted
    return min(budgeted, _resident_bytes(sizes, chunks))


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
    return ["placement taken from the plan (ElixirConfig.plan, or searched for search='auto')"]


def _working_set_error(chunks, needed: int, budget: int, optim_dev: int, training: bool,
                       activation_bytes: int = 0) -> ValueError:
    err = _budget_error(needed, budget, "the largest pair of adjacent modules (unsharded chunks"
                        + (", two gradient buffers" if training else "")
                        + (", device optimizer states" if optim_dev else "") + ")", activation_bytes)
    sharded = [c for c in chunks if c.replicate_group is None]  # replicated chunks count whole at any size
    largest = max((s.numel for c in sharded for s in c.slots), default=0)
    size = max((c.chunk_numel for c in sharded), default=0)
    if largest and size > largest:
        err = ValueError(f"{err}; or a smaller ElixirConfig.chunk_size_numel (now {size}; at least the largest "
                         f"parameter, {largest}) shrinks that working set")
    return err


def _plan_decides(plan: ElixirPlan | None, budget: int | None) -> bool:
    """Whether the plan's per-chunk lists are followed: it lists chunks, or a search made it for a budget
    (a searched plan may put everything on the host). A hand-written plan without placement decisions
    (one carrying a chunk size, an order or ``activation_peak_bytes``) leaves them to the budget."""
    if plan is None:
        return False
    listed = plan.resident_chunks or plan.device_shard_chunks or plan.device_optim_chunks
    return bool(listed) or (budget is not None and plan.predicted_step_s is not None)


def _budget_error(needed: int, budget: int, what: str, activation_bytes: int) -> ValueError:
    """:func:`budget_error` for ``needed`` bytes of model data beside ``activation_bytes`` of activations."""
    if not activation_bytes:
        return budget_error(needed, budget, what)
    return budget_error(needed + activation_bytes, budget, f"{what} plus {activation_bytes} bytes of activations "
                        "(the budget covers activations: turn on activation checkpointing or use a smaller batch "
                        "to need less, or ElixirConfig.budget_covers_activations=False for a model-data-only "
                        "budget)")


def place(chunks, plan: ElixirPlan | None, config: ElixirConfig, sizes: Sizes, units_chunks: list[list],
          world_size: int, activation_bytes: int = 0) -> list[str]:
    """Decide resident / shard location / optimizer location per chunk. Returns reasons.

    Args:
        activation_bytes: device bytes kept out of the budget for activations and temporaries ([Note:
            activations in the budget] in ``hf_elixir/chunk/memory.py``); model data is placed in the rest.

    Raises:
        ValueError: the budget is below :func:`device_floor_bytes` plus ``activation_bytes`` (names the
            bytes needed).
    """
    total_budget = config.device_memory_budget_bytes
    if _plan_decides(plan, total_budget):
        return _from_plan(chunks, plan)
    budget = None if total_budget is None else total_budget - activation_bytes
    everything = _resident_bytes(sizes, chunks)
    offload_opt = config.offload_optimizer
    if budget is None or (everything <= budget and offload_opt is not True):
        for c in chunks:
            c.resident, c.shard_on_device, c.optim_on_device = True, True, offload_opt is not True
        fits = "no device budget is set" if budget is None else f"{everything} bytes fit the budget {budget}"
        return [f"everything resident ({fits}"
                + (f" left beside {activation_bytes} bytes of activations)" if activation_bytes else ")")]
    optim_dev = _device_optim_bytes(sizes, config, chunks)
    working = working_set(units_chunks, sizes, chunks)
    needed = working + optim_dev
    if budget < needed:
        if offload_opt is not True and everything < needed:  # the smaller floor: everything resident
            raise _budget_error(everything, total_budget, "every chunk resident (chunks" + (
                ", optimizer states, two gradient buffers" if sizes.training else "") + "; less than the largest "
                "pair of adjacent modules" + (" with device optimizer states" if optim_dev else "") + ")",
                activation_bytes)
        raise _working_set_error(chunks, needed, total_budget, optim_dev, sizes.training, activation_bytes)
    spare = budget - needed
    reasons = [f"working set {working} bytes reserved"
               + (f" beside {activation_bytes} bytes of activations" if activation_bytes else "")
               + f"; optimizer states on {'device' if offload_opt is False else 'host'}"]
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


def committed_bytes(chunks, units_chunks: list[list], config: ElixirConfig, optimizer, activation_bytes: int,
                    offloaded: frozenset = frozenset()) -> int:
    """The device bytes a placed model cannot give back ([Note: one device budget for several models] in
    ``hf_elixir/chunk/_shared_budget.py``): with every chunk resident, what :func:`place` charged for that; else
    the working set of two adjacent units, the resident chunks, the shards and optimizer states kept on the device;
    and the ``activation_bytes`` placement reserved. A cache of gathered chunks is not committed (it is evicted
    when the room is needed). ``offloaded``: ids of chunks counted as re-placed off the device (not resident, shard
    on the host)."""
    sizes = run_sizes(chunks, config, optimizer)
    if all(c.resident and c.chunk_id not in offloaded for c in chunks):
        return _resident_bytes(sizes, chunks) + activation_bytes
    kept = sum(sizes.full[c.chunk_id] for c in chunks
               if c.resident and c.replicate_group is None and c.chunk_id not in offloaded)
    shards = sum((sizes.full if c.world_size == 1 else sizes.shard)[c.chunk_id]
                 for c in chunks if c.shard_on_device and not c.resident and c.chunk_id not in offloaded)
    optim = sum(sizes.optim[c.chunk_id] for c in chunks if c.optim_on_device)
    return working_set(units_chunks, sizes, chunks) + kept + shards + optim + activation_bytes


def wanted_bytes(chunks, units_chunks: list[list], config: ElixirConfig, optimizer, activation_bytes: int) -> int:
    """What :func:`committed_bytes` comes to when :func:`place` has no budget to keep to: every chunk resident
    (optimizer states on the device unless ``offload_optimizer=True``, which keeps the working set and every shard
    on the device instead), plus ``activation_bytes``: a model's need when several share one budget."""
    sizes = run_sizes(chunks, config, optimizer)
    if config.offload_optimizer is not True:
        return _resident_bytes(sizes, chunks) + activation_bytes
    shards = sum((sizes.full if c.world_size == 1 else sizes.shard)[c.chunk_id] for c in chunks)
    return working_set(units_chunks, sizes, chunks) + shards + activation_bytes


def place_chunks(chunks, units_chunks: list[list], plan: ElixirPlan | None, config: ElixirConfig, optimizer,
                 world_size: int, activation_bytes: int = 0) -> list[str]:
    """Size the working set of ``units_chunks`` and :func:`place` the chunks in the budget less
    ``activation_bytes``; replicated chunks stay whole on the device, and without an optimizer no optimizer
    states are placed. Returns reasons.

    Raises:
        ValueError: the budget is below the working set plus ``activation_bytes``.
    """
    sizes = run_sizes(chunks, config, optimizer)
    reasons = place(chunks, plan, config, sizes, units_chunks, world_size, activation_bytes)
    for chunk in chunks:
        if chunk.replicate_group is not None:  # "replicated": whole on every rank, kept on the device
            chunk.resident = chunk.shard_on_device = True
    if optimizer is None:
        for c in chunks:
            c.optim_on_device = False
    return reasons + choose_host_copies(chunks, plan, config, sizes)


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
    other chunks may then differ between ranks too, since expert gradient buffers do). So does a pool that
    charges activations (``budget_covers_activations``): each rank's batch decides what it evicts for them,
    and a chunk evicted on one rank only must be refilled locally, never by an all-gather the other ranks
    do not issue (while those copies fit ``host_memory_budget_bytes``; else a warning says that batches
    must have the same shapes on every rank). Otherwise only
    the plan's ``host_copy_chunks`` keep one, as long as they fit ``host_memory_budget_bytes`` (default:
    :func:`default_host_budget_bytes`) next to the host shards and host optimizer states.
    """
    candidates = [c for c in chunks if c.world_size > 1 and not c.resident]
    for c in chunks:
        c.keep_host_copy = False
    if not candidates:
        return []
    if any(c.host_copy_required for c in chunks):  # experts anywhere: eviction pressure differs per rank
        for c in candidates:
            c.keep_host_copy = True
        return [f"rank-local host copies of all {len(candidates)} offloadable chunks (MoE experts: their use "
                "differs between ranks)"]
    budget = config.host_memory_budget_bytes or default_host_budget_bytes()
    used = host_bytes_without_copies(chunks, sizes)
    if candidates[0].manager.pool.charges_activations:  # each rank's activations evict what they need
        copies = sum(sizes.full[c.chunk_id] for c in candidates)
        if used + copies <= budget:
            for c in candidates:
                c.keep_host_copy = True
            return [f"rank-local host copies of all {len(candidates)} offloadable chunks (the budget covers "
                    "activations, whose bytes differ between ranks, and so do the evictions they cause)"]
        logger.warning(
            "the device budget covers activations at %d ranks, and rank-local host copies of the %d offloaded "
            "chunks (%d bytes) do not fit host_memory_budget_bytes=%d beside %d bytes of host state: batches "
            "must then have the same shapes on every rank (fixed-length or packed sequences), or the ranks' "
            "activations evict different chunks and issue different all-gathers. Set "
            "ElixirConfig(budget_covers_activations=False) to keep activations out of the budget, or raise "
            "host_memory_budget_bytes", candidates[0].world_size, len(candidates), copies, budget, used)
    wanted = set(plan.host_copy_chunks) if plan is not None else set()
    if not wanted:
        return ["no rank-local host copies (a re-unshard in the same step all-gathers again)"]
    kept = []
    for c in candidates:
        if c.chunk_id in wanted and used + sizes.full[c.chunk_id] <= budget:
            c.keep_host_copy = True
            used += sizes.full[c.chunk_id]
            kept.append(c.chunk_id)
    return [f"rank-local host copies of chunks {kept} (plan), {used} host bytes of budget {budget}"]


def replicated_bytes(numels: list[int], config: ElixirConfig, optimizer, element_bytes: int) -> int:
    """Device bytes per rank of the whole model, its gradients and its optimizer states (what
    ``DistributedDataParallel`` needs; no gradients or optimizer states for inference, ``optimizer=None``):
    the budget from which ``default_placement="auto"`` replicates."""
    total = sum(numels)
    grad_bytes = 0 if optimizer is None else 4 if config.reduce_dtype == "fp32" else element_bytes
    optim = 0
    if optimizer is not None and config.offload_optimizer is not True:
        master = 0 if config.precision == "fp32" else 4
        optim = total * (4 * (1 + optimizer_state_numel_factor(optimizer)) + master)
    return total * (element_bytes + grad_bytes) + optim


def replicated_fits(numels: list[int], config: ElixirConfig, optimizer, element_bytes: int, *,
                    group=None, device: torch.device | None = None, activation_bytes: int = 0) -> tuple[bool, str]:
    """Would :func:`replicated_bytes` fit each rank's device budget (less ``activation_bytes`` kept for
    activations)? Without a budget on CUDA, half the free memory, the smallest over ``group`` (a
    collective: every rank of ``group`` calls it; [Note: ranks agree] in ``placement/_agree.py``).
    Returns ``(fits, reason)``."""
    needed = replicated_bytes(numels, config, optimizer, element_bytes)
    budget = config.device_memory_budget_bytes
    if budget is not None:
        budget -= activation_bytes
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
                              device: torch.device | None = None, activation_bytes: int = 0
                              ) -> tuple[ElixirConfig, str]:
    """Turn ``default_placement="auto"`` into "sharded" or "replicated" (see ElixirConfig).

    Args:
        is_parallel: the model is tensor/expert parallel (always sharded).
        placements_of: the model's per-module placements under a config (to recognise a replicated plan).
        group, device: the group whose ranks must agree (see :func:`replicated_fits`) and the compute device.
        activation_bytes: bytes of the budget kept for activations (see :func:`place`).

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
    fits, reason = replicated_fits(numels, config, optimizer, element_bytes, group=group, device=device,
                                   activation_bytes=activation_bytes)
    return (replicated if fits else sharded), "default_placement='auto' -> " + reason
