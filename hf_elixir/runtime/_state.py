"""What ``hf_elixir.prepare`` attaches to a model, and its lookup: :class:`ElixirState`,
:func:`get_state`, :func:`memory_stats`, :func:`reset_memory_stats`.

The state lives on the model object (attribute ``_hf_elixir_state``), so every layer that is handed a
prepared model (``full_parameters``, checkpointing, the integrations) finds its chunk manager here
without importing ``hf_elixir.api``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
import torch

from hf_elixir.chunk._shared_budget import current_shared_budget
from hf_elixir.chunk.manager import ChunkManager
from hf_elixir.config import ElixirConfig
from hf_elixir.plan import ElixirPlan
from hf_elixir.runtime.compile import compile_stats
from hf_elixir.runtime.hooks import ModuleHandle

__all__ = ["ElixirState", "attach_state", "check_unclaimed", "claim_parameters", "get_state", "is_prepared",
           "memory_stats", "reset_memory_stats"]

_ATTR = "_hf_elixir_state"

#: the traffic counters ``prepare`` and ``reset_memory_stats`` zero
_TRAFFIC_COUNTERS = ("h2d_bytes", "d2h_bytes", "allgather_bytes", "reduce_scatter_bytes", "num_evictions",
                     "num_onloads", "num_prefetches", "num_prefetched_gathers", "num_blocking_gathers", "num_agreed_gather_evictions",
                     "num_refreshes_ahead", "num_unshards", "gather_wait_s", "reduce_wait_s",
                     "num_prefetched_act_onloads", "num_blocking_act_onloads")


@dataclass
class ElixirState:
    """What ``prepare`` attached to a model (``get_state(model)``)."""

    manager: ChunkManager
    handles: list[ModuleHandle]
    config: ElixirConfig
    plan: ElixirPlan
    #: the ``hf_elixir.optim.ElixirOptimizer`` prepare built (the optimizer layer sits above this one, so it is
    #: typed as what it is to this layer: a ``torch.optim.Optimizer``)
    optimizer: torch.optim.Optimizer | None = None
    compiled: list = field(default_factory=list)  # runtime/compile.py's compiled block forwards
    #: a model ``hf_elixir.parallel.parallelize`` rewrote: ``assemble_full(local, model, present=...)`` of
    #: ``hf_elixir/parallel/_gather.py``, which turns this rank's tensors into the unmodified model's full ones; the
    #: gradient readers (a lower layer) reach it here. ``None`` for other models.
    assemble_full: Callable | None = None
    #: a model whose fused experts were split ([Note: split fused experts] in ``parallel/_expert_units.py``):
    #: ``fuse_experts(model, tensors, present) -> (tensors, present)`` maps the pieces back to the fused names
    fuse_experts: Callable | None = None

#: id(parameter) -> (weak reference to it, the prepared model owning it): every parameter a prepared model
#: packed into its chunks (a parameter two prepared models both packed would be stepped twice)
_CLAIMED: dict[int, tuple[weakref.ref, str]] = {}


def claim_parameters(params, owner: torch.nn.Module) -> None:
    """Record that ``owner``'s chunks hold ``params`` (until the parameters are freed)."""
    description = f"a {type(owner).__name__} prepared earlier"
    for param in params:
        key = id(param)
        _CLAIMED[key] = (weakref.ref(param, lambda _, key=key: _CLAIMED.pop(key, None)), description)


def _owner_of(param: torch.nn.Parameter) -> str | None:
    entry = _CLAIMED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def check_unclaimed(model: torch.nn.Module, names: dict[torch.nn.Parameter, list[str]]) -> None:
    """Refuse a model holding a parameter that another prepared model manages.

    Args:
        model: the model about to be prepared.
        names: its parameters -> their names in it.

    Raises:
        ValueError: names the first shared parameter and the fix (one parent module holding both).
    """
    for param, param_names in names.items():
        owner = _owner_of(param)
        if owner is not None:
            raise ValueError(
                f"parameter {param_names[0]!r} of this {type(model).__name__} is already managed by hf_elixir: it "
                f"belongs to {owner}. A module shared by two separately prepared models (e.g. PPO's "
                "`value_model.transformer = lm.transformer`) would be sharded, reduced and stepped by both, and "
                "train wrong. Prepare one parent module holding both, e.g. `both = torch.nn.ModuleDict({'lm': lm, "
                "'value': value_model}); hf_elixir.prepare(both, torch.optim.AdamW(both.parameters()))`")


def _refuse_deepcopy(memo) -> None:
    """Set as the prepared model's ``__deepcopy__`` (``copy.deepcopy`` looks it up on the instance), so
    a copy fails at once instead of cloning every parameter first and failing at its first forward."""
    raise TypeError(
        "copy.deepcopy of a model prepared by hf_elixir.prepare is not supported: its parameters are views "
        "into chunk buffers (sharded, offloaded) that a copy cannot own. Copy the model before prepare, or "
        "build a plain copy from its full weights: `other = type(model)(model.config); "
        "other.load_state_dict(model.state_dict())`")


