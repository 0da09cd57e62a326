"""Block-wise activation policy (keep / recompute / offload per transformer block).

Runtime: parity with plain PyTorch (same seeds, fp32, <= 1e-5 relative) for every policy and a mixed one, at
1 rank and 2 gloo ranks, under a budget that evicts; the measured activation peak drops under recompute and
offload; offloaded bytes are counted both ways and strict mode (on for the suite) accepts the copies.
Plan: the per-block policy round-trips, old plans with the bool load. Config: a user policy, validated.
"""

from __future__ import annotations


import pytest
import torch

import hf_elixir
from hf_elixir.chunk import strict
from hf_elixir.plan import ElixirPlan
from hf_elixir.runtime.activations import transformer_blocks
from tests._dist import run_distributed
from tests._models import rank_batch, rel_l2, tiny_model, two_groups

CHUNK = 8192
STEPS = 3
ROWS = 2
BLOCKS = ["transformer.h.0", "transformer.h.1"]
POLICIES = {
    "keep": {b: "keep" for b in BLOCKS},
    "recompute": {b: "recompute" for b in BLOCKS},
    "offload": {b: "offload" for b in BLOCKS},
    "mixed": {"transformer.h.0": "offload", "transformer.h.1": "recompute"},
}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference(world_size: int):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    for step in range(STEPS):
        full = {k: torch.cat([rank_batch("gpt2", step, r, world_size, ROWS)[k] for r in range(world_size)])
                for k in ("input_ids", "labels")}
        model(**full).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return _state(model)


def _elixir(rank: int, world_size: int, policy, budget: int | None):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, device_memory_budget_bytes=budget, default_placement="sharded",
        activation_policy=policy, budget_covers_activations=False))  # the model-data floor: activations outside
    peaks = []
    for step in range(STEPS):
        hf_elixir.reset_memory_stats(model)
        opt.backward(model(**rank_batch("gpt2", step, rank, world_size, ROWS)).loss)
        peaks.append(hf_elixir.memory_stats(model)["activation_peak_bytes"])
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    stats = hf_elixir.memory_stats(model)
    return _state(model), max(peaks), stats, hf_elixir.get_state(model).plan


def _budget(world_size: int) -> int:
    model = tiny_model("gpt2")
    cfg = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded")
    return hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(model.parameters()), cfg, world_size=world_size)


def _run_all(rank: int, world_size: int):
    ref = _reference(world_size)
    budget = _budget(world_size)
    out = {}
    for name, policy in POLICIES.items():
        state, peak, stats, plan = _elixir(rank, world_size, policy, budget)
        out[name] = {"rel": rel_l2(state, ref), "act_peak": peak, "d2h": stats["d2h_bytes"],
                     "h2d": stats["h2d_bytes"], "policy": dict(plan.activation_policy),
                     "evictions": stats["num_evictions"], "strict": strict.enabled()}
    return out


def _check(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        for name, r in out.items():
            assert r["rel"] < 1e-5, f"rank {rank} {name}: parameters rel L2 {r['rel']:.2e}"
            assert r["policy"] == POLICIES[name], f"rank {rank} {name}: plan records {r['policy']}"
            assert r["strict"] and r["evictions"] > 0
        keep = out["keep"]
        for name in ("recompute", "offload", "mixed"):
            assert out[name]["act_peak"] < keep["act_peak"], \
                f"rank {rank}: activation peak {name} {out[name]['act_peak']} >= keep {keep['act_peak']}"
        # offloaded activations leave the device and come back: counted both ways on top of the chunk traffic
        assert out["offload"]["d2h"] > keep["d2h"] and out["offload"]["h2d"] > keep["h2d"]
        assert out["mixed"]["d2h"] > keep["d2h"]
        assert out["recompute"]["d2h"] == keep["d2h"]


def test_policies_match_pytorch_one_rank():
    _check([_run_all(0, 1)])


def test_policies_match_pytorch_two_ranks():
    _check(run_distributed(_run_all, 2, timeout_s=300))


def test_offload_bytes_leave_the_device_and_come_back():
    """Every byte offloaded in forward is copied back in backward (one batch per block); what moves is what
    the profiler measured (a buffer saved twice, or two views of it, moves once)."""
    from hf_elixir.profiler import profile_step

    profiled = profile_step(tiny_model("gpt2"), rank_batch("gpt2", 0, 0, 1, ROWS), device="cpu")
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()),
                                   hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, activation_policy="offload"))
    before = hf_elixir.memory_stats(model)
    loss = model(**rank_batch("gpt2", 0, 0, 1, ROWS)).loss
    mid = hf_elixir.memory_stats(model)
    offloaded = mid["d2h_bytes"] - before["d2h_bytes"]
    assert offloaded == sum(profiled.block_activation_bytes.values()) > 0
    opt.backward(loss)
    after = hf_elixir.memory_stats(model)
    assert after["h2d_bytes"] - mid["h2d_bytes"] == offloaded


