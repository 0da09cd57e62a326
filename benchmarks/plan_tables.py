"""``hf-elixir plan`` for the built-in model names on realistic targets, timed: the plan tables and the planner's
own speed (each answer should take at most about a minute on 2 CPU cores).

Each row runs exactly what a user runs, ``hf-elixir plan --json`` in this process (``hf_elixir.cli.main``), from
the model config alone (meta device, no GPU involved: every step time and memory figure is a prediction of the
cost model, ``hf_elixir/search/_cost.py``), and records the CPU seconds and wall seconds it took. With
``--tensor-parallel-size auto`` the search tries the tensor-parallel degrees 1, 2, 4, 8 that divide the heads and
fit a node and, for a MoE model, the expert-parallel degrees (1 and the largest dividing the GPUs and the expert
count); the most tokens per second of the whole job wins.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python benchmarks/plan_tables.py [--json benchmarks/plan_tables.json]
    python benchmarks/plan_tables.py --quick --json out.json      # one small model, one target (a smoke test)
    python benchmarks/plan_tables.py --all-names                  # every distinct built-in name on 8 x H100
    python benchmarks/plan_tables.py --disk --json out.json       # the disk tier: the largest models on one node

Assumptions (printed too, and in the JSON): bf16, AdamW, fp32 gradient reduce, batch 1 x 2048 tokens per
data-parallel rank, activations counted in the device budget; every rate the target's ([Note: target rates] in
``hf_elixir/cli/_plan.py``): device rates from the ``--gpu`` preset, the host side a GPU server's (host AdamW 4.5
G elements/s per GPU), nothing measured here, so any machine, busy or idle, prints the same plans. Fused MoE
experts are kept fused where they fit (``prepare``'s ``split_fused_experts="auto"``, the CLI's default).

``--disk``: DeepSeek-V3 (671B), a 1T-parameter MoE from Kimi-K2's config numbers (``kimi-k2-like``) and
Llama-3.1-405B, full fine-tuning on one node of 8 x H100 with 1 TiB of host memory and 30 TB of NVMe at 25 GB/s
(``--disk 30TB --disk-gbps 25``): what the host cannot hold lives on the disk, and each row gives the tokens per step
at which the disk's traffic hides under compute ([Note: disk tier pricing] in ``hf_elixir/search/_disk_cost.py``).
Anchor: ZeRO-Infinity (arXiv 2104.07857) trains a trillion parameters on one DGX-2 node from NVMe.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/plan_tables.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_elixir.cli import main as hf_elixir_main  # noqa: E402

GIB, TIB = 2**30, 2**40
MODELS = ("llama-3.1-8b", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "deepseek-v3")
#: one name per distinct built-in model (the aliases spell the same configs)
ALL_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "opt-125m", "opt-350m", "opt-1.3b", "opt-2.7b",
             "opt-6.7b", "opt-13b", "opt-30b", "opt-66b", "switch-base-8", "switch-base-16", "switch-base-32",
             "switch-base-64", "switch-base-128") + MODELS


@dataclass(frozen=True)
class Target:
    """A machine the plan is for: ``num_gpus`` of one ``--gpu`` preset, ``gpus_per_node`` a machine, each machine
    ``host`` of host memory (a ``--host-memory`` value); ``models``: only these (empty: every model)."""

    name: str
    gpu: str
    num_gpus: int
    gpus_per_node: int
    host: str
    models: tuple[str, ...] = ()
    disk: str | None = None  # a --disk value (per machine), with --disk-gbps disk_gbps
    disk_gbps: float | None = None


TARGETS = (
    Target("1 x RTX 4090, 128 GiB host", "rtx4090", 1, 1, "128GiB", models=MODELS[:4]),
    Target("8 x H100-80GB, 1 TiB host", "h100", 8, 8, "1TiB"),
    Target("8 x A100-40GB, 512 GiB host", "a100-40gb", 8, 8, "512GiB", models=("llama-3.1-8b",)),
    Target("64 x H100-80GB (8 nodes), 2 TiB host each", "h100", 64, 8, "2TiB", models=("deepseek-v3",)),
)
QUICK_TARGETS = (Target("2 x H100-80GB, 1 TiB host", "h100", 2, 8, "1TiB"),)
DISK_MODELS = ("deepseek-v3", "kimi-k2-like", "llama-3.1-405b")
DISK_TARGETS = (Target("8 x H100-80GB, 1 TiB host, 30 TB NVMe at 25 GB/s", "h100", 8, 8, "1TiB", models=DISK_MODELS,
                       disk="30TB", disk_gbps=25.0),)


def plan_row(name: str, target: Target, *, batch: int, seq: int) -> dict:
    """``hf-elixir plan --json`` for ``name`` on ``target``: its report (or its error) and the seconds it took."""
    argv = ["plan", "--model", name, "--gpu", target.gpu, "--num-gpus", str(target.num_gpus), "--gpus-per-node",
            str(target.gpus_per_node), "--host-memory", target.host, "--batch-size", str(batch), "--seq-len",
            str(seq), "--tensor-parallel-size", "auto", "--json"]
    if target.disk:
        argv[-1:-1] = ["--disk", target.disk, "--disk-gbps", f"{target.disk_gbps:g}"]
    out, err = io.StringIO(), io.StringIO()
    cpu, wall = time.process_time(), time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = hf_elixir_main(argv)
    row = {"model": name, "target": target.name, "command": "hf-elixir " + " ".join(argv[:-1]),
           "cpu_s": round(time.process_time() - cpu, 1), "wall_s": round(time.perf_counter() - wall, 1)}
    if code == 0:
        row.update(fits=True, report=json.loads(out.getvalue()))
    else:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        row.update(fits=False, why=(lines[-1].split("error: ", 1)[1] if lines else err.getvalue()[-300:]))
    print(f"  {name} on {target.name}: {row['cpu_s']} s CPU, {row['wall_s']} s wall", file=sys.stderr)
    return row


def why_not(text: str) -> str:
    """What a target lacks, in a table cell: the host memory per machine or the device budget the search names."""
    host = re.search(r"\(([\d.,]+) GiB per host[)\s]", text)
    device = re.search(r"a device_memory_budget_bytes of about (\d+)", text)
    if "fits host memory" in text and host:
        return f"needs {host.group(1)} GiB of host memory per machine"
    if device:
        return f"needs a device budget of about {int(device.group(1)) / GIB:.0f} GiB"
    return text.split(";")[0][:120]


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (one line per record)."""
    lines = ["| model | target | TP x EP x DP | predicted step | tokens/s (job) | device peak | host per GPU | "
             "planner CPU s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['model']} | {r['target']} | does not fit: {why_not(r['why'])} | - | - | - | - | "
                         f"{r['cpu_s']:.0f} |")
            continue
        rep, c = r["report"], r["report"]["chosen"]
        model = f"{r['model']} ({rep['parameters'] / 1e9:.1f} B)"
        lines.append(f"| {model} | {r['target']} | {c['tensor_parallel']} x {c['expert_parallel']} x "
                     f"{c['data_parallel']} | {c['step_s']:.3g} s | {c['tokens_per_s']:,.0f} | "
                     f"{c['device_peak_bytes'] / GIB:.1f} GiB | {c['host_bytes_per_gpu'] / GIB:.1f} GiB | "
                     f"{r['cpu_s']:.0f} |")
    return "\n".join(lines)


