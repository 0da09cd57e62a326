"""Mixture-of-experts under expert parallel vs ZeRO vs a dense model of the same size (2 gloo CPU ranks).

For each shape, three runs of full AdamW training steps under hf_elixir at 2 ranks, side by side:

- ``ep2``: a Mixtral-style model (``MixtralForCausalLM`` from a config built offline) with
  ``expert_parallel_size=2``: ``hf_elixir.parallel.parallelize`` keeps half the experts of every layer on
  each rank (placed by ``MixtralConfig``'s own ``base_model_ep_plan``), tokens reach their expert by
  all-to-all, everything else is ZeRO-3 sharded;
- ``zero``: the same model (same seed, same batches) with every module ZeRO-3 sharded, no expert parallel
  (each fused expert tensor is all-gathered whole before use);
- ``dense``: a ``MistralForCausalLM`` with the same attention and a dense SwiGLU MLP of width
  ``experts x expert width``, so the same parameter count (less the router), ZeRO-3 sharded.

Everything is resident (no budget): the comparison is compute, not offload. Each rank trains on its own
``batch x seq`` random tokens per step; tokens/s counts both ranks' tokens.

The physical bound: a token of the dense model costs ``attention + dense MLP`` FLOPs per layer, a token of
the MoE ``attention + router + experts_per_tok expert MLPs``. Their ratio (:func:`flops_per_token`; forward
matmuls, 2 FLOPs per multiply-add; backward is twice the forward for every matmul, so the ratio is the
training step's) bounds how much faster the MoE can train per token. The LM head (the same in both) is
left out of the bound, which makes the bound larger and the target stricter; its FLOPs are in the JSON.

Targets: EP tokens/s over dense tokens/s >= 0.75 x bound on every shape, and >= 3x on a shape
whose bound is >= 4 (8 experts, top-1, expert MLPs dominating the FLOPs).

Usage (from the repository root; about 10 minutes on 2 busy cores)::

    python benchmarks/moe_dense.py --out benchmarks/out/moe_dense.json
    python benchmarks/moe_dense.py --quick --out /tmp/moe_dense.json      # tiny shapes, seconds

The machine is shared, so the full run repeats every run ``--rounds`` times (2), in reversed order in
even rounds, and pools the timed steps (``benchmarks/run_cpu.py``'s [Note: interleaved rounds]); the
per-round ratios are printed next to the pooled one. CPU seconds per step (summed over both ranks) are
far less sensitive to other jobs than wall time: their ratio is printed too, judged against the same
targets, and a wall-clock ratio above the FLOP bound (which no implementation can beat) is flagged as
inflated by other jobs; the 1-minute load average at the end of every run is in the JSON. ``--quick`` runs every
spec once in one spawned process group (what ``tests/test_benchmarks.py`` runs). Exit status 1 when a
run failed; targets missed are reported, not an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/moe_dense.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import ModelSpec, RunResult, RunSpec, count_params, launch, launch_group  # noqa: E402

__all__ = ["SHAPES", "QUICK_SHAPES", "dense_twin", "flops_per_token", "run", "main"]

PEER = "elixir_resident_sharded"  # hf_elixir, everything resident, ZeRO-3 sharded (benchmarks/peers.py)
FRACTION_OF_BOUND = 0.75
BIG_BOUND, BIG_SPEEDUP = 4.0, 3.0  # a shape whose bound is >= 4 must reach >= 3x

_BASE = dict(family="mixtral", n_layer=2, n_embd=512, n_head=8, intermediate_size=1024, num_experts=8,
             vocab_size=2048, n_positions=256, batch_size=8, seq_len=256)
#: the measured shapes: Mixtral's 8 experts, top-2 (Mixtral-8x7B's routing) and top-1 (Switch's)
SHAPES: dict[str, ModelSpec] = {
    "mixtral-8-top2": ModelSpec(**_BASE, experts_per_tok=2),
    "8-experts-top1": ModelSpec(**_BASE, experts_per_tok=1),
}
_TINY = dict(family="mixtral", n_layer=1, n_embd=32, n_head=2, intermediate_size=16, num_experts=8,
             vocab_size=128, n_positions=16, batch_size=2, seq_len=16)
#: ``--quick``: the same routing at a microscopic size (seconds; the ratios mean nothing there)
QUICK_SHAPES: dict[str, ModelSpec] = {
    "mixtral-8-top2": ModelSpec(**_TINY, experts_per_tok=2),
    "8-experts-top1": ModelSpec(**_TINY, experts_per_tok=1),
}


def dense_twin(moe: ModelSpec) -> ModelSpec:
    """The dense Mistral with ``moe``'s attention, batch and vocabulary and one MLP of width
    ``num_experts x intermediate_size``: the same parameters as ``moe`` less its routers."""
    return dataclasses.replace(moe, family="mistral", intermediate_size=moe.num_experts * moe.intermediate_size,
                               num_experts=0, experts_per_tok=0)


def flops_per_token(spec: ModelSpec) -> dict[str, float]:
    """Forward FLOPs one token costs in ``spec`` (2 per multiply-add), by part.

    Per layer: ``attention_projections`` (q, k, v, o; grouped-query k/v are ``n_kv_head`` heads wide),
    ``attention_scores`` (q.k and the weighted sum of v over the causal prefix: ``(seq_len + 1) / 2`` keys on
    average), ``router`` (Mixtral: hidden -> experts logits) and ``mlp`` (SwiGLU gate, up and down projections:
    ``experts_per_tok`` expert MLPs for Mixtral, the one dense MLP for Mistral). ``layers`` is their sum over
    ``n_layer`` layers (what the bound compares); ``lm_head`` (hidden -> vocabulary, once per token) is reported
    apart. Norms, softmax and activations are left out (well under 1% here).
    """
    h = spec.n_embd
    head_dim = h // spec.n_head
    kv = (spec.n_kv_head or spec.n_head) * head_dim
    parts = {
        "attention_projections": 2.0 * (2 * h * h + 2 * h * kv),
        "attention_scores": 2.0 * 2 * h * (spec.seq_len + 1) / 2,
        "router": 2.0 * h * spec.num_experts,
        "mlp": 2.0 * 3 * h * spec.intermediate_size * (spec.experts_per_tok if spec.family == "mixtral" else 1),
    }
    parts["layers"] = spec.n_layer * sum(parts.values())
    parts["lm_head"] = 2.0 * h * spec.vocab_size
    return parts


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclasses.dataclass
class _Pooled:
    """One run's timed steps pooled over rounds (per-round medians kept)."""

    result: RunResult
    round_medians_s: list[float] = dataclasses.field(default_factory=list)
    round_cpu_s: list[float] = dataclasses.field(default_factory=list)
    round_loadavg: list[float] = dataclasses.field(default_factory=list)  # 1-minute load average as each run ended

    @classmethod
    def first(cls, result: RunResult) -> "_Pooled":
        pooled = cls(result)
        if result.ok:
            pooled.round_medians_s.append(result.median_s)
            pooled.round_cpu_s.append(sum(result.cpu_median_s))
        pooled.round_loadavg.append(os.getloadavg()[0])
        return pooled

    def add(self, again: RunResult) -> None:
        self.result.step_times_s.extend(again.step_times_s)
        for mine, theirs in zip(self.result.cpu_times_s, again.cpu_times_s):
            mine.extend(theirs)
        self.round_medians_s.append(again.median_s)
        self.round_cpu_s.append(sum(again.cpu_median_s))
        self.round_loadavg.append(os.getloadavg()[0])


