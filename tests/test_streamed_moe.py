"""Streamed init of today's MoE families from a folder plain ``save_pretrained`` wrote.

transformers 5 writes fused experts per expert (Mixtral ``block_sparse_moe.experts.{e}.w1/w2/w3``, Qwen3-MoE /
OLMoE / DeepSeek-V3 ``mlp.experts.{e}.gate_proj/up_proj/down_proj``; gpt-oss keeps them fused) and fuses
them at load through its conversion mapping; ``prepare(model_on_meta, checkpoint=folder)`` runs the same
converters one expert at a time ([Note: converted tensors] in ``hf_elixir/chunk/_converted_load.py``).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_elixir
from hf_elixir.chunk import _stream_load
from tests._dist import run_distributed
from tests._moe_models import MOE_FAMILIES, make_moe_model


def _prepared(folder: str, streamed: bool, budget=None):
    """The model prepared from ``folder``: on meta + ``checkpoint=`` (streamed) or from ``from_pretrained``;
    returns ``(state_dict, bytes the streamed reader read)``."""
    transformers.logging.set_verbosity_error()
    readers = []
    original = _stream_load.CheckpointReader.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        readers.append(self)

    if streamed:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = hf_elixir.ElixirConfig(default_placement="sharded", chunk_size_numel=8192,
                                 device_memory_budget_bytes=budget, budget_covers_activations=False)
    _stream_load.CheckpointReader.__init__ = recording
    try:
        model, opt = hf_elixir.prepare(model, opt, cfg, checkpoint=folder if streamed else None)
    finally:
        _stream_load.CheckpointReader.__init__ = original
    ids = torch.arange(2, 26).reshape(2, 12)
    loss = model(input_ids=ids, labels=ids).loss
    opt.backward(loss)
    opt.step()
    return model.state_dict(), sum(r.bytes_read for r in readers), loss.item()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_streamed_moe_matches_from_pretrained_one_rank(tmp_path, family):
    folder = str(tmp_path / family)
    make_moe_model(family).save_pretrained(folder)
    plain_sd, _, plain_loss = _prepared(folder, streamed=False)
    streamed_sd, read_bytes, streamed_loss = _prepared(folder, streamed=True)
    assert streamed_loss == plain_loss
    assert streamed_sd.keys() == plain_sd.keys()
    for key in plain_sd:
        assert torch.equal(streamed_sd[key], plain_sd[key]), key
    assert read_bytes > 0


def _two_ranks(rank, world_size, folder, budget):
    plain = _prepared(folder, streamed=False, budget=budget)
    streamed = _prepared(folder, streamed=True, budget=budget)
    return plain, streamed


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_streamed_moe_two_ranks_reads_about_its_own_experts(tmp_path, family):
    """Each rank builds only the experts its chunk shards cover: far less than the whole model's bytes."""
    folder = str(tmp_path / family)
    model = make_moe_model(family)
    model.save_pretrained(folder)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for (plain_sd, _, plain_loss), (streamed_sd, read_bytes, streamed_loss) in run_distributed(
            _two_ranks, 2, folder, 200_000, timeout_s=240):
        assert streamed_loss == plain_loss
        for key in plain_sd:
            assert torch.equal(streamed_sd[key], plain_sd[key]), key
        assert 0 < read_bytes <= 0.7 * model_bytes, (read_bytes, model_bytes)


def test_checkpoint_missing_an_expert_is_refused(tmp_path):
    """A folder whose per-expert tensors miss an expert: refused naming the parameter and both counts."""
    folder = tmp_path / "qwen3_moe"
    make_moe_model("qwen3_moe").save_pretrained(folder)
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if ".experts.3." not in k}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    with pytest.raises(ValueError, match=r"tensors of 3 experts for .*experts\.(gate_up|down)_proj.*the model has 4"):
        hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), hf_elixir.ElixirConfig(),
                          checkpoint=str(folder))
