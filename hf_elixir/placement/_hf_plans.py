"""Placements read from the model's own parallel plans (``config.base_model_tp_plan`` / ``base_model_ep_plan``).

Every transformers 5 model whose config declares a tensor-parallel plan gets tensor-parallel placements with no
registry entry: this module reads the plan transformers itself resolved for the model (``model.tp_plan`` /
``model.ep_plan``: the class's ``_tp_plan`` such as ``lm_head``, the config's base-model plan under the base
model's prefix, and the vocabulary-parallel input embedding transformers adds) and matches it against the
module names with transformers' own matcher (``_get_parameter_plan``: layer numbers become ``*``).

[Note: plan styles] A plan names a *style* per module; transformers applies it with DTensor parameters and
forward hooks (``transformers/distributed/tensor_parallel.py``). hf_elixir's chunks hold plain tensors (a
parameter is a view into its chunk's buffer, [Note: parameters as views] in ``hf_elixir/chunk/chunk.py``), so the
DTensor styles cannot run on them; each supported style maps to a placement that ``hf_elixir.parallel`` applies
with plain tensors and the same collectives:

==================================  ====================  ==========================================================
transformers style                  placement             what runs
==================================  ====================  ==========================================================
``colwise``                         ``column``            weight/bias split on output features; output stays split
``rowwise``                         ``row``               weight split on input features; output all-reduced
``colwise_gather_output``/``_rep``  ``column_gather``     ``column``, then the output all-gathered (full features)
``rowwise_split_input``/``_rep``    ``row_split``         input sliced locally (it arrives whole), then ``row``
``embedding_rowwise``               ``embedding_row``     vocabulary split; partial lookups all-reduced
``embedding_colwise``               ``embedding_column``  hidden dim split; lookups all-gathered
``replicated_with_grad_allreduce``  ``grad_allreduce``    parameters whole on every tp rank; gradient summed over tp
``packed_colwise``                  ``packed_column``     ``column`` per packed part: a rank holds ``gate_r|up_r``
``mla_kv_a_proj``                   ``mla_kv_a``          weight whole; the rotary part's gradient summed over tp
``moe_tp_experts``                  ``moe_tp``            every expert split over tp by its parameters' own entries
                                                          (``packed_rowwise``, ``colwise``, ...); output all-reduced
``replicate``                       (default)             nothing split: the data-parallel default placement
EP ``ep_dispatch_experts``          ``expert``            the experts module spread over the expert-parallel axis
EP ``grouped_gemm``                 (its module's)        parameters of the ``ep_dispatch_experts`` module
==================================  ====================  ==========================================================

Any other style (``local_params``, ``unit_colwise``, ``sequence_parallel``, ``all_reduce``, ...), and a style named
on a single parameter outside a ``moe_tp_experts`` module, is refused by :func:`plan_placements` naming the module,
the style and the fix, never replicated or split in some other way.

[Note: packed and MLA styles] ``packed_colwise`` (transformers' ``PackedColwiseParallel``) shards a linear weight
whose output features are two packed equal parts (``gate|up``) with ``_StridedShard(dim=0, split_factor=2)``: rank
r holds ``gate_r|up_r``, the input is replicated (its gradient all-reduced) and the output stays local, so the
module's own ``chunk(2, dim=-1)`` yields this rank's gate and up features for a row-parallel consumer. That is
``column`` with two fused parts (``TPShardLayout(dim, parts=2)``; GPT-2's ``c_attn`` uses three). transformers
shards a packed *bias* with a plain ``Shard(-1)``, which does not pair with the strided weight rows; here the bias
is split per part like the weight (the unmodified model's output). ``mla_kv_a_proj`` (``MlaKvAProjParallel``, the
DeepSeek-V2/V3 MLA families) splits nothing: ``kv_a_proj_with_mqa``'s output is ``[kv_lora_rank |
qk_rope_head_dim]``; the first part feeds ``kv_a_layernorm`` and the column-split ``kv_b_proj`` (whose input
gradient is all-reduced), the rotary part goes straight to this rank's heads, so its gradient is partial and is
summed over the tp group (identity forward, all-reduce backward on that slice of the output).

``moe_tp_experts`` (``MoeExpertsParallel``; Llama-4, whose experts take every token pre-scaled by its router score)
splits every expert over tp instead of spreading the experts: each fused 3-D parameter is split as its own plan
entry says (:data:`PARAM_STYLE_TO_SPLIT`: ``packed_rowwise`` on ``gate_up_proj`` ``(E, H, 2I)`` = the last dim's two
packed parts each split, a rank holds ``gate_r|up_r``; ``colwise`` on ``down_proj`` ``(E, I, H)`` = ``Shard(ndim - 2)``,
this rank's ``I`` rows), the module's input (and routing weights, when passed) gets an all-reduce backward and its
partial output is all-reduced, the column/row pair of Megatron per expert. A parameter of the module without an
entry, or 1-D (a bias, which the all-reduce would add ``tp`` times), is refused.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_elixir.chunk._tp_slices import tp_slice_sizes

__all__ = ["EP_STYLE_TO_PLACEMENT", "PARAM_STYLE_TO_SPLIT", "TP_STYLE_TO_PLACEMENT", "check_heads", "check_tp_split",
           "moe_tp_splits",
           "plan_placements", "read_plans", "rope_dim_of"]

#: transformers TP style -> hf_elixir placement (``None``: not split, keep the default placement)
TP_STYLE_TO_PLACEMENT: dict[str, str | None] = {
    "colwise": "column",
    "rowwise": "row",
    "colwise_gather_output": "column_gather",
    "colwise_rep": "column_gather",
    "rowwise_split_input": "row_split",
    "rowwise_rep": "row_split",
    "embedding_rowwise": "embedding_row",
    "embedding_colwise": "embedding_column",
    "replicated_with_grad_allreduce": "grad_allreduce",
    "packed_colwise": "packed_column",
    "mla_kv_a_proj": "mla_kv_a",
    "moe_tp_experts": "moe_tp",  # deprecated upstream (removal announced for v5.28): tests/test_style_drift.py
    "replicate": None,
}
#: parameter-entry style inside a ``moe_tp_experts`` module -> (split dim from the end, packed parts); see
#: [Note: packed and MLA styles] (transformers: ``Shard(ndim - 2)`` / ``Shard(-1)``, ``_StridedShard(split_factor=2)``)
PARAM_STYLE_TO_SPLIT: dict[str, tuple[int, int]] = {"colwise": (2, 1), "rowwise": (1, 1), "packed_colwise": (2, 2),
                                                     "packed_rowwise": (1, 2)}
#: transformers EP style -> hf_elixir placement (``None``: a parameter of the experts module, placed with it)
EP_STYLE_TO_PLACEMENT: dict[str, str | None] = {"ep_dispatch_experts": "expert", "grouped_gemm": None}

#: projections whose output holds attention heads (transformers' ``get_kv_heads_per_rank`` names the key ones)
_QUERY_PROJECTIONS = ("q_proj", "q_b_proj", "query", "qkv_proj", "query_key_value", "c_attn")
_KEY_VALUE_PROJECTIONS = ("k_proj", "v_proj", "key", "value", "qkv_proj", "query_key_value", "kv_b_proj")


def read_plans(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """The tensor- and expert-parallel plans transformers resolved for ``model``: ``(tp_plan, ep_plan)``.

    Source: ``transformers.distributed.DistributedMixin.init_parallel_plans`` (run by ``post_init``), read
    through its ``tp_plan`` / ``ep_plan`` properties. Keys are module or parameter names with ``*`` for layer
    numbers, from the root of ``model``. Empty for a model without plans (or not a ``PreTrainedModel``).
    """
    tp_plan = getattr(model, "tp_plan", None)
    ep_plan = getattr(model, "ep_plan", None)
    return dict(tp_plan) if isinstance(tp_plan, dict) else {}, dict(ep_plan) if isinstance(ep_plan, dict) else {}


def _style_of(name: str, plan: dict[str, str], is_weight: bool) -> str | None:
    from transformers.distributed.parallel_utils import _get_parameter_plan  # noqa: PLC0415 (heavy import)

    return _get_parameter_plan(parameter_name=name, plan=plan, is_weight=is_weight)


def _refuse(kind: str, fqn: str, style: str, size: int, why: str = "") -> ValueError:
    axis = "tensor" if kind == "tp" else "expert"
    supported = sorted(k for k in (TP_STYLE_TO_PLACEMENT if kind == "tp" else EP_STYLE_TO_PLACEMENT))
    return ValueError(
        f"model.{kind}_plan places {fqn!r} with the {kind.upper()} style {style!r}, which hf_elixir does not "
        f"support yet{why} (supported: {supported}); set ElixirConfig.{axis}_parallel_size=1 (now {size}), or "
        "give the whole model's placements with hf_elixir.placement.register_model_spec (a registered spec "
        "replaces the config's plan)"
    )


def _module_styles(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module, str, bool]]:
    """``(fqn, module, style, is_param_entry)`` for every module the plan names, directly or by a parameter."""
    found = []
    for fqn, module in model.named_modules():
        if not fqn:
            continue
        style = _style_of(fqn, plan, is_weight=False)
        if style is not None:
            found.append((fqn, module, style, False))
        for pname, _ in module.named_parameters(recurse=False):
            pstyle = _style_of(f"{fqn}.{pname}", plan, is_weight=False)  # an entry naming the parameter itself
            if pstyle is not None:
                found.append((fqn, module, pstyle, True))
    return found


def plan_placements(model: nn.Module, tp_size: int, ep_size: int, *, use_tp: bool = True,
                    use_ep: bool = True) -> dict[str, str]:
    """Module FQN -> placement from the model's own plans, for the axis sizes asked for.

    Args:
        model: a transformers model (its ``tp_plan`` / ``ep_plan``; see :func:`read_plans`).
        tp_size / ep_size: ``ElixirConfig.tensor_parallel_size`` / ``expert_parallel_size``; a plan is read only
            when its axis is > 1.
        use_tp / use_ep: ``False`` when a registered spec gives that axis' placements instead.

    Returns:
        ``{module_fqn: placement}`` for the modules the plans split (see [Note: plan styles]); modules left out
        keep the default placement.

    Raises:
        ValueError: the plan uses a style hf_elixir does not support, or a supported style on a module it cannot
            take (naming the module, the style and the fix).
    """
    tp_plan, ep_plan = read_plans(model)
    out: dict[str, str] = {}
    if tp_size > 1 and use_tp and tp_plan:
        styles = _module_styles(model, tp_plan)
        moe_tp = {fqn for fqn, _, style, is_param in styles if style == "moe_tp_experts" and not is_param}
        for fqn, module, style, is_param in styles:
            if is_param and fqn in moe_tp:  # split by the moe_tp rewrite (checked by moe_tp_splits)
                continue
            if style not in TP_STYLE_TO_PLACEMENT or is_param:
                why = "" if style not in TP_STYLE_TO_PLACEMENT else " on a single parameter"
                raise _refuse("tp", fqn, style, tp_size, why)
            placement = TP_STYLE_TO_PLACEMENT[style]
            if placement is None:
                continue
            if not any(True for _ in module.parameters(recurse=False)):
                raise _refuse("tp", fqn, style, tp_size, f" on a {type(module).__name__} that owns no parameters")
            if placement == "mla_kv_a" and not isinstance(rope_dim_of(model), int):
                raise _refuse("tp", fqn, style, tp_size, " without config.qk_rope_head_dim (the rotary features it "
                              "splits off the output)")
            out[fqn] = placement
    if ep_size > 1 and use_ep and ep_plan:
        for fqn, module, style, is_param in _module_styles(model, ep_plan):
            if style not in EP_STYLE_TO_PLACEMENT:
                raise _refuse("ep", fqn, style, ep_size)
            if EP_STYLE_TO_PLACEMENT[style] is not None and not is_param:
                out[fqn] = "expert"
    return out


def moe_tp_splits(model: nn.Module, fqn: str, module: nn.Module, tp_size: int) -> dict[str, tuple[int, int]]:
    """Parameter name -> ``(split dim, packed parts)`` of a ``moe_tp`` module, from its parameters' plan entries.

    Raises:
        ValueError: a parameter without an entry, with a style not in :data:`PARAM_STYLE_TO_SPLIT`, 1-D, or whose
            split dim cannot be split (:func:`check_tp_split`; uneven slices are fine), naming the parameter, the
            style and the fix.
    """
    tp_plan = read_plans(model)[0]
    out = {}
    for pname, param in module.named_parameters(recurse=False):
        style = _style_of(f"{fqn}.{pname}", tp_plan, is_weight=False)
        if style not in PARAM_STYLE_TO_SPLIT or param.dim() < 2:
            got = f"style {style!r}" if style is not None else "no entry in model.tp_plan"
            raise ValueError(
                f"placement 'moe_tp' of {fqn!r} splits each parameter as its plan entry says, but {pname!r} "
                f"({param.dim()}-D) has {got} (supported on 2-D and larger: {sorted(PARAM_STYLE_TO_SPLIT)}); set "
                f"ElixirConfig.tensor_parallel_size=1 (now {tp_size}) or place {fqn!r} 'sharded' in "
                "ElixirConfig.placements")
        from_end, parts = PARAM_STYLE_TO_SPLIT[style]
        dim = param.dim() - from_end
        check_tp_split(f"{fqn}.{pname} ({style}): dim {dim} of size {param.shape[dim]}", param.shape[dim], parts,
                       tp_size, f"place {fqn!r} 'sharded' in ElixirConfig.placements")
        out[pname] = (dim, parts)
    return out


def check_tp_split(what: str, size: int, parts: int, tp_size: int, fix: str) -> None:
    """Refuse a split of ``size`` features (``parts`` equal packed parts, each split on its own) over ``tp_size``
    ranks that is impossible: parts that are not equal, or a rank left with no feature. Uneven slices are
    fine (ceil-sized, the last rank's shorter: [Note: uneven tensor-parallel slices] in
    ``hf_elixir/chunk/_tp_slices.py``).

    Raises:
        ValueError: naming ``what``, the sizes that work and ``fix``.
    """
    if tp_size <= 1:
        return
    if size % parts:
        raise ValueError(f"{what} are not {parts} equal packed parts; {fix}")
    part = size // parts
    sizes = tp_slice_sizes(part, tp_size)
    if 0 in sizes:
        valid = [t for t in range(2, min(part, 64) + 1) if 0 not in tp_slice_sizes(part, t)]
        empty = sizes.index(0)
        ranks = f"rank {empty}" if empty == tp_size - 1 else f"ranks {empty}..{tp_size - 1}"
        raise ValueError(
            f"{what} split over tensor_parallel_size={tp_size}{f' (x{parts} packed parts)' if parts > 1 else ''} "
            f"leave tp {ranks} no feature (ceil-sized slices of {-(-part // tp_size)}: {sizes[:empty + 1]}...); "
            f"pick a tensor_parallel_size that leaves every rank one (up to 64: {valid}), or {fix}")


def rope_dim_of(model: nn.Module) -> Any:
    """``qk_rope_head_dim`` of ``model``'s text config (the ``mla_kv_a`` placement's rotary features), or ``None``."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    return getattr(text, "qk_rope_head_dim", None)


