"""The cost model and the runtime share one description of the step ([Note: one step description] in
hf_elixir/chunk/schedule.py): the order the prefetch scheduler executes is the one ``predict`` builds from the profile,
and the fills, evictions and reduces the runtime executes in a steady step under a budget are the ones the model
prices, in the same order and at the same places of the step's order.

One rank in process (fills are onloads), and two gloo ranks (fills are all-gathers), with fixed event times
(``tests/_models.fixed_times``); the third step is recorded (a trace exists from the first, and the second leaves the
steady state's cached chunks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_elixir
from hf_elixir import ElixirConfig
from hf_elixir.chunk.schedule import EventRecorder, StepOrder
from hf_elixir.profiler import profile_step
from hf_elixir.search._cost import Knobs, build_chunked_step, predict

from _dist import run_distributed
from _models import batch, fixed_cpu_hardware, fixed_times, priced_plan, rank_batch, tiny_model
from _moe_models import make_moe_model

#: model -> (chunk elements, budget as a fraction of the fp32 parameter bytes): budgets that force onloads and
#: evictions in forward and backward
CASES = {"gpt2": (4096, 0.9), "mixtral": (8192, 0.9), "opt": (4096, 0.9)}


def _make(kind: str) -> torch.nn.Module:
    return make_moe_model("mixtral") if kind == "mixtral" else tiny_model(kind)


def _batch(kind: str, step: int) -> dict[str, torch.Tensor]:
    return batch("opt" if kind == "opt" else "gpt2", step, 4, 16)  # token ids and labels in the tiny vocabulary


def _step(kind: str):
    chunk_numel = CASES[kind][0]
    model = _make(kind)
    hardware = fixed_cpu_hardware()
    profile = fixed_times(profile_step(model, _batch(kind, 0)))
    return model, profile, hardware, build_chunked_step(profile, chunk_numel, world_size=1, precision="fp32",
                                                        hardware=hardware)


def _groups(kind: str):
    return _step(kind)[3].groups


def _record(kind: str, prefetch_depth: int):
    """(model events, runtime events of the third step, the model's order, the runtime's order, prediction, stats)."""
    chunk_numel, fraction = CASES[kind]
    model, profile, hardware, step = _step(kind)
    budget = int(sum(p.numel() for p in model.parameters()) * 4 * fraction)
    predicted = EventRecorder()
    pred = predict(step, Knobs(prefetch_depth=prefetch_depth), hardware, pool_bytes=budget, recorder=predicted)
    assert pred is not None
    plan = dataclasses.replace(priced_plan(profile, [], pred, chunk_size_numel=chunk_numel),
                               prefetch_depth=prefetch_depth)
    model = _make(kind)
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   ElixirConfig(plan=plan, device_memory_budget_bytes=budget,
                                                budget_covers_activations=False))
    manager = hf_elixir.get_state(model).manager
    assert manager.recorder is None  # off by default
    for i in range(3):
        if i == 2:
            manager.recorder = EventRecorder()
        model(**_batch(kind, i)).loss.backward()
        opt.step()
        opt.zero_grad()
    order = step.order
    return (predicted.events, manager.recorder.events, order, manager.prev_order, pred,
            hf_elixir.memory_stats(model))


@pytest.mark.parametrize("kind", sorted(CASES))
def test_predicted_events_equal_executed_events(kind):
    """Without prefetch every fill is in a hook: the model's fills, evictions and reduces are the runtime's, in the
    same order, at the same places; and the order the runtime's scheduler reads is the one the model builds."""
    predicted, executed, order, runtime_order, pred, stats = _record(kind, prefetch_depth=0)
    assert order == runtime_order
    assert {e.kind for e in executed} == {"fill", "evict", "reduce"}
    assert {e.phase for e in executed if e.kind == "fill"} == {"fwd", "bwd"}  # the budget forces refills
    assert predicted == executed
    assert pred.onloads == stats["step_num_onloads"] == sum(e.kind == "fill" for e in executed)


