"""Resolve every module's placement from the registry spec and the user's glob overrides.

Order of precedence (later wins): ``ElixirConfig.default_placement`` everywhere (``"auto"`` resolves to
``"sharded"`` here; ``hf_elixir.prepare`` decides it) -> the model's tensor-parallel placements (only when
``tensor_parallel_size > 1``) and expert-parallel placements (only when ``expert_parallel_size > 1``): a
registered spec's globs where it gives that axis any, else the model config's own plan
(``base_model_tp_plan`` / ``base_model_ep_plan``, read by ``_hf_plans.py``) -> ``ElixirConfig.placements``
in insertion order. A glob matches a module's FQN or any module below it (``"*.mlp"`` covers
``h.0.mlp.c_fc``).

Tensor-parallel modules that a spec's block does not claim (every module placed from a config's plan, and
the user's globs on any model) are rewritten one by one ("standalone"); a block's attributes (GPT-2's head
count) shrink only for the spec's blocks.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from hf_elixir.placement._hf_plans import check_heads, check_tp_split, moe_tp_splits, plan_placements, read_plans
from hf_elixir.placement._experts import PIECE_ATTR, SPLIT_ATTR, fused_expert_count
from hf_elixir.placement._registry import get_model_spec
from hf_elixir.placement._spec import PLACEMENTS, ModelPlacementSpec, TensorParallelBlock

__all__ = ["ResolvedPlacements", "resolve_placements", "resolve_placements_detailed"]

_BLOCK_PLACEMENTS = ("column", "row")
#: every placement that splits or hooks a module over the tensor-parallel axis
TP_PLACEMENTS = ("column", "row", "column_gather", "row_split", "embedding_row", "embedding_column", "grad_allreduce",
                 "packed_column", "mla_kv_a", "moe_tp")
#: tensor-parallel placements that keep the module's parameters whole (a hook over the tp group only)
_WHOLE_TP_PLACEMENTS = ("grad_allreduce", "mla_kv_a")


@dataclass
class ResolvedPlacements:
    """What :func:`resolve_placements_detailed` found.

    Attributes:
        placements: module FQN -> placement, for every module that owns parameters directly.
        tp_blocks: (parent FQN, block) for every tensor-parallel block whose children are column/row.
        tp_modules: (FQN, placement) of every other tensor-parallel module (rewritten on its own).
        expert_containers: FQNs of expert containers placed ``"expert"``.
        spec: the model spec used.
    """

    placements: dict[str, str]
    tp_blocks: list[tuple[str, TensorParallelBlock]] = field(default_factory=list)
    tp_modules: list[tuple[str, str]] = field(default_factory=list)
    expert_containers: list[str] = field(default_factory=list)
    spec: ModelPlacementSpec | None = None


def _matches(fqn: str, pattern: str) -> bool:
    return fnmatchcase(fqn, pattern) or fnmatchcase(fqn, pattern + ".*")


def _is_matmul_module(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _param_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that own parameters; fused experts split into one child per expert
    ([Note: split fused experts] in ``hf_elixir/parallel/_expert_units.py``) count as the one module they were,
    so a split and an unsplit model have the same placements."""
    return {
        fqn: mod for fqn, mod in model.named_modules()
        if (any(True for _ in mod.parameters(recurse=False)) and not getattr(mod, PIECE_ATTR, False))
        or getattr(mod, SPLIT_ATTR, None) is not None
    }


def _apply_globs(placements: dict[str, str], globs: dict[str, str], source: str, must_match: bool) -> None:
    for pattern, placement in globs.items():
        if placement not in PLACEMENTS:
            raise ValueError(f"{source}[{pattern!r}]={placement!r} is not a placement; use one of {PLACEMENTS}")
        hits = [fqn for fqn in placements if _matches(fqn, pattern)]
        if must_match and not hits:
            close = difflib.get_close_matches(pattern, list(placements), n=3)
            raise ValueError(
                f"{source}[{pattern!r}] matches no module with parameters; "
                f"module names look like {close or list(placements)[:3]}"
            )
        for fqn in hits:
            placements[fqn] = placement


