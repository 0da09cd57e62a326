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


def test_every_write_of_a_field_the_chunk_state_derives_from_is_in_a_verb_that_asserts_its_move():
    """``Chunk.state`` derives from ``unsharded``, ``pending_gather`` and ``full_alias``: each write of them, anywhere
    in the package, sits in a ``Chunk`` method that checks its move against the table (``_moved``), or in a helper
    such a verb calls (``_fill`` from ``unshard``), or in ``__init__``."""
    import ast
    from pathlib import Path

    fields = {"unsharded", "pending_gather", "full_alias"}
    helpers_of = {"_fill": "unshard"}  # helper -> the asserting verb that calls it
    root = Path(chunk_module.__file__).resolve().parents[1]
    writers = {}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(func):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                if any(isinstance(t, ast.Attribute) and t.attr in fields for t in flat):
                    writers[(path.name, func.name)] = func
    assert writers, "the search found no write: it would pass whatever the code does"
    for (file, name), func in writers.items():
        assert file == "chunk.py", f"{file}:{name} writes a chunk-state field outside Chunk's verbs"
        if name == "__init__":
            continue
        verb = helpers_of.get(name, name)
        body = ast.unparse(next(f for (fl, n), f in writers.items() if n == verb) if verb != name else func)
        assert "self._moved(" in body, f"Chunk.{name} changes the chunk state without asserting the move"
