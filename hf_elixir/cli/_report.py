"""The ``hf-elixir plan`` report: one dict (what ``--json`` prints) and its tables.

What it says, in order: what to run and why it wins (step time, tokens per second of the whole job, memory per
GPU; the runner-up in the same terms, so a faster step that runs fewer tokens does not read as the winner), the
rates the plan is priced with and where each came from ([Note: target rates] in ``_plan.py``), the device memory
at the peak by kind with the source of each row (the rows add up to the peak), the runners-up, the activation
policy and placements, the search's reasons, and one count of the configurations searched. Sizes in GiB/TiB,
parameter counts in M/B, no scientific notation.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hf_elixir.cli._disk import disk_lines, disk_report
from hf_elixir.cli._units import human_bytes, human_count, human_s
from hf_elixir.plan import policy_summary

__all__ = ["build_report", "human_bytes", "human_count", "human_s", "print_json", "print_report"]

#: each kind of device memory at the peak (``Prediction.peak_breakdown``), what it holds and what sizes it
MEMORY_ROWS = {
    "resident_chunks": "whole chunks kept on the device for the step (compute dtype)",
    "device_shards": "this GPU's shards of the other chunks, kept on the device (compute dtype)",
    "device_optimizer": "optimizer state of the chunks updated on the device: per element of their shards the fp32 "
                        "gradient, the AdamW moments and the fp32 master (16 B for AdamW)",
    "refresh_staging": "fp32 staging for the uploads cast on the device",
    "cache": "gathered chunks borrowed while in use (cache blocks)",
    "grad_buffers": "gradient buffers and reduce outputs in flight",
    "onload_staging": "a shard being onloaded for a gather",
    "kept_grad_buffers": "finished gradient buffers kept for reuse",
    "activations": "saved activations at the peak, under the activation policy",
}


def _mesh(cand) -> str:
    return f"TP {cand.tensor_parallel_size} x EP {cand.expert_parallel_size}"


def _candidate(cand, args: argparse.Namespace) -> dict[str, Any]:
    """One priced configuration, per GPU, with the job's tokens per second (the data-parallel rows' tokens: the
    GPUs of a tensor-parallel group share one micro-batch)."""
    pred, k = cand.prediction, cand.knobs
    data_parallel = args.num_gpus // cand.tensor_parallel_size
    tokens = data_parallel * args.batch_size * args.seq_len
    return {"tensor_parallel": cand.tensor_parallel_size, "expert_parallel": cand.expert_parallel_size,
            "data_parallel": data_parallel, "data_parallel_kind": cand.data_parallel,
            "chunk_size_numel": cand.chunk_size_numel, "resident_chunks": len(k.resident),
            "cache_blocks": k.cache_blocks, "device_optimizer_chunks": len(k.device_optim),
            "prefetch_depth": k.prefetch_depth, "activations": policy_summary(cand.activation_policy),
            "step_s": round(pred.step_s, 6), "tokens_per_step": tokens, "tokens_per_s": round(tokens / pred.step_s, 1),
            "device_peak_bytes": int(pred.device_peak_bytes), "host_bytes_per_gpu": int(pred.host_bytes)}


def build_report(args: argparse.Namespace, profile, result, hardware, rates: list[dict], label: str) -> dict:
    """The whole report as plain data (``--json``)."""
    best, pred = result.best, result.best.prediction
    chosen = _candidate(best, args)
    ranked = [best] + [c for c in result.alternatives if c is not best]
    others, seen = [], set()
    for cand in ranked:
        row = _candidate(cand, args)
        key = tuple(v for k, v in row.items() if k not in ("tokens_per_s",))
        if key not in seen:
            seen.add(key)
            others.append(row)
    others.sort(key=lambda r: -r["tokens_per_s"])
    budget = hardware.device_total_bytes
    limit = int(budget * (1.0 - args.safety_margin))
    memory = [{"kind": key, "bytes": int(value), "holds": MEMORY_ROWS.get(key, key)}
              for key, value in pred.peak_breakdown.items() if value]
    degrees = {"tensor_parallel": {str(d): _degree(v, args) for d, v in result.best_by_tensor_parallel.items()},
               "expert_parallel": {str(d): _degree(v, args) for d, v in result.best_by_expert_parallel.items()}}
    return {
        "model": args.model, "parameters": int(profile.num_params), "precision": args.precision,
        "hardware": label, "num_gpus": args.num_gpus, "gpus_per_node": args.gpus_per_node,
        "micro_batch": {"batch_size": args.batch_size, "seq_len": args.seq_len},
        "chosen": chosen, "runner_up": _runner_up(chosen, others),
        "device_budget_bytes": int(budget), "device_limit_bytes": limit,
        "memory_at_peak": memory, "device_peak_bytes": int(pred.device_peak_bytes),
        "host_bytes_per_gpu": int(pred.host_bytes), "host_memory_per_machine_bytes": int(hardware.host_total_bytes),
        "gpus_sharing_a_host": min(args.num_gpus, args.gpus_per_node),
        "zero3_model_data_per_gpu_bytes": profile.model_data_bytes(args.precision, args.num_gpus),
        "rates": rates, "alternatives": others[:8], "degrees": degrees,
        "searched_configurations": int(result.evaluated), "search_s": round(result.search_s, 2),
        "reasons": list(result.plan.reasons),
        "disk": disk_report(pred, chosen["tokens_per_step"], min(args.num_gpus, args.gpus_per_node)),
    }


def _runner_up(chosen: dict, others: list[dict]) -> dict | None:
    """The best configuration of another mesh or data-parallel kind (what a user would otherwise run), else the
    next best one."""
    mesh = ("tensor_parallel", "expert_parallel", "data_parallel_kind")
    other = [r for r in others if any(r[k] != chosen[k] for k in mesh)]
    return (other or [r for r in others if r != chosen] or [None])[0]


def _degree(value, args: argparse.Namespace) -> dict | str:
    return value if isinstance(value, str) else _candidate(value, args)


def print_json(report: dict) -> None:
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")


def _headline(report: dict) -> list[str]:
    c = report["chosen"]
    mb = report["micro_batch"]
    lines = [
        f"{report['model']}: {human_count(report['parameters'])} parameters, {report['precision']}, on "
        f"{report['hardware']}",
        f"Run tensor parallel {c['tensor_parallel']} x expert parallel {c['expert_parallel']} x data parallel "
        f"{c['data_parallel']} ({c['data_parallel_kind']} chunks of {human_count(c['chunk_size_numel'])} elements, "
        f"activations {c['activations']}{' blocks' if c['activations'] != 'keep' else ''})",
        f"  predicted {human_s(c['step_s'])} a step for {_batches(c['data_parallel'])} of {mb['batch_size']} x "
        f"{mb['seq_len']} tokens = {c['tokens_per_s']:,.0f} tokens/s for the job",
        f"  device peak {human_bytes(c['device_peak_bytes'])} per GPU (of {human_bytes(report['device_budget_bytes'])}"
        f", {human_bytes(report['device_limit_bytes'])} after the safety margin); host "
        f"{human_bytes(c['host_bytes_per_gpu'])} per GPU x {report['gpus_sharing_a_host']} GPUs of "
        f"{human_bytes(report['host_memory_per_machine_bytes'])} per machine",
    ]
    runner = report["runner_up"]
    if runner:
        lines.append(f"Why: the most tokens/s of the {report['searched_configurations']:,} configurations searched; "
                     f"next best {_mesh_text(runner)}: {human_s(runner['step_s'])} a step for "
                     f"{_batches(runner['data_parallel'])} = {runner['tokens_per_s']:,.0f} tokens/s")
    return lines


def _batches(count: int) -> str:
    return f"{count} micro-batch{'es' if count != 1 else ''}"


def _mesh_text(row: dict) -> str:
    return (f"tensor parallel {row['tensor_parallel']} x expert parallel {row['expert_parallel']} "
            f"({row['data_parallel_kind']})")


def print_report(report: dict, plan) -> None:
    """The tables (rich), 140 columns wide when not on a terminal."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 140)
    for line in _headline(report) + disk_lines(report):
        console.print(line, highlight=False)
    rates = Table(title="rates priced (the target's, and where each came from)", title_justify="left")
    for col in ("rate", "value", "source"):
        rates.add_column(col)
    for r in report["rates"]:
        value = human_bytes(r["value"]) if r["unit"] == "bytes" else f"{r['value']:,.4g} {r['unit']}"
        rates.add_row(r["rate"], value, r["source"])
    console.print(rates)
    memory = Table(title=f"device memory per GPU at the step's peak (rows add up to "
                         f"{human_bytes(report['device_peak_bytes'])})", title_justify="left")
    for col, justify in (("kind", "left"), ("size", "right"), ("holds", "left")):
        memory.add_column(col, justify=justify)
    for row in report["memory_at_peak"]:
        memory.add_row(row["kind"], human_bytes(row["bytes"]), row["holds"])
    memory.add_row("total", human_bytes(report["device_peak_bytes"]), "the plan's predicted device peak")
    console.print(memory)
    zero3 = report["zero3_model_data_per_gpu_bytes"]
    console.print(f"(for scale: the whole model data split evenly over {report['num_gpus']} GPUs, as plain ZeRO-3 "
                  f"would, is {human_bytes(zero3['total'])} per GPU: parameters {human_bytes(zero3['params'])}, fp32 "
                  f"gradients {human_bytes(zero3['grads'])}, optimizer moments and masters "
                  f"{human_bytes(zero3['optimizer'])}; the plan keeps the rest on the host)", highlight=False)
    alts = Table(title="configurations compared (best tokens/s first)", title_justify="left")
    for col in ("TP x EP", "data parallel", "chunk", "resident", "cache blocks", "device optim", "prefetch",
                "activations", "step", "tokens/s", "device peak", "host per GPU"):
        alts.add_column(col)
    for r in report["alternatives"]:
        alts.add_row(f"{r['tensor_parallel']} x {r['expert_parallel']}",
                     f"{r['data_parallel']} {r['data_parallel_kind']}", human_count(r["chunk_size_numel"]),
                     str(r["resident_chunks"]), str(r["cache_blocks"]), str(r["device_optimizer_chunks"]),
                     str(r["prefetch_depth"]), r["activations"], human_s(r["step_s"]), f"{r['tokens_per_s']:,.0f}",
                     human_bytes(r["device_peak_bytes"]), human_bytes(r["host_bytes_per_gpu"]))
    console.print(alts)
    if plan.activation_policy:
        console.print(_policy_table(plan.activation_policy))
    console.print(_placement_table(plan.placements))
    for line in report["reasons"]:
        console.print(f"- {line}", highlight=False)
    console.print(f"searched {report['searched_configurations']:,} configurations in {human_s(report['search_s'])}",
                  highlight=False)
    if report.get("plan_file"):
        console.print(f"plan written to {report['plan_file']}", highlight=False)