def _check_tp(model: nn.Module, modules: dict[str, nn.Module], placements: dict[str, str],
              spec: ModelPlacementSpec, tp_size: int) -> tuple[list[tuple[str, TensorParallelBlock]],
                                                                list[tuple[str, str]]]:
    named = dict(model.named_modules())
    claimed: dict[str, str] = {}  # child fqn -> required role
    blocks: list[tuple[str, TensorParallelBlock]] = []
    for parent_fqn, parent in named.items():
        for block in spec.blocks:
            if not fnmatchcase(parent_fqn, block.parent):
                continue
            children = {f"{parent_fqn}.{c}": "column" for c in block.column}
            children[f"{parent_fqn}.{block.row}"] = "row"
            if not all(c in modules for c in children):
                continue
            roles = {c: placements[c] for c in children}
            if not any(r in _BLOCK_PLACEMENTS for r in roles.values()):
                continue
            if roles != children:
                raise ValueError(
                    f"tensor-parallel block {parent_fqn!r} must be placed together: {children} "
                    f"(got {roles}); set all of them or none of them to column/row in ElixirConfig.placements"
                )
            if getattr(parent, "is_cross_attention", False):
                raise ValueError(f"module {parent_fqn!r} is a cross-attention; tensor parallel supports self-attention only")
            _check_divisible(parent_fqn, parent, block, modules, children, tp_size)
            claimed.update(children)
            blocks.append((parent_fqn, block))
    standalone = [(fqn, placement) for fqn, placement in placements.items()
                  if placement in TP_PLACEMENTS and fqn not in claimed]
    for fqn, placement in standalone:
        if placement == "moe_tp":  # its parameters' own plan entries say how each one splits
            moe_tp_splits(model, fqn, modules[fqn], tp_size)
        else:
            _check_standalone(fqn, modules[fqn], placement, tp_size)
    return blocks, standalone


def _check_standalone(fqn: str, module: nn.Module, placement: str, tp_size: int) -> None:
    """A tensor-parallel module outside a spec block: the module type takes the placement, the split dim divides."""
    if placement.startswith("embedding_"):
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"module {fqn!r} ({type(module).__name__}) cannot take placement {placement!r}: only "
                             "nn.Embedding splits by vocabulary or hidden dim; use 'sharded' or 'replicated'")
        name, size = (("num_embeddings", module.num_embeddings) if placement == "embedding_row"
                      else ("embedding_dim", module.embedding_dim))
    elif placement in _WHOLE_TP_PLACEMENTS:
        return
    else:
        if not _is_matmul_module(module):
            raise ValueError(
                f"module {fqn!r} ({type(module).__name__}) cannot take placement {placement!r}: only "
                "nn.Linear and transformers Conv1D split by features; use 'sharded' or 'replicated'"
            )
        conv = type(module).__name__ == "Conv1D"
        out_features, in_features = (module.weight.shape[1], module.weight.shape[0]) if conv else module.weight.shape
        name, size = (("output features", out_features) if placement.startswith(("column", "packed_column"))
                      else ("input features", in_features))
    parts = 2 if placement == "packed_column" else 1  # each packed part is split on its own
    check_tp_split(f"module {fqn!r}: its {size} {name}", size, parts, tp_size,
                   f"place the module 'sharded' in ElixirConfig.placements (placement {placement!r})")


