"""``hf_elixir.prepare``: pack a model's parameters into chunks, place them, install hooks, wrap the
optimizer. Also ``min_device_budget_bytes`` (``search/_floor.py``) and ``memory_stats`` (``runtime/_state.py``).

A façade: each phase lives in its layer, and ``prepare`` calls them in order:

1. checks: arguments, streamed init, placements, the precision (``runtime/_checks.py``, ``parallel/``);
2. the budget: this rank's, then the smallest over the ranks, agreed once (``placement/_agree.py``);
3. whether the fused MoE experts are split (``search/_lay_out.py``), and the split ([Note: split fused experts]
   in ``parallel/_expert_units.py``); parameters another prepared model manages (``runtime/_state.py``), the
   optimizer (``optim/_check.py``);
4. the layout (``search/_lay_out.py``): the plan, loaded or searched, rank 0's; ``default_placement="auto"``
   resolved, the parameters' order, the chunk size, the chunks built empty and checked against the plan;
5. each chunk placed (from ``search/_floor.py``, which names the floor when it does not fit), rank 0's;
6. hooks and guards installed (``runtime/hooks.py``, ``runtime/guards.py``);
7. parameters copied into their chunks, or streamed from ``checkpoint`` (``chunk/_build.py``, ``_stream_load.py``);
8. the plan recorded (``placement/_layout.py``), optimizer wrapped (``optim/``), state-dict hooks, activation
   policy or checkpointing (``runtime/``), state attached (``runtime/_state.py``).

From phase 3 on, every change is undone on any failure, in reverse order (one undo list: the split, the
optimizer's groups, then a ``ModelSnapshot``, [Note: all-or-nothing prepare] in ``runtime/_rollback.py``).
``prepare`` extends the model in place and returns it (as FSDP2's ``fully_shard``): ``generate()`` etc. keep working.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from hf_elixir._logging import info_on_main_rank
from hf_elixir.chunk import _host_heap, _nf4
from hf_elixir.chunk._build import materialize_chunks, unique_params
from hf_elixir.chunk._stream_load import StreamedInit, retie
from hf_elixir.config import ElixirConfig
from hf_elixir.optim._check import check_optimizer
from hf_elixir.optim.optimizer import ElixirOptimizer
from hf_elixir.parallel import get_parallel_state, placements_for_plan
from hf_elixir.parallel._exit import end_gloo_group_at_exit
from hf_elixir.parallel._expert_units import (fuse_tensors, fused_names, release_fused, split_fused_experts,
                                              split_optimizer_params, unsplit_fused_experts)
from hf_elixir.parallel._gather import assemble_full
from hf_elixir.parallel._groups import default_group, job_group_of
from hf_elixir.parallel._launch import check_launch_world_size
from hf_elixir.placement._agree import agree_budget
from hf_elixir.placement._layout import Layout, recorded_plan
from hf_elixir.profiler import _device
from hf_elixir.profiler._runtime_probe import RuntimeProbe
from hf_elixir.runtime._checks import check_arguments, check_streamed_init
from hf_elixir.runtime._checks import check_precision_supported as _check_precision_supported
from hf_elixir.runtime._rollback import ModelSnapshot
from hf_elixir.runtime._state import (ElixirState, attach_state, check_unclaimed, claim_parameters, get_state,
                                      memory_stats, reset_memory_stats)
from hf_elixir.runtime.activations import install_activation_policy
from hf_elixir.runtime.compile import apply_compile, mark_compiled_blocks
from hf_elixir.runtime.guards import install_guards
from hf_elixir.runtime.hooks import install_hooks
from hf_elixir.runtime.state_dict import install_state_dict_hooks
from hf_elixir.search._floor import min_device_budget_bytes
from hf_elixir.search._lay_out import decide_split_experts, lay_out

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
    and ``requires_grad``, nothing attached), so fixing the cause and calling it again works. With
    ``ElixirConfig.split_fused_experts`` (``"auto"``, the default: where the budget is below the fused floor, or the
    plan was made split) fused 3-D MoE experts become one child module per expert ([Note: split fused experts] in
    ``parallel/_expert_units.py``), and ``optimizer``'s param groups hold the pieces.

    Args:
        model: a ``torch.nn.Module`` (typically a ``transformers.PreTrainedModel``), on CPU or on the
            compute device, identical on every rank (rank 0's values are broadcast anyway).
        optimizer: a ``torch.optim`` optimizer on ``model.parameters()`` (element-wise kinds only), or
            ``None`` for inference (no gradient buffers are kept or counted in the budget).
        config: :class:`~hf_elixir.config.ElixirConfig`; default all-resident fp32.
        sample_batch: the batch ``ElixirConfig(search="auto")`` profiles one step with: a training step with an
            optimizer (``model(**sample_batch)`` returns ``.loss``), else one forward under ``torch.no_grad()`` and
            the plan is searched for inference ([Note: forward-only pricing] in ``search/_cost.py``).
        checkpoint: a Hugging Face folder (``model.safetensors``, or shards with an index) to take the values
            from; the model may then be on the meta device, each rank reading only its own shards' byte ranges
            (as DeepSpeed's ``zero.Init`` / FSDP2's meta-device init), tied weights kept tied. The result equals
            ``from_pretrained(folder)`` + ``prepare`` bit for bit. A ``parallelize``d model reads its ranks'
            slices; not with tensor and expert parallel together or ``search="auto"`` yet ([Note: streamed init]
            in ``chunk/_stream_load.py``).

    Returns:
        ``(model, optimizer)``: the same model object, and an
        :class:`~hf_elixir.optim.optimizer.ElixirOptimizer` (or ``None``).

    Raises:
        ValueError: the model is already prepared, or shares a module with another prepared model;
            parameters on the meta device without ``checkpoint=`` (names them); a checkpoint missing
            parameters or with other shapes; the budget is below :func:`min_device_budget_bytes` (with
            the plan's ``activation_peak_bytes`` as ``activation_bytes``; names the bytes needed); the plan was
            made for another model/world size/precision; the optimizer holds parameters outside the model;
            ``search="auto"`` with an encoder-decoder ``sample_batch`` without ``decoder_input_ids``/``labels``.
        FileNotFoundError: ``checkpoint`` is not a folder with safetensors weights.
        TypeError: an unsupported optimizer.
    """
    config = config or ElixirConfig()
    check_launch_world_size()  # [Note: silent single-process runs] in parallel/_launch.py
    check_arguments(model, optimizer, config)  # 1
    pstate = get_parallel_state(model)
    check_streamed_init(model, config, checkpoint)
    if checkpoint is not None:
        retie(model, optimizer)  # what from_pretrained does after loading (kept if prepare fails)
    placements_for_plan(model, config)  # validates tp/ep sizes and placement globs
    device = _compute_device()
    _check_precision_supported(config.precision, device)
    group = default_group(config)
    agree_group = job_group_of(model, group)
    config, charges_activations = agree_budget(config, agree_group, device)  # 2
    config = decide_split_experts(model, optimizer, config, group)  # 3
    split = split_fused_experts(model) if config.split_fused_experts else []
    undo = [lambda: unsplit_fused_experts(split)]
    try:
        undo.append(_nf4.pack_nf4_params(model, config, checkpoint, pstate))  # [Note: NF4 in chunks]
        undo.append(split_optimizer_params(optimizer, split))
        names = unique_params(model)
        check_unclaimed(model, names)
        params = [p for p in names if p.is_floating_point()]
        if optimizer is not None:
            check_optimizer(optimizer, {p: names[p] for p in params})
        undo.append(ModelSnapshot(model).restore)  # the profiled step of search="auto" runs the model too
        mark_compiled_blocks(model, config.compile)  # compiled blocks are hook units ([Note: compiled blocks])
        layout = lay_out(model, optimizer, config, sample_batch, names, params, group=group,  # 4, 5
                         agree_group=agree_group, device=device, charges_activations=charges_activations,
                         runtime_probe=RuntimeProbe(prepare, memory_stats, min_device_budget_bytes))
        with contextlib.closing(_stream(model, checkpoint, names, params, layout, pstate)) as stream:
            prepared = _apply_layout(model, optimizer, names, layout, stream)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    del undo  # the last reference to the parameters' original storage
    release_fused(split)  # the fused tensors' storage can go (the pieces' values are in their chunks)
    _host_heap.after_prepare(get_state(prepared[0]).manager)  # which goes back to the system ([Note: host heap])
    end_gloo_group_at_exit()  # [Note: gloo group at exit] in parallel/_exit.py
    return prepared


