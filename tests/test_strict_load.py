"""Loads from a Hugging Face folder are as strict as transformers' ``from_pretrained``: tensors the model does not
use are reported (the same keys transformers reports), missing parameters raise naming the option that allows
them (which then initialises them identically on every rank), a shape mismatch names the tensor, its file and both
shapes (and a folder holding one rank's tensor/expert-parallel slices says so), and an unreadable safetensors file
is named. 1 and 2 gloo ranks."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import transformers

import hf_elixir
from tests._dist import run_distributed
from tests._models import tiny_model


class _Records(logging.Handler):
    """The warnings of hf_elixir's loaders, as text."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        for name in ("hf_elixir.chunk._load_report", "hf_elixir.chunk._stream_load"):
            logging.getLogger(name).addHandler(self)
            logging.getLogger(name).setLevel(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def text(self) -> str:
        return "\n".join(self.lines)


def _gpt2(n_layer: int, seed: int = 0):
    torch.manual_seed(seed)
    config = tiny_model("gpt2").config
    config.n_layer = n_layer
    return transformers.GPT2LMHeadModel(config)


def _llama(layers: int = 2):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))


def _meta(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _prepare(model, folder, **config):
    return hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                             hf_elixir.ElixirConfig(default_placement="sharded", **config), checkpoint=folder)


# -- one rank ---------------------------------------------------------------------------------------
def test_unused_tensors_warn_with_the_keys_transformers_reports(tmp_path):
    """A 3-layer folder into a 2-layer model loads layers 0-1 and warns about layer 2's tensors: the same keys
    ``from_pretrained`` reports as unexpected (GPT-2 ignores ``attn.bias`` matches, as there). A matching folder
    (tied ``lm_head`` written once) warns about nothing."""
    _gpt2(3).save_pretrained(tmp_path / "three")
    small = _gpt2(2).config
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "three", config=small,
                                                                output_loading_info=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "three", config=small)
    records = _Records()
    from hf_elixir.chunk import _load_report

    _load_report._LISTED = 100  # every key in the message
    try:
        model, _ = _prepare(_meta(small), str(tmp_path / "three"))
    finally:
        _load_report._LISTED = 10
    text = records.text()
    unexpected = sorted(info["unexpected_keys"])
    assert unexpected and f"holds {len(unexpected)} tensors {unexpected}" in text, (text, unexpected)
    assert "transformer.h.2.ln_1.weight" in text and "does not use (UNEXPECTED" in text
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    _gpt2(2).save_pretrained(tmp_path / "two")
    records.lines.clear()
    _prepare(_meta(small), str(tmp_path / "two"))
    assert records.lines == [], records.lines


def test_missing_parameters_raise_or_start_from_init_weights_when_allowed(tmp_path):
    _gpt2(2).save_pretrained(tmp_path / "two")
    big = _gpt2(3).config
    with pytest.raises(ValueError, match=r"no tensor for 12 of the model's 40 parameters.*transformer\.h\.2\..*"
                                         r"ElixirConfig\(allow_missing_keys=True\)"):
        _prepare(_meta(big), str(tmp_path / "two"))
    records = _Records()
    model, opt = _prepare(_meta(big), str(tmp_path / "two"), allow_missing_keys=True)
    assert "has no tensor for 12 parameters ['transformer.h.2." in records.text(), records.text()
    state = model.state_dict()
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "two").state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(state["transformer.h.2.ln_1.weight"], torch.ones(32))  # GPT-2's _init_weights
    assert torch.equal(state["transformer.h.2.attn.c_attn.bias"], torch.zeros(96))
    assert 0.015 < float(state["transformer.h.2.mlp.c_fc.weight"].std()) < 0.025  # normal(0, initializer_range)
    again, _ = _prepare(_meta(big), str(tmp_path / "two"), allow_missing_keys=True)
    assert torch.equal(again.state_dict()["transformer.h.2.mlp.c_fc.weight"], state["transformer.h.2.mlp.c_fc.weight"])
    ids = torch.randint(0, 128, (2, 12))
    opt.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    assert torch.isfinite(model.state_dict()["transformer.h.2.mlp.c_fc.weight"]).all()


