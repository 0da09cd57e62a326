"""Chunk storage states: one declared transition table ([Note: chunk states] in hf_elixir/chunk/states.py), asserted
at every move of a chunk's verbs. Real steps under a budget that evicts (1 rank) and with all-gathers issued ahead
(2 gloo ranks) make only declared moves, and make the ones the table is for."""

from __future__ import annotations

import pytest
import torch

import hf_elixir
from hf_elixir.chunk import chunk as chunk_module
from hf_elixir.chunk.states import CHUNK_TRANSITIONS, ChunkState, check_chunk_transition
from tests._dist import run_distributed
from tests._models import rank_batch, tiny_model

CHUNK = 8192


def test_chunk_transition_table_is_declared_and_enforced():
    assert set(CHUNK_TRANSITIONS) == set(ChunkState)
    check_chunk_transition(ChunkState.GATHERING, ChunkState.GATHERED)
    with pytest.raises(AssertionError, match="GATHERING -> SHARDED"):  # freeing a buffer a gather still writes
        check_chunk_transition(ChunkState.GATHERING, ChunkState.SHARDED)
    with pytest.raises(AssertionError, match="ALIAS -> SHARDED"):
        check_chunk_transition(ChunkState.ALIAS, ChunkState.SHARDED)


def _moves_of_training(rank: int, world_size: int, budget_factor: float) -> list[tuple[str, str]]:
    moves = []
    original = chunk_module.check_chunk_transition

    def spy(old, new, what=""):
        moves.append((old.name, new.name))
        original(old, new, what)

    chunk_module.check_chunk_transition = spy
    try:
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cfg = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded",
                                     budget_covers_activations=False)
        budget = hf_elixir.min_device_budget_bytes(model, opt, cfg, world_size=world_size)
        model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
            chunk_size_numel=CHUNK, default_placement="sharded", budget_covers_activations=False,
            device_memory_budget_bytes=int(budget * budget_factor)))
        for step in range(2):
            opt.backward(model(**rank_batch("gpt2", step, rank, world_size, 2)).loss)
            opt.step()
            opt.zero_grad()
    finally:
        chunk_module.check_chunk_transition = original
    return moves


def test_one_rank_under_an_evicting_budget_makes_declared_moves():
    moves = set(_moves_of_training(0, 1, 1.1))
    assert {("SHARDED", "GATHERED"), ("GATHERED", "SHARDED")} <= moves, moves


def test_two_ranks_gathering_ahead_make_declared_moves():
    per_rank = run_distributed(_moves_of_training, 2, 3.0, timeout_s=240)
    for moves in map(set, per_rank):
        assert {("SHARDED", "GATHERED"), ("GATHERED", "SHARDED")} <= moves, moves
        assert any(new == "GATHERING" for _, new in moves) and ("GATHERING", "GATHERED") in moves, moves
