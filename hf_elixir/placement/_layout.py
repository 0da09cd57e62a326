"""The layout ``prepare`` decides before it changes the model (chunks built empty and placed), and the
bytes and reasons that go with it: what placement keeps for activations, why all-gathers run ahead or
wait, and the plan that records what runs.

The phases that compute it live in their layers (``placement/_agree.py``, ``_device_placement.py``,
``search/_chunk_size.py``, ``chunk/_build.py``); ``hf_elixir.api.prepare`` calls them in order and keeps
the result in a :class:`Layout`.
"""

from __future__ import annotations

import dataclasses

import torch

from hf_elixir.chunk.manager import ChunkManager
from hf_elixir.config import ElixirConfig
from hf_elixir.plan import ElixirPlan

__all__ = ["Layout", "activation_reserve_bytes", "prefetch_reasons", "recorded_plan"]


@dataclasses.dataclass
class Layout:
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


def activation_reserve_bytes(plan: ElixirPlan | None, config: ElixirConfig, charges_activations: bool) -> int:
    """Bytes of the budget placement keeps for activations: the plan's ``activation_peak_bytes`` when the
    budget covers activations and is bounded ([Note: activations in the budget] in ``chunk/memory.py``)."""
    if not charges_activations or config.device_memory_budget_bytes is None or plan is None:
        return 0
    return plan.activation_peak_bytes or 0


def prefetch_reasons(manager: ChunkManager, optimizer) -> list[str]:
    """The plan's reasons for how the placed chunks' all-gathers run ahead ([Note: gather prefetch] in
    ``chunk/manager.py``), when some sharded chunk is offloaded and the manager prefetches: agreed gathers
    ahead, the first forward's gathers in their hooks (inference), or none ahead and why."""
    chunks = manager.chunks
    reasons: list[str] = []
    offloaded = any(c.world_size > 1 and not c.resident for c in chunks)
    if manager.prefetch_depth and offloaded and manager.pool.charges_activations and optimizer is not None \
            and manager.gather_prefetch_mode() == "agreed":
        reasons.append("forward all-gathers are issued ahead from the third step on, those every rank had room "
                       "for in the step before (agreed at each optimizer step: the budget covers activations, "
                       "whose bytes can differ between ranks; [Note: agreed gathers ahead] in chunk/_agreed_gathers.py)")
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
    return reasons


def recorded_plan(model: torch.nn.Module, names: dict, layout: Layout) -> ElixirPlan:
    """The plan ``prepare`` attaches: the given one (or, without one, what was decided: chunk size, order,
    per-chunk placement, prefetch depth, reasons), with the module placements and, block by block, the
    activation policy that runs."""
    manager, config, chunks = layout.manager, layout.config, layout.manager.chunks
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
    return plan