def test_shape_mismatch_names_the_tensor_its_file_both_shapes_and_the_config_difference(tmp_path):
    _gpt2(2).save_pretrained(tmp_path / "two", max_shard_size="20KB")
    wide = _gpt2(2).config
    wide.n_embd = 64
    with pytest.raises(ValueError) as info:
        _prepare(_meta(wide), str(tmp_path / "two"))
    message = str(info.value)
    assert "'transformer.wte.weight' in model-0000" in message and "is (128, 32), the model's is (128, 64)" in message
    assert "n_embd: 32 in the folder, 64 in the model" in message and "AutoConfig.from_pretrained" in message
    assert "manifest.json" not in message
    # a parallel layout that hf_elixir.save_checkpoint's manifest records is named
    (tmp_path / "two" / "manifest.json").write_text(json.dumps({"step": 3, "mesh": {"tp": 2, "ep": 1, "dp": 1}}))
    with pytest.raises(ValueError, match=r'manifest.json records the layout it was saved with: \{"mesh": \{"dp": 1, '
                                         r'"ep": 1, "tp": 2\}\}'):
        _prepare(_meta(wide), str(tmp_path / "two"))


def test_an_unreadable_safetensors_file_is_named(tmp_path):
    folder = tmp_path / "two"
    _gpt2(2).save_pretrained(folder)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated: the header names bytes the file lacks
    with pytest.raises(ValueError, match=f"checkpoint file '{path}' cannot be read as safetensors.*truncated or "
                                         "corrupt"):
        _prepare(_meta(_gpt2(2).config), str(folder))
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json" + data[16:100])  # a garbage header
    with pytest.raises(ValueError, match=f"checkpoint file '{path}' cannot be read"):
        _prepare(_meta(_gpt2(2).config), str(folder))
    sharded = tmp_path / "sharded"
    _gpt2(2).save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[-1]
    os.remove(sharded / lost)
    with pytest.raises(ValueError, match=f"checkpoint file '{sharded / lost}' cannot be read"):
        _prepare(_meta(_gpt2(2).config), str(sharded))


def test_a_streamed_prepare_that_fails_after_the_swap_leaves_the_meta_model_as_it_was(tmp_path, monkeypatch):
    """A read that fails while the chunks are filled (the meta parameters were already swapped for placeholders):
    ``prepare`` raises that error, every parameter is on the meta device again, and a second try loads."""
    from hf_elixir.chunk import _stream_load

    _gpt2(2).save_pretrained(tmp_path / "two")
    model = _meta(_gpt2(2).config)
    original = _stream_load.read_chunk_range

    def failing(*args):
        raise OSError("disk went away")

    monkeypatch.setattr(_stream_load, "read_chunk_range", failing)
    with pytest.raises(OSError, match="disk went away"):
        _prepare(model, str(tmp_path / "two"))
    assert all(p.is_meta for p in model.parameters())
    monkeypatch.setattr(_stream_load, "read_chunk_range", original)
    model, _ = _prepare(model, str(tmp_path / "two"))
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "two").state_dict()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