def test_old_plan_bool_loads_as_uniform_policy(tmp_path):
    old = {"model_type": "gpt2", "activation_checkpointing": True}
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps(old))
    plan = ElixirPlan.load(path)
    assert plan.activation_policy == {}
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(plan=plan))
    assert hf_elixir.get_state(model).plan.activation_policy == {b: "recompute" for b in BLOCKS}
    assert all(model.transformer.h[i].gradient_checkpointing for i in range(2))
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(
        plan=ElixirPlan(model_type="gpt2", activation_checkpointing=False)))
    assert hf_elixir.get_state(model).plan.activation_policy == {b: "keep" for b in BLOCKS}


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_plan_policy_round_trip(tmp_path, suffix):
    plan = ElixirPlan(model_type="gpt2", activation_policy={"transformer.h.0": "offload",
                                                            "transformer.h.1": "recompute"})
    plan.save(tmp_path / f"plan{suffix}")
    assert ElixirPlan.load(tmp_path / f"plan{suffix}") == plan


def test_plan_policy_validated():
    with pytest.raises(ValueError, match=r"activation_policy\['transformer.h.0'\]='swap'"):
        ElixirPlan(activation_policy={"transformer.h.0": "swap"})
    with pytest.raises(TypeError, match="activation_policy"):
        ElixirPlan(activation_policy=["transformer.h.0"])


def test_config_policy_validated_and_named():
    with pytest.raises(ValueError, match=r"activation_policy='recomput'.*Did you mean 'recompute'"):
        hf_elixir.ElixirConfig(activation_policy="recomput")
    with pytest.raises(ValueError, match=r"activation_policy\['transformer.h.\*'\]='swap'"):
        hf_elixir.ElixirConfig(activation_policy={"transformer.h.*": "swap"})
    with pytest.raises(TypeError, match="activation_policy=3"):
        hf_elixir.ElixirConfig(activation_policy=3)
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match=r"activation_policy\['decoder.layers.\*'\] matches no block"):
        hf_elixir.prepare(model, None, hf_elixir.ElixirConfig(activation_policy={"decoder.layers.*": "offload"}))
    assert not hasattr(model, "_elixir_state") and not model.transformer.h[0].gradient_checkpointing
    plan = ElixirPlan(model_type="gpt2", activation_policy={"transformer.h.7": "keep"})
    with pytest.raises(ValueError, match=r"names blocks this model lacks: \['transformer.h.7'\]"):
        hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(plan=plan))


def test_user_globs_first_match_wins_over_plan():
    plan = ElixirPlan(model_type="gpt2", activation_policy={b: "recompute" for b in BLOCKS})
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(
        plan=plan, activation_policy={"transformer.h.1": "offload", "transformer.h.*": "keep"}))
    assert hf_elixir.get_state(model).plan.activation_policy == {"transformer.h.0": "keep",
                                                                  "transformer.h.1": "offload"}
    assert transformer_blocks(model) == BLOCKS


