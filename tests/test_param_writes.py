"""In-place writes to current parameters between steps reach the shards and fp32 masters ([Note: parameter
writes] in hf_elixir/chunk/_chunk_params.py): a manual weight decay (``with torch.no_grad(): p.mul_(0.99)`` or
``p.data.mul_(0.99)`` between backward and step, as hand-written loops do) and a zeroed embedding row used to
be lost silently wherever the
compute copy is not the master (two ranks with replicated chunks and host optimizer states: 4% parameter
difference from plain PyTorch after 4 steps; bf16 at one rank: the step restored the zeroed weight)."""

from __future__ import annotations

import dataclasses

import torch

import hf_elixir
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model, two_groups

CHUNK = 8192
STEPS = 3


def _loop(model, opt, get):
    for s in range(STEPS):
        model(**get(s)).loss.backward()
        with torch.no_grad():
            for p in model.transformer.h[0].parameters():
                p.mul_(0.99)  # a manual weight decay between backward and step
            model.transformer.wte.weight[5].zero_()  # a padding row kept at zero
        for p in model.transformer.h[1].parameters():
            p.data.mul_(0.98)  # the same, written the older way
        opt.step()
        opt.zero_grad()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _worker(rank, world_size):
    ref = tiny_model("gpt2")
    expected = _loop(ref, torch.optim.AdamW(two_groups(ref), lr=5e-3), lambda s: batch("gpt2", s, 2 * world_size))
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    cfg = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="replicated",
                                 budget_covers_activations=False)
    # chunks whole on the device, optimizer states and fp32 masters on the host: the compute copy is not the master
    budget = int(hf_elixir.min_device_budget_bytes(model, opt, cfg, world_size=world_size) * 1.5)
    model, opt = hf_elixir.prepare(model, opt, dataclasses.replace(cfg, device_memory_budget_bytes=budget))
    got = _loop(model, opt, lambda s: rank_batch("gpt2", s, rank, world_size, 2))
    return rel_l2(got, expected)


def test_writes_between_backward_and_step_match_pytorch_two_ranks():
    for rel in run_distributed(_worker, 2, timeout_s=120):
        assert rel < 1e-5, f"parameter rel L2 {rel:.2e} from plain PyTorch"


def test_bf16_write_reaches_the_master_and_leaves_the_rest_of_the_chunk_unrounded():
    """One rank, bf16: zero one weight between backward and a step at lr 0. The step keeps it zero (it used to
    restore it from the fp32 master), and every other master element of its chunk keeps its fp32 value (a
    merge, not a copy of the bf16 compute copy into the masters)."""
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, precision="bf16"))
    model(**batch("gpt2", 0, 2)).loss.backward()
    weight = model.transformer.h[0].mlp.c_fc.weight
    manager = hf_elixir.get_state(model).manager
    chunk, slot = manager.chunk_of[weight], manager.slot_of[weight]
    before = opt.masters[chunk.chunk_id].clone()
    with torch.no_grad():
        weight.zero_()
    opt.step()
    after = opt.masters[chunk.chunk_id]
    written = torch.zeros_like(before, dtype=torch.bool)
    written[slot.offset:slot.offset + slot.numel] = True
    assert float(after[written].abs().max()) == 0.0
    assert torch.equal(after[~written], before[~written])
    assert float(model.state_dict()["transformer.h.0.mlp.c_fc.weight"].abs().max()) == 0.0
