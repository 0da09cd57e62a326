"""Cost model and search of the block-wise activation policy ([Note: activation policy] in
``hf_elixir/search/_activation_cost.py``): memory and time of keep / recompute / offload per block, the search
choosing a non-keep policy only when the budget forces it, and ``hf-elixir plan`` printing the policy per block."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_elixir
from hf_elixir.cli import main
from hf_elixir.plan import ElixirPlan
from hf_elixir.profiler import HardwareProfile, profile_step
from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch
from hf_elixir.search import build_chunked_step, predict, search
from hf_elixir.search._activation_cost import activation_bytes, profile_blocks
from hf_elixir.search._cost import Knobs
from tests._models import batch, fixed_times, tiny_model

GIB = 2**30
H = [f"transformer.h.{i}" for i in range(12)]


def _gpu(memory_bytes: int) -> HardwareProfile:
    return HardwareProfile(device_kind="cuda", device_name="test-gpu", device_total_bytes=memory_bytes,
                           device_free_bytes=memory_bytes, host_total_bytes=256 * GIB, host_available_bytes=256 * GIB,
                           h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, host_adam_numel_per_s=1e9,
                           device_adam_numel_per_s=4e10, device_flops_per_s=150e12, can_overlap=True)


@pytest.fixture(scope="module")
def gpt2_profile():
    model, sample = meta_model_and_batch(load_config("gpt2"), batch_size=8, seq_len=1024, dtype=torch.bfloat16)
    return profile_step(model, sample, device="meta")


def _uniform(kind: str, k: int = 12) -> dict[str, str]:
    return {b: kind if i < k else "keep" for i, b in enumerate(H)}


def test_blocks_in_forward_order(gpt2_profile):
    assert profile_blocks(gpt2_profile) == H  # h.10 after h.9, not after h.1


def test_activation_bytes_per_policy(gpt2_profile):
    p = gpt2_profile
    keep = activation_bytes(p, "bf16", _uniform("keep"))
    assert keep == activation_bytes(p, "bf16", False) == int(p.activation_peak_bytes)
    assert activation_bytes(p, "bf16", _uniform("recompute")) == activation_bytes(p, "bf16", True)
    block = p.block_activation_bytes["transformer.h.0"]
    # offloading k blocks frees k blocks' activations but one comes back in backward, and with two or more the
    # one before it is copied back ahead meanwhile ([Note: activation onload ahead] in runtime/activations.py)
    for k in (1, 4, 12):
        assert activation_bytes(p, "bf16", _uniform("offload", k)) == keep - (k - min(k, 2)) * block
    # a recomputed block keeps its input on top
    inputs = p.block_input_bytes["transformer.h.0"]
    assert activation_bytes(p, "bf16", _uniform("recompute", 4)) == keep - 3 * block + 4 * inputs
    mixed = {**_uniform("offload", 2), "transformer.h.5": "recompute"}  # h.1 back with h.0 ahead: two blocks
    assert activation_bytes(p, "bf16", mixed) == keep - block + inputs


def _step(profile, hardware, policy):
    return build_chunked_step(profile, 1 << 26, world_size=1, precision="bf16", hardware=hardware,
                              activation_policy=policy)


def _resident(step) -> Knobs:
    everything = frozenset(range(step.num_chunks))
    return Knobs(resident=everything, device_shard=everything, device_optim=everything)


def test_offload_priced_by_bandwidth_serial_without_overlap(gpt2_profile):
    """Off CUDA both copies are serial with compute: exactly bytes / rate each way, counted both ways."""
    cpu = dataclasses.replace(_gpu(80 * GIB), can_overlap=False)
    keep, off = _step(gpt2_profile, cpu, _uniform("keep")), _step(gpt2_profile, cpu, _uniform("offload", 3))
    a, b = predict(keep, _resident(keep), cpu), predict(off, _resident(off), cpu)
    moved = 3 * gpt2_profile.block_activation_bytes["transformer.h.0"]
    assert b.d2h_bytes - a.d2h_bytes == moved and b.h2d_bytes - a.h2d_bytes == moved
    assert b.forward_backward_s - a.forward_backward_s == pytest.approx(moved / 20e9 * 2, rel=1e-9)
    assert b.host_bytes - a.host_bytes == moved


def test_offload_overlaps_forward_on_cuda_and_recompute_costs_compute(gpt2_profile):
    gpu = _gpu(80 * GIB)
    keep, off, rec = (_step(gpt2_profile, gpu, _uniform(kind, 3)) for kind in ("keep", "offload", "recompute"))
    a, b, c = (predict(s, _resident(s), gpu) for s in (keep, off, rec))
    moved = 3 * gpt2_profile.block_activation_bytes["transformer.h.0"]
    extra = b.forward_backward_s - a.forward_backward_s
    # the copy back blocks backward; the forward copy overlaps the next blocks' compute
    assert moved / 20e9 <= extra < 2 * moved / 20e9
    recompute_s = sum(rec.event_compute_s) - sum(keep.event_compute_s)
    assert recompute_s > 0
    assert c.forward_backward_s - a.forward_backward_s == pytest.approx(recompute_s + (len(rec.groups) - len(
        keep.groups)) * gpu.hook_event_s, rel=1e-6)


def test_search_moves_activations_only_when_the_budget_forces_it(gpt2_profile):
    p = gpt2_profile
    roomy = search(p, _gpu(80 * GIB), precision="bf16")
    assert set(roomy.plan.activation_policy.values()) == {"keep"} and len(roomy.plan.activation_policy) == 12
    # a budget the kept activations do not fit beside the smallest working set; a policy that moves some does
    gpu = _gpu(80 * GIB)
    keep = _step(p, gpu, _uniform("keep"))
    need_keep = keep.working_set_bytes() + keep.activation_bytes
    budget = int((need_keep - 3 * p.block_activation_bytes["transformer.h.0"]) / 0.95)
    tight = search(p, _gpu(budget), precision="bf16", chunk_size_numel=1 << 26)
    policy = tight.plan.activation_policy
    assert set(policy.values()) != {"keep"}, policy
    assert tight.plan.predicted_peak_device_bytes <= budget * 0.95  # the budget covers the result
    moved = [b for b in H if policy[b] != "keep"]
    assert moved == H[:len(moved)]  # the first k blocks in forward order
    assert any("activation policy" in r for r in tight.plan.reasons)
    # the user's policy is priced as given, not searched
    fixed = search(p, _gpu(80 * GIB), precision="bf16", activation_policy="offload")
    assert set(fixed.plan.activation_policy.values()) == {"offload"}


def test_plan_command_prints_policy_per_block(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    code = main(["plan", "--model", "gpt2", "--gpu-memory", "24GiB", "--host-memory", "64GiB", "--batch-size", "16",
                 "--seq-len", "1024", "--output", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    plan = ElixirPlan.load(out)
    assert list(plan.activation_policy) == H
    assert "activation policy per block" in text and "transformer.h.0" in text
    assert set(plan.activation_policy.values()) != {"keep"}  # 16 x 1024 tokens of GPT-2 activations need > 24 GiB


def test_searched_policy_runs_in_prepare():
    """``search="auto"`` with activations on the device: the plan's policy is what the model runs."""
    model = tiny_model("gpt2")
    sample = batch("gpt2", 0, 2)
    profile = fixed_times(profile_step(model, sample, device="cpu"))  # the search's choice: no measured times
    hw = dataclasses.replace(_gpu(10**9), device_kind="cpu", can_overlap=False, device_flops_per_s=1e10)
    keep = build_chunked_step(profile, 8192, world_size=1, precision="fp32", hardware=hw,
                              activation_policy={b: "keep" for b in profile_blocks(profile)})
    budget = int((keep.working_set_bytes() + keep.activation_bytes - 1) / 0.95)
    result = search(profile, dataclasses.replace(hw, device_total_bytes=budget, device_free_bytes=budget),
                    chunk_size_numel=8192, activations_on_device=True)
    assert set(result.plan.activation_policy.values()) != {"keep"}
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()),
                                   hf_elixir.ElixirConfig(plan=result.plan))
    assert hf_elixir.get_state(model).plan.activation_policy == result.plan.activation_policy
    opt.backward(model(**sample).loss)
    opt.step()


