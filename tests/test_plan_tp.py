"""The planner prices tensor parallelism ([Note: tensor parallel pricing] in ``hf_elixir/search/_tensor_parallel.py``):
one rank's split weights and matmuls, every chunk sharded over the data-parallel group, the split layers'
all-reduces and all-gathers; the report names the mesh. Pure arithmetic on meta-device configs (no step runs)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from hf_elixir.config import ElixirConfig
from hf_elixir.placement import resolve_placements
from hf_elixir.profiler import HardwareProfile, profile_step
from hf_elixir.profiler._gpu_presets import preset_hardware
from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch
from hf_elixir.search import Knobs, build_chunked_step, predict, search, search_tensor_parallel
from hf_elixir.search._expert_parallel import expert_parallel_profile
from hf_elixir.search._memory_cost import fixed_memory
from hf_elixir.search._tensor_parallel import (SPLIT_PLACEMENTS, collective_bytes, tensor_parallel_collectives,
                                               tensor_parallel_degrees, tensor_parallel_profile)

TiB = 2**40
_FAST = dict(num_chunk_sizes=1, grid_points=4, refine_starts=0, prefetch_depths=(0,), max_alternatives=8)


def _h100(world_size: int, host_bytes: int) -> HardwareProfile:
    """The H100 preset over fixed host-side rates (nothing measured here, so every run prices the same)."""
    base = HardwareProfile(hostname="test", host_total_bytes=host_bytes, host_available_bytes=host_bytes,
                           host_adam_numel_per_s=1.5e9, hook_event_s=2e-5, onload_fixed_s=1e-4, optim_tensor_s=5e-6)
    return preset_hardware("h100", base, world_size=world_size)


def _tiny_llama(batch: int = 2, seq: int = 8):
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1)
    model, batch_ = meta_model_and_batch(config, batch_size=batch, seq_len=seq, dtype=torch.bfloat16)
    return model, profile_step(model, batch_, device="meta")


def _split_numel(model, placements) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if placements.get(n.rsplit(".", 1)[0]) in SPLIT_PLACEMENTS)


def test_collective_bytes_match_a_hand_count():
    model, profile = _tiny_llama(batch=2, seq=8)
    assert (profile.tokens, profile.hidden_size) == (16, 32)
    placements = resolve_placements(model, ElixirConfig(tensor_parallel_size=2))
    hw = _h100(2, TiB)
    th = 16 * 32 * 4  # one fp32 activation of every token, H wide
    # ring all-reduce over 2 ranks: each sends 2 (tp - 1) / tp = 1 of it; all-gather (tp - 1) / tp = 1/2
    assert collective_bytes(16 * 32, 4, 2, "all_reduce") == th and collective_bytes(16 * 32, 4, 2, "all_gather") == th // 2
    assert collective_bytes(16 * 32, 4, 1, "all_reduce") == 0
    assert collective_bytes(16 * 32, 2, 4, "all_reduce") == 2 * 16 * 32 * 2 * 3 // 4
    with pytest.raises(ValueError, match="kind="):
        collective_bytes(16, 4, 2, "reduce")
    # per layer: forward o_proj and down_proj all-reduce their output; backward q/k/v/gate/up their input gradient;
    # embed_tokens (vocabulary rows) all-reduces its lookups; lm_head gathers its 128-wide logits and all-reduces its
    # input gradient
    hand = 2 * 7 * th + th + 16 * 128 * 4 // 2 + th
    rank = tensor_parallel_profile(profile, 2, placements)
    for gpus_per_node, across in ((8, False), (1, True)):
        seconds, sent = tensor_parallel_collectives(rank, rank.events, 2, placements, "fp32", hw, gpus_per_node)
        assert sent == hand
        assert sum(seconds) == pytest.approx(hand / hw.link_rate(across_nodes=across), rel=1e-9)
    step = build_chunked_step(profile, 16384, world_size=2, precision="fp32", hardware=hw, tensor_parallel_size=2,
                              tensor_parallel_placements=placements)
    assert step.tensor_parallel_bytes == hand and step.tensor_parallel_size == 2
    # a recomputed block sends its two forward all-reduces again
    ckpt = build_chunked_step(profile, 16384, world_size=2, precision="fp32", hardware=hw, tensor_parallel_size=2,
                              tensor_parallel_placements=placements, activation_checkpointing=True)
    assert ckpt.tensor_parallel_bytes == hand + 2 * 2 * th
    assert build_chunked_step(profile, 16384, world_size=2, precision="fp32", hardware=hw).tensor_parallel_bytes == 0
    with pytest.raises(ValueError, match="tensor_parallel_placements"):
        build_chunked_step(profile, 16384, world_size=2, precision="fp32", hardware=hw, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="must divide world_size"):
        build_chunked_step(profile, 16384, world_size=3, precision="fp32", hardware=hw, tensor_parallel_size=2,
                           tensor_parallel_placements=placements)


def test_tensor_parallel_divides_split_weights_compute_and_activations_per_rank():
    model, profile = _tiny_llama()
    placements = resolve_placements(model, ElixirConfig(tensor_parallel_size=2))
    split = _split_numel(model, placements)
    total = profile.num_params
    assert 0 < split < total  # the norms stay whole
    hw = _h100(4, TiB)
    zero = build_chunked_step(profile, 16384, world_size=4, precision="bf16", hardware=hw)
    tp2 = build_chunked_step(profile, 16384, world_size=4, precision="bf16", hardware=hw, tensor_parallel_size=2,
                             tensor_parallel_placements=placements)
    # one rank holds half of every split weight and all of the rest, every chunk sharded over the 2 data-parallel
    # ranks of its tensor-parallel position (parallel/_groups.py: dp_group)
    assert sum(tp2.trained_numels) == split // 2 + (total - split)
    assert tp2.chunk_world_sizes == [2] * tp2.num_chunks
    assert sum(n / tp2.group_size(c) for c, n in enumerate(tp2.trained_numels)) == split / 4 + (total - split) / 2
    for step in (zero, tp2):  # every chunk on the host: bf16 shard + 16 B of fp32 state per shard element
        assert fixed_memory(step, Knobs())[1] == 18 * sum(step.shard_numel(c) for c in range(step.num_chunks))
    # the split matmuls' FLOPs halve; nothing else changes
    rank = tensor_parallel_profile(profile, 2, placements)
    matmul = {"column", "row", "column_gather", "row_split"}
    for e, r in zip(profile.events, rank.events):
        assert r.flops == (e.flops / 2 if placements.get(e.module) in matmul else e.flops)
    assert rank.forward_flops < profile.forward_flops
    # the attention and MLP internals' saved activations halve; the norms' and the column inputs' stay
    assert tp2.activation_bytes < zero.activation_bytes
    block = "model.layers.0"
    for fqn in ("model.layers.0.self_attn", "model.layers.0.mlp.down_proj"):
        assert rank.module_activation_bytes[fqn] == profile.module_activation_bytes[fqn] - (
            profile.module_activation_bytes[fqn] - profile.module_activation_bytes[fqn] // 2)
    for fqn in ("model.layers.0.input_layernorm", "model.layers.0.self_attn.q_proj"):
        assert rank.module_activation_bytes[fqn] == profile.module_activation_bytes[fqn]
    dropped = profile.block_activation_bytes[block] - rank.block_activation_bytes[block]
    assert dropped == sum(profile.module_activation_bytes[f] - rank.module_activation_bytes[f]
                          for f in profile.module_activation_bytes if f.startswith(block + "."))
    # at tp = world size every chunk is whole on its rank: no all-gather, no reduce-scatter
    # (the placements are the same mapping at any degree; the pricing does not check the heads)
    tp4 = build_chunked_step(profile, 16384, world_size=4, precision="bf16", hardware=hw, tensor_parallel_size=4,
                             tensor_parallel_placements=placements)
    pred = predict(tp4, Knobs(), hw, pool_bytes=2**30, activations_on_device=False)
    assert tp4.chunk_world_sizes == [1] * tp4.num_chunks
    assert pred.allgather_bytes == pred.reduce_scatter_bytes == 0 and pred.tensor_parallel_bytes > 0
    assert tensor_parallel_degrees(8, 8, (4, 2)) == (1, 2) and tensor_parallel_degrees(16, 8) == (1, 2, 4, 8)
    assert tensor_parallel_degrees(8, 4, (32, 8)) == (1, 2, 4)


def test_parallelized_profile_priced_as_the_same_rank():
    """A model already rewritten by ``parallelize`` is profiled as one rank's step (``prepare(search="auto")``):
    priced with ``parallelized=True`` it gives the step the full profile gives at that degree."""
    model, profile = _tiny_llama()
    placements = resolve_placements(model, ElixirConfig(tensor_parallel_size=2))
    hw = _h100(4, TiB)
    kwargs = dict(world_size=4, precision="bf16", hardware=hw, tensor_parallel_size=2,
                  tensor_parallel_placements=placements)
    full = build_chunked_step(profile, 16384, **kwargs)
    rank = build_chunked_step(tensor_parallel_profile(profile, 2, placements), 16384, parallelized=True, **kwargs)
    for field in ("chunk_numels", "chunk_world_sizes", "trained_numels", "event_compute_s", "activation_bytes",
                  "tensor_parallel_bytes", "collective_rates"):
        assert getattr(rank, field) == getattr(full, field), field
    from tests.test_plan_moe import _tiny_mixtral

    _, moe = _tiny_mixtral()
    full = build_chunked_step(moe, 16384, world_size=4, precision="bf16", hardware=hw, expert_parallel_size=2)
    rank = build_chunked_step(expert_parallel_profile(moe, 2)[0], 16384, world_size=4, precision="bf16", hardware=hw,
                              expert_parallel_size=2, parallelized=True)
    for field in ("chunk_numels", "chunk_world_sizes", "alltoall_bytes", "event_compute_s"):
        assert getattr(rank, field) == getattr(full, field), field


def test_llama_8b_8xh100_tensor_parallel_2_against_1():
    """Llama-3.1-8B on 8 x H100: at tensor parallel 2 a rank holds half the weights (all but the norms are split),
    computes half the matmuls of the same micro-batch and sends the split layers' collectives; the report names
    the mesh, the device rows add up to the peak and the peak fits the budget."""
    model, batch = meta_model_and_batch(load_config("llama-3.1-8b"), batch_size=1, seq_len=2048, dtype=torch.bfloat16)
    profile = profile_step(model, batch, device="meta")
    hw = _h100(8, TiB)
    placements = resolve_placements(model, ElixirConfig(tensor_parallel_size=2))
    kwargs = dict(world_size=8, precision="bf16", host_memory_bytes=TiB, ranks_per_host=8, data_parallel="sharded",
                  device_memory_budget_bytes=hw.device_total_bytes, **_FAST)
    one = search(profile, hw, **kwargs)
    two = search(profile, hw, tensor_parallel_size=2, tensor_parallel_placements=placements, **kwargs)
    split = _split_numel(model, placements)
    assert two.plan.num_params == split // 2 + (profile.num_params - split) < 0.51 * one.plan.num_params
    assert one.best.prediction.tensor_parallel_bytes == 0 < two.best.prediction.tensor_parallel_bytes
    assert two.best.tensor_parallel_size == 2 and "tp=2" in two.best.summary()
    assert two.best.prediction.compute_s < one.best.prediction.compute_s
    assert two.best.prediction.step_s < one.best.prediction.step_s  # the same micro-batch over 2 ranks
    assert "tensor parallel 2 x data parallel 4 (8 ranks)" in " ".join(two.plan.reasons)
    assert "data parallel over 8 rank(s)" in " ".join(one.plan.reasons)
    assert any(r.startswith("tensor parallel over 2 ranks") for r in two.plan.reasons)
    limit = 0.95 * hw.device_total_bytes
    for result in (one, two):
        for cand in [result.best] + result.alternatives:
            pred = cand.prediction
            assert sum(pred.peak_breakdown.values()) == pred.device_peak_bytes
            assert min(pred.peak_breakdown.values()) >= 0 and pred.device_peak_bytes <= limit
            assert pred.host_bytes * 8 <= TiB
    # the degrees compared per token of the whole job: a tp = 2 step runs half the micro-batches of a tp = 1 one
    both = search_tensor_parallel(profile, hw, tensor_parallel_sizes=(1, 2),
                                  tensor_parallel_placements=lambda tp: placements, **kwargs)
    per_token = {tp: c.prediction.step_s * tp for tp, c in both.best_by_tensor_parallel.items()}
    assert both.best.tensor_parallel_size == min(per_token, key=per_token.get)
    assert any(r.startswith(f"tensor parallel {both.best.tensor_parallel_size} wins") for r in both.plan.reasons)


def test_plan_command_tensor_parallel(tmp_path, capsys, monkeypatch):
    """``hf-elixir plan --tensor-parallel-size 2`` prices and reports the mesh; ``auto`` tries the degrees that divide
    the heads and records the winner's placements."""
    from hf_elixir.cli import main
    from hf_elixir.plan import ElixirPlan
    from tests._models import fixed_cpu_hardware

    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", lambda *a, **k: fixed_cpu_hardware())
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 1,
        "max_position_embeddings": 256}))
    argv = ["plan", "--model", str(config), "--gpu", "h100", "--num-gpus", "4", "--gpu-memory", "8MiB",
            "--host-memory", "1GiB", "--batch-size", "2", "--seq-len", "64", "--output"]
    assert main(argv + [str(tmp_path / "tp2.json"), "--tensor-parallel-size", "2"]) == 0
    text = capsys.readouterr().out
    plan = ElixirPlan.load(tmp_path / "tp2.json")
    assert "tensor parallel 2 x data parallel 2 (4 ranks)" in " ".join(plan.reasons)
    assert "Run tensor parallel 2 x expert parallel 1 x data parallel 2" in text and "TP x EP" in text
    assert plan.placements["model.layers.0.self_attn.o_proj"] == "row"
    assert main(argv + [str(tmp_path / "auto.json"), "--tensor-parallel-size", "auto"]) == 0
    capsys.readouterr()
    plan = ElixirPlan.load(tmp_path / "auto.json")
    won = [r for r in plan.reasons if " wins per token: predicted " in r and r.startswith("tensor parallel")]
    assert len(won) == 1 and "tensor parallel 4" not in won[0]  # 4 does not divide the 2 key/value heads
    tp = int(won[0].split()[2])
    assert plan.placements["model.layers.0.self_attn.o_proj"] == ("row" if tp > 1 else "sharded")
    assert main(argv + [str(tmp_path / "bad.json"), "--tensor-parallel-size", "two"]) == 2  # argparse's error line
    assert "'two' is not a whole number" in capsys.readouterr().err


