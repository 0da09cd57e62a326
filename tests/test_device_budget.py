"""The budget covers the whole device ([Note: activations in the budget], [Note: device reserve] in
hf_elixir/chunk/memory.py): ``None`` on CUDA is what the card has less a reserve; activations and
autograd's temporaries are measured (and charged when the budget is the card); the pool is reconciled
with the CUDA allocator. CUDA is faked where only the arithmetic is under test."""

from __future__ import annotations

import logging

import pytest
import torch

import hf_elixir
from hf_elixir.chunk.memory import (DEVICE_RESERVE_MIN_BYTES, DeviceBudgetExceededError, DevicePool, MemoryCounters,
                                    device_reserve_bytes, resolve_budget_bytes, whole_device_budget_bytes)
from tests._models import batch, tiny_model

GIB = 2**30


def test_none_on_cuda_means_the_free_memory_less_the_reserve(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GIB, 80 * GIB))
    budget = whole_device_budget_bytes(torch.device("cuda", 0))
    assert budget == 60 * GIB - int(80 * GIB * 0.08)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 4 * GIB))
    assert whole_device_budget_bytes(torch.device("cuda", 0)) == 3 * GIB - DEVICE_RESERVE_MIN_BYTES  # small card
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**20, 4 * GIB))
    assert whole_device_budget_bytes(torch.device("cuda", 0)) == 0  # never negative
    assert device_reserve_bytes(80 * GIB) == int(80 * GIB * 0.08)


def test_none_resolves_from_the_device_only_on_cuda(monkeypatch):
    """What ``prepare`` enforces for each ``device_memory_budget_bytes`` (CUDA faked: the arithmetic
    only): None on CUDA is the card (and charges activations), an explicit budget is kept, None on the
    simulated device stays unlimited."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 16 * GIB))
    cuda = torch.device("cuda", 0)
    assert resolve_budget_bytes(None, cuda) == (10 * GIB - int(16 * GIB * 0.08), True)
    assert resolve_budget_bytes(123, cuda) == (123, True)
    assert resolve_budget_bytes(123, cuda, covers_activations=False) == (123, False)
    assert resolve_budget_bytes(None, torch.device("cpu")) == (None, False)


def _train_one_step(model, opt, rows=2):
    b = batch("gpt2", 0, rows)
    model(**b).loss.backward()
    opt.step()
    opt.zero_grad()


def test_activations_are_measured_and_released():
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=4096))
    _train_one_step(model, opt, rows=2)
    small = hf_elixir.memory_stats(model)["activation_peak_bytes"]
    assert small > 0
    hf_elixir.reset_memory_stats(model)
    _train_one_step(model, opt, rows=8)
    stats = hf_elixir.memory_stats(model)
    assert stats["activation_peak_bytes"] > 3 * small, "activations grow with the batch"
    assert stats["activation_bytes"] == 0, "released when backward freed them"
    assert stats["device_total_peak_bytes"] >= stats["device_peak_bytes"] + 0  # model data + activations
    assert stats["device_total_peak_bytes"] > stats["device_used_bytes"]


def test_whole_device_budget_charges_activations_and_temporaries():
    """With the budget being the card, activations evict chunks, and a batch whose activations cannot
    fit raises (the real card would run out of memory) instead of passing on the simulation."""
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = hf_elixir.ElixirConfig(chunk_size_numel=4096)
    floor = hf_elixir.min_device_budget_bytes(model, opt, cfg)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=4096,
                                                                      device_memory_budget_bytes=floor * 4))
    manager = hf_elixir.get_state(model).manager
    manager.pool.charges_activations = True  # what prepare sets when the budget covers activations
    _train_one_step(model, opt, rows=2)
    stats = hf_elixir.memory_stats(model)
    assert stats["device_total_peak_bytes"] <= floor * 4
    assert stats["device_total_peak_bytes"] > stats["device_peak_bytes"]
    with pytest.raises(DeviceBudgetExceededError, match="activations"):
        _train_one_step(model, opt, rows=64)


def test_reconcile_warns_once_with_both_figures(caplog):
    counters = MemoryCounters()
    pool = DevicePool(None, counters)
    pool.charge(1000, "chunk")
    with caplog.at_level(logging.WARNING, logger="hf_elixir.chunk.memory"):
        assert not pool.reconcile(1050, 2048)  # within 10%
        assert pool.reconcile(1500, 2048)
        assert pool.reconcile(3000, 4096)
    warnings = [r.getMessage() for r in caplog.records if "drift" in r.getMessage()]
    assert len(warnings) == 1
    assert "1000 bytes" in warnings[0] and "1500 bytes" in warnings[0] and "2048" in warnings[0]


def test_reconcile_reads_the_cuda_allocator(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5000)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 8192)
    pool = DevicePool(None, MemoryCounters())
    pool.charge(1000, "chunk")
    with caplog.at_level(logging.WARNING, logger="hf_elixir.chunk.memory"):
        assert pool.reconcile_cuda(torch.device("cuda", 0))
    assert "5000 bytes" in caplog.text and "8192" in caplog.text


def test_activation_accounting_keeps_an_enclosing_saved_tensors_hook_working():
    """A nested ``saved_tensors_hooks`` context replaces the outer one; the accounting chains to the
    outer hooks (e.g. ``profile_step``'s tracer on a prepared model), which still see every tensor."""
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()),
                                   hf_elixir.ElixirConfig(chunk_size_numel=4096))
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch("gpt2", 0, 2)).loss
    loss.backward()
    assert len(packed) > 10
    assert hf_elixir.memory_stats(model)["activation_peak_bytes"] > 0
