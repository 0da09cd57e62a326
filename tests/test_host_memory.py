"""Host memory: a few host blocks sliced per tensor (host_bytes = what the blocks hold); no rank-local
refill copy unless the plan chooses one within host_memory_budget_bytes; a resident sharded chunk keeps
one buffer (its shard is a view into the gathered copy)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_elixir
from hf_elixir.chunk.host_blocks import ALIGN_BYTES, HostBlockAllocator
from tests._dist import run_distributed
from tests._models import rank_batch, tiny_model


def test_block_allocator_slices_few_blocks_and_reuses_freed_ranges():
    changes = []
    alloc = HostBlockAllocator(pin=False, on_change=changes.append)
    alloc.reserve_for([(1000, torch.float32), (333, torch.bfloat16)])
    a = alloc.empty(1000, torch.float32)
    b = alloc.empty(333, torch.bfloat16)
    assert len(alloc.blocks) == 1 and alloc.reserved_bytes == 4096 + 1024 == sum(changes)
    assert a.dtype == torch.float32 and a.numel() == 1000 and b.dtype == torch.bfloat16 and b.numel() == 333
    base = a.untyped_storage().data_ptr()
    assert (b.data_ptr() - base) % ALIGN_BYTES == 0 and b.untyped_storage().data_ptr() == base
    a.fill_(1.0)
    b.fill_(2.0)
    assert bool((a == 1.0).all()) and bool((b == 2.0).all())  # no overlap
    many = [alloc.empty(n, torch.float32) for n in (7, 100, 3000, 5, 70_000)]
    assert len(alloc.blocks) <= 3  # grown geometrically, not one allocation per tensor
    assert alloc.reserved_bytes >= alloc.requested_bytes
    alloc.free(a)
    again = alloc.empty(900, torch.float32)  # first fit into the freed range
    assert again.data_ptr() == a.data_ptr()
    for t in many + [b, again]:
        alloc.free(t)
    assert alloc.blocks == [] and alloc.reserved_bytes == 0 and sum(changes) == 0


def _host_tensors(manager, optimizer) -> list[torch.Tensor]:
    tensors = [c.shard for c in manager.chunks if not c.shard_on_device and c.shard.numel()]
    tensors += [g for g in manager.grad_shards.values() if g.device.type == "cpu"]
    tensors += [m for cid, m in optimizer.masters.items() if not manager.chunks[cid].optim_on_device]
    return tensors


def test_host_shards_and_optimizer_shards_come_from_few_blocks():
    model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters())
    need = hf_elixir.min_device_budget_bytes(model, optimizer, hf_elixir.ElixirConfig(precision="bf16"))
    model, optimizer = hf_elixir.prepare(model, optimizer, hf_elixir.ElixirConfig(
        precision="bf16", device_memory_budget_bytes=need, offload_optimizer=True, budget_covers_activations=False))
    manager = hf_elixir.get_state(model).manager
    tensors = _host_tensors(manager, optimizer)
    assert len(tensors) > 4
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) <= 2, f"{len(tensors)} host tensors in {len(storages)} allocations"
    assert len(manager.host.blocks) == len(storages)
    # host_bytes counts the blocks (what is allocated); the Adam moments are in them too ([Note: host
    # optimizer state]), handed out at prepare
    moments = sum(2 * c.shard_numel * 4 for c in manager.chunks if c.trainable and not c.optim_on_device)
    assert moments and hf_elixir.memory_stats(model)["host_bytes"] == manager.host.reserved_bytes
    assert manager.host.requested_bytes >= sum(t.numel() * t.element_size() for t in tensors) + moments


def test_resident_sharded_chunk_keeps_one_buffer():
    """With several ranks and no budget every chunk is resident: its shard is a slice of the gathered
    copy, not a second buffer."""
    results = run_distributed(_resident_worker, 2, timeout_s=120)
    for device_used, full_bytes, same_storage in results:
        assert same_storage
        assert device_used == full_bytes  # no separate shard copies charged


def _resident_worker(rank, world_size):
    model = tiny_model("gpt2")
    model, optimizer = hf_elixir.prepare(model, None, hf_elixir.ElixirConfig(default_placement="sharded"))
    manager = hf_elixir.get_state(model).manager
    assert all(c.resident and c.world_size == 2 for c in manager.chunks)
    same = all(c.shard.untyped_storage().data_ptr() == c.full.untyped_storage().data_ptr() for c in manager.chunks)
    return (manager.counters.device_used_bytes, sum(c.full_bytes for c in manager.chunks), same)


def _train(model, optimizer, rank, world_size, steps=2):
    losses = []
    for step in range(steps):
        loss = model(**rank_batch("gpt2", step, rank, world_size, 2)).loss
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _refill_worker(rank, world_size):
    base = tiny_model("gpt2")
    cfg = hf_elixir.ElixirConfig(precision="bf16", default_placement="sharded", budget_covers_activations=False,
                                 device_memory_budget_bytes=hf_elixir.min_device_budget_bytes(
                                     base, torch.optim.AdamW(base.parameters()),
                                     hf_elixir.ElixirConfig(precision="bf16"), world_size=2))
    results = {}
    plan = None
    for label in ("default", "plan keeps copies", "plan over host budget"):
        model = tiny_model("gpt2")
        run_cfg = cfg
        if plan is not None:
            run_cfg = dataclasses.replace(cfg, plan=plan, host_memory_budget_bytes=(
                10**12 if label == "plan keeps copies" else 1))
        model, optimizer = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), run_cfg)
        state = hf_elixir.get_state(model)
        if plan is None:  # the default plan, asking for a copy of every chunk
            plan = dataclasses.replace(state.plan, host_copy_chunks=[c.chunk_id for c in state.manager.chunks])
        losses = _train(model, optimizer, rank, world_size)
        stats = hf_elixir.memory_stats(model)
        copies = sum(c.host_full is not None for c in state.manager.chunks)
        results[label] = (losses, stats["host_bytes"], stats["allgather_bytes"], copies,
                          state.plan.host_copy_chunks, model.state_dict())
    return results


def test_refill_copies_only_where_the_plan_keeps_them_within_the_host_budget():
    for results in run_distributed(_refill_worker, 2, timeout_s=240):
        default, kept, over = results["default"], results["plan keeps copies"], results["plan over host budget"]
        assert default[3] == 0 and default[4] == []  # no full per-rank host replica by default
        assert kept[3] > 0 and kept[4]
        assert over[3] == 0  # the host budget bounds what the plan asks for
        assert kept[1] > default[1]  # counted in host_bytes
        assert default[2] > kept[2]  # traded for all-gather traffic
        for other in (kept, over):  # the same training either way
            assert other[0] == default[0]
            for key, value in default[5].items():
                assert torch.equal(value, other[5][key]), key


def test_host_memory_budget_is_validated():
    with pytest.raises(ValueError, match="host_memory_budget_bytes=0 must be > 0"):
        hf_elixir.ElixirConfig(host_memory_budget_bytes=0)
    assert hf_elixir.ElixirConfig(host_memory_budget_bytes="2GiB").host_memory_budget_bytes == 2 * 2**30
