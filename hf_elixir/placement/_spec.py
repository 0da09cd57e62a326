"""Declarative placement specs: one small :class:`ModelPlacementSpec` per ``config.model_type``.

A spec says, by module-name glob, which modules take a non-default placement, and names the
tensor-parallel *blocks* (a column-parallel producer paired with a row-parallel consumer inside one
parent module, e.g. GPT-2's ``attn.c_attn`` -> ``attn.c_proj``) so the rewrite in
:mod:`hf_elixir.parallel` knows which parent attributes (head counts, split sizes) to shrink.

Source: Megatron-LM (Shoeybi et al., arXiv 1909.08053, section 3) for the column/row pairing;
Elixir (arXiv 2212.05339, section 3) for per-module placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_elixir.plan import PLACEMENT_NAMES

__all__ = ["PLACEMENTS", "ModelPlacementSpec", "TensorParallelBlock"]

#: Every placement name a module can take.
#:
#: - ``"sharded"``: parameters live in ZeRO-3 chunks sharded over the data-parallel axis (default).
#: - ``"replicated"``: a full copy on every rank; gradients all-reduced over the data-parallel axis.
#: - ``"column"``: output features split over the tensor-parallel axis (per head for attention); the
#:   output stays split (transformers' ``colwise``).
#: - ``"row"``: input features split over the tensor-parallel axis (the input arrives split); outputs
#:   all-reduced (``rowwise``).
#: - ``"column_gather"``: ``"column"``, then the output all-gathered to full features
#:   (``colwise_gather_output``, e.g. ``lm_head``).
#: - ``"row_split"``: the input arrives whole and each rank takes its slice, then ``"row"``
#:   (``rowwise_split_input``).
#: - ``"embedding_row"``: an embedding's vocabulary split; each rank looks up its ids, the partial
#:   lookups are all-reduced (``embedding_rowwise``).
#: - ``"embedding_column"``: an embedding's hidden dim split; lookups all-gathered (``embedding_colwise``).
#: - ``"grad_allreduce"``: parameters whole on every tensor-parallel rank, in a module that sees only this
#:   rank's heads (Qwen3's ``q_norm``): gradients summed over the tensor-parallel group
#:   (``replicated_with_grad_allreduce``).
#: - ``"packed_column"``: ``"column"`` on a linear whose output packs two equal parts (``gate|up``): each part is
#:   split over the tensor-parallel axis, a rank holds ``gate_r|up_r`` (``packed_colwise``).
#: - ``"mla_kv_a"``: parameters whole on every tensor-parallel rank (DeepSeek MLA's ``kv_a_proj_with_mqa``); the
#:   gradient of the output's last ``qk_rope_head_dim`` features (the rotary key every rank's heads share) is
#:   summed over the tensor-parallel group (``mla_kv_a_proj``).
#: - ``"moe_tp"``: every expert of a fused experts module split over the tensor-parallel axis as its parameters'
#:   plan entries say (Llama-4: ``gate_up_proj`` packed on the last dim, ``down_proj`` on dim 1); the partial
#:   output all-reduced (``moe_tp_experts``).
#: - ``"expert"``: the experts of an MoE layer spread over the expert-parallel axis (a fused 3-D experts
#:   module such as ``MixtralExperts`` as a whole, or the experts of a registered container).
#:
#: All but ``"replicated"`` are also ZeRO-sharded over the data-parallel axis. See
#: ``hf_elixir/placement/_hf_plans.py`` for how a model config's plan maps onto them.
PLACEMENTS = PLACEMENT_NAMES


@dataclass(frozen=True, kw_only=True)
class TensorParallelBlock:
    """A column-parallel -> row-parallel pair inside one parent module.

    Attributes:
        parent: glob matched against the parent module's FQN (e.g. ``"*.attn"``).
        column: child names whose output features are split (e.g. ``("q_proj", "k_proj", "v_proj")``).
        row: child name whose input features are split and whose output is all-reduced.
        fused_parts: each column child's output is this many equal parts concatenated (GPT-2's
            ``c_attn`` is ``q|k|v`` = 3); each part is split separately so every rank keeps whole heads.
        num_heads_attr: parent attribute holding the head count; divided by the axis size, and the
            head count must be divisible by it. ``None`` for MLP blocks.
        width_attrs: parent attributes holding a per-part feature width (GPT-2's ``split_size``),
            divided by the axis size.
    """

    parent: str
    column: tuple[str, ...]
    row: str
    fused_parts: int = 1
    num_heads_attr: str | None = None
    width_attrs: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ModelPlacementSpec:
    """Placements for one model family, keyed by ``config.model_type``.

    Attributes:
        model_type: the ``config.model_type`` this spec is for (``"*"`` for the generic fallback).
        tensor_parallel: module glob -> a tensor-parallel placement (``"column"``/``"row"``, ...); used only
            when ``ElixirConfig.tensor_parallel_size > 1``. A spec with any of them replaces the model config's
            own ``base_model_tp_plan`` for its ``model_type``.
        expert_parallel: module glob -> ``"expert"``; used only when
            ``ElixirConfig.expert_parallel_size > 1``; replaces the config's ``base_model_ep_plan`` when given.
        blocks: the tensor-parallel blocks the globs above form.
        expert_containers: class names of MoE expert containers (a ``ModuleDict`` of
            ``expert_{i}`` called as ``experts(hidden_TH, one_hot_T1E, weights_T1)``).
        num_experts_attr: container attribute holding the expert count.
    """

    model_type: str
    tensor_parallel: dict[str, str] = field(default_factory=dict)
    expert_parallel: dict[str, str] = field(default_factory=dict)
    blocks: tuple[TensorParallelBlock, ...] = ()
    expert_containers: tuple[str, ...] = ()
    num_experts_attr: str = "num_experts"
