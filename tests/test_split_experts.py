"""Fused MoE experts split into one hook unit per expert (``ElixirConfig.split_fused_experts``, [Note: split fused
experts] in ``hf_elixir/parallel/_expert_units.py``): parity with plain PyTorch under ZeRO alone (1 rank, a budget
that forces evictions, strict device mode from conftest, AdamW with weight decay + clipping, an expert that never
gets a token), the unmodified model's names and shapes in ``state_dict`` / ``save_pretrained`` / ``full_gradients``,
the device floor of one expert instead of E, and the all-or-nothing rollback."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import hf_elixir
from hf_elixir.placement._experts import SPLIT_ATTR
from tests._moe_ep_cases import LR, MAX_NORM, WEIGHT_DECAY, _adamw, _batch, _silence_experts, rel
from tests._moe_models import make_moe_model

STEPS = 5
TOL = 2e-5


def _config(**kw) -> hf_elixir.ElixirConfig:
    return hf_elixir.ElixirConfig(budget_covers_activations=False, default_placement="sharded", **kw)


def _tight(model, opt, cfg) -> hf_elixir.ElixirConfig:
    """5% above the smallest budget prepare accepts (chunks get evicted and offloaded)."""
    need = hf_elixir.min_device_budget_bytes(model, opt, cfg)
    return dataclasses.replace(cfg, device_memory_budget_bytes=int(need * 1.05) + 1024)


def _train(family: str, idle: bool = False):
    """STEPS steps of the split, prepared model and of plain PyTorch on the unmodified one."""
    model = make_moe_model(family)
    if idle:
        _silence_experts(model, (2, 3))
    ref = copy.deepcopy(model)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    opt, opt_ref = _adamw(model), _adamw(ref)
    cfg = _tight(model, opt, _config())
    model, opt = hf_elixir.prepare(model, opt, cfg)
    loss_rel = norm_rel = 0.0
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(**_batch(step, 0)).loss
        opt.backward(loss)
        norm = opt.clip_grad_norm(MAX_NORM)
        opt.step()
        opt_ref.zero_grad()
        ref_loss = ref(**_batch(step, 0)).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt_ref.step()
        loss_rel = max(loss_rel, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        norm_rel = max(norm_rel, abs(float(norm) - float(ref_norm)) / float(ref_norm))
    return model, opt, ref, init, loss_rel, norm_rel


@pytest.mark.parametrize("family,idle", [("mixtral", False), ("gpt_oss", True)])
def test_split_experts_match_plain_pytorch(family, idle):
    model, opt, ref, init, loss_rel, norm_rel = _train(family, idle)
    experts = model.model.layers[0].mlp.experts
    assert getattr(experts, SPLIT_ATTR).num_pieces == 4 and experts.get_submodule("3").num_experts == 1
    assert loss_rel < TOL and norm_rel < TOL, (loss_rel, norm_rel)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)  # the fused names, in the unmodified model's order
    assert all(sd[k].shape == ref_sd[k].shape for k in sd)
    worst = max((rel(sd[k], ref_sd[k]), k) for k in ref_sd if ref_sd[k].norm() > 0)
    assert worst[0] < TOL, worst
    assert hf_elixir.memory_stats(model)["num_evictions"] > 0  # the budget forced chunks off the device
    if idle:  # never-routed experts 2, 3: a zero gradient, so AdamW only decays their slices, as in PyTorch
        decay = (1 - LR * WEIGHT_DECAY) ** STEPS
        for k in ref_sd:
            if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
                assert rel(sd[k][2:], init[k][2:] * decay) < 1e-6, k
                assert rel(sd[k][2:], init[k][2:]) > 1e-4, k
