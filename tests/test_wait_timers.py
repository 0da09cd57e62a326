"""``memory_stats`` reports the seconds the training thread was blocked in all-gathers and in gradient
reduce-scatters: cumulative ``gather_wait_s`` / ``reduce_wait_s`` and the last
step's ``step_gather_wait_s`` / ``step_reduce_wait_s``; zero where no collective runs."""

from __future__ import annotations

import torch

import hf_elixir
from tests._dist import run_distributed
from tests._models import rank_batch, tiny_model

CHUNK = 8192


def _steps(rank: int, world_size: int) -> dict:
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded")
    budget = hf_elixir.min_device_budget_bytes(model, opt, config, world_size=world_size)
    config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded",
                                    device_memory_budget_bytes=budget, budget_covers_activations=False)
    model, opt = hf_elixir.prepare(model, opt, config)
    for step in range(3):
        opt.backward(model(**rank_batch("gpt2", step, rank, world_size, 2)).loss)
        opt.step()
        opt.zero_grad()
    return hf_elixir.memory_stats(model)


def _check_blocked(stats: dict) -> None:
    assert stats["step_allgather_bytes"] > 0 and stats["step_reduce_scatter_bytes"] > 0
    for key in ("gather_wait_s", "reduce_wait_s"):
        assert isinstance(stats[key], float) and stats[key] >= stats[f"step_{key}"] > 0, (key, stats)


def test_blocked_wait_is_timed_at_two_ranks():
    for stats in run_distributed(_steps, 2, timeout_s=300):
        _check_blocked(stats)


def test_no_collective_no_wait_at_one_rank():
    stats = _steps(0, 1)
    assert stats["allgather_bytes"] == stats["reduce_scatter_bytes"] == 0
    assert stats["gather_wait_s"] == stats["reduce_wait_s"] == stats["step_gather_wait_s"] == 0