def _specs(shapes: dict[str, ModelSpec], warmup: int, steps: int) -> dict[str, RunSpec]:
    """``{tag: RunSpec}``: ``<shape>_ep2`` and ``<shape>_zero`` per shape, one ``dense-ffn<width>`` per distinct
    dense twin (shapes that differ only in routing share it)."""
    out: dict[str, RunSpec] = {}
    sharded = {"default_placement": "sharded"}
    for name, moe in shapes.items():
        dense = dense_twin(moe)
        runs = {f"{name}_ep2": (moe, {**sharded, "expert_parallel_size": 2}), f"{name}_zero": (moe, sharded),
                f"dense-ffn{dense.intermediate_size}": (dense, sharded)}
        for tag, (model, options) in runs.items():
            out.setdefault(tag, RunSpec(peer=PEER, world_size=2, model=model, warmup_steps=warmup, steps=steps,
                                        options=options, tag=tag))
    return out


def run(shapes: dict[str, ModelSpec], work_dir: Path, *, warmup: int, steps: int, rounds: int,
        shared_process: bool, timeout_s: float) -> dict[str, _Pooled]:
    """Every spec of :func:`_specs`, ``rounds`` times interleaved (or once in one process group when
    ``shared_process``); returns ``{tag: pooled result}`` (a failed run keeps its error)."""
    specs = _specs(shapes, warmup, steps)
    if shared_process:
        _log(f"running {len(specs)} runs in one process group of 2 ranks ...")
        results = launch_group(list(specs.values()), work_dir, timeout_s=timeout_s)
        pooled = {tag: _Pooled.first(r) for tag, r in zip(specs, results)}
        for tag, p in pooled.items():
            _log_result(tag, p.result)
        return pooled
    pooled: dict[str, _Pooled] = {}
    for round_index in range(1, rounds + 1):
        order = list(specs) if round_index % 2 else list(reversed(specs))
        for tag in order:
            if tag in pooled and not pooled[tag].result.ok:
                continue
            _log(f"round {round_index}/{rounds}: {tag} ({specs[tag].model.label()}) ...")
            result = launch(specs[tag], work_dir / f"round{round_index}", timeout_s=timeout_s)
            _log_result(tag, result)
            if tag not in pooled or not result.ok:
                pooled[tag] = _Pooled.first(result)
            else:
                pooled[tag].add(result)
    return pooled


