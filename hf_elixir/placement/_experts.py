"""Recognise the fused 3-D expert containers of today's Hugging Face MoE families.

Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss (transformers 5.x) hold one layer's experts in one module
(``MixtralExperts``, ``GptOssExperts``, ...) whose parameters are stacked over the experts on dim 0:
``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)`` (gpt-oss transposed, with ``(E, 2I)`` /
``(E, H)`` biases), called as ``experts(hidden_TH, top_k_index_TK, top_k_weights_TK) -> (T, H)``. Such a
module takes the placement ``"expert"`` as a whole; no registry entry is needed.

Source: transformers ``integrations/moe.py`` (``use_experts_implementation``) and the families' modeling files.
"""

from __future__ import annotations

from torch import nn

__all__ = ["PIECE_ATTR", "SPLIT_ATTR", "fused_expert_count", "is_fused_experts"]

#: set on a fused experts module split into one child per expert (``hf_elixir/parallel/_expert_units.py``)
SPLIT_ATTR = "_hf_elixir_split_experts"
#: set on each such child (one expert, ``num_experts = 1``): a piece of its parent, not a container itself
PIECE_ATTR = "_hf_elixir_expert_piece"


def fused_expert_count(module: nn.Module) -> int | None:
    """``module.num_experts`` if ``module`` is a fused expert container, else ``None``.

    A fused container has an int ``num_experts`` attribute, owns parameters directly, has no child with
    parameters, and every direct parameter has at least two dims with dim 0 equal to ``num_experts``.
    A fused container split into one child per expert ([Note: split fused experts] in
    ``hf_elixir/parallel/_expert_units.py``) still is one (its ``num_experts``); its children are not.
    """
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int) or isinstance(module, (nn.ModuleDict, nn.ModuleList)):
        return None
    if getattr(module, PIECE_ATTR, False):
        return None
    if getattr(module, SPLIT_ATTR, None) is not None:
        return num_experts
    params = list(module.parameters(recurse=False))
    if not params or any(True for child in module.children() for _ in child.parameters()):
        return None
    if all(p.dim() >= 2 and p.shape[0] == num_experts for p in params):
        return num_experts
    return None


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds an MoE layer's experts as fused tensors (see :func:`fused_expert_count`)."""
    return fused_expert_count(module) is not None