def _auto_on_parallelized(rank: int, world_size: int) -> dict:
    """``prepare(search="auto")`` on models rewritten by ``parallelize``: Llama at tensor parallel 2, Mixtral at
    expert parallel 2; what each searched plan says, and one step's loss."""
    import hf_elixir
    from hf_elixir.parallel import parallelize
    from tests.test_plan_moe import _tiny_mixtral

    out = {}
    for name, make, cfg in (
            ("tp", lambda: _tiny_llama()[0], dict(tensor_parallel_size=2)),
            ("ep", lambda: _tiny_mixtral()[0], dict(expert_parallel_size=2))):
        torch.manual_seed(0)
        meta = make()
        model = type(meta)(meta.config)  # the same config, on the CPU
        config = hf_elixir.ElixirConfig(search="auto", device_memory_budget_bytes=64 * 2**20, **cfg)
        parallelize(model, config)
        ids = torch.randint(0, 128, (2, 8))
        batch = {"input_ids": ids, "labels": ids}
        model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config,
                                       sample_batch=batch)
        loss = model(**batch).loss
        opt.backward(loss)
        opt.step()
        plan = hf_elixir.get_state(model).plan
        out[name] = {"reasons": plan.reasons, "world_size": plan.world_size, "loss": float(loss)}
    return out


def test_prepare_search_auto_prices_the_parallelized_model():
    """A model rewritten by ``parallelize`` is priced at its mesh's tensor/expert-parallel sizes (it was priced as
    plain data parallel: "data parallel over 2 rank(s)", no collectives of its own)."""
    from tests._dist import run_distributed

    results = run_distributed(_auto_on_parallelized, 2)
    for rank in results:
        tp, ep = rank["tp"], rank["ep"]
        assert "tensor parallel 2 x data parallel 1 (2 ranks)" in " ".join(tp["reasons"]), tp["reasons"]
        assert any(r.startswith("tensor parallel over 2 ranks") for r in tp["reasons"])
        assert any(r.startswith("expert parallel over 2 ranks") for r in ep["reasons"]), ep["reasons"]
        assert tp["world_size"] == ep["world_size"] == 2
        assert torch.isfinite(torch.tensor([tp["loss"], ep["loss"]])).all()
