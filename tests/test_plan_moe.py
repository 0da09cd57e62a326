"""The planner prices MoE models: expert parallelism in the cost model and the search ([Note: expert parallel
pricing] in ``hf_elixir/search/_expert_parallel.py``), rank-local host copies priced only where they fit, and plan
device rows that add up to the peak. Pure arithmetic on meta-device configs (no step runs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import MixtralConfig

from hf_elixir.profiler import HardwareProfile, profile_step, static_profile
from hf_elixir.profiler._gpu_presets import preset_hardware
from hf_elixir.profiler._model_zoo import BUILTIN_MODELS, load_config, meta_model_and_batch
from hf_elixir.search import (Knobs, alltoall_bytes_per_layer, build_chunked_step, expert_parallel_degrees, predict,
                              search, search_expert_parallel)
from hf_elixir.search._memory_cost import fixed_memory

TiB = 2**40


def _h100(world_size: int, host_bytes: int) -> HardwareProfile:
    """The H100 preset over fixed host-side rates (nothing measured here, so every run prices the same)."""
    base = HardwareProfile(hostname="test", host_total_bytes=host_bytes, host_available_bytes=host_bytes,
                           host_adam_numel_per_s=1.5e9, hook_event_s=2e-5, onload_fixed_s=1e-4, optim_tensor_s=5e-6)
    return preset_hardware("h100", base, world_size=world_size)


def _tiny_mixtral(batch: int = 2, seq: int = 8):
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           bos_token_id=0, eos_token_id=1)
    model, batch_ = meta_model_and_batch(config, batch_size=batch, seq_len=seq, dtype=torch.bfloat16)
    return model, profile_step(model, batch_, device="meta")


_FAST = dict(num_chunk_sizes=1, grid_points=4, refine_starts=0, prefetch_depths=(0,), max_alternatives=8)


def test_alltoall_bytes_match_a_hand_count():
    model, profile = _tiny_mixtral(batch=2, seq=8)
    layers = profile.moe_layers
    assert sorted(layers) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert layers["model.layers.0.mlp.experts"] == {"num_experts": 4, "top_k": 2, "hidden_size": 32, "tokens": 16,
                                                     "fused": 1}
    # per layer per step: 4 all-to-alls (dispatch + combine, forward and backward) of 16 tokens x 2 choices x
    # 32 fp32 values, of which the half routed to this rank's own experts stays at ep = 2
    hand = 4 * (16 * 2 * 32 * 4) // 2
    assert alltoall_bytes_per_layer(16, 2, 32, 4, 2) == hand == 8192
    assert alltoall_bytes_per_layer(16, 2, 32, 4, 1) == 0
    assert alltoall_bytes_per_layer(16, 2, 32, 2, 4) == 4 * 16 * 2 * 32 * 2 * 3 // 4
    with pytest.raises(ValueError, match="top_k=0"):
        alltoall_bytes_per_layer(16, 0, 32, 4, 2)
    hw = _h100(2, TiB)
    dense = build_chunked_step(profile, 16384, world_size=2, precision="fp32", hardware=hw)
    for gpus_per_node, across in ((8, False), (1, True)):  # the group within a node, or across the network
        moe = build_chunked_step(profile, 16384, world_size=2, precision="fp32", hardware=hw, expert_parallel_size=2,
                                 gpus_per_node=gpus_per_node)
        assert moe.alltoall_bytes == 2 * hand  # two MoE layers
        extra = sum(moe.event_compute_s) - sum(dense.event_compute_s)
        assert extra == pytest.approx(2 * hand / hw.link_rate(across_nodes=across), rel=1e-9)
    assert hw.link_rate(True) < hw.link_rate(False)
    # recomputed forwards (activation checkpointing) send their dispatch and combine again: 6 per layer
    recomputed = build_chunked_step(profile, 16384, world_size=2, precision="fp32", hardware=hw,
                                    expert_parallel_size=2, activation_checkpointing=True)
    assert recomputed.alltoall_bytes == 2 * hand * 3 // 2
    assert dense.alltoall_bytes == 0 and dense.chunk_world_sizes == []


def test_expert_parallel_divides_expert_state_per_rank():
    model, profile = _tiny_mixtral()
    expert_numel = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    hw = _h100(4, TiB)

    zero = build_chunked_step(profile, 16384, world_size=4, precision="bf16", hardware=hw)
    ep2 = build_chunked_step(profile, 16384, world_size=4, precision="bf16", hardware=hw, expert_parallel_size=2)
    assert expert_parallel_degrees(profile, 4) == (1, 4) and expert_parallel_degrees(profile, 6) == (1, 2)
    held = [c for c in range(ep2.num_chunks) if ep2.group_size(c) == 2]  # the expert chunks: over 4 / 2 ranks
    assert held and all(ep2.group_size(c) == 4 for c in range(ep2.num_chunks) if c not in held)
    # a rank holds half the experts: half the expert elements in its chunks, sharded over the other 2 ranks
    assert sum(ep2.trained_numels[c] for c in held) * 2 == expert_numel
    assert sum(ep2.shard_numel(c) for c in held) * 2 == sum(ep2.chunk_numels[c] for c in held)
    # the experts' state per rank: (E / ep experts) / (4 / ep ranks) = 1 / 4 of it, as under ZeRO alone
    assert sum(ep2.trained_numels[c] for c in held) / ep2.group_size(held[0]) == expert_numel / 4
    # every chunk on the host: bf16 shard + 16 B of fp32 state per shard element, each chunk over its own group;
    # the model's state per rank (padding aside) is the same 1 / 4 of it as under ZeRO alone
    for step in (zero, ep2):
        assert fixed_memory(step, Knobs())[1] == 18 * sum(step.shard_numel(c) for c in range(step.num_chunks))
    assert (sum(n / ep2.group_size(c) for c, n in enumerate(ep2.trained_numels))
            == sum(zero.trained_numels) / 4 == profile.num_params / 4)
    # at ep = world size an expert chunk is whole on its rank: no all-gather, no reduce-scatter, no host copy
    ep4 = build_chunked_step(profile, 16384, world_size=4, precision="bf16", hardware=hw, expert_parallel_size=4)
    whole = [c for c in range(ep4.num_chunks) if ep4.group_size(c) == 1]
    assert sum(ep4.trained_numels[c] for c in whole) * 4 == expert_numel
    pred = predict(ep4, Knobs(), hw, pool_bytes=2**30, activations_on_device=False)
    pred0 = predict(zero, Knobs(), hw, pool_bytes=2**30, activations_on_device=False)
    sharded_bytes = sum(ep4.full_bytes(c) for c in range(ep4.num_chunks) if c not in whole)
    assert pred.reduce_scatter_bytes == sum(ep4.chunk_numels[c] * 4 for c in range(ep4.num_chunks) if c not in whole)
    assert pred.allgather_bytes < pred0.allgather_bytes
    with_copies = fixed_memory(ep4, Knobs(host_copies=True))[1] - fixed_memory(ep4, Knobs())[1]
    assert with_copies == sharded_bytes  # copies of the sharded chunks only
    with pytest.raises(ValueError, match="not divisible"):
        build_chunked_step(profile, 16384, world_size=8, precision="bf16", hardware=hw, expert_parallel_size=8)


def test_mixtral_8xh100_1tib_plan_found():
    """``hf-elixir plan --model mixtral-8x7b --gpu h100 --num-gpus 8 --host-memory 1TiB`` said "no configuration fits
    host memory": every rank kept a rank-local host copy of the whole model (the budget covers activations) next to
    its state. The search now drops copies that do not fit and tries expert parallelism."""
    model, batch = meta_model_and_batch(load_config("mixtral-8x7b"), batch_size=1, seq_len=1024, dtype=torch.bfloat16)
    profile = profile_step(model, batch, device="meta")
    hw = _h100(8, TiB)
    result = search_expert_parallel(profile, hw, world_size=8, precision="bf16", host_memory_bytes=TiB,
                                    ranks_per_host=8, device_memory_budget_bytes=hw.device_total_bytes, **_FAST)
    state_per_rank = 16 * profile.num_params / 8  # 16 B/param of fp32 state (ZeRO-3 over 8), ~87 GiB
    tried = result.best_by_expert_parallel
    assert set(tried) == {1, 8} and all(not isinstance(c, str) for c in tried.values()), tried
    best = result.best
    assert best.prediction.host_bytes <= 1.2 * state_per_rank
    assert best.prediction.host_bytes * 8 <= TiB
    assert best.prediction.device_peak_bytes <= 0.95 * hw.device_total_bytes
    assert result.plan.predicted_step_s == best.prediction.step_s
    ep8 = tried[8]
    assert ep8.prediction.alltoall_bytes > 0 and ep8.whole_chunks  # expert chunks whole on their rank at ep = 8
    assert any("expert parallel" in r for r in result.plan.reasons)


def _builtin_names() -> list[str]:
    seen: dict[int, str] = {}
    for name, cfg in BUILTIN_MODELS.items():
        seen.setdefault(id(cfg), name)
    return sorted(seen.values())


def test_device_rows_add_up_to_the_peak_for_every_builtin():
    """The plan table's device rows (``Prediction.peak_breakdown``: what the device holds at the peak) sum to the
    peak it reports, within the budget, for every built-in model at 2 ranks (8 for the 1T MoE; expert parallel where
    it applies).
    A static trace (module order) stands in for the traced step and every block is recomputed (one activation
    policy): the accounting does not depend on either, and the test stays fast."""
    checked = 0
    for name in _builtin_names():
        model, _ = meta_model_and_batch(load_config(name), batch_size=1, seq_len=64, dtype=torch.bfloat16)
        profile = static_profile(model, tokens=64)
        ranks = 8 if name == "kimi-k2-like" else 2  # a 1T MoE's experts fill more than 2 GPUs: one node of 8
        hw = _h100(ranks, 64 * TiB)
        result = search_expert_parallel(profile, hw, world_size=ranks, precision="bf16", host_memory_bytes=64 * TiB,
                                        device_memory_budget_bytes=hw.device_total_bytes, activation_checkpointing=True,
                                        **dict(_FAST, grid_points=2))
        limit = 0.95 * hw.device_total_bytes
        for cand in [result.best] + result.alternatives:
            pred = cand.prediction
            assert sum(pred.peak_breakdown.values()) == pred.device_peak_bytes, (name, pred.peak_breakdown)
            assert min(pred.peak_breakdown.values()) >= 0, (name, pred.peak_breakdown)
            assert pred.device_peak_bytes <= limit, name
            checked += 1
        assert (len(result.best_by_expert_parallel) == 2) == bool(profile.moe_layers), name
    assert checked > 20


def test_dense_plan_unchanged_by_expert_parallel():
    model, batch = meta_model_and_batch(load_config("gpt2"), batch_size=2, seq_len=128)
    profile = profile_step(model, batch, device="meta")
    hw = _h100(2, TiB)
    kwargs = dict(world_size=2, precision="bf16", device_memory_budget_bytes=2 * 2**30, host_memory_bytes=TiB, **_FAST)
    plain = search(profile, hw, **kwargs)
    through = search_expert_parallel(profile, hw, **kwargs)
    assert list(through.best_by_expert_parallel) == [1]
    assert through.best.summary() == plain.best.summary()
    assert through.best.prediction.step_s == plain.best.prediction.step_s
    assert dataclasses.asdict(through.plan) == dataclasses.asdict(plain.plan)
    size = profile.largest_param_numel
    step = build_chunked_step(profile, size, world_size=2, precision="bf16", hardware=hw)
    assert step.chunk_world_sizes == [] and step.alltoall_bytes == 0 and step.collective_rates == {}
    with pytest.raises(ValueError, match="no MoE layers"):
        build_chunked_step(profile, size, world_size=2, precision="bf16", hardware=hw, expert_parallel_size=2)


def test_forced_host_copies_dropped_where_they_do_not_fit():
    """Under a budget covering activations the runtime keeps a rank-local host copy of every offloadable chunk only
    while they fit the host (``placement.choose_host_copies``); where they do not, it keeps none, and the cost model
    prices that cheaper variant instead of a point no host fits."""
    model, batch = meta_model_and_batch(load_config("gpt2"), batch_size=2, seq_len=128)
    profile = profile_step(model, batch, device="meta")
    hw = _h100(2, TiB)
    step = build_chunked_step(profile, 50_000_000, world_size=2, precision="bf16", hardware=hw)
    copies = predict(step, Knobs(), hw, pool_bytes=2**30, activations_on_device=True)
    _, without, _ = fixed_memory(step, Knobs())
    assert copies.host_bytes > without  # roomy host: the copies are kept and priced
    tight = predict(step, Knobs(), hw, pool_bytes=2**30, activations_on_device=True, host_budget_bytes=without + 1)
    assert tight.host_bytes == without  # priced without them
    # a host that holds the state but not the copies: a plan is found (the search said "no configuration fits")
    host = 2 * (without + (copies.host_bytes - without) // 2)
    result = search(profile, hw, world_size=2, precision="bf16", device_memory_budget_bytes=2**30,
                    host_memory_bytes=host, ranks_per_host=2, data_parallel="sharded", **_FAST)
    assert result.best.prediction.host_bytes * 2 <= host


def test_plan_command_tries_expert_parallel_and_shows_its_degree(tmp_path, capsys, monkeypatch):
    """``hf-elixir plan`` on an MoE config tries expert parallel 1 and the largest degree, shows the winner's
    degree (and each alternative's), records its placements, and ``--expert-parallel-size 1`` keeps ZeRO alone."""
    import json

    from hf_elixir.cli import main
    from hf_elixir.plan import ElixirPlan
    from tests._models import fixed_cpu_hardware

    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", lambda *a, **k: fixed_cpu_hardware())
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "bos_token_id": 0, "eos_token_id": 1, "max_position_embeddings": 256}))
    argv = ["plan", "--model", str(config), "--gpu", "h100", "--num-gpus", "2", "--gpu-memory", "8MiB",
            "--host-memory", "1GiB", "--batch-size", "2", "--seq-len", "64", "--output"]
    assert main(argv + [str(tmp_path / "auto.json")]) == 0
    text = capsys.readouterr().out
    plan = ElixirPlan.load(tmp_path / "auto.json")
    ep = 2 if plan.placements["model.layers.0.mlp.experts"] == "expert" else 1
    assert f"Run tensor parallel 1 x expert parallel {ep} x data parallel 2" in text and "TP x EP" in text
    assert any(r.startswith(f"expert parallel {ep} wins") for r in plan.reasons), plan.reasons
    assert main(argv + [str(tmp_path / "zero.json"), "--expert-parallel-size", "1"]) == 0
    assert "expert parallel 1 wins" not in capsys.readouterr().out.replace("\n", " ")  # one degree, no contest
    assert ElixirPlan.load(tmp_path / "zero.json").placements["model.layers.0.mlp.experts"] == "sharded"
