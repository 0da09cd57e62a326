"""The ``hf-elixir plan`` tables for the built-in model names: the plan search run in-process on a few
realistic targets, from the model configs alone (meta device, no GPU involved: every number is a prediction of the
cost model, ``hf_elixir/search/_cost.py``).

For each model and target the search tries what ``hf-elixir plan --tensor-parallel-size auto`` tries: the
tensor-parallel degrees 1, 2, 4, 8 that divide the heads and fit in a node, and for a MoE model the expert-parallel
degrees (1 and the largest dividing the GPUs and the expert count); the fastest per token of the whole job that fits
wins ([Note: tensor parallel pricing] in ``hf_elixir/search/_tensor_parallel.py``, [Note: expert parallel pricing]
in ``_expert_parallel.py``). Then the same degrees at a 1 MiB budget give the smallest device budget the search
accepts (the "about N bytes" of its error). Prints a markdown table and writes the raw records as JSON.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python benchmarks/plan_tables.py [--json benchmarks/plan_tables.json]
    python benchmarks/plan_tables.py --quick --json out.json      # one small model, one target (a smoke test)

Assumptions (printed too, and in the JSON): bf16, AdamW, fp32 gradient reduce, batch 1 x 2048 tokens per
data-parallel rank (the ranks of a tensor-parallel group share it), activations counted in the device budget;
device rates from the ``--gpu`` presets (``hf_elixir/profiler/_gpu_presets.py``, data sheets derated); host-side
rates fixed, not measured here (host AdamW ``--host-adam-gelems`` G elements/s per rank, default 4.5 as in
``benchmarks/predicted_gpu.py``), so every run on any machine prices the same. Fused MoE experts are kept fused:
``prepare``'s default ``split_fused_experts="auto"`` splits them only under a budget below the fused model's floor,
and every plan of the table fits above it (the DeepSeek-V3 targets that do not fit lack host memory as well), which is
also what ``hf-elixir plan`` decides there by default; ``--split-fused-experts`` plans them split
(one hook unit per expert: the search then takes minutes a target for Qwen3-30B-A3B's 48 x 128 experts). The search runs at reduced effort
(``SEARCH_EFFORT``: fewer chunk sizes and grid points, a shorter local refinement; ``--full-effort`` runs
``hf-elixir plan``'s), which keeps the whole table to a few minutes on 2 CPU cores; the full search may find a
slightly faster plan.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/plan_tables.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_elixir.config import ElixirConfig  # noqa: E402
from hf_elixir.parallel._expert_units import split_fused_experts  # noqa: E402
from hf_elixir.placement import resolve_placements  # noqa: E402
from hf_elixir.profiler import HardwareProfile, profile_step  # noqa: E402
from hf_elixir.profiler._gpu_presets import preset_hardware  # noqa: E402
from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch  # noqa: E402
from hf_elixir.search import search, search_parallel  # noqa: E402

GIB, TIB = 2**30, 2**40
MODELS = ("llama-3.1-8b", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "deepseek-v3")
#: the search's knobs at reduced effort (module docstring); ``--full-effort`` drops them
SEARCH_EFFORT = dict(num_chunk_sizes=2, grid_points=4, refine_starts=2, refine_max_priced=100)
#: the bytes at which the search is asked for its smallest need (it names it when nothing fits)
_TINY_BUDGET = 2**20


@dataclass(frozen=True)
class Target:
    """A machine the plan is for: ``num_gpus`` of one ``--gpu`` preset, ``gpus_per_node`` a machine, each machine
    ``host_bytes`` of host memory; ``models``: only these (empty: every model)."""

    name: str
    gpu: str
    num_gpus: int
    gpus_per_node: int
    host_bytes: int
    models: tuple[str, ...] = ()


TARGETS = (
    Target("1 x RTX 4090 24 GiB, 128 GiB host", "rtx4090", 1, 1, 128 * GIB),
    Target("8 x H100-80GB, 1 TiB host", "h100", 8, 8, TIB),
    Target("8 x A100-40GB, 512 GiB host", "a100-40gb", 8, 8, 512 * GIB, models=("llama-3.1-8b",)),
    Target("64 x H100-80GB (8 nodes), 2 TiB host each", "h100", 64, 8, 2 * TIB, models=("deepseek-v3",)),
)
QUICK_MODELS = ("gpt2",)
QUICK_TARGETS = (Target("2 x H100-80GB, 1 TiB host", "h100", 2, 8, TIB),)


def target_hardware(target: Target, host_adam_numel_per_s: float) -> HardwareProfile:
    """The target's :class:`HardwareProfile`: the preset's device side over fixed host-side rates."""
    base = HardwareProfile(hostname="plan_tables", host_total_bytes=target.host_bytes,
                           host_available_bytes=target.host_bytes, host_adam_numel_per_s=host_adam_numel_per_s,
                           hook_event_s=2e-5, onload_fixed_s=1e-4, optim_tensor_s=5e-6)
    return replace(preset_hardware(target.gpu, base, world_size=target.num_gpus), host_total_bytes=target.host_bytes)


def _heads(config) -> tuple[int, ...]:
    names = ("num_attention_heads", "num_key_value_heads", "n_head")
    return tuple({v for n in names if isinstance(v := getattr(config, n, None), int) and v > 0})


def best_plan(model, profile, hw: HardwareProfile, common: dict):
    """The fastest per token of the tensor-parallel degrees and, for a MoE model, the expert-parallel ones
    (:func:`hf_elixir.search.search_parallel`, as ``hf-elixir plan --tensor-parallel-size auto``); ``(result,
    placements at its tensor-parallel degree)``.

    Raises:
        ValueError: nothing fits at any degree.
    """
    def placements(tp: int) -> dict[str, str]:
        return resolve_placements(model, ElixirConfig(tensor_parallel_size=tp))

    result = search_parallel(profile, hw, tensor_parallel_placements=placements, heads=_heads(model.config),
                             data_parallel="sharded", **common)
    tp = result.best.tensor_parallel_size
    return result, placements(tp) if tp > 1 else None


def why_not(err: ValueError) -> str:
    """What a target lacks, in a table cell: the host memory per node or the device budget the search names."""
    text = str(err)
    host = re.search(r"\(([\d.]+) GiB per host\)", text)
    device = re.search(r"a device_memory_budget_bytes of about (\d+)", text)
    if "fits host memory" in text and host:
        return f"needs {host.group(1)} GiB of host memory per node"
    if device:
        return f"needs a device budget of about {int(device.group(1)) / GIB:.0f} GiB"
    return text.split(";")[0][:160]


def min_budget_bytes(profile, hw: HardwareProfile, common: dict, tp: int, ep: int, placements) -> int | None:
    """The smallest device budget the search accepts at these degrees: what it names when ``_TINY_BUDGET`` does
    not fit (``None`` if it names none)."""
    try:
        search(profile, hw, **dict(common, device_memory_budget_bytes=_TINY_BUDGET), data_parallel="sharded",
               tensor_parallel_size=tp, expert_parallel_size=ep, tensor_parallel_placements=placements)
    except ValueError as err:
        found = re.search(r"a device_memory_budget_bytes of about (\d+)", str(err))
        return int(found.group(1)) if found else None
    return _TINY_BUDGET


def rows_for(name: str, targets: tuple[Target, ...], *, batch: int, seq: int, host_adam: float,
             effort: dict, split_experts: bool = False) -> list[dict]:
    """One record per target of ``name``: the chosen plan, or why nothing fits. ``split_experts``: fused MoE
    experts split into one chunk unit per expert first (``hf-elixir plan``'s default; [Note: split fused experts]
    in ``hf_elixir/parallel/_expert_units.py``)."""
    started = time.perf_counter()
    config = load_config(name)
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions and seq > positions:
        raise ValueError(f"--seq-len {seq} is longer than {name}'s {positions} positions")
    model, sample = meta_model_and_batch(config, batch_size=batch, seq_len=seq, dtype=torch.bfloat16)
    if split_experts:  # the model prepare lays out below the fused floor (split_fused_experts="auto")
        split_fused_experts(model)
    profile = profile_step(model, sample, device="meta")
    profiled_s = time.perf_counter() - started
    out = []
    for target in targets:
        if target.models and name not in target.models:
            continue
        started = time.perf_counter()
        hw = target_hardware(target, host_adam)
        common = dict(world_size=target.num_gpus, precision="bf16", device_memory_budget_bytes=hw.device_total_bytes,
                      activations_on_device=True, host_memory_bytes=target.host_bytes,
                      ranks_per_host=target.gpus_per_node, **effort)
        row: dict = {"model": name, "params": profile.num_params, "target": target.name, "gpu": target.gpu,
                     "num_gpus": target.num_gpus, "gpus_per_node": target.gpus_per_node,
                     "host_bytes_per_node": target.host_bytes, "tokens_per_data_parallel_rank": batch * seq,
                     "profile_s": round(profiled_s, 1)}
        try:
            result, placements = best_plan(model, profile, hw, common)
        except ValueError as err:
            row.update(fits=False, why=why_not(err), error=str(err))
            row["search_s"] = round(time.perf_counter() - started, 1)
            out.append(row)
            print(f"  {name} on {target.name}: does not fit ({row['search_s']} s)", file=sys.stderr)
            continue
        best, pred = result.best, result.best.prediction
        tp, ep = best.tensor_parallel_size, best.expert_parallel_size
        dp = target.num_gpus // tp
        row.update(
            fits=True, tensor_parallel=tp, expert_parallel=ep, data_parallel=dp, data_parallel_kind=best.data_parallel,
            chunk_size_numel=best.chunk_size_numel, num_chunks=best.num_chunks,
            device_peak_bytes=pred.device_peak_bytes,
            peak_breakdown=pred.peak_breakdown, host_bytes_per_rank=pred.host_bytes, step_s=pred.step_s,
            tokens_per_s=dp * batch * seq / pred.step_s, tensor_parallel_bytes=pred.tensor_parallel_bytes,
            alltoall_bytes=pred.alltoall_bytes, summary=best.summary(),
            degrees={"tensor_parallel": {k: v if isinstance(v, str) else v.prediction.step_s
                                         for k, v in result.best_by_tensor_parallel.items()},
                     "expert_parallel": {k: v if isinstance(v, str) else v.prediction.step_s
                                         for k, v in result.best_by_expert_parallel.items()}},
            min_device_budget_bytes=min_budget_bytes(profile, hw, common, tp, ep, placements))
        row["search_s"] = round(time.perf_counter() - started, 1)
        out.append(row)
        print(f"  {name} on {target.name}: searched in {row['search_s']} s", file=sys.stderr)
    return out


def _gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (one line per record)."""
    lines = ["| model | target | TP / EP / DP | chunk (M elements) | device peak GiB | host GiB per rank | "
             "predicted step s | tokens/s (job) | min device budget GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        model = f"{r['model']} ({r['params'] / 1e9:.1f} B)"
        if not r["fits"]:
            lines.append(f"| {model} | {r['target']} | does not fit: {r['why']} | - | - | - | - | - | - |")
            continue
        mesh = f"{r['tensor_parallel']} / {r['expert_parallel']} / {r['data_parallel']}"
        lines.append(f"| {model} | {r['target']} | {mesh} | {r['chunk_size_numel'] / 1e6:.1f} | "
                     f"{_gib(r['device_peak_bytes'])} | {_gib(r['host_bytes_per_rank'])} | {r['step_s']:.3g} | "
                     f"{r['tokens_per_s']:,.0f} | {_gib(r['min_device_budget_bytes'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"built-in names (default: {' '.join(MODELS)})")
    parser.add_argument("--batch-size", type=int, default=1, help="micro-batch per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048 (--quick: 256)")
    parser.add_argument("--host-adam-gelems", type=float, default=4.5, help="host AdamW G elements/s per rank")
    parser.add_argument("--split-fused-experts", default=False, action=argparse.BooleanOptionalAction,
                        help="one chunk unit per expert of fused MoE experts, as hf-elixir plan --split-fused-experts "
                        "(default here: kept fused, see the module docstring; split, a 48-layer 128-expert model "
                        "takes minutes a target)")
    parser.add_argument("--full-effort", action="store_true", help="search as hf-elixir plan does (slower)")
    parser.add_argument("--quick", action="store_true", help="one small model on one target (a smoke test)")
    parser.add_argument("--json", default="benchmarks/plan_tables.json")
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 256 if args.quick else 2048
    if min(args.batch_size, args.seq_len) < 1 or not (math.isfinite(args.host_adam_gelems)
                                                       and args.host_adam_gelems > 0):
        parser.error("--batch-size and --seq-len must be >= 1 and --host-adam-gelems a positive number")
    models = args.models or (QUICK_MODELS if args.quick else MODELS)
    targets = QUICK_TARGETS if args.quick else TARGETS
    effort = {} if args.full_effort else SEARCH_EFFORT
    started = time.perf_counter()
    rows = []
    for name in models:
        rows += rows_for(name, targets, batch=args.batch_size, seq=args.seq_len,
                         host_adam=args.host_adam_gelems * 1e9, effort=effort,
                         split_experts=args.split_fused_experts)
    elapsed = time.perf_counter() - started
    assumptions = {"precision": "bf16", "optimizer": "adamw", "reduce_dtype": "fp32", "batch_size": args.batch_size,
                   "seq_len": args.seq_len, "host_adam_gelems": args.host_adam_gelems,
                   "search_effort": effort or "full (hf-elixir plan's)", "activations_on_device": True,
                   "split_fused_experts": args.split_fused_experts,
                   "runtime_s": round(elapsed, 1)}
    print(f"PREDICTED (cost model, no GPU): bf16 AdamW, batch {args.batch_size} x {args.seq_len} per data-parallel "
          f"rank, host AdamW {args.host_adam_gelems} G elements/s per rank, search effort "
          f"{'full' if args.full_effort else SEARCH_EFFORT}")
    print(table(rows))
    with open(args.json, "w") as f:
        json.dump({"assumptions": assumptions, "rows": rows}, f, indent=1)
    print(f"wrote {args.json} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
