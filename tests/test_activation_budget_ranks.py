"""Activations charged against the budget at several ranks: their bytes are rank-local (each rank's
batch), so the evictions they cause differ between ranks. A sharded chunk evicted on one rank and not on
another must not make the two ranks issue different all-gathers (a hang under NCCL and gloo alike):
while the pool charges activations, every offloadable sharded chunk keeps a rank-local host copy, so a
re-unshard within the step is a local onload ([Note: rank-local refill] in hf_elixir/chunk/chunk.py;
[Note: activations in the budget] in hf_elixir/chunk/memory.py).

With the copies, a step's all-gathers are the first unshards in forward order on every rank, and the forward
ones are issued ahead from the third step on, the ones every rank had room for in the step before (agreed at
the optimizer step: [Note: agreed gathers ahead] in hf_elixir/chunk/_agreed_gathers.py)."""

from __future__ import annotations

import torch

import hf_elixir
from hf_elixir import ElixirConfig
from tests._dist import run_distributed
from tests._models import batch, rel_l2, tiny_model

CHUNK = 4096
STEPS = 4
STEP_KEYS = ("step_num_prefetched_gathers", "step_num_blocking_gathers", "step_allgather_bytes",
             "step_num_agreed_gather_evictions")


def _batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    # rank 1 gets a far longer sequence: its activations (and the evictions they force) differ from rank 0's
    return batch("gpt2", step * 2 + rank, 1, 4 if rank == 0 else 24)


def _reference(world_size: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        for rank in range(world_size):  # the mean of the ranks' losses, as data parallelism averages
            (model(**_batch(step, rank)).loss / world_size).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _prepared(world_size: int):
    """The tiny GPT-2 and AdamW prepared sharded under a budget that covers activations: the floor plus room for
    rank 1's activations (about 205 KB at 24 tokens; rank 0's are 34 KB) and a cache of chunks, of which rank 1
    evicts more. Returns ``(model, optimizer, config)``."""
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    config = ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded")
    floor = hf_elixir.min_device_budget_bytes(model, opt, config, world_size=world_size)
    config = ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded",
                          device_memory_budget_bytes=floor + 320_000)
    model, opt = hf_elixir.prepare(model, opt, config)
    return model, opt, config


def _worker(rank: int, world_size: int, no_room: dict[int, set[int] | None] | None = None,
            steps: int = STEPS) -> dict:
    """Train ``steps`` steps; ``no_room``: {step: chunk ids (``None``: all)} for which rank 1 votes "no room"
    in that step, as if its batch had left none."""
    model, opt, config = _prepared(world_size)
    manager = hf_elixir.get_state(model).manager
    room_ahead = manager._room_ahead
    per_step = []
    for step in range(steps):
        vetoed = (no_room or {}).get(step, set()) if rank == 1 else set()

        def fake_room(chunk, need, keep, vetoed=vetoed):
            # this rank's own check runs first: it still evicts for an agreed gather as it would
            room = room_ahead(chunk, need, keep)
            return room and not (vetoed is None or chunk.chunk_id in vetoed)
        manager._room_ahead = fake_room
        opt.backward(model(**_batch(step, rank)).loss)
        opt.step()
        opt.zero_grad()
        stats = hf_elixir.memory_stats(model)
        per_step.append({k: stats[k] for k in STEP_KEYS})
    stats = hf_elixir.memory_stats(model)
    with hf_elixir.full_parameters(model):
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"state": state, "evictions": stats["num_evictions"], "total_peak": stats["device_total_peak_bytes"],
            "budget": config.device_memory_budget_bytes, "reasons": hf_elixir.get_state(model).plan.reasons,
            "per_step": per_step}


def test_ranks_with_different_activations_evict_apart_without_hanging_and_match_pytorch():
    out = run_distributed(_worker, 2, timeout_s=90)
    ref = _reference(2)
    assert out[0]["evictions"] != out[1]["evictions"], "the ranks were meant to evict differently"
    for r in out:
        assert rel_l2(r["state"], ref) < 1e-5
        assert r["total_peak"] <= r["budget"]
        assert any("issued ahead from the third step on" in line for line in r["reasons"]), r["reasons"]
    for step in range(STEPS):
        s0, s1 = out[0]["per_step"][step], out[1]["per_step"][step]
        # the same all-gathers on both ranks, and the same of them issued ahead: agreed, not rank-local
        assert s0 == s1, (step, s0, s1)
        if step < 2:  # the first step has no order to prefetch by; the second one votes
            assert s0["step_num_prefetched_gathers"] == 0, (step, s0)
        else:
            assert s0["step_num_prefetched_gathers"] > s0["step_num_blocking_gathers"], (step, s0)
        assert s0["step_num_agreed_gather_evictions"] == 0  # rank 1's batch had room in every step