def test_fills_ahead_follow_the_shared_window():
    """With ``prefetch_depth=2`` the runtime's scheduler fills chunks ahead, at the places :meth:`StepOrder.window`
    names: the same fills, evictions and reduces as the model prices (which prices a fill at its use), each fill
    no later than the model's place and no earlier than the first window that holds its use."""
    predicted, executed, order, runtime_order, pred, stats = _record("gpt2", prefetch_depth=2)
    assert order == runtime_order
    key = [(e.phase, e.kind, e.chunk) for e in executed]
    assert sorted(key) == sorted((e.phase, e.kind, e.chunk) for e in predicted)
    assert [e for e in executed if e.kind == "reduce"] == [e for e in predicted if e.kind == "reduce"]
    # the scheduler runs after each unit's access, with that unit's chunks pinned
    pinned_at, pos = {}, 0
    for group in _groups("gpt2"):
        pos += len(set(group))
        pinned_at[pos] = set(group)
    every = set(order.trace)
    pinned = [pinned_at.get(p, every) for p in range(len(order))]
    runtime_at, model_at = {}, {}
    for events, out in ((executed, runtime_at), (predicted, model_at)):
        for e in events:
            if e.kind == "fill":
                out.setdefault((e.phase, e.chunk), []).append(e.at)
    ahead = 0
    for fill, places in runtime_at.items():
        for at, use in zip(places, model_at[fill]):
            assert order.issue_position(use - 1, 2, pinned) <= at <= use, (fill, at, use)
            ahead += at < use
    assert ahead >= 5


def test_step_order_window_and_phase_ends():
    order = StepOrder.from_events([(0,), (1, 0), (2,), (2,), (1,), (0,)], ["fwd", "fwd", "fwd", "bwd", "bwd", "bwd"])
    assert order.trace == (0, 0, 1, 2, 2, 1, 0)
    assert (order.forward_ends, order.backward_ends) == ((4,), (7,))
    assert order.next_use(0, after=1) == 6 and order.next_use(2, after=4) == float("inf")
    assert order.window(1, pinned={0}, depth=2) == [(2, 1), (3, 2)]
    assert order.window(1, pinned={0}, depth=0) == []
    assert order.window_end(1, backward=False) == 4 and order.window_end(4, backward=True) == 7
    assert StepOrder((3, 4)).window_end(0, backward=True) == 0  # no backward in that step: nothing ahead
    assert order.issue_position(3, depth=1, pinned_at=[{0}, {0}, {1}]) == 2
    assert order.issue_position(3, depth=2) == 2 and order.issue_position(6, depth=1) == 6


def _two_rank_worker(rank: int, world_size: int):
    hardware = fixed_cpu_hardware()
    model = tiny_model("gpt2")
    budget = int(sum(p.numel() for p in model.parameters()) * 4 * 0.6)
    profile = fixed_times(profile_step(model, rank_batch("gpt2", 0, rank, world_size, 4)))
    step = build_chunked_step(profile, 4096, world_size=world_size, precision="fp32", hardware=hardware)
    predicted = EventRecorder()
    pred = predict(step, Knobs(), hardware, pool_bytes=budget, recorder=predicted)
    plan = dataclasses.replace(priced_plan(profile, [], pred), world_size=world_size)
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   ElixirConfig(plan=plan, device_memory_budget_bytes=budget,
                                                budget_covers_activations=False))
    manager = hf_elixir.get_state(model).manager
    for i in range(3):
        if i == 2:
            manager.recorder = EventRecorder()
        model(**rank_batch("gpt2", i, rank, world_size, 4)).loss.backward()
        opt.step()
        opt.zero_grad()
    stats = hf_elixir.memory_stats(model)
    return (predicted.events, manager.recorder.events, step.order == manager.prev_order, pred.onloads,
            stats["step_num_blocking_gathers"])


def test_predicted_gathers_equal_executed_gathers_at_two_ranks():
    """Two ranks, chunks sharded: every fill is an all-gather in its hook; the model's all-gathers, evictions and
    reduce-scatters are each rank's, in the same order, at the same places."""
    for predicted, executed, same_order, onloads, gathers in run_distributed(_two_rank_worker, 2, timeout_s=120):
        assert same_order
        assert {(e.phase, e.kind) for e in executed} >= {("fwd", "fill"), ("bwd", "fill"), ("fwd", "evict")}
        assert predicted == executed
        assert onloads == gathers == sum(e.kind == "fill" for e in executed)
