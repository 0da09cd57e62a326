"""What a 1-rank step holds at its peak (issue 13: growth at world size 1): no chunk-sized gradient buffer
beside the host gradient shard ([Note: direct host gradient] in hf_elixir/chunk/chunk.py), and no stale
gathered copy of a chunk carried through the end of backward and the step ([Note: dead chunks] in
hf_elixir/chunk/manager.py). Both are checked on the bytes really held (the pool's charges, which every
device allocation of model data goes through, and the chunks' buffer storage) and against plain PyTorch."""

from __future__ import annotations

import copy

import torch

import hf_elixir
from tests._models import batch, rel_l2, tiny_model

CHUNK = 4096
ROWS = 2


def _config(**kw) -> hf_elixir.ElixirConfig:
    return hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded", **kw)


def _reference(model, steps, micro: int = 1) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for step in steps:
        for m in range(micro):
            (model(**batch("gpt2", 10 * step + m, ROWS)).loss / micro).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_rank_host_optimizer_backward_charges_no_gradient_buffer_and_matches_pytorch():
    model = tiny_model("gpt2")
    ref = _reference(copy.deepcopy(model), range(3), micro=2)
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=5e-3),
                                   config=_config(offload_optimizer=True))
    manager = hf_elixir.get_state(model).manager
    assert all(not c.optim_on_device for c in manager.chunks) and len(manager.chunks) > 2
    grad_buffer_bytes = max(c.grad_full_bytes for c in manager.chunks)
    for step in range(3):
        for m in range(2):  # the second micro-batch adds into shards that hold the first: the buffer path
            hf_elixir.reset_memory_stats(model)
            before = hf_elixir.memory_stats(model)["device_used_bytes"]
            opt.backward(model(**batch("gpt2", 10 * step + m, ROWS)).loss / 2)
            grown = hf_elixir.memory_stats(model)["device_peak_bytes"] - before
            if m == 0:
                # before: each chunk's gradients went through a chunk-sized fp32 buffer in the pool first
                assert grown < grad_buffer_bytes, f"backward charged {grown} bytes (a gradient buffer: {grad_buffer_bytes})"
            else:
                assert grown >= grad_buffer_bytes
        opt.step()
        opt.zero_grad()
    with hf_elixir.full_parameters(model):
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert rel_l2(got, ref) < 1e-5


def _allocated_chunk_bytes(manager) -> int:
    """Bytes of the gathered (unsharded) buffers of chunks that are neither resident nor the shard itself."""
    return sum(c.full.untyped_storage().nbytes() for c in manager.chunks if not (c.resident or c.full_alias))


def test_chunks_backward_no_longer_uses_are_freed_before_the_step():
    model = tiny_model("gpt2")
    ref = _reference(copy.deepcopy(model), range(3))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    budget = hf_elixir.min_device_budget_bytes(model, opt, _config())
    model, opt = hf_elixir.prepare(model, opt, config=_config(device_memory_budget_bytes=2 * budget,
                                                               budget_covers_activations=False))
    manager = hf_elixir.get_state(model).manager
    assert any(not (c.resident or c.full_alias) for c in manager.chunks)
    held = []
    for step in range(3):
        opt.backward(model(**batch("gpt2", 10 * step, ROWS)).loss)
        held.append(_allocated_chunk_bytes(manager))
        opt.step()
        opt.zero_grad()
    # step 0 has no previous order to know what backward still uses; from step 1 every non-resident chunk's
    # gathered copy is freed once backward is done with it (before: the ones backward used last stayed)
    assert held[0] > 0 and held[1:] == [0, 0], held
    got = {k: v.detach().clone() for k, v in model.state_dict().items()}  # chunk by chunk at this budget
    assert rel_l2(got, ref) < 1e-5
