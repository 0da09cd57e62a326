"""At several ranks a pool that charges activations makes the runtime keep a rank-local host copy of every
offloadable chunk whatever the plan says (``choose_host_copies``; [Note: rank-local refill] in
``hf_elixir/chunk/chunk.py``): a chunk evicted within the step is refilled from it, not all-gathered again. The cost
model prices every point that way too (``host_copies_forced``), so a searched plan's all-gather and H2D bytes are
the runtime's; before, a plan without host copies was priced with backward re-gathers the runtime never issues."""

from __future__ import annotations

import dataclasses

import torch

import hf_elixir
from hf_elixir import ElixirConfig
from hf_elixir.profiler import profile_step
from hf_elixir.search import search
from hf_elixir.search._cost import build_chunked_step, host_copies_forced, predict
from tests._dist import run_distributed
from tests._models import batch, fixed_cpu_hardware, fixed_times, tiny_model

ROWS, SEQ = 2, 16
FRACTION = 3.0


def _worker(rank: int, world_size: int):
    hw = fixed_cpu_hardware(world_size=world_size)
    sample = batch("gpt2", 0, ROWS, SEQ)
    profile = fixed_times(profile_step(tiny_model("gpt2"), sample))
    budget = int(profile.num_params * 4 * FRACTION)
    result = search(profile, hw, world_size=world_size, device_memory_budget_bytes=budget, data_parallel="sharded",
                    activations_on_device=True)
    pred = result.best.prediction
    # the same point priced as a plan without copies would have been: the runtime keeps them anyway
    step = build_chunked_step(profile, result.best.chunk_size_numel, world_size=world_size, precision="fp32",
                              hardware=hw, activation_checkpointing=result.best.activation_checkpointing,
                              activation_policy=result.best.activation_policy or None)
    plain = dataclasses.replace(result.best.knobs, host_copies=False, cache_blocks=0)
    unforced = predict(step, plain, hw, pool_bytes=budget - step.activation_bytes, activations_on_device=False)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = hf_elixir.prepare(model, opt, ElixirConfig(plan=result.plan, device_memory_budget_bytes=budget,
                                                            default_placement="sharded"))
    for s in range(3):  # the same batch shapes on both ranks: the evictions, and so the counts, agree
        hf_elixir.reset_memory_stats(model) if s == 2 else None
        model(**batch("gpt2", 10 * s + rank, ROWS, SEQ)).loss.backward()
        opt.step()
        opt.zero_grad()
    stats = hf_elixir.memory_stats(model)
    kept = [c.chunk_id for c in hf_elixir.get_state(model).manager.chunks if c.keep_host_copy]
    return (result.plan.host_copy_chunks, kept, host_copies_forced(step, True),
            (pred.allgather_bytes, pred.h2d_bytes, pred.onloads),
            (stats["step_allgather_bytes"], stats["step_h2d_bytes"], stats["step_num_onloads"]),
            None if unforced is None else unforced.allgather_bytes)


def test_a_budget_covering_activations_prices_the_host_copies_the_runtime_keeps():
    for rank, (planned, kept, forced, predicted, measured, unforced_gathers) in enumerate(
            run_distributed(_worker, 2, timeout_s=300)):
        assert forced and kept, (rank, kept)
        assert planned == kept, (rank, planned, kept)  # the plan lists the copies the runtime keeps
        assert predicted[0] == measured[0] > 0, (rank, predicted, measured)  # all-gather bytes
        assert measured[2] > 0, (rank, measured)  # the budget binds: chunks are refilled within the step
        # priced without the copies, the point would re-gather in backward what the runtime refills locally
        assert unforced_gathers is None or unforced_gathers > measured[0], (rank, unforced_gathers, measured)
