"""``benchmarks/gpu.py``'s summary.md: one line per section, the GPT-2 parity table and the OPT-1.3B table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_summary"]

GIB = 2**30


def _gib(value: Any) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) else "-"


def _step_summary(rows: list[dict]) -> dict[str, Any]:
    steps = [r for r in rows if "step_s" in r]
    timed = [r["step_s"] for r in steps[1:]] or [r["step_s"] for r in steps]
    return {"median_s": sorted(timed)[len(timed) // 2] if timed else None,
            "pool_peak": max((r["pool_peak_bytes"] for r in steps if "pool_peak_bytes" in r), default=None),
            "cuda_peak": max((r["cuda_max_allocated_bytes"] for r in steps if "cuda_max_allocated_bytes" in r),
                             default=None),
            "h2d": (sum(r.get("h2d_bytes", 0) for r in steps[1:]) / max(1, len(steps) - 1)) if len(steps) > 1 else None}


def write_summary(out: Path, results: dict[str, Any], total_budget_s: float) -> None:
    """``<out>/summary.md``: one line per section, the parity and OPT tables, the failures."""
    sections = results["sections"]
    lines = ["# hf_elixir GPU run (benchmarks/gpu.sh)", "",
             f"- dry run: {results['dry_run']}; took {results.get('wall_s', 0):.0f} s of a {total_budget_s:.0f} s budget",
             f"- environment: `{json.dumps(sections.get('env', {}).get('env', {}))}`", "",
             "| section | status | wall (s) | result |", "|---|---|---|---|"]
    for name, sec in sections.items():
        lines.append(f"| {name} | {sec.get('status')} | {sec.get('wall_s', '-')} | "
                     f"{_headline(name, sec)} |".replace("\n", " "))
    parity = sections.get("parity", {}).get("rows", [])
    if parity:
        lines += ["", "## Parity: GPT-2 small vs plain PyTorch AdamW (per-step pool peak vs CUDA peak in results.json)",
                  "", "| run | ok | max loss rel diff | param rel L2 | budget (GiB) | median step (s) | "
                  "pool peak (GiB) | torch.cuda max allocated (GiB) |", "|---|---|---|---|---|---|---|---|"]
        for row in parity:
            s = _step_summary(row.get("steps", []))
            lines.append(f"| {row.get('run')} | {row.get('ok', '-')} | {row.get('max_loss_rel_diff', '-'):.3g} | "
                         f"{row.get('param_rel_l2', '-')} | {_gib(row.get('budget_bytes'))} | "
                         f"{s['median_s'] if s['median_s'] is None else round(s['median_s'], 4)} | "
                         f"{_gib(s['pool_peak'])} | {_gib(s['cuda_peak'])} |"
                         if "max_loss_rel_diff" in row else
                         f"| {row.get('run')} | {row.get('ok', '-')} | {row.get('error', row.get('skipped', 'reference'))[:120]} "
                         f"| | | {s['median_s'] if s['median_s'] is None else round(s['median_s'], 4)} | | "
                         f"{_gib(s['cuda_peak'])} |")
    opt = {k: v for k, v in sections.items() if k.startswith("opt_")}
    if opt:
        lines += ["", "## OPT-1.3B (random init), one GPU", "", "| system | status | median step (s) | tokens/s | "
                  "budget (GiB) | pool peak (GiB) | torch.cuda max allocated (GiB) | H2D per step (GiB) |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, sec in opt.items():
            s = _step_summary(sec.get("rows", []))
            lines.append(f"| {sec.get('system', name)} | {sec.get('status')}{': ' + sec['skipped'] if 'skipped' in sec else ''} | "
                         f"{sec.get('median_step_s', '-')} | {sec.get('tokens_per_s', '-')} | "
                         f"{_gib(sec.get('budget_bytes'))} | {_gib(s['pool_peak'])} | {_gib(s['cuda_peak'])} | "
                         f"{_gib(s['h2d'])} |")
    failed = {n: s.get("error", "")[:300] for n, s in sections.items() if s.get("status") == "failed"}
    if failed:
        lines += ["", "## Failures", ""] + [f"- **{n}**: {e}" for n, e in failed.items()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def _headline(name: str, sec: dict[str, Any]) -> str:
    if sec.get("status") == "failed":
        return "FAILED: " + sec.get("error", "")[:150]
    if "skipped" in sec:
        return "skipped: " + sec["skipped"]
    if name == "env":
        env = sec.get("env", {})
        return f"{env.get('gpu', 'no GPU')}, torch {env.get('torch')}, triton {env.get('triton')}"
    if name == "kernels":
        return (f"{sec.get('num_checks')} checks, failed {sec.get('failed_checks')}, "
                f"{len(sec.get('compiled_binaries', []))} binaries compiled")
    if name == "adamw_bw":
        return (f"fused AdamW {sec.get('adamw_fp32_gbs', 0):.0f} GB/s = {100 * sec.get('adamw_fraction_of_copy', 0):.1f}% "
                f"of copy ({sec.get('copy_gbs', 0):.0f} GB/s); x{sec.get('speedup_vs_torch_fused', 0):.2f} vs torch fused")
    if name == "parity":
        runs = sec.get("rows", [])
        return f"{sum(1 for r in runs if r.get('ok'))}/{sum(1 for r in runs if 'ok' in r)} runs within tolerance"
    if name.startswith("opt_"):
        return f"median {sec.get('median_step_s', '-')} s/step"
    if name == "search":
        return (f"predicted {sec.get('predicted_step_s', 0):.4g} s (compute {sec.get('predicted_compute_s', 0):.4g} s) "
                f"vs measured {sec.get('measured_step_s', 0):.4g} s: x{sec.get('predicted_over_measured', 0):.2f}")
    return ""
