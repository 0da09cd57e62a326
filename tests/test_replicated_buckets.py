"""[Note: replicated buckets] (hf_elixir/chunk/packing.py): replicated chunks are DDP-sized gradient buckets; a
parameter larger than the bucket (GPT-2's tied embedding) gets a chunk of its own instead of raising every
chunk to its size, and no replicated chunk carries padding (it would be all-reduced and zeroed for nothing)."""

from __future__ import annotations

import pytest
import torch

import hf_elixir
from hf_elixir.chunk.packing import pack_chunks
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model


def test_bucket_packing_gives_an_oversized_parameter_its_own_chunk_and_trims_every_chunk():
    layout = pack_chunks([10, 3, 4, 20, 2, 5], 8, world_size=1, bucket_packing=True)
    assert layout.members == [[0], [1, 2], [3], [4, 5]]
    assert layout.chunk_numels == layout.used_numels == [10, 7, 20, 7]
    assert layout.padding_numel == 0
    # sharded packing keeps one chunk size (cache blocks), and still refuses a chunk below the largest parameter
    assert pack_chunks([3, 4, 2], 8, world_size=2).chunk_numels == [8, 2]
    with pytest.raises(ValueError, match="smaller than the largest parameter"):
        pack_chunks([10, 3], 8)


def _run(rank: int, world_size: int):
    from hf_elixir.chunk import packing

    model = tiny_model("gpt2")
    wte = model.transformer.wte.weight
    # a bucket of half the embedding: the embedding is the oversized parameter, as GPT-2 124M's is at 25 MiB
    packing.REPLICATED_BUCKET_BYTES = wte.numel() // 2 * 4
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(budget_covers_activations=False))
    for step in range(3):
        loss = model(**rank_batch("gpt2", step, rank, world_size, 2)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    stats = hf_elixir.memory_stats(model)
    from hf_elixir.runtime._state import get_state

    chunks = get_state(model).manager.chunks
    layout = [(c.chunk_numel, sum(s.numel for s in c.slots), [s.name for s in c.slots]) for c in chunks]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return layout, stats["reduce_scatter_bytes"], stats["allgather_bytes"], state


def test_replicated_chunks_are_ddp_buckets_at_two_ranks():
    results = run_distributed(_run, 2, timeout_s=180)
    ref = tiny_model("gpt2")
    opt = torch.optim.AdamW(ref.parameters(), lr=5e-3)
    for step in range(3):
        ref(**batch("gpt2", step, 4)).loss.backward()
        opt.step()
        opt.zero_grad()
    num_params = sum(p.numel() for p in ref.parameters())
    for layout, reduced_bytes, gathered_bytes, state in results:
        wte = [entry for entry in layout if "transformer.wte.weight" in entry[2]]
        assert len(wte) == 1 and wte[0][2] == ["transformer.wte.weight"], layout  # a chunk of its own
        assert len(layout) > 2, layout  # the rest in several buckets, not one chunk as large as the embedding
        assert all(numel == used for numel, used, _ in layout), f"padding in replicated chunks: {layout}"
        assert gathered_bytes == 0 and reduced_bytes == 3 * num_params * 4  # all-reduced once per step, no padding
        assert rel_l2(state, ref.state_dict()) < 1e-5


def _whole_shard_passes(rank: int, world_size: int, offload: bool = False):
    """The element-wise ops over a whole replicated gradient shard during backward (none expected: the
    gradients are divided as they land, [Note: pre-divided all-reduce] in chunk/_chunk_grads.py), and the reduced
    gradient against the mean of both ranks' gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_elixir.runtime._state import get_state

    model = tiny_model("gpt2")
    ref = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(budget_covers_activations=False,
                                                                      offload_optimizer=offload))
    manager = get_state(model).manager
    shard_numels = {g.numel() for g in manager.grad_shards.values()}
    passes = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            first = args[0] if args else None
            name = func.overloadpacket.__name__
            if isinstance(first, torch.Tensor) and first.numel() in shard_numels and name.endswith("_"):
                passes.append(name)  # an in-place op over a whole gradient shard
            return func(*args, **(kwargs or {}))

    mine = rank_batch("gpt2", 0, rank, world_size, 2)
    with Record():
        model(**mine).loss.backward()
        (cid,) = list(manager.grad_shards)
        manager.drain_reduces()  # off CUDA the last all-reduce finishes at the next reader ([Note: late reduce waits])
    reduced = manager.grad_shards[cid].clone()
    ref(**batch("gpt2", 0, 2 * world_size)).loss.backward()
    chunk = manager.chunks[cid]
    expected = torch.zeros_like(reduced)
    for slot in chunk.slots:
        named = dict(ref.named_parameters())[slot.name]
        expected[slot.offset:slot.offset + slot.numel] = named.grad.reshape(-1)
    return passes, float((reduced - expected).norm() / expected.norm())


def test_replicated_gradients_need_no_pass_after_the_all_reduce():
    for passes, rel in run_distributed(_whole_shard_passes, 2, timeout_s=180):
        assert passes == [], passes  # no division (or other) pass over the whole shard
        assert rel < 1e-5


def test_replicated_gradient_buffers_need_no_division_after_the_all_reduce():
    """With the optimizer state on the host the gradients land in a buffer, all-reduced and then copied to the
    host shard: divided as they land too, so the only whole-chunk pass left is that copy (the offload)."""
    for passes, rel in run_distributed(_whole_shard_passes, 2, True, timeout_s=180):
        assert passes == ["copy_"], passes
        assert rel < 1e-5