def test_search_auto_prices_the_users_policy():
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), hf_elixir.ElixirConfig(
        search="auto", chunk_size_numel=8192, activation_policy={"transformer.h.1": "offload"}),
        sample_batch=batch("gpt2", 0, 2))
    plan = hf_elixir.get_state(model).plan
    assert plan.activation_policy == {"transformer.h.0": "keep", "transformer.h.1": "offload"}
    assert any("offload 1/2" in r for r in plan.reasons)  # the search priced that policy
    opt.backward(model(**batch("gpt2", 1, 2)).loss)
    opt.step()


def test_offload_copies_back_ahead_on_cuda(gpt2_profile):
    """[Note: activation onload ahead]: with compute longer than the copies, only the last offloaded block's copy
    back blocks backward; the earlier blocks' copies run during the backward of the block after them."""
    fast = _gpu(80 * GIB)
    gpu = dataclasses.replace(fast, device_flops_per_s=fast.device_flops_per_s / 1000)  # compute-bound
    keep, off = (_step(gpt2_profile, gpu, _uniform(kind, 3)) for kind in ("keep", "offload"))
    a, b = predict(keep, _resident(keep), gpu), predict(off, _resident(off), gpu)
    block = gpt2_profile.block_activation_bytes["transformer.h.0"]
    assert b.forward_backward_s - a.forward_backward_s == pytest.approx(block / 20e9, rel=1e-6)
