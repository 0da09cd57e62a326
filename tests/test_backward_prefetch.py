"""Backward all-gather prefetch ([Note: backward gather prefetch] in ``hf_elixir/chunk/_prefetch.py``):
at two gloo ranks under a budget that reshards chunks after forward, backward re-gathers them ahead of their
pre-backward hooks (async work handles off CUDA) where free and dead-chunk room allows, with the same bytes, the
same decisions on every rank, and parity with plain PyTorch; the cost model prices those gathers as ahead.

Blocked waiting is asserted through counts: the gathers issued inside a backward access for the chunk it needs
(the compute waits for the whole collective) are counted by wrapping ``ChunkManager.access``.
"""

from __future__ import annotations

import torch

import hf_elixir
from tests._dist import run_distributed
from tests._models import rel_l2, tiny_model
from tests.test_gather_prefetch import CHUNK, _prepared, _reference, _state, _train

EXTRA_CHUNKS = 1  # above the smallest budget: chunks are resharded after forward, and backward has some room


def _count_backward_gathers(model) -> dict[str, int]:
    """Wrap the manager's ``access``: count the all-gathers issued blocking inside backward accesses, and those
    issued ahead while backward runs (cumulative over the run; ``step`` keys hold the last step's)."""
    manager = hf_elixir.get_state(model).manager
    counts = {"blocking": 0, "ahead": 0}
    access = manager.access

    def counted(chunks):
        blocking, ahead = manager.counters.num_blocking_gathers, manager.counters.num_prefetched_gathers
        access(chunks)
        if manager.backward_pending:
            counts["blocking"] += manager.counters.num_blocking_gathers - blocking
            counts["ahead"] += manager.counters.num_prefetched_gathers - ahead

    manager.access = counted
    return counts


def _depths_worker(rank: int, world_size: int) -> dict:
    out = {}
    for depth in (0, 2):
        model, opt = _prepared(world_size, depth, extra_chunks=EXTRA_CHUNKS)
        counts = _count_backward_gathers(model)
        steps = _train(rank, world_size, model, opt)
        out[depth] = {"steps": steps, "state": _state(model), "backward": dict(counts)}
    return out


def test_backward_gathers_issued_ahead_replace_blocking_ones_with_parity_at_two_ranks():
    results = run_distributed(_depths_worker, 2, timeout_s=120)
    ref = _reference(2, 1)
    for rank, r in enumerate(results):
        for depth, run in r.items():
            assert rel_l2(run["state"], ref) < 1e-5, f"rank {rank} depth {depth}: parity lost"
        off, on = r[0], r[2]
        assert off["backward"]["blocking"] > 0 and off["backward"]["ahead"] == 0, off["backward"]
        # every step after the first (which has no previous order) issues its backward re-gathers ahead
        assert on["backward"]["ahead"] > 0, on["backward"]
        assert on["backward"]["blocking"] < off["backward"]["blocking"], (on["backward"], off["backward"])
        last_off, last_on = off["steps"][-1], on["steps"][-1]
        assert (last_on["step_num_prefetched_gathers"] + last_on["step_num_blocking_gathers"]
                == last_off["step_num_blocking_gathers"]), (last_on, last_off)
        assert last_on["step_allgather_bytes"] == last_off["step_allgather_bytes"], (last_on, last_off)
    for depth in (0, 2):
        assert results[0][depth]["steps"] == results[1][depth]["steps"], f"ranks decided differently at {depth}"
        assert results[0][depth]["backward"] == results[1][depth]["backward"]


def _disagreeing_worker(rank: int, world_size: int) -> dict:
    # rank 1 asks for a far larger budget (agreed down to rank 0's at prepare) and reaches every micro-batch
    # late; two micro-batches per step put a forward's gathers between two backwards' gathers and reduces
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded")
    smallest = hf_elixir.min_device_budget_bytes(model, opt, config, world_size=world_size)
    budget = smallest + EXTRA_CHUNKS * CHUNK * 4 if rank == 0 else 64 * 2**30
    model, opt = _prepared(world_size, 2, budget)
    counts = _count_backward_gathers(model)
    steps = _train(rank, world_size, model, opt, micro_batches=2, slow=0.05 * rank)
    return {"steps": steps, "state": _state(model), "backward": dict(counts)}


def test_ranks_with_other_budget_and_timing_gather_ahead_in_backward_identically_without_hanging():
    results = run_distributed(_disagreeing_worker, 2, timeout_s=90)
    ref = _reference(2, 2)
    for rank, r in enumerate(results):
        assert rel_l2(r["state"], ref) < 1e-5, f"rank {rank}: parity with PyTorch lost"
        assert r["backward"]["ahead"] > 0, r["backward"]
    assert results[0]["steps"] == results[1]["steps"], "ranks made different prefetch decisions"
    assert results[0]["backward"] == results[1]["backward"]


def test_cost_model_prices_backward_gathers_ahead_where_the_runtime_issues_them():
    # [Note: overlap] in search/_cost.py: with room among free and dead chunks a backward re-gather is
    # issued ahead (its time leaves the compute timeline); none at prefetch depth 0, none for MoE models
    from hf_elixir.profiler import HardwareProfile, static_profile
    from hf_elixir.search import build_chunked_step, predict
    from hf_elixir.search._cost import Knobs

    hardware = HardwareProfile(device_kind="cpu", world_size=2, allgather_bytes_per_s=1e6)
    step = build_chunked_step(static_profile(tiny_model("gpt2")), CHUNK, world_size=2, precision="fp32",
                              hardware=hardware)
    cache = 3  # a cache of three gathered chunks: backward re-gathers what forward evicted
    on = predict(step, Knobs(prefetch_depth=2, cache_blocks=cache), hardware)
    off = predict(step, Knobs(prefetch_depth=0, cache_blocks=cache), hardware)
    assert on.gathers_ahead.get("bwd", 0) > 0 and off.gathers_ahead == {}, (on.gathers_ahead, off.gathers_ahead)
    assert on.allgather_bytes == off.allgather_bytes
    assert on.forward_backward_s < off.forward_backward_s
    moe = build_chunked_step(static_profile(tiny_model("switch")), CHUNK, world_size=2, precision="fp32",
                             hardware=hardware)
    fitting = [p for p in (predict(moe, Knobs(prefetch_depth=2, cache_blocks=c), hardware) for c in range(3, 12)) if p]
    assert fitting and not any(p.gathers_ahead for p in fitting)
    assert "bwd" not in predict(step, Knobs(prefetch_depth=2, cache_blocks=cache), hardware,
                                activations_on_device=True).gathers_ahead
