"""Cost model and search accuracy on CPU with the simulated device pool (the measured checks).

For tiny GPT-2 / OPT at several budgets: the searched plan's predicted step time next to the measured
one, and the searched plan's measured time next to the fastest point of a brute-force grid over the same
knobs (resident chunks x device optimizer states), every point prepared and timed for real.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/tests python benchmarks/search_accuracy.py [--steps 12]

Timings are the fastest of ``--steps`` steps after two warm-up steps, over interleaved rounds (a shared
machine is noisy).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import hf_elixir  # noqa: E402
from hf_elixir import ElixirConfig  # noqa: E402
from hf_elixir.plan import ElixirPlan  # noqa: E402
from hf_elixir import probe_hardware  # noqa: E402 - with the runtime probe
from hf_elixir.profiler import profile_step  # noqa: E402
from hf_elixir.search import brute_force_grid, search  # noqa: E402

from _models import batch, tiny_model  # noqa: E402


def measure(kind: str, plan: ElixirPlan, budget: int, steps: int) -> float:
    """Fastest full training step (forward, backward, optimizer step, zero_grad) in seconds."""
    model = tiny_model(kind)
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   # the search priced a model-data-only pool (activations off the device
                                   # off CUDA): the budget bounds model data here too
                                   ElixirConfig(plan=plan, device_memory_budget_bytes=budget,
                                                budget_covers_activations=False))
    best = float("inf")
    for step in range(steps + 2):
        data = batch(kind, step, 4, 16)
        start = time.perf_counter()
        model(**data).loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= 2:
            best = min(best, time.perf_counter() - start)
    assert hf_elixir.memory_stats(model)["device_peak_bytes"] <= budget
    return best


def _plan_for(result_plan: ElixirPlan, knobs) -> ElixirPlan:
    return ElixirPlan(**{**result_plan.to_dict(), "resident_chunks": sorted(knobs.resident),
                         "device_shard_chunks": sorted(knobs.device_shard | knobs.resident),
                         "device_optim_chunks": sorted(knobs.device_optim), "prefetch_depth": knobs.prefetch_depth})


def run(kinds=("gpt2", "opt"), fractions=(0.9, 1.4, 3.0), steps: int = 12, grid: bool = True,
        hardware=None, rounds: int = 3) -> list[dict]:
    hardware = hardware or probe_hardware()
    rows = []
    for kind in kinds:
        model = tiny_model(kind)
        numel = sum(p.numel() for p in model.parameters())
        profile = profile_step(model, batch(kind, 0, 4, 16), repeats=3)
        for fraction in fractions:
            budget = int(numel * 4 * fraction)
            result = search(profile, hardware, device_memory_budget_bytes=budget)
            predicted = result.best.prediction.step_s
            points = brute_force_grid(profile, hardware, device_memory_budget_bytes=budget,
                                      chunk_size_numel=result.plan.chunk_size_numel) if grid else []
            plans = [result.plan] + [_plan_for(result.plan, c.knobs) for c in points]
            # interleaved rounds, fastest per configuration: load on a shared machine comes and goes
            times = [float("inf")] * len(plans)
            for _ in range(rounds):
                for i, plan in enumerate(plans):
                    times[i] = min(times[i], measure(kind, plan, budget, steps))
            measured = times[0]
            row = {"model": kind, "budget_bytes": budget, "searched": result.best.summary(),
                   "predicted_s": predicted, "measured_s": measured, "error": predicted / measured - 1}
            if grid:
                fastest = min(times[1:])
                cand = points[times[1:].index(fastest)]
                row.update(grid_points=len(points), grid_fastest_s=fastest, grid_fastest=cand.summary(),
                           searched_vs_grid=measured / fastest - 1)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-grid", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(steps=args.steps, grid=not args.no_grid)
    print(f"{'model':6} {'budget B':>9} {'predicted ms':>12} {'measured ms':>11} {'error':>7} "
          f"{'grid best ms':>12} {'searched vs grid':>16}")
    for r in rows:
        print(f"{r['model']:6} {r['budget_bytes']:>9} {r['predicted_s'] * 1e3:>12.3f} {r['measured_s'] * 1e3:>11.3f} "
              f"{r['error']:>+7.1%} {r.get('grid_fastest_s', float('nan')) * 1e3:>12.3f} "
              f"{r.get('searched_vs_grid', float('nan')):>+16.1%}")
    for r in rows:
        print(f"{r['model']} {r['budget_bytes']}: searched {r['searched']}")
        if "grid_fastest" in r:
            print(f"{'':>{len(r['model'])}} {r['budget_bytes']}: grid best {r['grid_fastest']} ({r['grid_points']} points)")


if __name__ == "__main__":
    main()
