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

[Note: MoE layers in a profile]
:func:`moe_layers` records each MoE layer's expert container in ``StepProfile.moe_layers``, what the planner needs to
price expert parallelism (``hf_elixir/search/_expert_parallel.py``): how many experts, how many each token goes to,
the hidden size of the tokens the all-to-all moves, the tokens of the sample batch, and whether the experts are
fused tensors (every direct parameter stacked over the experts on dim 0, split by expert parallelism) or one child
module per expert (HF Switch's ``SwitchTransformersExperts``, whose children expert parallelism deals out whole).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_elixir.placement._experts import PIECE_ATTR, SPLIT_ATTR

__all__ = ["add_meta_expert_flops", "moe_layers", "record_moe_layers"]

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
    if getattr(module, PIECE_ATTR, False):  # one expert of split fused experts: counted with its parent
        return None
    if getattr(module, SPLIT_ATTR, None) is not None:  # split per expert (hf_elixir/parallel/_expert_units.py)
        return module.num_experts, sum(p.numel() for p in module.parameters() if p.dim() == 3)
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
            # split experts: their FLOPs go to the experts' own events (one unit per expert)
            events = [e for e in profile.events if (e.module == name or e.module.startswith(name + "."))
                      and e.phase == phase]
            if not events or sum(e.flops for e in events) >= 0.5 * flops:
                continue
            for event in events:
                event.flops += flops / len(events)
            if phase == "fwd":
                profile.forward_flops += flops
            else:
                profile.backward_flops += flops


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0) or 0)


def _expert_container(module: nn.Module) -> tuple[int, bool] | None:
    """``(num_experts, fused)`` when ``module`` is an MoE layer's expert container: fused 3-D expert weights
    (every direct parameter with at least two dims stacked over the experts on dim 0), or a module list/dict with
    its own forward over one child per expert (the same rule as ``hf_elixir.runtime.hooks``' routing
    containers)."""
    fused = _fused_expert_numel(module)
    if fused is not None:
        experts = fused[0]
        params = list(module.parameters(recurse=False))
        if all(p.dim() >= 2 and p.shape[0] == experts for p in params):
            return experts, True
        return None
    from hf_elixir.runtime.hooks import _is_routing_container  # noqa: PLC0415

    if _is_routing_container(module):
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        if len(children) > 1:
            return len(children), False
    return None


def moe_layers(model: nn.Module, tokens: int) -> dict[str, dict[str, int]]:
    """``StepProfile.moe_layers`` ([Note: MoE layers in a profile]): expert container FQN -> ``{"num_experts": E,
    "top_k": k, "hidden_size": H, "tokens": T, "fused": 0 | 1}``.

    Args:
        model: the profiled model (any device, meta included: only shapes are read).
        tokens: tokens in the sample batch (``input_ids.numel()``); ``k`` falls back to 1 (Switch routing) where
            neither the container nor the config names a top-k.
    """
    hidden = _hidden_size(model)
    out: dict[str, dict[str, int]] = {}
    for name, module in model.named_modules():
        found = _expert_container(module)
        if found is None or any(name.startswith(outer + ".") for outer in out):
            continue
        experts, fused = found
        top_k = _top_k(model, module) or 1
        out[name] = {"num_experts": experts, "top_k": min(top_k, experts), "hidden_size": hidden,
                     "tokens": int(tokens), "fused": int(fused)}
    return out


def record_moe_layers(model: nn.Module, profile: Any, tokens: int, meta_flops: bool) -> None:
    """Fill ``profile.moe_layers`` (:func:`moe_layers`) and, with ``meta_flops`` (FLOPs counted on meta), add the
    routed experts' FLOPs (:func:`add_meta_expert_flops`)."""
    profile.moe_layers = moe_layers(model, tokens)
    if meta_flops:
        add_meta_expert_flops(model, profile, tokens)