def _check_divisible(parent_fqn: str, parent: nn.Module, block: TensorParallelBlock,
                     modules: dict[str, nn.Module], children: dict[str, str], tp_size: int) -> None:
    if block.num_heads_attr is not None:
        num_heads = getattr(parent, block.num_heads_attr)
        if num_heads % tp_size:
            raise ValueError(
                f"{parent_fqn}.{block.num_heads_attr}={num_heads} heads are not divisible by "
                f"tensor_parallel_size={tp_size}; pick a tensor_parallel_size that divides {num_heads}"
            )
    for child, role in children.items():
        module = modules[child]
        conv = type(module).__name__ == "Conv1D"
        out_features, in_features = (module.weight.shape[1], module.weight.shape[0]) if conv else module.weight.shape
        parts = block.fused_parts if role == "column" else 1
        features = out_features if role == "column" else in_features
        what = f"module {child!r}: its {features} {'output' if role == 'column' else 'input'} features"
        if block.num_heads_attr is not None or block.width_attrs:  # the parent's widths shrink by tp: even only
            if features % (parts * tp_size):
                raise ValueError(f"{what} are not divisible by tensor_parallel_size={tp_size} (x{parts} fused "
                                 "parts); change tensor_parallel_size")
        else:  # an MLP pair: any split (see [Note: uneven tensor-parallel slices] in hf_elixir/chunk/_tp_slices.py)
            check_tp_split(what, features, parts, tp_size, "change tensor_parallel_size")


def _check_experts(model: nn.Module, modules: dict[str, nn.Module], placements: dict[str, str],
                   spec: ModelPlacementSpec, ep_size: int) -> list[str]:
    containers = [
        (fqn, mod) for fqn, mod in model.named_modules()
        if type(mod).__name__ in spec.expert_containers or fused_expert_count(mod) is not None
    ]
    placed: list[str] = []
    covered: set[str] = set()
    for fqn, container in containers:
        members = [m for m in placements if m == fqn or m.startswith(fqn + ".")]
        covered.update(members)
        kinds = {placements[m] for m in members}
        if "expert" not in kinds:
            continue
        if kinds != {"expert"}:
            raise ValueError(
                f"all experts of {fqn!r} must share the placement 'expert' (got {sorted(kinds)}); "
                "place the whole container, e.g. ElixirConfig.placements={'*.mlp.experts': 'expert'}"
            )
        attr = "num_experts" if fused_expert_count(container) is not None else spec.num_experts_attr
        num_experts = getattr(container, attr)
        if num_experts % ep_size:
            raise ValueError(
                f"{fqn}.{attr}={num_experts} experts are not divisible by "
                f"expert_parallel_size={ep_size}; pick an expert_parallel_size that divides {num_experts}"
            )
        placed.append(fqn)
    for fqn, placement in placements.items():
        if placement == "expert" and fqn not in covered:
            raise ValueError(
                f"module {fqn!r} ({type(modules[fqn]).__name__}) cannot take placement 'expert': only the "
                f"experts of an MoE container (a fused experts module such as MixtralExperts, or "
                f"{list(spec.expert_containers) or 'none for ' + repr(spec.model_type)}) can"
            )
    return placed


def _tied_layout(module: nn.Module, placement: str) -> object:
    """What a placement does to a module's weight: the dim it splits over tp, or the placement itself.
    An embedding split by vocabulary and its tied ``lm_head`` split by output features hold the same rows."""
    if placement not in TP_PLACEMENTS or placement in _WHOLE_TP_PLACEMENTS or placement == "moe_tp":
        return placement
    conv = type(module).__name__ == "Conv1D"
    if placement.startswith("embedding_"):
        return ("tp", 0 if placement == "embedding_row" else 1)
    if placement == "packed_column":
        return ("tp", int(conv), 2)
    return ("tp", (0 if placement.startswith("column") else 1) ^ int(conv))


def _check_tied(model: nn.Module, placements: dict[str, str]) -> None:
    owner: dict[int, tuple[str, str, object]] = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        if fqn not in placements:
            continue
        layout = _tied_layout(mod, placements[fqn])
        for p in mod.parameters(recurse=False):
            first = owner.setdefault(id(p), (fqn, placements[fqn], layout))
            if first[2] != layout:
                raise ValueError(
                    f"modules {first[0]!r} ({first[1]!r}) and {fqn!r} ({placements[fqn]!r}) share a tied "
                    "parameter and must have the same placement; override both in ElixirConfig.placements"
                )