def disk_table(rows: list[dict]) -> str:
    """The disk tier's markdown table: where each model's state lives, the disk's seconds a step, and the tokens per
    step at which they hide under compute."""
    lines = ["| model | TP x EP x DP | host / GPU | on disk / node | step: disk-bound; without the disk | tokens/step "
             "hiding the disk | tokens/s there |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['model']} | does not fit: {why_not(r['why'])} | - | - | - | - | - |")
            continue
        rep, c, d = r["report"], r["report"]["chosen"], r["report"]["disk"]
        model = f"{r['model']} ({rep['parameters'] / 1e9:.0f} B)"
        if d is None:
            lines.append(f"| {model} | {c['tensor_parallel']} x {c['expert_parallel']} x {c['data_parallel']} | "
                         f"{c['host_bytes_per_gpu'] / GIB:.0f} GiB | none | {c['step_s']:.3g} s | - | - |")
            continue
        lines.append(f"| {model} | {c['tensor_parallel']} x {c['expert_parallel']} x {c['data_parallel']} | "
                     f"{c['host_bytes_per_gpu'] / GIB:.0f} GiB | {d['disk_bytes_per_machine'] / 1e12:.1f} TB | "
                     f"{d['disk_s']:.0f} s; {d['step_without_disk_s']:.3g} s | {d['hide_tokens_per_step'] / 1e6:.1f} M "
                     f"| {d['hide_tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"built-in names (default: {' '.join(MODELS)})")
    parser.add_argument("--batch-size", type=int, default=1, help="micro-batch per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048 (--quick: 256)")
    parser.add_argument("--quick", action="store_true", help="one small model on one target (a smoke test)")
    parser.add_argument("--all-names", action="store_true",
                        help="every distinct built-in name on 8 x H100 (the planner's speed on each)")
    parser.add_argument("--disk", action="store_true",
                        help=f"the disk tier's table: {', '.join(DISK_MODELS)} on {DISK_TARGETS[0].name}")
    parser.add_argument("--json", default="benchmarks/plan_tables.json")
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 256 if args.quick else 2048
    if min(args.batch_size, args.seq_len) < 1:
        parser.error("--batch-size and --seq-len must be >= 1")
    models = args.models or (("gpt2",) if args.quick else ALL_NAMES if args.all_names else DISK_MODELS if args.disk
                             else MODELS)
    targets = (QUICK_TARGETS if args.quick else TARGETS[1:2] if args.all_names else DISK_TARGETS if args.disk
               else TARGETS)
    started = time.perf_counter()
    rows = []
    for name in models:
        for target in targets:
            if target.models and name not in target.models and not args.all_names:
                continue
            seq = args.seq_len if "gpt2" not in name else min(args.seq_len, 1024)  # GPT-2 has 1024 positions
            rows.append(plan_row(name, target, batch=args.batch_size, seq=seq))
    elapsed = time.perf_counter() - started
    assumptions = {"precision": "bf16", "optimizer": "adamw", "reduce_dtype": "fp32", "batch_size": args.batch_size,
                   "seq_len": args.seq_len, "rates": "the --gpu preset's and a GPU server's host (nothing measured)",
                   "activations_on_device": True, "runtime_s": round(elapsed, 1),
                   "disk": {"size": DISK_TARGETS[0].disk, "gbps": DISK_TARGETS[0].disk_gbps} if args.disk else None}
    print(f"PREDICTED (cost model, no GPU): bf16 AdamW, batch {args.batch_size} x {args.seq_len} per data-parallel "
          "rank, the target's rates (preset device, a GPU server's host: 4.5 G AdamW elements/s per GPU)")
    print(disk_table(rows) if args.disk else table(rows))
    with open(args.json, "w") as f:
        json.dump({"assumptions": assumptions, "rows": rows}, f, indent=1)
    print(f"wrote {args.json} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