def _log_result(tag: str, result: RunResult) -> None:
    if result.ok:
        _log(f"  {tag}: median {result.median_s:.3f} s/step, {result.tokens_per_s:.0f} tokens/s, "
             f"CPU {sum(result.cpu_median_s):.3f} s/step (both ranks), loss {result.losses[0]:.4f} -> "
             f"{result.losses[-1]:.4f}")
    else:
        _log(f"  {tag}: FAILED: {result.error.splitlines()[0]}")


def _run_record(p: _Pooled) -> dict[str, Any]:
    r = p.result
    if not r.ok:
        return {"ok": False, "error": r.error}
    return {"ok": True, "tokens_per_s": r.tokens_per_s, "median_step_s": r.median_s, "step_times_s": r.step_times_s,
            "cpu_s_per_step": sum(r.cpu_median_s), "cpu_s_per_step_per_rank": r.cpu_median_s,
            "round_medians_s": p.round_medians_s, "round_cpu_s_per_step": p.round_cpu_s,
            "round_loadavg_1min": p.round_loadavg, "losses": r.losses,
            "num_params": r.num_params, "peak_rss_bytes": r.peak_rss_bytes,
            "allgather_bytes_per_step": r.extra.get("allgather_bytes_per_step"),
            "reduce_scatter_bytes_per_step": r.extra.get("reduce_scatter_bytes_per_step")}


