"""The planner prices tensor and expert parallel together ([Note: tp x ep pricing] in
``hf_elixir/search/_expert_parallel.py``): each rank's chunks over the dense and the expert data-parallel groups of
the tp x ep mesh, the all-to-alls of the rank's slice of the tokens, and ``search_parallel`` (``hf-elixir plan
--tensor-parallel-size auto``) tries the (tp, ep) pairs beside tp and ep alone."""

from __future__ import annotations

import pytest
import torch

from hf_elixir.config import ElixirConfig
from hf_elixir.placement import resolve_placements
from hf_elixir.profiler import profile_step
from hf_elixir.search import build_chunked_step, search, search_parallel
from hf_elixir.search._degree_search import tensor_expert_pairs
from tests._moe_models import moe_config
from tests.test_plan_moe import _FAST, TiB, _h100


def _tiny(family: str = "qwen3_moe", dtype=torch.float32):
    from hf_elixir.profiler._model_zoo import meta_model_and_batch

    model, batch = meta_model_and_batch(moe_config(family), batch_size=2, seq_len=12, dtype=dtype)
    return model, batch, profile_step(model, batch, device="meta")


def _placements(model, tp: int, ep: int) -> dict:
    return resolve_placements(model, ElixirConfig(tensor_parallel_size=tp, expert_parallel_size=ep))


@pytest.mark.parametrize("world,tp,ep", [(4, 2, 2), (8, 2, 4)])
def test_chunks_are_priced_over_the_dense_and_expert_groups(world, tp, ep):
    model, _, profile = _tiny()
    hw = _h100(world, TiB)
    step = build_chunked_step(profile, 4096, world_size=world, precision="fp32", hardware=hw, expert_parallel_size=ep,
                              tensor_parallel_size=tp, tensor_parallel_placements=_placements(model, tp, ep))
    assert set(step.chunk_world_sizes) == {world // tp, world // ep}
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    expert_chunks = [c for c in range(step.num_chunks) if step.group_size(c) == world // ep]
    if world // ep != world // tp:  # the expert chunks hold 1 / ep of the experts, over world / ep ranks
        assert sum(step.trained_numels[c] for c in expert_chunks) * ep == experts
    alone = build_chunked_step(profile, 4096, world_size=world, precision="fp32", hardware=hw, expert_parallel_size=ep)
    # the tp ranks of a row split their tokens before the dispatch: 1 / tp of the all-to-all bytes
    assert step.alltoall_bytes * tp == pytest.approx(alone.alltoall_bytes, rel=0.02)
    assert step.tensor_parallel_bytes > 0


def test_runtime_shards_match_the_priced_state_per_rank(tmp_path_factory):
    """The model state one rank holds under tp=2 x ep=2 at 4 ranks: the runtime's chunk shards
    (``tests/test_tp_ep.py``'s run, split fused experts, chunks of 4096) against ``build_chunked_step`` at the same degrees and chunk size,
    within 5% (measured 11488 elements a rank against 11128 priced: padding, the runtime packs each expert of a split
    fused tensor on its own)."""
    from tests.test_tp_ep import _results

    model, _, profile = _tiny()
    step = build_chunked_step(profile, 4096, world_size=4, precision="fp32", hardware=_h100(4, TiB),
                              expert_parallel_size=2, tensor_parallel_size=2,
                              tensor_parallel_placements=_placements(model, 2, 2))
    priced = sum(step.shard_numel(c) for c in range(step.num_chunks))
    for m in _results(tmp_path_factory)["qwen3_moe_none"]:
        assert m["chunk_group_sizes"] == [2]
        assert m["shard_numel"] == pytest.approx(priced, rel=0.05), (m["shard_numel"], priced)


def test_search_prices_a_tp_x_ep_plan():
    model, batch, _ = _tiny(dtype=torch.bfloat16)
    result = search(model, _h100(4, TiB), world_size=4, sample_batch=batch, precision="bf16", tensor_parallel_size=2,
                    expert_parallel_size=2, device_memory_budget_bytes=8 << 20, **_FAST)
    best = result.best
    assert (best.tensor_parallel_size, best.expert_parallel_size) == (2, 2)
    assert best.prediction.alltoall_bytes > 0 and best.prediction.tensor_parallel_bytes > 0
    with pytest.raises(ValueError, match="not a multiple of tensor_parallel_size=2"):
        search(model, _h100(6, TiB), world_size=6, sample_batch=batch, precision="bf16", tensor_parallel_size=2,
               expert_parallel_size=3, **_FAST)


def test_plan_search_tries_the_tp_x_ep_pairs():
    model, batch, profile = _tiny(dtype=torch.bfloat16)
    assert tensor_expert_pairs(profile, 8, (1, 2, 4), (1, 4)) == ((2, 2), (2, 4), (4, 4))
    assert tensor_expert_pairs(profile, 4, (1, 2), (1, 4)) == ((2, 2), (2, 4))
    result = search_parallel(model, _h100(4, TiB), world_size=4, heads=(4, 2), sample_batch=batch, precision="bf16",
                             device_memory_budget_bytes=8 << 20, **_FAST)
    assert set(result.best_by_tensor_expert_parallel) == {(2, 2), (2, 4)}
    for pair, got in result.best_by_tensor_expert_parallel.items():  # priced, or pruned as slower per token
        assert not isinstance(got, str) or got.startswith("pruned:"), (pair, got)


def test_plan_command_plans_a_tp_x_ep_pair(tmp_path, capsys, monkeypatch):
    """``hf-elixir plan --tensor-parallel-size 2 --expert-parallel-size 2`` on a MoE config prices that pair and
    records both kinds of placement; a pair that does not lay out the GPUs is refused, naming the valid pairs."""
    from hf_elixir.cli import main
    from hf_elixir.plan import ElixirPlan
    from tests._models import fixed_cpu_hardware

    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", lambda *a, **k: fixed_cpu_hardware())
    moe_config("qwen3_moe").save_pretrained(tmp_path / "tiny")
    argv = ["plan", "--model", str(tmp_path / "tiny" / "config.json"), "--gpu", "h100", "--gpu-memory", "8MiB",
            "--host-memory", "1GiB", "--batch-size", "2", "--seq-len", "32", "--tensor-parallel-size", "2"]
    assert main(argv + ["--num-gpus", "4", "--expert-parallel-size", "2", "--output", str(tmp_path / "p.json")]) == 0
    assert "Run tensor parallel 2 x expert parallel 2 x data parallel 2" in capsys.readouterr().out
    plan = ElixirPlan.load(tmp_path / "p.json")
    assert plan.placements["model.layers.0.mlp.experts"] == "expert"
    assert plan.placements["model.layers.0.self_attn.o_proj"] == "row"
    assert main(argv + ["--num-gpus", "6", "--expert-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "expert_parallel_size=3 is not a multiple of tensor_parallel_size=2" in err and "(tp=2, ep=2)" in err
