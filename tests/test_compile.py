"""``ElixirConfig(compile=...)``: each transformer block's forward compiled, Elixir's hooks outside
([Note: compiled blocks] in ``hf_elixir/runtime/compile.py``).

Parity: the same tiny GPT-2 trained 5 steps with and without compile, at 1 and 2 gloo ranks, sharded under a
budget that offloads chunks every step, ends with the same parameters (1e-5 relative L2). ``aot_eager`` runs
dynamo's capture and AOTAutograd's joint forward/backward graph (what inductor compiles) without the C++ code
generator, which takes minutes on CPU; one inductor run at one rank checks the generated code too.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

import hf_elixir
from hf_elixir import ElixirConfig
from tests._dist import run_distributed
from tests._models import batch, rel_l2, tiny_model

STEPS = 5
CHUNK = 4096


def _train(rank: int, world_size: int, compile_setting, steps: int = STEPS, kind: str = "gpt2") -> dict:
    model = tiny_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    config = ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded", compile=compile_setting,
                          budget_covers_activations=False)
    floor = hf_elixir.min_device_budget_bytes(model, opt, config, world_size=world_size)
    config = ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded", compile=compile_setting,
                          budget_covers_activations=False, device_memory_budget_bytes=floor)
    model, opt = hf_elixir.prepare(model, opt, config)
    losses = []
    for step in range(steps):
        loss = model(**batch(kind, step * world_size + rank, 2)).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    stats = hf_elixir.memory_stats(model)
    return {"state": {k: v.float().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "stats": {k: stats[k] for k in ("h2d_bytes", "num_compiled_blocks", "compile_graph_breaks") if k in stats}}


@pytest.mark.parametrize("world_size", [1, 2])
def test_compiled_blocks_match_eager_under_an_offloading_budget(world_size):
    compiled = run_distributed(_train, world_size, "aot_eager", timeout_s=300)
    eager = run_distributed(_train, world_size, False, timeout_s=300)
    for c, e in zip(compiled, eager):
        assert c["stats"]["num_compiled_blocks"] == 2 and c["stats"]["compile_graph_breaks"] == 0, c["stats"]
        assert c["stats"]["h2d_bytes"] > 0  # the budget made chunks come back from the host every step
        assert "num_compiled_blocks" not in e["stats"]
        assert rel_l2(c["state"], e["state"]) < 1e-5
        assert c["losses"] == pytest.approx(e["losses"], rel=1e-5)


@pytest.mark.slow  # C++ code generation: ~1-4 min on 2 cores; the aot_eager parity above covers the hooks and graphs
def test_inductor_compiled_blocks_match_eager():
    compiled = _train(0, 1, True, steps=3)
    eager = _train(0, 1, False, steps=3)
    assert compiled["stats"]["num_compiled_blocks"] == 2 and compiled["stats"]["compile_graph_breaks"] == 0
    assert rel_l2(compiled["state"], eager["state"]) < 1e-5


def test_one_graph_serves_every_block_in_training():
    """A Hugging Face model's training forward builds a KV cache unless told not to; each block's update of its
    own cache layer made dynamo recompile per block, and past 8 blocks the rest ran eagerly. Compiled training
    passes ``use_cache=False`` ([Note: no KV cache in compiled training])."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=10, n_embd=32, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    assert cfg.use_cache
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = hf_elixir.prepare(model, opt, ElixirConfig(compile="eager"))
    for step in range(2):
        opt.backward(model(**batch("gpt2", step, 2)).loss)
        opt.step()
        opt.zero_grad()
    assert counters["stats"]["unique_graphs"] == 1
    assert hf_elixir.memory_stats(model)["num_compiled_blocks"] == 10


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        if float(x.detach().sum()) > 1e9:  # a host read: dynamo breaks the graph here
            return x
        return torch.relu(self.fc(x))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def test_graph_breaks_are_counted_and_logged(caplog):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = hf_elixir.prepare(model, opt, ElixirConfig(compile="eager"))
    caplog.set_level(logging.INFO, logger="hf_elixir")
    assert hf_elixir.memory_stats(model)["compile_graph_breaks"] == -1  # not compiled before the first forward
    opt.backward(model(torch.randn(4, 8)))
    opt.step()
    assert hf_elixir.memory_stats(model)["compile_graph_breaks"] >= 1
    assert any("graph breaks" in r.getMessage() and "of 2 blocks" in r.getMessage() for r in caplog.records)


def test_moe_blocks_stay_eager_with_a_warning_naming_why(caplog):
    caplog.set_level(logging.WARNING, logger="hf_elixir")
    model = tiny_model("switch")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = hf_elixir.prepare(model, opt, ElixirConfig(compile="eager"))
    warned = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert warned and all("routes tokens to some experts only" in w for w in warned), warned
    stats = hf_elixir.memory_stats(model)
    assert 0 < stats["num_compiled_blocks"] < len(hf_elixir.runtime.activations.transformer_blocks(model))