def check_heads(model: nn.Module, placements: dict[str, str], tp_size: int) -> None:
    """Refuse attention heads a tensor-parallel size cannot split whole (query and key/value heads, GQA).

    A column-split query or key/value projection gives each rank ``heads / tp_size`` whole heads (the attention
    forward reshapes to ``(-1, head_dim)``), so both head counts of the text config must be divisible by
    ``tp_size``; unlike features (uneven slices are fine), heads never split unevenly, and fewer key/value heads
    than ranks are refused rather than replicated. Source: transformers' ``get_kv_heads_per_rank`` (the same rule
    for its cache: ``None`` when the heads do not divide).

    Raises:
        ValueError: a head count not divisible by ``tp_size``, naming both numbers.
    """
    if tp_size <= 1:
        return
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    split = [fqn for fqn, p in placements.items() if p in ("column", "column_gather")]
    leaf = {fqn.rsplit(".", 1)[-1] for fqn in split}
    checks = (("num_attention_heads", _QUERY_PROJECTIONS), ("num_key_value_heads", _KEY_VALUE_PROJECTIONS))
    for attr, names in checks:
        heads: Any = getattr(text, attr, None)
        if not isinstance(heads, int) or not leaf.intersection(names):
            continue
        if heads % tp_size:
            example = next(f for f in split if f.rsplit(".", 1)[-1] in names)
            other = "num_key_value_heads" if attr == "num_attention_heads" else "num_attention_heads"
            counts = [h for h in (getattr(text, a, None) for a, _ in checks) if isinstance(h, int) and h > 0]
            sizes = [d for d in range(1, min(counts) + 1) if all(h % d == 0 for h in counts)]
            fewer = " (fewer key/value heads than ranks are not replicated)" if 0 < heads < tp_size else ""
            raise ValueError(
                f"ElixirConfig.tensor_parallel_size={tp_size} does not divide config.{attr}={heads} "
                f"({other}={getattr(text, other, None)}): the tensor-parallel placement of {example!r} gives every "
                f"rank whole heads{fewer}; pick a tensor_parallel_size that divides every head count: one of {sizes}"
            )
