"""Strict device simulation ([Note: strict device] in hf_elixir/chunk/strict.py): collectives over host
memory and host<->device copies outside the chunk manager's copy paths raise, as on CUDA/NCCL."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers as T

import hf_elixir
from hf_elixir.chunk import strict


def test_strict_mode_is_on_for_the_suite():
    assert os.environ["HF_ELIXIR_STRICT_DEVICE"] == "1"
    assert strict.enabled()


@pytest.mark.parametrize("async_op", [False, True])
def test_collective_over_host_memory_raises(single_rank_group, async_op):
    host = strict.host_empty(6, torch.float32, pin=False).zero_()
    with pytest.raises(strict.HostMemoryError, match=r"all_reduce over a host-memory tensor of shape \(6,\) and "
                                                     r"dtype torch.float32"):
        dist.all_reduce(host, async_op=async_op)
    with pytest.raises(strict.HostMemoryError, match="all_gather_into_tensor"):
        dist.all_gather_into_tensor(torch.empty(2), host[:2])  # a view of a host buffer is host memory
    from hf_elixir._compat import all_gather_single, reduce_scatter_single

    with pytest.raises(strict.HostMemoryError, match="all_gather_(single|into_tensor)"):
        all_gather_single(torch.empty(2), host[:2])  # the names the library calls (torch >= 2.13)
    with pytest.raises(strict.HostMemoryError, match="reduce_scatter_(single|tensor)"):
        reduce_scatter_single(torch.empty(6), host)
    with pytest.raises(strict.HostMemoryError, match="all_gather over"):
        dist.all_gather([torch.empty(6)], host)
    with pytest.raises(strict.HostMemoryError, match="broadcast"):
        dist.broadcast(strict.to_host(torch.ones(3)), src=0)
    device = torch.ones(6)  # computed on the (simulated) device
    work = dist.all_reduce(device, async_op=async_op)
    if async_op:
        work.wait()
    assert torch.equal(device, torch.ones(6))
    dist.all_reduce(strict.to_device(host, torch.device("cpu")))  # moved to the device first: accepted


def test_host_device_copy_outside_the_manager_raises():
    host = strict.host_empty(4, torch.float32, pin=False)
    device = strict.register_device(torch.arange(4.0))  # a buffer the manager owns
    with pytest.raises(strict.HostMemoryError, match="host->device copy_"):
        device.copy_(host)
    with pytest.raises(strict.HostMemoryError, match="device->host copy_"):
        host.copy_(device)
    with strict.host_copies():
        host.copy_(device)  # a counted copy path
    assert torch.equal(host, device)
    host.copy_(strict.host_empty(4, torch.float32, pin=False).fill_(2))  # host->host is not a transfer
    assert torch.equal(host, torch.full((4,), 2.0))
    torch.zeros(4).copy_(host)  # into a tensor nobody registered (a plain CPU model): not checked


def test_strict_mode_can_be_switched_off():
    host = strict.host_empty(2, torch.float32, pin=False)
    device = strict.register_device(torch.zeros(2))
    strict.disable()
    try:
        device.copy_(host)
    finally:
        strict.enable()
    with pytest.raises(strict.HostMemoryError):
        device.copy_(host)


def _tiny_gpt2():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32))


def test_offloaded_training_runs_strict_and_state_dict_is_host_memory(single_rank_group):
    """Host shards and host optimizer states (every copy path of an offloaded step) under strict mode."""
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = hf_elixir.min_device_budget_bytes(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=4096))
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=4096, device_memory_budget_bytes=budget, offload_optimizer=True,
        budget_covers_activations=False))  # the model-data floor: every copy path runs
    ids = torch.randint(0, 128, (2, 8))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.clip_grad_norm(0.1)
        opt.step()
        opt.zero_grad()
    assert hf_elixir.memory_stats(model)["h2d_bytes"] > 0
    state = model.state_dict()
    assert all(strict.is_host(t) for t in state.values())


def test_load_state_dict_is_a_manager_copy_path(single_rank_group):
    model = _tiny_gpt2()
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()),
                                   hf_elixir.ElixirConfig(chunk_size_numel=4096, offload_optimizer=True))
    state = model.state_dict()
    assert all(strict.is_host(t) for t in state.values())
    model.load_state_dict({k: v + 1 for k, v in state.items()})  # host -> device through the load hooks
    assert all(torch.equal(v, state[k] + 1) for k, v in model.state_dict().items())
    with pytest.raises(strict.HostMemoryError):  # and the sanction ends with the load
        model.lm_head.weight.data[0, :2].copy_(state["lm_head.weight"][0, :2])


def test_tp_gather_of_a_prepared_model_gathers_on_the_device(single_rank_group):
    """``state_dict()`` of a prepared model returns host tensors; the tensor-parallel gather used to
    all-gather them as they were (NCCL rejects host memory): now it moves them to the device first."""
    from hf_elixir.parallel import gather_full_state_dict, parallelize

    model = _tiny_gpt2()
    cfg = hf_elixir.ElixirConfig(placements={"*.attn.c_attn": "column", "*.attn.c_proj": "row"})
    parallelize(model, cfg)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model, _ = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), cfg)
    full = gather_full_state_dict(model)
    assert full.keys() == expected.keys()
    assert all(torch.equal(full[k], v) for k, v in expected.items())
    assert all(strict.is_host(t) for t in full.values())