class _NoStream:  # no checkpoint: chunks are filled from the parameters
    fill_for, close = None, staticmethod(lambda: None)


def _stream(model, checkpoint, names, params, layout: Layout, pstate):
    """The checkpoint's reader for phase 7 ([Note: streamed init]), else a stand-in without one. A split expert's
    piece reads its rows of the fused checkpoint tensor."""
    if not checkpoint:
        return _NoStream()
    fused = fused_names(model)
    return StreamedInit(model, checkpoint, {p: [fused[n][0] if n in fused else n for n in names[p]] for p in params},
                        layout.manager.compute_device, allow_missing=layout.config.allow_missing_keys,
                        **(dict(shards=pstate.stream_shards(), expected=pstate.full_shapes) if pstate is not None else {}))


def _apply_layout(model, optimizer, names, layout: Layout, stream):
    """Phases 6-8 of ``prepare``: the model changes (``prepare`` undoes them all if one fails); with a checkpoint's
    ``stream``, each chunk is filled from the checkpoint instead of the parameters."""
    manager, config = layout.manager, layout.config
    handles = install_hooks(model, manager)  # 6
    install_guards(model, manager)
    fp32_masters = {} if optimizer is not None else None  # [Note: fp32 masters at prepare] in chunk/_build.py
    materialize_chunks(manager, stream.fill_for, fp32_masters)  # 7
    plan = recorded_plan(model, names, layout)  # 8
    state = ElixirState(manager=manager, handles=handles, config=config, plan=plan,
                        assemble_full=assemble_full if get_parallel_state(model) is not None else None,
                        fuse_experts=fuse_tensors if fused_names(model) else None)
    if optimizer is not None:
        state.optimizer = ElixirOptimizer(optimizer, manager, config, refresh_cast=plan.refresh_cast,
                                          fp32_masters=fp32_masters)
    else:  # no optimizer step: each forward is a step ([Note: forward steps] in chunk/_steps.py)
        manager.forward_steps = True
    install_state_dict_hooks(model, manager, on_loaded=(
        state.optimizer.sync_masters_from_params if state.optimizer is not None else (lambda params: None)))
    state.compiled = apply_compile(model, config.compile, handles)  # before the activation policy wraps forwards
    install_activation_policy(model, layout.activation_policy, plan.activation_checkpointing, manager, handles)
    attach_state(model, state)
    claim_parameters(layout.params, model)
    info_on_main_rank(logger, "hf_elixir: %d params in %d chunks of %d elements; %s",  # one line per job
                      sum(p.numel() for p in layout.params), len(manager.chunks), layout.chunk_size,
                      "; ".join(layout.reasons))
    return model, state.optimizer

