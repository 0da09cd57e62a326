"""Tensor parallel over dims the ranks do not divide: DTensor's ceil-sized slices, the last rank's shorter.

Two gloo ranks on CPU (TP=2), the four dense families read from their config's plan (Llama, Qwen3, Mistral,
Gemma3 with its lm_head tied to the scaled embedding) with a vocabulary of 255 (128 + 127 rows: the vocabulary-
parallel embedding and the gathered lm_head) and an MLP width of 63 (32 + 31: gate/up column, down row), against
the single-process plain-PyTorch reference (tests/parallel_harness.py: AdamW with weight decay, 5 steps): plain
parallel layers, and ``hf_elixir.prepare`` with a model-data budget of half the 16 B/param state (clipped every
step); each saved with ``save_pretrained`` and reloaded by plain ``from_pretrained``; a streamed load of a folder
into a meta Llama; ``full_gradients`` and ``load_full_state_dict`` (dict and folder); GPT-2's MLP block (width 63);
Llama-4's packed tensor-parallel experts (width 15); ``embedding_column`` / ``row_split`` on uneven slices; a
searched plan (``search="auto"``). Then the single-process part: the slicing rule against DTensor's, the merges and
streamed cuts, and the errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_elixir
from hf_elixir.placement import resolve_placements
from parallel_harness import ODD, PLAN_FAMILIES, UNEVEN_CASES, make_model
from tests._dist import run_distributed
from tests.test_tp_plans import TOL, _check

FULL_GRAD_TOL = 1e-5  # as tests/test_full_gradients.py


def _worker(rank: int, world_size: int, out_dir: str) -> dict:
    import traceback

    from parallel_harness import CASES, make_batch
    from tests.test_full_gradients import _parallel_case

    results = {}
    for case in UNEVEN_CASES:
        try:
            results[case] = CASES[case](out_dir)
        except Exception:  # noqa: BLE001 - reported per case; the other rank raises too
            results[case] = {"error": f"rank {rank}: {traceback.format_exc()}"}
    cfg = hf_elixir.ElixirConfig(tensor_parallel_size=2, chunk_size_numel=4096)
    results["full_gradients_mistral"] = _parallel_case(  # folder read slice by slice, half the state offloaded
        make_model("mistral" + ODD), cfg, [make_batch("mistral" + ODD, 0, 0)], rank, "model.embed_tokens.weight",
        half_budget=True, load_from=f"{out_dir}/mistral_full")
    results["full_gradients_gemma3"] = _parallel_case(  # tied lm_head = embedding, loaded from a dict
        make_model("gemma3" + ODD), cfg, [make_batch("gemma3" + ODD, 0, 0)], rank, "layers.1.mlp.down_proj.weight",
        load_from="dict")
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("uneven")), timeout_s=400)


def _worst(per_rank: list[dict], case: str) -> dict:
    from parallel_harness import _merge

    ms = [r[case] for r in per_rank]
    keys = {k for m in ms for k in m}
    merged = {k: _merge([m[k] for m in ms if k in m]) for k in keys}
    for k in ("params_moved", "num_evictions"):
        if k in merged:
            merged[k] = min(m[k] for m in ms if k in m)
    return merged


@pytest.mark.parametrize("kind", list(PLAN_FAMILIES))
def test_uneven_vocabulary_and_mlp_width_match_pytorch_plain_and_prepared(uneven, kind):
    m = _worst(uneven, f"{kind}{ODD}_tp2")
    _check(m, elixir=False)
    assert {"column", "row", "embedding_row", "column_gather"} <= set(m["placements"].values())
    m = _worst(uneven, f"elixir_{kind}{ODD}_tp2_half")
    _check(m, elixir=True)  # clipped every step; the global norm compared every step
    assert m["num_evictions"] > 0, "half the state must force offload"
    assert m["loss_rel"] < TOL


@pytest.mark.parametrize("kind", list(PLAN_FAMILIES))
@pytest.mark.parametrize("prepared", [False, True])
def test_uneven_save_pretrained_loads_with_plain_from_pretrained(uneven, kind, prepared):
    m = _worst(uneven, f"elixir_{kind}{ODD}_tp2_half" if prepared else f"{kind}{ODD}_tp2")
    assert "error" not in m, m["error"]
    assert m["loaded_keys_match"] and m["loaded_bitwise"] and m["partial_refused"] and m["folder_final"], m
    assert m["logits_rel"] < 1e-5, m


def test_uneven_mlp_block_of_a_registered_spec_matches_pytorch(uneven):
    """GPT-2's spec: the attention block splits by heads (even), its MLP block (``c_fc``/``c_proj``, Conv1D) now
    splits a width of 63 into 32 + 31; saved and reloaded as the others."""
    m = _worst(uneven, f"gpt2{ODD}_tp2")
    _check(m, elixir=False)
    assert m["placements"]["transformer.h.0.mlp.c_fc"] == "column", m["placements"]
    assert m["loaded_keys_match"] and m["loaded_bitwise"] and m["logits_rel"] < 1e-5, m


def test_uneven_packed_experts_match_pytorch(uneven):
    """Llama-4's ``moe_tp_experts``: ``gate_up_proj`` (two packed parts of 15 features: a rank holds gate_r|up_r, 8 + 8
    or 7 + 7) and ``down_proj`` (15 rows: 8 + 7) split unevenly; saved and reloaded (re-interleaved to gate|up)."""
    m = _worst(uneven, f"llama4{ODD}_tp2")
    _check(m, elixir=False)
    assert "moe_tp" in set(m["placements"].values())
    assert m["loaded_keys_match"] and m["loaded_bitwise"] and m["logits_rel"] < 1e-5, m


def test_uneven_streamed_load_reads_each_ranks_slices(uneven):
    """``prepare(meta_model, checkpoint=folder)``: each rank reads its 128 or 127 vocabulary rows and its 32 or 31
    MLP features; bitwise the folder's weights, and a step bitwise the one of the model loaded whole."""
    m = _worst(uneven, f"stream_llama{ODD}_tp2")
    assert "error" not in m, m["error"]
    assert m["was_meta"] and m["same_keys"] and m["stream_bitwise"] and m["step_bitwise"], m
    assert m["read_fraction"] < 0.6, m  # about half: this rank's slices plus the replicated norms