# -- two ranks --------------------------------------------------------------------------------------
def _rank_slices_worker(rank: int, world_size: int, out_dir: str) -> dict:
    """Rank 0's tensor-parallel (Llama, TP=2) and expert-parallel (Mixtral, EP=2) local tensors, saved as if they
    were the whole model (``torch.save(model.state_dict())`` of a parallel model), then loaded into the dense
    model: the error says the folder looks sharded and names the kind. Switch experts under expert parallel are
    refused before the model changes."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from hf_elixir.parallel import parallelize
    from tests._moe_models import make_moe_model

    out = {}
    cases = {"tp": (_llama, hf_elixir.ElixirConfig(tensor_parallel_size=2)),
             "ep": (lambda: make_moe_model("mixtral"),
                    hf_elixir.ElixirConfig(expert_parallel_size=2, placements={"*.mlp.experts": "expert"},
                                           split_fused_experts=False))}
    from tests.parallel_harness import make_model

    switch = make_model("switch")  # Switch experts under expert parallel: refused before the model changes
    if rank == 0:
        switch.save_pretrained(os.path.join(out_dir, "switch"))
    dist.barrier()
    with torch.device("meta"):
        model = type(switch)(switch.config)
    parallelize(model, hf_elixir.ElixirConfig(expert_parallel_size=2))
    try:
        _prepare(model, os.path.join(out_dir, "switch"), expert_parallel_size=2)
        out["switch"] = "accepted"
    except ValueError as err:
        out["switch"] = str(err)
    out["switch_still_meta"] = all(p.is_meta for p in model.parameters())
    for kind, (make, config) in cases.items():
        model = make()
        dense_config = model.config
        parallelize(model, config)
        folder = os.path.join(out_dir, kind)
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
            dense_config.save_pretrained(folder)
            save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
                      os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        dist.barrier()
        try:
            _prepare(_meta(dense_config), folder)
            out[kind] = "accepted"
        except ValueError as err:
            out[kind] = str(err)
    return out


def test_one_ranks_parallel_slices_saved_whole_are_named_as_sharded(tmp_path):
    for out in run_distributed(_rank_slices_worker, 2, str(tmp_path), timeout_s=300):
        assert "is (16, 32), the model's is (32, 32)" in out["tp"], out["tp"]
        assert "1/2 of the model's along dim 0: it looks tensor-parallel-sharded" in out["tp"], out["tp"]
        assert "of the model's along dim 0: it looks expert-parallel-sharded" in out["ep"], out["ep"]
        assert "consolidated save" in out["ep"]
        assert "is on the meta device with gradient hooks" in out["switch"] and out["switch_still_meta"], out


def _parallel_load_worker(rank: int, world_size: int, out_dir: str) -> dict:
    """TP=2 Llama and EP=2 Mixtral streamed from 3-layer folders into 2-layer models: the used tensors load bit
    for bit, layer 2's are reported, the experts the other rank holds are not; GPT-2 with a missing layer, allowed,
    gets the same initial values on both ranks."""
    import torch.distributed as dist

    from hf_elixir.parallel import gather_full_state_dict, load_full_state_dict, parallelize
    from tests._moe_models import make_moe_model, moe_config

    records = _Records()
    out = {}
    mixtral3 = moe_config("mixtral")
    mixtral3.num_hidden_layers = 3
    cases = {"tp": (lambda: _llama(3), _llama(2).config, hf_elixir.ElixirConfig(tensor_parallel_size=2)),
             "ep": (lambda: transformers.AutoModelForCausalLM.from_config(mixtral3), make_moe_model("mixtral").config,
                    hf_elixir.ElixirConfig(expert_parallel_size=2, placements={"*.mlp.experts": "expert"}))}
    for kind, (make_big, small, config) in cases.items():
        folder = os.path.join(out_dir, kind)
        if rank == 0:
            torch.manual_seed(0)
            make_big().save_pretrained(folder)
        dist.barrier()
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, config=small).state_dict()
        records.lines.clear()
        model = _meta(small)
        parallelize(model, config)
        model, _ = _prepare(model, folder, **{k: getattr(config, k) for k in
                                              ("tensor_parallel_size", "expert_parallel_size", "placements")})
        full = gather_full_state_dict(model, rank0_only=False)
        out[kind] = {"bitwise": all(torch.equal(full[k], reference[k]) for k in reference),
                     "warnings": records.text()}
        if kind == "tp":  # the resume path: load_full_state_dict from the folder reports the same
            records.lines.clear()
            load_full_state_dict(model, folder)
            out["tp_load_full"] = records.text()
            one = os.path.join(out_dir, "tp_one_layer")  # lacks layer 1: raises, or with strict=False keeps it
            if rank == 0:
                torch.manual_seed(5)
                _llama(1).save_pretrained(one)
            dist.barrier()
            try:
                load_full_state_dict(model, one)
                out["strict"] = "accepted"
            except ValueError as err:
                out["strict"] = str(err)
            load_full_state_dict(model, one, strict=False)
            after = gather_full_state_dict(model, rank0_only=False)
            saved = transformers.AutoModelForCausalLM.from_pretrained(one).state_dict()
            out["lenient"] = (all(torch.equal(after[k], v) for k, v in saved.items())
                              and all(torch.equal(after[k], full[k]) for k in full if ".layers.1." in k))
    folder = os.path.join(out_dir, "gpt2")
    if rank == 0:
        _gpt2(2).save_pretrained(folder)
    dist.barrier()
    model, _ = _prepare(_meta(_gpt2(3).config), folder, allow_missing_keys=True)
    out["gpt2_h2"] = model.state_dict()["transformer.h.2.mlp.c_fc.weight"]
    return out


def test_two_ranks_report_unused_tensors_and_initialise_missing_ones_alike(tmp_path):
    outs = run_distributed(_parallel_load_worker, 2, str(tmp_path), timeout_s=400)
    for out in outs:
        for kind in ("tp", "ep"):
            assert out[kind]["bitwise"], kind
            assert "model.layers.2." in out[kind]["warnings"] and "does not use" in out[kind]["warnings"], out[kind]
            assert "layers.0." not in out[kind]["warnings"] and "layers.1." not in out[kind]["warnings"], out[kind]
        assert "model.layers.2." in out["tp_load_full"], out["tp_load_full"]
        assert "no tensor for 9 of the model's" in out["strict"] and "'model.layers.1." in out["strict"], out["strict"]
        assert "strict=False to keep their values" in out["strict"] and out["lenient"]
    assert torch.equal(outs[0]["gpt2_h2"], outs[1]["gpt2_h2"])
    assert 0.015 < float(outs[0]["gpt2_h2"].std()) < 0.025
