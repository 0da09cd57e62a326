"""The GPU comparison on paper: *predicted* step times, no GPU involved.

For OPT-1.3B/6.7B/13B/30B on 1 and 2 GPUs of two published profiles (A100-40GB PCIe Gen4, no NVLink;
H200 with PCIe Gen5 host links and NVLink between the GPUs), price

* hf_elixir's searched plan (:func:`hf_elixir.search.search`, the cost model of ``search/_cost.py``,
  which overlaps only what the runtime overlaps today: see its [Note: overlap]);
* the same search with gradients reduced in the compute dtype (``ElixirConfig.reduce_dtype=None``; the default
  reduces fp32 gradients), as the peers' models below reduce theirs;
* the peers, from what each moves by construction (``benchmarks/_peers_predicted.py``): FSDP2 +
  CPUOffload, DeepSpeed ZeRO-3 offload, ZeRO-Offload (ZeRO-2 + CPU Adam);

on the same FLOP-counted meta profile, the same derated device rates
(``hf_elixir/profiler/_gpu_presets.py``) and the same host AdamW rate. The brute-force grid over the
searched plan's chunk size and checkpointing setting checks the search (``searched vs grid``).

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python benchmarks/predicted_gpu.py [--json benchmarks/predicted_gpu.json]

Assumptions (printed too): bf16 compute, batch 8 x 1024 tokens per rank, host AdamW at
``--host-adam-gelems`` G elements/s for every system (default 4.5: about 1 B parameters in 0.22 s, the
order of DeepSpeed CPU-Adam on a 2-socket server in the ZeRO-Offload paper; this CPU's measured rate
says nothing about a GPU server's host), 1 TiB of host memory per machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/predicted_gpu.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._peers_predicted import PEER_MODELS, predict_peer  # noqa: E402
from hf_elixir import probe_hardware  # noqa: E402 - with the runtime probe
from hf_elixir.profiler import HardwareProfile, profile_step  # noqa: E402
from hf_elixir.profiler._gpu_presets import ACHIEVED_FRACTION, GPU_PRESETS, preset_hardware  # noqa: E402
from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch  # noqa: E402
from hf_elixir.search import brute_force_grid, search  # noqa: E402

MODELS = ("opt-1.3b", "opt-6.7b", "opt-13b", "opt-30b")
HOST_BYTES = 2**40
GRID_MAX_CHUNKS = 24  # the 2-rank grid is cubic in the chunk count


def gpu_profiles(base: HardwareProfile, world_size: int) -> dict[str, HardwareProfile]:
    """``a100-40gb-pcie4``: the A100-40GB preset with its peers over PCIe Gen4 (the PCIe card has no
    NVLink without a bridge); ``h200-pcie5``: the H200 preset (PCIe Gen5 host link, NVLink peers)."""
    a100 = preset_hardware("a100-40gb", base, world_size=world_size)
    a100 = replace(a100, device_name="NVIDIA A100-PCIE-40GB")
    if world_size > 1:
        ring = GPU_PRESETS["a100-40gb"].pcie_bytes_per_s * ACHIEVED_FRACTION["pcie"] * world_size / (world_size - 1)
        a100 = replace(a100, allgather_bytes_per_s=ring, reduce_scatter_bytes_per_s=ring, allreduce_bytes_per_s=ring / 2)
    h200 = preset_hardware("h200", base, world_size=world_size)
    return {"a100-40gb-pcie4": a100, "h200-pcie5": h200}


def _grid_ratio(profile, hw, ws, precision, best) -> float | None:
    """Searched step time over the fastest grid point at the searched chunk size (None: grid skipped)."""
    if ws > 1 and sum(profile.param_numels) / best.chunk_size_numel > GRID_MAX_CHUNKS:
        return None
    grid = brute_force_grid(profile, hw, world_size=ws, precision=precision,
                            device_memory_budget_bytes=hw.device_total_bytes, chunk_size_numel=best.chunk_size_numel,
                            activations_on_device=True, prefetch_depths=(0, 1, 2),
                            activation_checkpointing=best.activation_checkpointing,
                            activation_policy=best.activation_policy or None)
    if not grid:
        return None
    return best.prediction.step_s / grid[0].prediction.step_s


def rows_for(model: str, *, batch: int, seq: int, precision: str, host_adam: float, grid: bool) -> list[dict]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    meta, sample = meta_model_and_batch(load_config(model), batch_size=batch, seq_len=seq, dtype=dtype)
    profile = profile_step(meta, sample, device="meta")
    base = replace(probe_hardware(), host_adam_numel_per_s=host_adam, host_total_bytes=HOST_BYTES,
                   host_available_bytes=HOST_BYTES)
    out = []
    for ws in (1, 2):
        for gpu, hw in gpu_profiles(base, ws).items():
            row: dict = {"model": model, "params": profile.num_params, "gpu": gpu, "gpus": ws,
                         "tokens_per_rank": batch * seq}
            limit = int(hw.device_total_bytes * 0.95)  # the search's safety margin, for every system
            try:
                result = search(profile, hw, world_size=ws, precision=precision,
                                device_memory_budget_bytes=hw.device_total_bytes, activations_on_device=True,
                                host_memory_bytes=HOST_BYTES)
                best = result.best
                row["elixir"] = {"step_s": best.prediction.step_s, "plan": best.summary(),
                                 "bytes": {"h2d": best.prediction.h2d_bytes, "d2h": best.prediction.d2h_bytes,
                                           "allgather": best.prediction.allgather_bytes,
                                           "reduce_scatter": best.prediction.reduce_scatter_bytes}}
                if grid:
                    row["elixir"]["searched_vs_grid"] = _grid_ratio(profile, hw, ws, precision, best)
            except ValueError as err:
                row["elixir"] = {"step_s": None, "plan": f"does not fit: {err}"}
            try:  # gradients reduced in the compute dtype, as the peers reduce them (ElixirConfig.reduce_dtype=None)
                half = search(profile, hw, world_size=ws, precision=precision,
                              device_memory_budget_bytes=hw.device_total_bytes, activations_on_device=True,
                              host_memory_bytes=HOST_BYTES, reduce_dtype=None).best
                row["elixir_compute_reduce"] = {"step_s": half.prediction.step_s, "plan": half.summary()}
            except ValueError as err:
                row["elixir_compute_reduce"] = {"step_s": None, "plan": f"does not fit: {err}"}
            for peer in PEER_MODELS:
                pred = predict_peer(peer, profile, hw, precision=precision, world_size=ws, device_bytes=limit)
                row[peer] = None if pred is None else {
                    "step_s": pred.step_s, "optimizer_s": pred.optimizer_s, "compute_s": pred.compute_s,
                    "activation_checkpointing": pred.activation_checkpointing, "bytes": pred.bytes}
            out.append(row)
    return out


def _fmt(entry) -> str:
    return "OOM" if not entry or entry.get("step_s") is None else f"{entry['step_s']:.2f}"


def table(rows: list[dict]) -> str:
    """Markdown: seconds per step per system, and hf_elixir's speed-up over each peer."""
    head = ("| model | GPU | GPUs | hf_elixir s | FSDP2+CPUOffload s | ZeRO-3 offload s | ZeRO-Offload s "
            "| vs FSDP2 | vs ZeRO-3 | vs ZeRO-Offload | searched / grid | hf_elixir, compute-dtype reduce s "
            "| its speed-up over the fastest peer |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        e = r["elixir"].get("step_s")
        ratio = [f"{r[p]['step_s'] / e:.2f}x" if e and r[p] else "-" for p in PEER_MODELS]
        g = r["elixir"].get("searched_vs_grid")
        half = r.get("elixir_compute_reduce") or {}
        fastest = min((r[p]["step_s"] for p in PEER_MODELS if r[p]), default=None)
        over = f"{fastest / half['step_s']:.2f}x" if fastest and half.get("step_s") else "-"
        lines.append(f"| {r['model']} | {r['gpu']} | {r['gpus']} | {_fmt(r['elixir'])} | "
                     + " | ".join(_fmt(r[p]) for p in PEER_MODELS) + " | " + " | ".join(ratio)
                     + f" | {'-' if g is None else f'{g:.3f}'} | {_fmt(half)} | {over} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--host-adam-gelems", type=float, default=4.5)
    parser.add_argument("--no-grid", action="store_true")
    parser.add_argument("--json", default="benchmarks/predicted_gpu.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = []
    for model in args.models:
        rows += rows_for(model, batch=args.batch_size, seq=args.seq_len, precision=args.precision,
                         host_adam=args.host_adam_gelems * 1e9, grid=not args.no_grid)
    print(f"PREDICTED (cost model, no GPU): {args.precision}, batch {args.batch_size} x {args.seq_len} per rank, "
          f"host AdamW {args.host_adam_gelems} G elements/s, host memory {HOST_BYTES / 2**30:.0f} GiB")
    print(table(rows))
    with open(args.json, "w") as f:
        json.dump({"assumptions": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.json} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