def _policy_table(policy: dict[str, str]):
    """Each transformer block's activation policy, consecutive blocks with the same one on one row."""
    from rich.table import Table

    table = Table(title=f"activation policy per block ({len(policy)} blocks, forward order)", title_justify="left")
    for col in ("blocks", "count", "policy"):
        table.add_column(col)
    runs: list[list] = []
    for block, kind in policy.items():
        if runs and runs[-1][2] == kind:
            runs[-1][1] = block
            runs[-1][3] += 1
        else:
            runs.append([block, block, kind, 1])
    for first, last, kind, count in runs:
        table.add_row(first if first == last else f"{first} .. {last}", str(count), kind)
    return table


def _placement_table(placements: dict[str, str]):
    """Placements grouped by pattern: layer indices folded into ``*`` (``h.*.attn.c_attn``)."""
    from rich.table import Table

    grouped: dict[tuple[str, str], int] = {}
    for fqn, placement in placements.items():
        pattern = ".".join("*" if part.isdigit() else part for part in fqn.split("."))
        grouped[(pattern, placement)] = grouped.get((pattern, placement), 0) + 1
    table = Table(title=f"module placements ({len(placements)} modules with parameters)", title_justify="left")
    for col in ("modules", "count", "placement"):
        table.add_column(col)
    for (pattern, placement), count in grouped.items():
        table.add_row(pattern or "(root)", str(count), placement)
    return table