def test_measured_activation_peak_within_the_cost_model():
    """The activations the pool measures under keep and offload stay within what the search priced
    (``search._cost.activation_bytes``): restored blocks give their bytes back once their backward ends."""
    from hf_elixir.profiler import profile_step
    from hf_elixir.search._cost import activation_bytes

    sample = rank_batch("gpt2", 0, 0, 1, ROWS)
    profile = profile_step(tiny_model("gpt2"), sample, device="cpu")
    for name in ("keep", "offload", "mixed"):
        model = tiny_model("gpt2")
        model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), hf_elixir.ElixirConfig(
            chunk_size_numel=CHUNK, activation_policy=POLICIES[name]))
        opt.backward(model(**sample).loss)
        measured = hf_elixir.memory_stats(model)["activation_peak_bytes"]
        predicted = activation_bytes(profile, "fp32", POLICIES[name])
        assert measured <= predicted, f"{name}: measured {measured} > predicted {predicted}"
        if name == "keep":
            assert measured == predicted


def test_user_checkpointing_recorded_and_overridable():
    model = tiny_model("gpt2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    func = model.transformer.h[0]._gradient_checkpointing_func
    model, _ = hf_elixir.prepare(model, None, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    assert hf_elixir.get_state(model).plan.activation_policy == POLICIES["recompute"]
    assert model.transformer.h[0]._gradient_checkpointing_func is func  # the user's function is kept
    model = tiny_model("gpt2")
    model.gradient_checkpointing_enable()
    model, _ = hf_elixir.prepare(model, None, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, activation_policy={"transformer.h.1": "keep"}))
    assert hf_elixir.get_state(model).plan.activation_policy == {"transformer.h.0": "recompute",
                                                                  "transformer.h.1": "keep"}
    assert model.transformer.h[0].gradient_checkpointing and not model.transformer.h[1].gradient_checkpointing


@pytest.mark.parametrize("kind", ["opt", "switch"])
def test_mixed_policy_matches_pytorch_opt_and_switch(kind):
    """OPT decoder layers and Switch encoder/decoder blocks (MoE experts inside): the first block offloaded,
    the rest recomputed, against plain PyTorch."""
    from tests._models import batch

    ref = tiny_model(kind)
    ref_opt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    model = tiny_model(kind)
    blocks = transformer_blocks(model)
    policy = {b: "offload" if i == 0 else "recompute" for i, b in enumerate(blocks)}
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK,
                                                                      activation_policy=policy))
    for step in range(2):
        ref(**batch(kind, step, ROWS)).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(model(**batch(kind, step, ROWS)).loss)
        opt.step()
        opt.zero_grad()
    assert len(blocks) == (2 if kind == "opt" else 4)
    assert rel_l2(_state(model), _state(ref)) < 1e-5
    assert hf_elixir.memory_stats(model)["d2h_bytes"] > 0


class _Stack(torch.nn.Module):
    """A plain (non-Hugging Face) model: its blocks get their forward wrapped for recompute."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)) for _ in range(3))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).pow(2).mean()


def test_plain_module_blocks_recompute_and_offload():
    ref = _Stack()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = _Stack()
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), hf_elixir.ElixirConfig(
        chunk_size_numel=1024, activation_policy={"blocks.0": "offload", "blocks.1": "recompute"}))
    assert hf_elixir.get_state(model).plan.activation_policy == {"blocks.0": "offload", "blocks.1": "recompute",
                                                                  "blocks.2": "keep"}
    assert "forward" in vars(model.blocks[1]) and "forward" not in vars(model.blocks[2])
    calls = {1: 0, 2: 0}
    for i in calls:
        model.blocks[i][0].register_forward_hook(lambda *a, _i=i: calls.__setitem__(_i, calls[_i] + 1))
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(model(x))
        opt.step()
        opt.zero_grad()
    assert calls == {1: 6, 2: 3}  # the recomputed block ran its forward again in each backward
    assert rel_l2(_state(model), _state(ref)) < 1e-5
    with torch.no_grad():  # eval and no-grad forwards run the blocks as they are
        model.eval()
        assert torch.allclose(model(torch.ones(2, 16)), ref.eval()(torch.ones(2, 16)), atol=1e-6)
