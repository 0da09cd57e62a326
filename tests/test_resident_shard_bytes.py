"""A resident chunk sharded over several ranks costs its full buffer only: its shard is a view into that buffer
(``Chunk.shard_in_full``), so placement, the budget floor and the cost model must not charge the shard again.
Before, they did (``shard_numel * element_size`` per resident chunk at world size > 1): placement left room unused
(fewer chunks resident than fit) and the cost model's fixed and peak bytes were above what the pool charges.

Two gloo ranks, tiny GPT-2 in fp32, chunks of 4096 elements (13 chunks), AdamW. Every figure is checked against
what the device pool really charged (``memory_stats``), never against the formula under test."""

from __future__ import annotations


import torch

import hf_elixir
from hf_elixir import ElixirConfig
from hf_elixir.plan import ElixirPlan
from hf_elixir.profiler import profile_step
from hf_elixir.runtime._state import get_state
from hf_elixir.search._cost import Knobs, build_chunked_step, fixed_memory, predict
from tests._dist import run_distributed
from tests._models import fixed_cpu_hardware, fixed_times, rank_batch, tiny_model

CHUNK = 4096
STEPS = 3


def _config(**changes) -> ElixirConfig:
    return ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded", budget_covers_activations=False,
                        **changes)


def _step_peaks(model, opt, rank: int, world_size: int) -> list[int]:
    """The pool's model-data peak of each of :data:`STEPS` training steps."""
    peaks = []
    for step in range(STEPS):
        hf_elixir.reset_memory_stats(model)
        opt.backward(model(**rank_batch("gpt2", step, rank, world_size, 2)).loss)
        opt.step()
        opt.zero_grad()
        peaks.append(hf_elixir.memory_stats(model)["device_peak_bytes"])
    return peaks


def _smallest_pool(step, knobs: Knobs, hardware, lo: int, hi: int) -> int:
    """The smallest model-data pool in ``[lo, hi]`` the cost model runs ``knobs`` in (bisection)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if predict(step, knobs, hardware, pool_bytes=mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _planned(rank: int, world_size: int, device_optim: bool) -> dict:
    """An all-resident plan priced by the cost model at the smallest pool it runs in, then run at that budget."""
    hardware = fixed_cpu_hardware(world_size=world_size)
    profile = fixed_times(profile_step(tiny_model("gpt2"), rank_batch("gpt2", 0, rank, world_size, 2)))
    step = build_chunked_step(profile, CHUNK, world_size=world_size, precision="fp32", hardware=hardware)
    every = frozenset(range(step.num_chunks))
    knobs = Knobs(resident=every, device_shard=every, device_optim=every if device_optim else frozenset())
    fixed = fixed_memory(step, knobs)[0]
    budget = _smallest_pool(step, knobs, hardware, fixed, 2**30)
    pred = predict(step, knobs, hardware, pool_bytes=budget)
    plan = ElixirPlan(model_type=profile.model_type, num_params=profile.num_params, world_size=world_size,
                      precision="fp32", chunk_size_numel=CHUNK, param_order=list(profile.param_names),
                      resident_chunks=sorted(every), device_shard_chunks=sorted(every),
                      device_optim_chunks=sorted(knobs.device_optim), prefetch_depth=0,
                      predicted_step_s=pred.step_s, predicted_peak_device_bytes=pred.device_peak_bytes)
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   _config(plan=plan, device_memory_budget_bytes=budget))
    chunks = get_state(model).manager.chunks
    return dict(fixed=fixed, predicted_peak=pred.device_peak_bytes, budget=budget,
                shard_in_full=[c.shard_in_full for c in chunks],
                prepare_peak=hf_elixir.memory_stats(model)["device_peak_bytes"],
                step_peaks=_step_peaks(model, opt, rank, world_size))


def _placed(rank: int, world_size: int) -> dict:
    """``prepare`` without a plan at the budget that holds every chunk resident: what the pool charges for every
    chunk and optimizer state (``prepare`` without a budget places everything resident) plus two gradient
    buffers and one reduce-scatter output shard, the room the budget floor keeps for backward
    (``placement/_device_placement.py: _resident_bytes``); and one byte less."""
    model = tiny_model("gpt2")
    model, _ = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _config())
    chunks = get_state(model).manager.chunks
    assert all(c.resident for c in chunks), f"rank {rank}: no budget, yet not everything resident"
    grads = sorted((c.grad_full_bytes for c in chunks), reverse=True)
    reduce_out = max(c.grad_full_bytes // c.world_size for c in chunks)  # a gradient's reduce-scatter output shard
    budget = hf_elixir.memory_stats(model)["device_peak_bytes"] + sum(grads[:2]) + reduce_out
    out = {"budget": budget, "shard_bytes": sum(c.shard_bytes for c in chunks)}
    for name, nbytes in (("at", budget), ("below", budget - 1)):
        model = tiny_model("gpt2")
        model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       _config(device_memory_budget_bytes=nbytes))
        state = get_state(model)
        out[name] = dict(resident=[c.resident for c in state.manager.chunks], reasons=state.plan.reasons,
                         step_peaks=_step_peaks(model, opt, rank, world_size))
    return out


def _worker(rank: int, world_size: int) -> dict:
    return {"device_optim": _planned(rank, world_size, True), "host_optim": _planned(rank, world_size, False),
            "placed": _placed(rank, world_size)}


def test_resident_sharded_chunks_cost_their_full_buffer_only():
    """Cost model: an all-resident plan at 2 ranks (optimizer states on the device, then on the host) has fixed
    bytes equal to what ``prepare`` charges (chunks built, optimizer states made) and a predicted step peak equal
    to the pool's measured one at the smallest pool the model accepts. Placement: at the pool's own figure for
    everything resident plus two gradient buffers and a reduce-scatter output shard, every chunk is resident and a step stays in the budget; one
    byte less is not everything resident. Before, both charged each resident shard a second time (98496 bytes)."""
    for rank, out in enumerate(run_distributed(_worker, 2, timeout_s=300)):
        for name in ("device_optim", "host_optim"):
            run = out[name]
            where = f"rank {rank} {name}: {run}"
            assert all(run["shard_in_full"]) and len(run["shard_in_full"]) == 13, where
            assert run["prepare_peak"] == run["fixed"], where
            assert run["step_peaks"] == [run["predicted_peak"]] * STEPS, where
            assert run["predicted_peak"] <= run["budget"], where
        placed = out["placed"]
        at, below = placed["at"], placed["below"]
        assert placed["shard_bytes"] > 0
        assert all(at["resident"]), (rank, at["reasons"])
        assert any(r.startswith("everything resident") for r in at["reasons"]), (rank, at["reasons"])
        assert max(at["step_peaks"]) <= placed["budget"], (rank, at["step_peaks"], placed["budget"])
        assert not any(below["resident"]), (rank, below["reasons"])
        assert max(below["step_peaks"]) <= placed["budget"] - 1, (rank, below["step_peaks"])
