"""The host AdamW step with the compute-dtype copy: step then a separate cast vs the same-pass step.

Times, side by side and interleaved (every variant once per round, rounds repeated; median or min), on this CPU:

* ``step``: the fused AdamW update alone (``torch._fused_adamw_`` over the chunk's views, one call per param
  group: what ``torch.optim.AdamW(fused=True)`` runs on the shard views);
* ``step+cast``: the same, then ``staging.copy_(master)`` (fp32 -> bf16) over the whole chunk: the host path
  before [Note: same-pass host step] (``hf_elixir/optim/_same_pass.py``);
* ``same-pass B``: :func:`hf_elixir.optim._same_pass.step_and_cast`, blocks of ``B`` elements.

for one chunk laid out like a layer of OPT-1.3B (hidden 2048: q/k/v/out 2048 x 2048, fc1/fc2 2048 x 8192 with
weight decay; biases and layer norms without), 50.4 M elements, with 1 thread and all threads. It prints each
variant's time, the ratio ``step+cast / same-pass`` and the cast's extra cost as a fraction of the step alone
in both forms: ``(step+cast - step) / step`` (the separate cast) and ``(same-pass - step) / step`` (what
``hf_elixir/search/_cost.py`` prices the same-pass cast at).

    PYTHONPATH=$PWD flock /tmp/bench.lock python benchmarks/host_adam.py [--rounds 7] [--layers 1]
        [--blocks 131072,262144,524288,1048576,2097152] [--threads 1,0] [--json out.json]

``--threads 0`` means all of ``torch.get_num_threads()`` at start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/host_adam.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_elixir.optim._same_pass import SamePassTable, ViewTensors, _kernel_call, step_and_cast  # noqa: E402

HIDDEN = 2048


def layer_views(layers: int, hidden: int = HIDDEN) -> list[tuple[int, bool]]:
    """``(numel, decays)`` of the parameters of ``layers`` OPT-shaped decoder layers (OPT-1.3B: hidden 2048), in
    module order."""
    h, ffn = hidden, 4 * hidden
    attention = [(h * h, True), (h, False)] * 4  # q, k, v, out: weight, bias
    mlp = [(h * ffn, True), (ffn, False), (ffn * h, True), (h, False)]  # fc1, fc2
    norm = [(h, False), (h, False)]
    return (attention + norm + mlp + norm) * layers


class Chunk:
    """One flat shard: fp32 master, gradient, Adam moments, bf16 staging, and its views in two param groups."""

    def __init__(self, layers: int, hidden: int = HIDDEN) -> None:
        sizes = layer_views(layers, hidden)
        self.numel = sum(n for n, _ in sizes)
        gen = torch.Generator().manual_seed(0)
        self.master = torch.randn(self.numel, generator=gen) * 0.02
        self.grad = torch.randn(self.numel, generator=gen) * 1e-3
        self.exp_avg = torch.zeros(self.numel)
        self.exp_avg_sq = torch.zeros(self.numel)
        self.staging = torch.empty(self.numel, dtype=torch.bfloat16)
        self.groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd, "amsgrad": False,
                        "maximize": False, "decoupled_weight_decay": True} for wd in (0.1, 0.0)]
        self.spans, cursor = [], 0
        for numel, _ in sizes:
            self.spans.append((cursor, cursor + numel))
            cursor += numel
        self.group_of = [0 if decays else 1 for _, decays in sizes]
        self.steps = [torch.tensor(0.0) for _ in sizes]

    def views(self) -> list[ViewTensors]:
        return [ViewTensors(self.master[lo:hi], self.grad[lo:hi], self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], None,
                            step, self.groups[g]) for (lo, hi), step, g in zip(self.spans, self.steps, self.group_of)]

    def step(self) -> None:
        """The unblocked update: one fused call per param group over whole views (torch.optim's fused path)."""
        views = self.views()
        torch._foreach_add_(self.steps, 1)
        for index, group in enumerate(self.groups):
            mine = [v for v, g in zip(views, self.group_of) if g == index]
            torch._fused_adamw_([v.param for v in mine], [v.grad for v in mine], [v.exp_avg for v in mine],
                                [v.exp_avg_sq for v in mine], [], [v.step for v in mine], amsgrad=False,
                                lr=group["lr"], beta1=0.9, beta2=0.999, weight_decay=group["weight_decay"],
                                eps=group["eps"], maximize=False)

    def step_then_cast(self) -> None:
        self.step()
        self.staging.copy_(self.master)

    def same_pass(self, table: SamePassTable) -> None:
        step_and_cast(table, self.views(), self.master, self.staging)

    def blocked_step(self, table: SamePassTable) -> None:
        """The same-pass walk without its cast: what cutting the update into blocks costs by itself."""
        views = self.views()
        torch._foreach_add_(self.steps, 1)
        for segments in table.segments:
            by_group: dict[int, list] = {}
            for seg in segments:
                by_group.setdefault(self.group_of[seg.view], []).append((views[seg.view], seg.start, seg.stop))
            for items in by_group.values():
                _kernel_call(items)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(threads: int, rounds: int, blocks: list[int], layers: int, diagnose: bool = False,
        stat: str = "median", hidden: int = HIDDEN) -> dict:
    torch.set_num_threads(threads)
    chunk = Chunk(layers, hidden)
    variants = {"step": chunk.step, "step+cast": chunk.step_then_cast}
    for block in blocks:
        table = SamePassTable.build(chunk.spans, chunk.numel, block)
        variants[f"same-pass {block}"] = lambda table=table: chunk.same_pass(table)
        if diagnose:
            variants[f"blocked, no cast {block}"] = lambda table=table: chunk.blocked_step(table)
    for fn in variants.values():  # warm up: page faults, thread pool
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))  # interleaved, order alternated
        for name in names:
            times[name].append(_time(variants[name]))
    medians = {name: (min(ts) if stat == "min" else statistics.median(ts)) for name, ts in times.items()}
    best = min((n for n in medians if n.startswith("same-pass")), key=medians.get)
    step = medians["step"]
    return {"threads": threads, "numel": chunk.numel, "rounds": rounds, "stat": stat, "seconds": medians, "best": best,
            "ratio_step_then_cast_over_same_pass": medians["step+cast"] / medians[best],
            "separate_cast_fraction": (medians["step+cast"] - step) / step,
            "same_pass_cast_fraction": {n: (medians[n] - step) / step for n in medians if n.startswith("same-pass")},
            "all_s": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=1, help="OPT-1.3B-shaped layers in the chunk (1: 50.4 M)")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="layer width (smoke tests: 64)")
    parser.add_argument("--blocks", default="131072,262144,524288,1048576,2097152")
    parser.add_argument("--threads", default="1,0", help="comma-separated; 0 = all threads")
    parser.add_argument("--json", default=None)
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="per variant over the rounds; min is the robust one on a shared, loaded machine")
    parser.add_argument("--diagnose", action="store_true", help="also time the blocked update without its cast")
    args = parser.parse_args(argv)
    all_threads = torch.get_num_threads()
    blocks = [int(b) for b in args.blocks.split(",")]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"host AdamW + bf16 copy, torch {torch.__version__}, {all_threads} threads available, load average {load}")
    results = []
    for threads in [int(t) or all_threads for t in args.threads.split(",")]:
        out = run(threads, args.rounds, blocks, args.layers, args.diagnose, args.stat, args.hidden)
        results.append(out)
        print(f"\n{threads} thread(s), chunk of {out['numel'] / 1e6:.1f} M elements, {args.stat} of {args.rounds} "
              "rounds:")
        for name, seconds in out["seconds"].items():
            extra = (seconds - out["seconds"]["step"]) / out["seconds"]["step"]
            print(f"  {name:<20} {seconds * 1e3:9.1f} ms   {out['numel'] / seconds / 1e9:6.2f} G elem/s   "
                  f"{100 * extra:+6.1f}% vs step")
        print(f"  step+cast / {out['best']}: {out['ratio_step_then_cast_over_same_pass']:.3f}x; cast as a fraction "
              f"of the step: separate {out['separate_cast_fraction']:.3f}, same pass "
              f"{out['same_pass_cast_fraction'][out['best']]:.3f}")
    print(f"\nload average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_start": load, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
