"""A prepared model is freed when the user drops it: after ``prepare`` and a training step, ``del model,
optimizer`` and ``gc.collect()`` release the ChunkManager and its chunk buffers (a user who prepares models
in a loop, e.g. a hyperparameter search or a second Trainer, must not leak a model's memory each time).

Nothing the collector cannot traverse (hooks held by a parameter's C++ TensorImpl, global registries,
the host lane's worker thread) may hold the manager strongly."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import hf_elixir
from hf_elixir.runtime._state import get_state
from tests._models import batch, tiny_model, two_groups

ROWS = 2
CHUNK = 4096
OFFLOAD = dict(offload_optimizer=True, overlap_host_optimizer=True, device_memory_budget_bytes=150_000,
               budget_covers_activations=False)


def _train_and_watch(config: hf_elixir.ElixirConfig, offloaded: bool) -> list[weakref.ref]:
    """Prepare a tiny GPT-2, train two steps, return weak references to the manager and chunk buffers;
    every strong reference dies with this frame."""
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, config)
    for step in range(2):
        opt.backward(model(**batch("gpt2", step, ROWS)).loss)
        opt.step()
        opt.zero_grad()
    manager = get_state(model).manager
    if offloaded:
        assert opt._lane is not None, "the host lane must be on"
        assert any(not c.shard_on_device for c in manager.chunks), "some chunk must be offloaded"
    refs = [weakref.ref(manager)] + [weakref.ref(c) for c in manager.chunks]
    refs += [weakref.ref(c.shard) for c in manager.chunks if c.shard is not None]
    del model, opt, manager
    return refs


@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded_host_lane"])
def test_dropping_a_prepared_model_frees_its_manager_and_chunks(single_rank_group, offloaded):
    config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, **(OFFLOAD if offloaded else {}))
    refs = _train_and_watch(config, offloaded)
    gc.collect()
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, f"still alive after del + gc.collect(): {alive}"