def test_uneven_full_gradients_and_load_full_state_dict(uneven):
    for rank, per_case in enumerate(uneven):
        for case in ("full_gradients_mistral", "full_gradients_gemma3"):
            m = per_case[case]
            where = f"rank {rank} {case}: {m}"
            assert m["same_names"] and m["shapes"] and m["local_shapes"] and m["loaded_exact"] is True, where
            assert m["rel"] < FULL_GRAD_TOL and m["worst"][0] < FULL_GRAD_TOL, where
            assert m["one"][3] < FULL_GRAD_TOL and m["num_sharded"] > 0, where
        rows = per_case["full_gradients_mistral"]["one_local_shape"][0]
        assert rows == (128 if rank == 0 else 127), rows  # the embedding's own uneven slice


def _styles_worker(rank: int, world_size: int) -> dict:
    """``embedding_column`` (hidden 5: 3 + 2), ``row_split`` (input 5: 3 + 2) and ``column_gather`` (output 7: 4 + 3)
    on uneven slices, the styles the four families do not use: output and every gradient against the whole model."""
    import copy

    from torch import nn

    from hf_elixir.parallel._tensor_parallel import _split
    from hf_elixir.parallel._tp_modules import parallelize_modules

    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(11, 5), "a": nn.Linear(5, 9), "b": nn.Linear(9, 7)})
    ref = copy.deepcopy(model)
    items = [("emb", "embedding_column"), ("a", "row_split"), ("b", "column_gather")]
    layouts = parallelize_modules(model, items, dist.group.WORLD, rank, world_size)
    ids = torch.tensor([[1, 4, 10], [0, 3, 7]])
    outs = [m["b"](m["a"](m["emb"](ids))) for m in (model, ref)]
    for out in outs:
        out.square().sum().backward()
    grads = {}
    for name, param in ref.named_parameters():
        lay = layouts.get(name)
        want = param.grad if lay is None else _split(param.grad, lay.dim, lay.parts, rank, world_size)
        local = model.get_parameter(name).grad
        grads[name] = (tuple(local.shape), float((local - want).abs().max()))
    return {"out": float((outs[0] - outs[1]).abs().max()), "grads": grads}


def test_uneven_embedding_column_row_split_and_column_gather():
    for rank, r in enumerate(run_distributed(_styles_worker, 2, timeout_s=60)):
        assert r["out"] < 1e-6, r
        assert all(err < 1e-6 for _, err in r["grads"].values()), r
        assert r["grads"]["emb.weight"][0] == (11, 3 - rank) and r["grads"]["b.weight"][0] == (4 - rank, 9), r


def _searched_worker(rank: int, world_size: int) -> dict:
    """``prepare(search="auto")`` of an uneven model: rank 0's searched plan counts rank 0's longer slices."""
    from hf_elixir.parallel import parallelize
    from parallel_harness import make_batch

    kind = "llama" + ODD
    ref = make_model(kind)
    model = make_model(kind)
    config = hf_elixir.ElixirConfig(search="auto", device_memory_budget_bytes=64 * 2**20, tensor_parallel_size=2)
    parallelize(model, config)
    batch = make_batch(kind, 0, 0)
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config, sample_batch=batch)
    loss = model(**batch).loss
    opt.backward(loss)
    opt.step()
    with torch.no_grad():
        ref_loss = ref(**batch).loss
    return {"loss_rel": abs(float(loss) - float(ref_loss)) / float(ref_loss),
            "local_numel": sum(p.numel() for p in model.parameters()),
            # the searched plan's reason names the fastest configuration that fits (a plan laid out without the
            # search has none)
            "searched": any("fastest that fits" in r for r in hf_elixir.get_state(model).plan.reasons)}


