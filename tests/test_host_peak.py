"""What a 1-rank step holds at its peak (growth at world size 1): no stale gathered copy of a chunk
carried through the end of backward and the step ([Note: dead chunks] in hf_elixir/chunk/_eviction.py), checked
on the chunks' buffer storage really held, and against plain PyTorch."""

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