def resolve_placements_detailed(model: nn.Module, config: Any) -> ResolvedPlacements:
    """Like :func:`resolve_placements`, also returning the tensor-parallel blocks and expert containers."""
    tp_size = config.tensor_parallel_size
    ep_size = config.expert_parallel_size
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = get_model_spec(model_type)
    modules = _param_modules(model)
    # "auto" is decided by hf_elixir.prepare (it knows the budget); resolved alone it is "sharded"
    base = getattr(config, "default_placement", "sharded")
    placements = {fqn: base if base in ("sharded", "replicated") else "sharded" for fqn in modules}
    if tp_size > 1:
        _apply_globs(placements, spec.tensor_parallel, f"placement spec {spec.model_type!r}", must_match=False)
    if ep_size > 1:
        _apply_globs(placements, spec.expert_parallel, f"placement spec {spec.model_type!r}", must_match=False)
    from_plan = plan_placements(model, tp_size, ep_size, use_tp=not spec.tensor_parallel,
                                use_ep=not spec.expert_parallel)
    placements.update({fqn: p for fqn, p in from_plan.items() if fqn in placements})
    _apply_globs(placements, dict(config.placements), "ElixirConfig.placements", must_match=True)
    if not spec.blocks:  # a spec's blocks check their own head counts
        check_heads(model, placements, tp_size)
    blocks, standalone = _check_tp(model, modules, placements, spec, tp_size)
    containers = _check_experts(model, modules, placements, spec, ep_size)
    _check_tied(model, placements)
    if tp_size > 1 and not blocks and not standalone:
        raise ValueError(
            f"ElixirConfig.tensor_parallel_size={tp_size} but model_type {model_type!r} has no tensor-parallel "
            "plan (its config declares no base_model_tp_plan and no registered spec gives one) and no "
            "ElixirConfig.placements glob places a module 'column'/'row'; set tensor_parallel_size=1, give "
            "placements such as {'*.q_proj': 'column', ..., '*.o_proj': 'row'}, or register a spec with "
            "hf_elixir.placement.register_model_spec"
        )
    if ep_size > 1 and not containers:
        dense = not spec.expert_parallel and not read_plans(model)[1]
        raise ValueError(
            f"ElixirConfig.expert_parallel_size={ep_size} but model_type {model_type!r} has no experts placed "
            "'expert'" + (" (a dense model: its config declares no base_model_ep_plan and no registered spec "
                          "names experts); set expert_parallel_size=1" if dense else
                          "; place its experts modules, e.g. ElixirConfig(placements={'*.mlp.experts': 'expert'}), "
                          "or set expert_parallel_size=1")
        )
    return ResolvedPlacements(placements=placements, tp_blocks=blocks, tp_modules=standalone,
                              expert_containers=containers, spec=spec)


def resolve_placements(model: nn.Module, config: Any) -> dict[str, str]:
    """Every parameter-owning module's placement, read from the model config and ``config``.

    Args:
        model: a ``PreTrainedModel`` (or any ``nn.Module``; ``model.config.model_type`` picks the spec,
            unknown types get the generic "everything sharded" spec).
        config: an :class:`hf_elixir.ElixirConfig` (uses ``placements``, ``tensor_parallel_size``,
            ``expert_parallel_size``).

    Returns:
        ``{module_fqn: placement}`` for every module that owns parameters directly, in
        ``named_modules`` order; record it as ``ElixirPlan.placements``.

    Raises:
        ValueError: an override glob matching nothing, a placement a module type cannot take (column on
            a LayerNorm, expert outside an MoE container), a tensor-parallel block placed only partly,
            heads/features/experts not divisible by the axis size, tied modules with different
            placements, or an axis size > 1 with nothing to parallelize.
    """
    return resolve_placements_detailed(model, config).placements