def test_searched_plan_of_an_uneven_model_prepares_on_every_rank():
    """The plan is rank 0's (``prepare`` agrees it); a rank with shorter slices holds fewer parameters, which the
    plan check refused as a plan "made for another run"."""
    r0, r1 = run_distributed(_searched_worker, 2, timeout_s=200)
    assert r0["local_numel"] > r1["local_numel"], (r0, r1)
    for r in (r0, r1):
        assert r["loss_rel"] < 1e-6 and r["searched"], r


# -- single process: the slicing rule, merges and cuts, the errors ----------------------------------------------
@pytest.mark.parametrize("full, size", [(255, 2), (311, 2), (50257, 4), (63, 8), (9, 4), (8, 4)])
def test_slices_are_dtensors(full, size):
    """The rule every split, merge, gather and streamed read uses is DTensor's ``Shard`` (torch.chunk)."""
    from torch.distributed.tensor.placement_types import Shard

    from hf_elixir.chunk._tp_slices import tp_slice

    for rank in range(size):
        length, start = Shard.local_shard_size_and_offset(full, size, rank)
        assert tp_slice(full, rank, size) == (start, length)


@pytest.mark.parametrize("shape, dim, parts", [((255, 4), 0, 1), ((6, 63), 1, 1), ((2, 5, 126), 2, 2), ((9, 3), 0, 3)])
def test_split_merge_and_streamed_cut_round_trip_uneven(shape, dim, parts):
    from hf_elixir.chunk._stream_load import TensorShard
    from hf_elixir.parallel._tensor_parallel import TPShardLayout, _split, merge_shards

    full = torch.randn(shape)
    size = 2
    shards = [_split(full, dim, parts, r, size) for r in range(size)]
    assert len({s.shape[dim] for s in shards}) == 2  # really uneven
    layout = TPShardLayout(dim, parts, shape[dim])
    assert [s.shape[dim] for s in shards] == layout.sizes(size)
    assert torch.equal(merge_shards(shards, layout), full)
    for r, shard in enumerate(shards):
        cut = TensorShard(dim, parts, r, size, shape[dim])
        assert torch.equal(cut.cut(full), shard) and cut.full_shape(shard.shape) == full.shape


def _llama(**kw):
    import transformers as T

    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=255)
    return T.LlamaForCausalLM(T.LlamaConfig(**{**base, **kw}))


def test_uneven_vocabulary_is_placed_where_it_was_refused():
    p = resolve_placements(_llama(), hf_elixir.ElixirConfig(tensor_parallel_size=2))
    assert p["model.embed_tokens"] == "embedding_row" and p["lm_head"] == "column_gather"


@pytest.mark.parametrize("kw, tp, match", [
    # fewer key/value heads than ranks: not replicated, refused naming the sizes that work
    ({}, 4, r"tensor_parallel_size=4 does not divide config.num_key_value_heads=2 .*whole heads \(fewer key/value "
            r"heads than ranks are not replicated\).*one of \[1, 2\]"),
    # a split that leaves a rank nothing: ceil(3 / 4) = 1 gives 1, 1, 1, 0
    ({"intermediate_size": 3, "num_key_value_heads": 4}, 4,
     r"'model.layers.0.mlp.gate_proj': its 3 output features split over tensor_parallel_size=4 leave tp rank 3 "
     r"no feature \(ceil-sized slices of 1: \[1, 1, 1, 0\]...\).*\[2, 3\]"),
])
def test_impossible_splits_are_refused_naming_the_sizes_that_work(kw, tp, match):
    with pytest.raises(ValueError, match=match):
        resolve_placements(_llama(**kw), hf_elixir.ElixirConfig(tensor_parallel_size=tp))


def test_plan_command_prices_an_uneven_vocabulary(tmp_path, capsys, monkeypatch):
    """``hf-elixir plan --tensor-parallel-size 2`` on a vocabulary after ``resize_token_embeddings`` (32001) and an
    odd MLP width: priced and placed (the vocabulary split was refused, so the degree was dropped)."""
    import json

    from hf_elixir.cli import main
    from hf_elixir.plan import ElixirPlan
    from tests._models import fixed_cpu_hardware

    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", lambda *a, **k: fixed_cpu_hardware())
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32001, "hidden_size": 64, "intermediate_size": 97,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 0,
        "eos_token_id": 1, "max_position_embeddings": 256}))
    out = tmp_path / "tp2.json"
    assert main(["plan", "--model", str(config), "--gpu", "h100", "--num-gpus", "2", "--gpu-memory", "64MiB",
                 "--host-memory", "1GiB", "--batch-size", "2", "--seq-len", "64", "--output", str(out),
                 "--tensor-parallel-size", "2"]) == 0
    capsys.readouterr()
    plan = ElixirPlan.load(out)
    assert "tensor parallel 2 x data parallel 1 (2 ranks)" in " ".join(plan.reasons)
    assert plan.placements["model.embed_tokens"] == "embedding_row" and plan.placements["lm_head"] == "column_gather"
    assert plan.placements["model.layers.0.mlp.down_proj"] == "row"