def test_a_rank_without_room_vetoes_the_gathers_ahead_of_every_rank():
    """Rank 1 votes "no room" for three chunks in the second step: in the third, neither rank issues those
    ahead (the others still run ahead). In the third step it votes "no room" for every chunk, while the gathers
    agreed before are still issued ahead on it (the ranks' collectives stay in step): in the fourth nothing
    runs ahead on either rank, and in the fifth everything does again. Training matches PyTorch throughout."""
    steps = 5
    out = run_distributed(_worker, 2, {1: {3, 5, 7}, 2: None}, steps, timeout_s=120)
    ref = _reference(2, steps)
    ahead = [[r["per_step"][step]["step_num_prefetched_gathers"] for step in range(steps)] for r in out]
    assert ahead[0] == ahead[1], ahead
    full = ahead[0][4]
    assert full > 3, ahead
    assert ahead[0][2] == full - 3, ahead  # the three vetoed chunks (all gathered in forward) waited in their hooks
    assert ahead[0][3] == 0, ahead
    for r in out:
        assert rel_l2(r["state"], ref) < 1e-5
        for step in range(steps):  # every step all-gathers the same bytes, whatever ran ahead
            assert r["per_step"][step]["step_allgather_bytes"] == out[0]["per_step"][step]["step_allgather_bytes"]


def _no_room_worker(rank: int, world_size: int) -> dict:
    import logging

    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("hf_elixir").addHandler(_Keep())
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    config = ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded")
    floor = hf_elixir.min_device_budget_bytes(model, opt, config, world_size=world_size)
    # host memory too small for the copies: none kept, and the warning says what the run then relies on
    config = ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded",
                          device_memory_budget_bytes=floor + 320_000, host_memory_budget_bytes=1)
    model, opt = hf_elixir.prepare(model, opt, config)
    for step in range(2):  # the same shapes on both ranks: evictions agree, no copies needed
        opt.backward(model(**batch("gpt2", step * 2 + rank, 1, 12)).loss)
        opt.step()
        opt.zero_grad()
    copies = sum(c.keep_host_copy for c in hf_elixir.get_state(model).manager.chunks)
    return {"copies": copies, "warned": [m for m in records if "same shapes on every rank" in m]}


def test_copies_that_do_not_fit_host_memory_are_not_kept_and_the_run_is_warned():
    out = run_distributed(_no_room_worker, 2, timeout_s=90)
    for r in out:
        assert r["copies"] == 0
        assert len(r["warned"]) == 1 and "budget_covers_activations=False" in r["warned"][0]


def _eval_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    return batch("gpt2", 700 + step, 1, 8 if rank == 0 else 30)


def _eval_worker(rank: int, world_size: int, steps: int) -> dict:
    """Train ``steps`` steps with a no-grad evaluation forward (each rank its own length) after every odd step."""
    model, opt, _ = _prepared(world_size)
    ahead, logits = [], []
    for step in range(steps):
        opt.backward(model(**_batch(step, rank)).loss)
        opt.step()
        opt.zero_grad()
        ahead.append(hf_elixir.memory_stats(model)["step_num_prefetched_gathers"])
        if step % 2 == 1:
            model.eval()
            with torch.no_grad():
                logits.append(model(**_eval_batch(step, rank)).logits.clone())
            model.train()
    with hf_elixir.full_parameters(model):
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"ahead": ahead, "logits": logits, "state": state}


def test_evaluation_forwards_between_steps_keep_the_agreed_gathers_ahead():
    """An evaluation forward between steps (``Trainer`` with ``eval_steps``) issues the agreed gathers ahead
    itself, so the training forward after it needs none and votes on none: the last agreement stands, and every
    step from the third on still issues its gathers ahead (before, the step after each one issued none).
    Training and the evaluation logits match PyTorch."""
    steps = 6
    out = run_distributed(_eval_worker, 2, steps, timeout_s=120)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_logits = []
    for step in range(steps):
        for rank in range(2):
            (model(**_batch(step, rank)).loss / 2).backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 1:
            with torch.no_grad():
                ref_logits.append([model(**_eval_batch(step, rank)).logits for rank in range(2)])
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert out[0]["ahead"] == out[1]["ahead"], [r["ahead"] for r in out]
    ahead = out[0]["ahead"]
    assert ahead[:2] == [0, 0] and min(ahead[2:]) > 0 and len(set(ahead[2:])) == 1, ahead
    for rank, r in enumerate(out):
        assert rel_l2(r["state"], ref) < 1e-5
        for got, want in zip(r["logits"], ref_logits):
            torch.testing.assert_close(got, want[rank], rtol=1e-5, atol=1e-5)
