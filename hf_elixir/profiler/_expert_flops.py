"""Expert FLOPs of fused-expert MoE layers on the meta device.

[Note: meta expert FLOPs]
Today's MoE layers (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss in transformers 5.x) hold their experts as fused
3-D parameters (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], gpt-oss transposed) and run only the
experts that got tokens, found with data-dependent ops (``nonzero``, ``.item()``, a Python loop over hit
experts). On meta no expert is "hit", so the FLOP counter sees no expert matmul and the planner priced
Mixtral-8x7B at a quarter of Llama-2-7B. On meta we add them from the routing arithmetic instead: each token
goes to ``top_k`` experts, spread evenly (the balanced routing the router's aux loss aims for), so the experts
of one layer do ``tokens x top_k x 2 x (expert parameters / E)`` forward FLOPs (one multiply-add per weight per
routed token) and twice that backward (input and weight gradients), as the FLOP counter counts a dense MLP.
The counted FLOPs are used when the trace already holds them (a loop-based layer that ran on meta).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["add_meta_expert_flops"]

_TOP_K_FIELDS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")


def _top_k(model: nn.Module, module: nn.Module) -> int | None:
    for owner in (module, getattr(model, "config", None)):
        for field in _TOP_K_FIELDS:
            value = getattr(owner, field, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _fused_expert_numel(module: nn.Module) -> tuple[int, int] | None:
    """``(num_experts, parameter numel of all experts)`` when ``module`` holds fused 3-D expert weights."""
    weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    if not weights or len({p.shape[0] for p in weights}) != 1:
        return None
    return int(weights[0].shape[0]), sum(p.numel() for p in weights)


def add_meta_expert_flops(model: nn.Module, profile: Any, tokens: int) -> None:
    """Add the routed experts' FLOPs to ``profile``'s events of each fused-expert module ([Note: meta expert
    FLOPs]); a no-op for models without fused 3-D experts or whose expert events already counted them.

    Args:
        model: the model the profile traced (on meta); its config gives ``num_experts_per_tok``.
        profile: the :class:`StepProfile`; its ``events``, ``forward_flops`` and ``backward_flops`` grow.
        tokens: tokens in the sample batch (``input_ids.numel()``).
    """
    for name, module in model.named_modules():
        fused = _fused_expert_numel(module)
        top_k = _top_k(model, module) if fused else None
        if not fused or top_k is None:
            continue
        experts, numel = fused
        forward = 2.0 * tokens * min(top_k, experts) * numel / experts
        for phase, flops in (("fwd", forward), ("bwd", 0.0 if profile.forward_only else 2.0 * forward)):
            events = [e for e in profile.events if e.module == name and e.phase == phase]
            if not events or sum(e.flops for e in events) >= 0.5 * flops:
                continue
            for event in events:
                event.flops += flops / len(events)
            if phase == "fwd":
                profile.forward_flops += flops
            else:
                profile.backward_flops += flops
