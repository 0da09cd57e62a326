"""prepare(model_on_meta, ..., checkpoint=folder): each rank reads only its shards from the folder; the
result equals from_pretrained + prepare bit for bit (1 and 2 ranks, with and without a budget)."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_elixir
from hf_elixir.chunk import _stream_load
from tests._dist import run_distributed
from tests._models import rank_batch, tiny_model


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def _save(kind: str, folder, max_shard_size=None) -> str:
    model = _llama() if kind == "llama" else tiny_model(kind)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return str(folder)


def _on_meta(folder: str, how: str = "meta"):
    config = transformers.AutoConfig.from_pretrained(folder)
    cls = transformers.AutoModelForCausalLM
    if how == "init_empty_weights":
        from accelerate import init_empty_weights

        with init_empty_weights():
            return cls.from_config(config)
    with torch.device("meta"):
        return cls.from_config(config)


def _run(folder: str, streamed: bool, budget, rank: int, world_size: int, kind: str = "gpt2", how: str = "meta"):
    transformers.logging.set_verbosity_error()
    model = _on_meta(folder, how) if streamed else transformers.AutoModelForCausalLM.from_pretrained(folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = hf_elixir.ElixirConfig(device_memory_budget_bytes=budget, precision="bf16", default_placement="sharded")
    model, optimizer = hf_elixir.prepare(model, optimizer, cfg, checkpoint=folder if streamed else None)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    losses = []
    for step in range(2):
        b = rank_batch("gpt2", step, rank, world_size, 2)
        loss = model(**b).loss
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    tied = kind == "gpt2" and model.lm_head.weight is model.transformer.wte.weight
    return losses, model.state_dict(), buffers, tied


def _same(a, b) -> None:
    losses_a, state_a, buffers_a, tied_a = a
    losses_b, state_b, buffers_b, tied_b = b
    assert losses_a == losses_b
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key
    assert buffers_a.keys() == buffers_b.keys()
    for key in buffers_a:
        assert torch.equal(buffers_a[key], buffers_b[key]), key
    assert tied_a == tied_b


@pytest.mark.parametrize("budget", [None, 300_000])
@pytest.mark.parametrize("how", ["meta", "init_empty_weights"])
def test_streamed_init_matches_from_pretrained_one_rank(tmp_path, budget, how):
    folder = _save("gpt2", tmp_path / "gpt2")
    streamed = _run(folder, True, budget, 0, 1, how=how)
    assert streamed[3], "lm_head and wte stay one parameter"
    _same(_run(folder, False, budget, 0, 1), streamed)


def test_streamed_init_rebuilds_rotary_buffers(tmp_path):
    """Llama's rotary inv_freq is a non-persistent buffer (not in the file), on meta under
    torch.device('meta'): the model's own _init_weights rebuilds it, equal to from_pretrained's."""
    folder = _save("llama", tmp_path / "llama")
    streamed = _run(folder, True, None, 0, 1, kind="llama")
    assert "model.rotary_emb.inv_freq" in streamed[2]
    _same(_run(folder, False, None, 0, 1, kind="llama"), streamed)


def _two_rank_worker(rank, world_size, folder):
    read: list[int] = []
    original = _stream_load.CheckpointReader.read_flat

    def counting(self, key, begin, end):
        out = original(self, key, begin, end)
        read.append(out.numel() * out.element_size())
        return out

    results = []
    for budget in (None, 300_000):
        plain = _run(folder, False, budget, rank, world_size)
        read.clear()
        _stream_load.CheckpointReader.read_flat = counting
        try:
            streamed = _run(folder, True, budget, rank, world_size)
        finally:
            _stream_load.CheckpointReader.read_flat = original
        results.append((plain, streamed, sum(read)))
    return results


def test_streamed_init_two_ranks_reads_only_own_shards(tmp_path):
    folder = _save("gpt2", tmp_path / "gpt2", max_shard_size="100KB")  # sharded folder with an index
    assert (tmp_path / "gpt2" / "model.safetensors.index.json").is_file()
    model_bytes = sum(p.numel() * 4 for p in tiny_model("gpt2").parameters())
    for rank_results in run_distributed(_two_rank_worker, 2, folder, timeout_s=180):
        for plain, streamed, read_bytes in rank_results:
            _same(plain, streamed)
            assert 0 < read_bytes <= 0.6 * model_bytes, (read_bytes, model_bytes)


def test_meta_model_without_checkpoint_is_refused(tmp_path):
    folder = _save("gpt2", tmp_path / "gpt2")
    model = _on_meta(folder)
    with pytest.raises(ValueError, match=r"meta device.*checkpoint="):
        hf_elixir.prepare(model, None, hf_elixir.ElixirConfig())
    with pytest.raises(ValueError, match="transformer.wte.weight"):
        hf_elixir.prepare(model, None, hf_elixir.ElixirConfig())


def test_checkpoint_missing_a_parameter_is_refused(tmp_path):
    folder = _save("gpt2", tmp_path / "gpt2")
    config = transformers.AutoConfig.from_pretrained(folder)
    config.n_layer = 3  # one block more than the folder holds
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"has no tensor for 12 of the model's 40 parameters: \['transformer.h.2.*"
                                         r"ElixirConfig\(allow_missing_keys=True\)"):
        hf_elixir.prepare(model, None, hf_elixir.ElixirConfig(), checkpoint=folder)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        hf_elixir.prepare(model, None, hf_elixir.ElixirConfig(), checkpoint=str(tmp_path / "nope"))
