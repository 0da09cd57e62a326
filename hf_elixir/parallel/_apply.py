"""``parallelize``: resolve placements and rewrite the model in place on the mesh.

Call it on every rank, on a model with the same initial weights everywhere (same seed or loaded
from the same checkpoint), before building the optimizer (parameters of rewritten layers are new
``nn.Parameter`` objects).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_elixir.parallel._expert_parallel import ExpertParallelExperts
from hf_elixir.parallel._fused_experts import shard_fused_experts
from hf_elixir.parallel._gather import install_save_guard
from hf_elixir.parallel._state_dict import install_full_state_dict
from hf_elixir.parallel._mesh import ElixirMesh, build_mesh
from hf_elixir.parallel._state import _STATE_ATTR, ParallelState, get_parallel_state
from hf_elixir.parallel._tensor_parallel import parallelize_block
from hf_elixir.parallel._tp_modules import parallelize_modules
from hf_elixir.placement import resolve_placements_detailed
from hf_elixir.placement._experts import is_fused_experts

__all__ = ["param_process_groups", "parallelize", "placements_for_plan", "reduce_gradients"]


def parallelize(model: nn.Module, config: Any, mesh: ElixirMesh | None = None) -> ParallelState:
    """Rewrite ``model`` in place for ``config``'s tensor/expert-parallel sizes.

    Args:
        model: a Hugging Face model: tensor-parallel placements from its config's own plan
            (``base_model_tp_plan``: Llama, Qwen3, Mistral, Gemma3, ...), a registered spec (GPT-2, OPT,
            Switch-Transformers), or ``config.placements`` globs. Fused 3-D experts of any
            family take ``"expert"`` (from the config's ``base_model_ep_plan`` or ``ElixirConfig.placements``).
        config: an :class:`hf_elixir.ElixirConfig`.
        mesh: reuse a mesh; default builds one with :func:`build_mesh`.

    Returns:
        the :class:`ParallelState` (also stored on the model).

    Raises:
        ValueError: see :func:`hf_elixir.placement.resolve_placements` and :func:`build_mesh`;
            also if the model was already parallelized, or modules are placed ``"expert"`` on several ranks
            without an expert-parallel axis (``expert_parallel_size=1``, e.g. with tensor parallel).
    """
    if get_parallel_state(model) is not None:
        raise ValueError("this model was already parallelized; call parallelize once per model")
    resolved = resolve_placements_detailed(model, config)
    if mesh is None:
        mesh = build_mesh(config)
    if mesh.tp_size != config.tensor_parallel_size or mesh.ep_size != config.expert_parallel_size:
        raise ValueError(
            f"mesh (tp={mesh.tp_size}, ep={mesh.ep_size}) does not match ElixirConfig "
            f"(tensor_parallel_size={config.tensor_parallel_size}, expert_parallel_size={config.expert_parallel_size})"
        )
    if resolved.expert_containers and mesh.ep_size == 1 and mesh.world_size > 1:
        # the experts' all-to-all would run on no expert-parallel group (WORLD): it failed in the first forward
        # ("Number of tensor splits not equal to group size")
        raise ValueError(
            f"modules {resolved.expert_containers[:2]} are placed 'expert' but ElixirConfig.expert_parallel_size=1 "
            f"(tensor_parallel_size={mesh.tp_size}, {mesh.world_size} ranks): experts spread over ranks need an "
            "expert-parallel axis; drop the 'expert' placements (the experts are then ZeRO-sharded) or set "
            "expert_parallel_size (a multiple of tensor_parallel_size that divides the world size)")
    named = dict(model.named_modules())
    _refuse_switch_experts_under_tp(resolved.expert_containers, named, mesh)
    state = ParallelState(mesh=mesh, placements=resolved.placements,
                          full_shapes={k: tuple(v.shape) for k, v in model.state_dict().items()})
    for parent_fqn, block in resolved.tp_blocks:
        layouts = parallelize_block(named[parent_fqn], block, mesh.tp_group, mesh.tp_rank, mesh.tp_size)
        state.tp_layouts.update({f"{parent_fqn}.{k}": v for k, v in layouts.items()})
    state.tp_layouts.update(parallelize_modules(model, resolved.tp_modules, mesh.tp_group, mesh.tp_rank, mesh.tp_size))
    for fqn in resolved.expert_containers:
        parent_fqn, _, child = fqn.rpartition(".")
        container = named[fqn]
        if is_fused_experts(container):  # sliced in place: names and class unchanged
            both = mesh.mp_axis == "tp_ep"  # the tp ranks split the tokens ([Note: tokens split over tp])
            state.expert_containers[fqn] = shard_fused_experts(
                container, mesh.ep_group, mesh.ep_rank, mesh.ep_size,
                tp_group=mesh.tp_group if both else None, tp_size=mesh.tp_size if both else 1)
            continue
        state.expert_containers[fqn] = container.num_experts
        new = ExpertParallelExperts(container, mesh.ep_group, mesh.ep_rank, mesh.ep_size)
        setattr(named[parent_fqn] if parent_fqn else model, child, new)
    setattr(model, _STATE_ATTR, state)
    install_save_guard(model)
    install_full_state_dict(model)  # model.state_dict(): full tensors ([Note: one state_dict contract])
    return state


def _refuse_switch_experts_under_tp(containers: list[str], named: dict[str, nn.Module], mesh: ElixirMesh) -> None:
    """Under tp x ep only fused 3-D experts split their tokens over tp ([Note: tokens split over tp] in
    ``_fused_experts.py``); Switch-style ``expert_{i}`` containers would compute each token ``tp`` times."""
    switch = [fqn for fqn in containers if not is_fused_experts(named[fqn])]
    if mesh.mp_axis == "tp_ep" and switch:
        raise ValueError(
            f"modules {switch[:2]} ({type(named[switch[0]]).__name__}: one module per expert) are placed 'expert' with "
            f"tensor_parallel_size={mesh.tp_size} and expert_parallel_size={mesh.ep_size}; tensor and expert parallel "
            "together support fused 3-D experts (Mixtral, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3): set "
            "tensor_parallel_size=1 for this model")


def placements_for_plan(model: nn.Module, config: Any) -> dict[str, str]:
    """Module FQN -> placement to record in ``ElixirPlan.placements`` (``hf_elixir.prepare`` calls this).

    A model rewritten by :func:`parallelize`: the placements it applied. Any other model: the resolved
    placements for ``config`` (every parameter-owning module ``"sharded"`` unless
    ``ElixirConfig.placements`` overrides it), which also validates the override globs.

    Raises:
        ValueError: ``config`` asks for tensor or expert parallelism (size > 1) but the model was not
            rewritten by :func:`parallelize` (it must be, before the optimizer is built on its
            parameters); the model was parallelized for other axis sizes than ``config``'s; see also
            :func:`hf_elixir.placement.resolve_placements`.
    """
    state = get_parallel_state(model)
    tp, ep = config.tensor_parallel_size, config.expert_parallel_size
    if state is None:
        resolved = resolve_placements_detailed(model, config)  # a bad plan or glob is named first
        if tp > 1 or ep > 1:
            raise ValueError(
                f"ElixirConfig(tensor_parallel_size={tp}, expert_parallel_size={ep}) needs a model rewritten "
                "for it before its optimizer is built: call hf_elixir.parallel.parallelize(model, config) on every "
                "rank, then build the optimizer on model.parameters(), then hf_elixir.prepare(model, optimizer, "
                "config). With ElixirCallback: parallelize(model, config) before Trainer(...) or SFTTrainer(...). "
                "ElixirPlugin().prepare(...) and a script launched with an accelerate config whose Elixir section "
                "sets these sizes parallelize the model themselves"
            )
        return resolved.placements
    if (state.mesh.tp_size, state.mesh.ep_size) != (tp, ep):
        raise ValueError(
            f"the model was parallelized with tensor_parallel_size={state.mesh.tp_size}, expert_parallel_size="
            f"{state.mesh.ep_size} but ElixirConfig has tensor_parallel_size={tp}, expert_parallel_size={ep}; "
            "pass the same config to parallelize and prepare"
        )
    return dict(state.placements)


def param_process_groups(model: nn.Module) -> dict[str, Any]:
    """Parameter FQN -> the process group its gradient is averaged (and ZeRO-sharded) over.

    See [Note: gradient groups] in ``hf_elixir/parallel/_mesh.py``: non-expert parameters use
    ``mesh.dp_group``, expert parameters ``mesh.expert_dp_group``.
    """
    return {name: _group_of(model, name) for name, _ in model.named_parameters()}


@torch.no_grad()
def reduce_gradients(model: nn.Module) -> None:
    """Plain data-parallel gradient reduction for a parallelized model (no ZeRO sharding).

    Averages each gradient over its group from :func:`param_process_groups`, so the result equals
    the gradient of the mean of the per-batch losses.
    A parameter that got no gradient on this rank (an expert without tokens) contributes zeros. A
    parameter that got no gradient on any rank of its group keeps ``.grad = None``, as PyTorch would
    have left it, so the optimizer skips it (no moment update, no weight decay): see [Note: idle
    experts] in ``_expert_parallel.py``. One MAX all-reduce of has-gradient flags per group decides
    it first, so every rank then issues the same all-reduces in the same order.
    """
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    by_group: dict[int, tuple[Any, list[nn.Parameter]]] = {}
    for name, param in params:
        group = _group_of(model, name)
        by_group.setdefault(id(group), (group, []))[1].append(param)
    had_grad: dict[nn.Parameter, bool] = {}
    for group, members in by_group.values():  # same groups in the same order on every rank
        flags = torch.tensor([float(p.grad is not None) for p in members], device=members[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        had_grad.update(zip(members, (flags > 0).tolist()))
    for name, param in params:
        if not had_grad[param]:  # the flags agree on every rank: all of them skip this all-reduce
            param.grad = None
            continue
        group = _group_of(model, name)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=group)
        param.grad.div_(dist.get_world_size(group))


def _group_of(model: nn.Module, name: str) -> Any:
    state = get_parallel_state(model)
    assert state is not None, "needs a model rewritten by hf_elixir.parallel.parallelize"
    return state.mesh.expert_dp_group if state.is_expert_param(name) else state.mesh.dp_group