def _max_rel_diff(a: list[float], b: list[float]) -> float | None:
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def summarize(shapes: dict[str, ModelSpec], pooled: dict[str, _Pooled]) -> dict[str, Any]:
    """Per shape: the FLOPs, the bound, the three runs, the ratios and whether the targets are met."""
    out: dict[str, Any] = {}
    for name, moe in shapes.items():
        dense = dense_twin(moe)
        runs = {"ep2": pooled[f"{name}_ep2"], "zero": pooled[f"{name}_zero"],
                "dense": pooled[f"dense-ffn{dense.intermediate_size}"]}
        moe_flops, dense_flops = flops_per_token(moe), flops_per_token(dense)
        bound = dense_flops["layers"] / moe_flops["layers"]
        with_head = (dense_flops["layers"] + dense_flops["lm_head"]) / (moe_flops["layers"] + moe_flops["lm_head"])
        shape: dict[str, Any] = {
            "model": dataclasses.asdict(moe), "dense_model": dataclasses.asdict(dense),
            "num_params_moe": count_params(moe), "num_params_dense": count_params(dense),
            "flops_per_token_moe": moe_flops, "flops_per_token_dense": dense_flops,
            "flop_bound": bound, "flop_ratio_with_lm_head": with_head,
            "runs": {k: _run_record(v) for k, v in runs.items()},
        }
        ok = all(v.result.ok for v in runs.values())
        if ok:
            ep, zero, dn = (runs[k].result for k in ("ep2", "zero", "dense"))
            ratio = ep.tokens_per_s / dn.tokens_per_s
            rounds = [d / e for e, d in zip(runs["ep2"].round_medians_s, runs["dense"].round_medians_s)]
            shape.update(
                ep_over_dense=ratio, zero_over_dense=zero.tokens_per_s / dn.tokens_per_s,
                ep_over_zero=ep.tokens_per_s / zero.tokens_per_s,
                ep_over_dense_rounds=rounds,
                cpu_ep_over_dense=sum(dn.cpu_median_s) / sum(ep.cpu_median_s),
                cpu_zero_over_dense=sum(dn.cpu_median_s) / sum(zero.cpu_median_s),
                fraction_of_bound=ratio / bound,
                loss_max_rel_diff_ep_vs_zero=_max_rel_diff(ep.losses, zero.losses),
            )
            shape["wall_above_bound"] = ratio > bound  # impossible in compute: the dense run waited for cores longer
            shape["targets"] = _targets(ratio, bound)
            shape["targets_cpu"] = _targets(shape["cpu_ep_over_dense"], bound)
        out[name] = shape
    return out


def _targets(ratio: float, bound: float) -> dict[str, dict[str, Any]]:
    """The targets for an EP/dense ``ratio`` at a FLOP ``bound``: >= 0.75 x bound; >= 3x when bound >= 4."""
    out = {"fraction_of_bound": {"target": FRACTION_OF_BOUND * bound, "met": ratio >= FRACTION_OF_BOUND * bound}}
    if bound >= BIG_BOUND:
        out["speedup_3x"] = {"target": BIG_SPEEDUP, "met": ratio >= BIG_SPEEDUP}
    return out


def _met(targets: dict[str, dict[str, Any]]) -> str:
    return "yes" if all(t["met"] for t in targets.values()) else "NO"


