"""Ranks agree ([Note: ranks agree], ``hf_elixir/placement/_agree.py``): a rank that sees another free-memory
figure, another device budget or other hardware timings than its peers still places, chunks and plans exactly
as they do, and the job trains like plain PyTorch instead of hanging.

Two gloo ranks; rank 1 is given a different figure (a patched ``torch.cuda.mem_get_info``, its own
``device_memory_budget_bytes``, a slower hardware profile); each rank returns what ``prepare`` decided
(default placement, chunk size, per-module placements, resident / device-shard / device-optimizer chunks,
the plan) and the test compares them across ranks, then checks parity with the single-process reference.
A disagreement without the fix shows up as a gloo timeout (short here) or a failed comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch

import hf_elixir
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model

STEPS = 3
ROWS_PER_RANK = 2
GIB = 2**30
TIMEOUT_S = 60  # gloo's collective timeout: a rank waiting on a collective its peer never issues fails


def _reference(world_size: int):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for step in range(STEPS):
        model(**batch("gpt2", step, ROWS_PER_RANK * world_size)).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _decisions(model) -> dict:
    state = hf_elixir.get_state(model)
    chunks = state.manager.chunks
    return {
        "default_placement": state.config.default_placement,
        "budget": state.config.device_memory_budget_bytes,
        "chunk_size": state.plan.chunk_size_numel,
        "num_chunks": len(chunks),
        "placements": dict(state.plan.placements),
        "replicated": [c.replicate_group is not None for c in chunks],
        "resident": [c.resident for c in chunks],
        "shard_on_device": [c.shard_on_device for c in chunks],
        "optim_on_device": [c.optim_on_device for c in chunks],
        "host_copy": [c.keep_host_copy for c in chunks],
        "plan": dataclasses.replace(state.plan, reasons=[]).to_dict(),
    }


def _train(rank: int, world_size: int, model, opt) -> dict:
    for step in range(STEPS):
        loss = model(**rank_batch("gpt2", step, rank, world_size, ROWS_PER_RANK)).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _fake_cuda_free_bytes(free_bytes: int):
    """``torch.cuda`` reports ``free_bytes`` free (of 80 GiB) while ``prepare`` still computes on the CPU."""
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.mem_get_info", return_value=(free_bytes, 80 * GIB)), \
            mock.patch("hf_elixir.profiler._device.select_compute_device", return_value=torch.device("cpu")):
        yield


def _free_memory_worker(rank: int, world_size: int) -> dict:
    # rank 0 has room for a replicated copy (default_placement="auto" would replicate); rank 1 has almost none
    free_bytes = 40 * GIB if rank == 0 else 2**16
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    with _fake_cuda_free_bytes(free_bytes):
        model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(default_placement="auto"))
    decided = _decisions(model)
    return {"decided": decided, "state": _train(rank, world_size, model, opt)}


def _budget_worker(rank: int, world_size: int) -> dict:
    # rank 1 was given (e.g. measured itself) a budget far below rank 0's: everything would be resident on
    # rank 0 and offloaded on rank 1 (different all-gathers), without agreement
    model = tiny_model("gpt2")
    config = hf_elixir.ElixirConfig(default_placement="sharded", chunk_size_numel=8192,
                                    budget_covers_activations=False)  # the model-data floor
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    smallest = hf_elixir.min_device_budget_bytes(model, opt, config=config, world_size=world_size)
    budget = 64 * GIB if rank == 0 else smallest
    model, opt = hf_elixir.prepare(model, opt, dataclasses.replace(config, device_memory_budget_bytes=budget))
    decided = _decisions(model)
    decided["smallest"] = smallest
    return {"decided": decided, "state": _train(rank, world_size, model, opt)}


def _perturbed_hardware(rank: int, budget: int):
    """A synthetic profile (no timing runs): rank 0's collectives favour replication, rank 1's favour sharding
    and its copies and host optimizer are a thousand times slower."""
    from hf_elixir.profiler import HardwareProfile

    slow = 1.0 if rank == 0 else 1e-3
    return HardwareProfile(device_kind="cpu", device_total_bytes=budget, device_free_bytes=budget,
                           host_total_bytes=64 * GIB, host_available_bytes=64 * GIB, h2d_bytes_per_s=10e9 * slow,
                           d2h_bytes_per_s=10e9 * slow, allgather_bytes_per_s=1e9 if rank == 0 else 1e11,
                           reduce_scatter_bytes_per_s=1e9 if rank == 0 else 1e11,
                           allreduce_bytes_per_s=1e11 if rank == 0 else 1e7, host_adam_numel_per_s=1e9 * slow,
                           device_adam_numel_per_s=1e9, device_flops_per_s=1e11, world_size=2)


def _search_worker(rank: int, world_size: int) -> dict:
    model = tiny_model("gpt2")
    budget = sum(p.numel() for p in model.parameters()) * 4 * 3
    hardware = _perturbed_hardware(rank, budget)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    sample = rank_batch("gpt2", 0, rank, world_size, ROWS_PER_RANK)
    with mock.patch("hf_elixir.profiler.probe_hardware", return_value=hardware):
        model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
            search="auto", device_memory_budget_bytes=budget, default_placement="auto"), sample_batch=sample)
    decided = _decisions(model)
    return {"decided": decided, "state": _train(rank, world_size, model, opt)}


def _check(results: list[dict]) -> dict:
    decided = [r["decided"] for r in results]
    for key in decided[0]:
        assert decided[0][key] == decided[1][key], f"ranks disagree on {key}: {decided[0][key]} vs {decided[1][key]}"
    ref = _reference(len(results))
    for rank, r in enumerate(results):
        assert rel_l2(r["state"], ref) < 1e-5, f"rank {rank}: parity with PyTorch lost"
    return decided[0]


def test_free_memory_differs_on_one_rank_same_placement_and_trains():
    decided = _check(run_distributed(_free_memory_worker, 2, timeout_s=TIMEOUT_S))
    # the smaller figure wins: rank 1 cannot hold a replicated copy, so neither rank replicates
    assert decided["default_placement"] == "sharded"
    assert set(decided["placements"].values()) == {"sharded"} and not any(decided["replicated"])


def test_device_budget_differs_on_one_rank_same_resident_set_and_trains():
    decided = _check(run_distributed(_budget_worker, 2, timeout_s=TIMEOUT_S))
    assert decided["budget"] == decided["smallest"]  # the smallest budget over the ranks, on both
    assert not all(decided["resident"])  # placed for rank 1's budget: not everything resident


def test_search_with_perturbed_timings_on_one_rank_gives_one_plan_and_trains():
    decided = _check(run_distributed(_search_worker, 2, timeout_s=TIMEOUT_S))
    assert decided["plan"]["world_size"] == 2