def is_prepared(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries an :class:`ElixirState`."""
    return getattr(model, _ATTR, None) is not None


def get_state(model: torch.nn.Module) -> ElixirState:
    """The :class:`ElixirState` of a prepared model.

    Raises:
        ValueError: the model was not prepared by :func:`hf_elixir.prepare`.
    """
    state = getattr(model, _ATTR, None)
    if state is None:
        raise ValueError("this model was not prepared by hf_elixir.prepare(model, ...); call that first")
    return state


def _regathers(manager) -> bool:
    """Does some chunk all-gather again after a reshard (sharded over several ranks, not resident, no rank-local
    host copy)?"""
    return any(c.world_size > 1 and not c.resident and not c.wants_host_copy for c in manager.chunks)


def _synced_generate(model: torch.nn.Module, manager) -> None:
    """Make ``model.generate`` run with ``synced_gpus=True`` (Hugging Face's mode for ZeRO-3 and FSDP):
    a rank whose sequences finish first keeps joining the others' forward passes. Needed when chunks
    sharded over several ranks keep no rank-local host copy ([Note: rank-local refill] in
    ``hf_elixir/chunk/chunk.py``): every re-unshard then all-gathers, so every rank must run every
    forward. Not inside :func:`hf_elixir.full_parameters` (every chunk gathered and pinned), where one
    rank may generate alone.

    An explicit ``synced_gpus=False`` is overridden too: ``Seq2SeqTrainer(predict_with_generate=True)``
    passes it for every model that is neither DeepSpeed ZeRO-3 nor FSDP, and a rank that stopped first
    then left the others in an all-gather it never joined (gloo: a peer aborted, NCCL: a hang). The
    generated tokens are the same either way; a synced rank only runs extra forwards whose outputs it
    discards."""
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        # read at each call: a model re-placed for another one of a shared budget may regather since prepare
        if _regathers(manager) and not all(c.pins > 0 for c in manager.chunks):
            kwargs["synced_gpus"] = True
        return original(*args, **kwargs)

    model.generate = generate


def attach_state(model: torch.nn.Module, state: ElixirState) -> None:
    """Zero the traffic counters (preparing is not a step), attach ``state``, refuse ``deepcopy``, and join the
    :class:`~hf_elixir.chunk._shared_budget.SharedDeviceBudget` entered around ``prepare``, if any."""
    _reset_counters(state.manager)
    shared = current_shared_budget()
    if shared is not None:
        shared.join(state.manager, f"{type(model).__name__} ({'trained' if state.optimizer is not None else 'frozen'})")
    setattr(model, _ATTR, state)
    model.__deepcopy__ = _refuse_deepcopy
    if any(c.world_size > 1 for c in state.manager.chunks) and callable(getattr(model, "generate", None)):
        _synced_generate(model, state.manager)


def _reset_counters(manager: ChunkManager) -> None:
    for name in _TRAFFIC_COUNTERS:
        setattr(manager.counters, name, 0)
    manager.reset_peak()
    manager._step_start = manager.counters.as_dict()


def memory_stats(model: torch.nn.Module) -> dict[str, int | float]:
    """Counters of the chunk manager: cumulative since ``prepare`` plus ``step_*`` deltas of the last
    optimizer step (of the last top-level forward for a model prepared without an optimizer: [Note: forward
    steps] in ``hf_elixir/chunk/_steps.py``); bytes are ints. Keys: ``device_used_bytes``, ``device_peak_bytes`` (model data),
    ``activation_bytes`` / ``activation_peak_bytes`` (what autograd saved for backward, live / peak),
    ``device_total_peak_bytes`` (model data + activations + temporaries), ``host_bytes``,
    ``h2d_bytes``, ``d2h_bytes``, ``allgather_bytes``, ``reduce_scatter_bytes``, ``num_evictions``,
    ``num_onloads``, ``num_prefetches`` (of which ``num_prefetched_gathers`` all-gathers issued ahead of use),
    ``num_blocking_gathers`` (all-gathers issued inside a hook for the chunk it needs),
    ``num_agreed_gather_evictions`` (chunks evicted before their next use to make room for an all-gather every
    rank agreed to issue ahead, under a budget that covers activations: [Note: agreed gathers ahead] in
    ``hf_elixir/chunk/_agreed_gathers.py``), ``num_refreshes_ahead``
    (uploads of updated parameters into device shards waited for at their first use), ``num_unshards``,
    ``num_prefetched_act_onloads`` / ``num_blocking_act_onloads`` (offloaded activations of one block call
    copied back ahead of its backward / when its backward first needs them),
    ``device_budget_bytes`` (-1 = unlimited), ``kept_grad_buffer_bytes`` (gradient buffers kept for the next
    backward off CUDA, part of ``device_used_bytes``: [Note: buffer reuse] in ``hf_elixir/chunk/_grad_buffers.py``),
    ``num_chunks``, ``chunk_size_numel``, ``loss_scale`` (float, when an optimizer is attached),
    ``gather_wait_s`` / ``reduce_wait_s`` (float seconds the training thread was blocked in all-gathers and
    in gradient reduce-scatters / all-reduces; ``step_*`` deltas too).

    Raises:
        ValueError: the model was not prepared.
    """
    state = get_state(model)
    manager = state.manager
    manager.sync_activation_bytes()
    stats: dict[str, int | float] = dict(manager.counters.as_dict())
    stats.update(manager.last_step)
    stats["device_budget_bytes"] = -1 if manager.pool.budget_bytes is None else manager.pool.budget_bytes
    stats["kept_grad_buffer_bytes"] = manager.kept_buffer_bytes
    stats.update(compile_stats(state.compiled))  # num_compiled_blocks, compile_graph_breaks (when compiled)
    stats["num_chunks"] = len(manager.chunks)
    stats["chunk_size_numel"] = max((c.chunk_numel for c in manager.chunks), default=0)
    if state.optimizer is not None:
        stats["loss_scale"] = state.optimizer.loss_scale
        stats["num_skipped_steps"] = state.optimizer.scaler.num_skipped_steps
    return stats


def reset_memory_stats(model: torch.nn.Module) -> None:
    """Zero the traffic counters and set the peak to the current use.

    Raises:
        ValueError: the model was not prepared.
    """
    _reset_counters(get_state(model).manager)