def _table(summary: dict[str, Any]) -> str:
    head = ("| shape | FLOP bound dense/MoE | EP=2 tok/s | ZeRO tok/s | dense tok/s | EP/dense tok/s (rounds) | "
            "EP/dense CPU-s | target | met: tok/s, CPU-s | ZeRO/dense tok/s | EP/ZeRO tok/s |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, s in summary.items():
        runs = s["runs"]
        if "ep_over_dense" not in s:
            failed = ", ".join(f"{k}: {v['error'].splitlines()[0][:80]}" for k, v in runs.items() if not v["ok"])
            lines.append(f"| {name} | {s['flop_bound']:.2f} | FAILED: {failed} |" + " |" * 8)
            continue
        wanted = " and ".join(f">= {t['target']:.2f}" for t in s["targets"].values())
        rounds = ", ".join(f"{x:.2f}" for x in s["ep_over_dense_rounds"])
        flag = " (above the bound!)" if s["wall_above_bound"] else ""
        lines.append(f"| {name} | {s['flop_bound']:.2f} | {runs['ep2']['tokens_per_s']:.0f} | "
                     f"{runs['zero']['tokens_per_s']:.0f} | {runs['dense']['tokens_per_s']:.0f} | "
                     f"{s['ep_over_dense']:.2f}x{flag} ({rounds}) | {s['cpu_ep_over_dense']:.2f}x | {wanted} | "
                     f"{_met(s['targets'])}, {_met(s['targets_cpu'])} | {s['zero_over_dense']:.2f}x | "
                     f"{s['ep_over_zero']:.2f}x |")
    if any(s.get("wall_above_bound") for s in summary.values()):
        lines.append("\nabove the bound!: no training step does fewer FLOPs than the bound allows, so the dense run's "
                     "wall time was inflated by other jobs on the machine (it waited for a core longer); trust the "
                     "CPU-s ratio")
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "backend": "gloo"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 warm-up + 2 steps, one process group")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "moe_dense.json"),
                        help="JSON file written (default: benchmarks/out/moe_dense.json, not tracked)")
    parser.add_argument("--work-dir", default=None, help="per-rank logs and records (default: a temp dir)")
    parser.add_argument("--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPES)}")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved repeats (default 2; quick 1)")
    args = parser.parse_args(argv)
    shapes = dict(QUICK_SHAPES if args.quick else SHAPES)
    if args.shapes:
        unknown = [s for s in args.shapes.split(",") if s not in shapes]
        if unknown:
            parser.error(f"--shapes: unknown {unknown}; choose from {list(shapes)}")
        shapes = {s: shapes[s] for s in args.shapes.split(",")}
    warmup = 1 if args.warmup is None else args.warmup
    steps = args.steps or (2 if args.quick else 3)
    rounds = args.rounds or (1 if args.quick else 2)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="moe_dense_"))
    start = time.perf_counter()
    pooled = run(shapes, work_dir, warmup=warmup, steps=steps, rounds=rounds, shared_process=args.quick,
                 timeout_s=120.0 if args.quick else 900.0)
    summary = summarize(shapes, pooled)
    record = {"date": datetime.date.today().isoformat(), "quick": args.quick, "world_size": 2, "warmup_steps": warmup,
              "steps": steps, "rounds": rounds, "versions": _versions(),
              "targets": {"fraction_of_bound": FRACTION_OF_BOUND, "big_bound": BIG_BOUND, "big_speedup": BIG_SPEEDUP},
              "shapes": summary, "wall_s": time.perf_counter() - start}
    for key, field in (("all_targets_met", "targets"), ("all_targets_met_cpu", "targets_cpu")):
        met = [t["met"] for s in summary.values() for t in s.get(field, {}).values()]
        record[key] = bool(met) and all(met) and all(field in s for s in summary.values())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print()
    for name, s in summary.items():
        moe, dense = s["flops_per_token_moe"], s["flops_per_token_dense"]
        print(f"{name}: {ModelSpec(**s['model']).label()}; {s['num_params_moe'] / 1e6:.2f}M params vs dense "
              f"{s['num_params_dense'] / 1e6:.2f}M (ffn {s['dense_model']['intermediate_size']}); FLOPs/token "
              f"(layers) MoE {moe['layers'] / 1e6:.1f}M, dense {dense['layers'] / 1e6:.1f}M -> bound "
              f"{s['flop_bound']:.2f} ({s['flop_ratio_with_lm_head']:.2f} with the LM head)")
        if s.get("loss_max_rel_diff_ep_vs_zero") is not None:
            print(f"  EP vs ZeRO loss, every step on rank 0: max relative difference "
                  f"{s['loss_max_rel_diff_ep_vs_zero']:.2e}")
    print()
    print(_table(summary))
    print(f"\nall targets met: tokens/s {record['all_targets_met']}, CPU-s {record['all_targets_met_cpu']}"
          + (" (quick shapes: ratios not meaningful)" if args.quick else ""))
    print(f"wrote {out} ({record['wall_s']:.0f} s)")
    failed = [k for k, p in pooled.items() if not p.result.ok]
    if failed:
        print(f"{len(failed)} run(s) FAILED: {failed}; first error:\n{pooled[failed[0]].result.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
