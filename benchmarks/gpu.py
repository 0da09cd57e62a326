"""One prepared GPU benchmark run (at most ~8 minutes, one GPU): the real CUDA path of hf_elixir.

Usage (from the repository root; ``benchmarks/gpu.sh`` wraps it with the right environment)::

    PYTHONPATH=$PWD python benchmarks/gpu.py --out "$OUT"

What it runs, each in its own spawned process on ``cuda:0`` (fp32 parameters, TF32 matmuls, AdamW),
in this order, skipping what no longer fits in the time box (and saying so):

1. GPT-2 large (774M params; 12.4 GB of fp32 model data with AdamW): plain PyTorch (fits on a big
   card: the speed reference), hf_elixir all-resident, hf_elixir at a device budget
   (``--budget-gib``, default 6 GiB) that forces offload (with one profiled step: host->device copies
   per CUDA stream, how many overlap compute = side-stream prefetch, Triton kernel names), FSDP2 with
   ``CPUOffloadPolicy(pin_memory=True)``, DeepSpeed ZeRO-3 with optimizer+parameter offload (if
   installed; its CUDA ops must build).
2. OPT-1.3B (1.3B params, 21 GB of model data): hf_elixir at the same budget.

A device budget below the model's need is how "a model that needs offload on that card" is made on a
card as big as an H200 (141 GB): the real limit would need > 128 GB of host RAM to hold the offloaded
states, which the lent machine does not have.

Writes ``gpu_results.md`` and ``gpu_results.json`` (and the per-rank logs and profiler trace summary)
under ``--out``. Exit status: 0 all hf_elixir runs succeeded; 1 an hf_elixir run failed (the reason is
in the report and printed); 2 no CUDA device; 3 a required package is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 2**30
GPT2_LARGE = dict(family="gpt2", n_layer=36, n_embd=1280, n_head=20, vocab_size=50257, n_positions=1024)
OPT_1_3B = dict(family="opt", n_layer=24, n_embd=2048, n_head=32, vocab_size=50272, n_positions=2048)


def _fail(code: int, message: str) -> None:
    print(f"gpu.py: ERROR: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _environment() -> dict:
    try:
        import torch
    except ImportError as exc:
        _fail(3, f"torch does not import: {exc}")
    if not torch.cuda.is_available():
        _fail(2, f"no CUDA device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda}); "
                 "this script measures the CUDA path and has nothing to do without one")
    missing = []
    for name in ("transformers", "psutil", "triton", "hf_elixir"):
        try:
            __import__(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    if missing:
        _fail(3, "missing packages: " + ", ".join(missing) + " (pip install them without touching torch)")
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / GIB, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": version("triton"), "transformers": version("transformers"),
            "deepspeed": version("deepspeed"), "cpu_count": os.cpu_count(),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/gpu_out")
    parser.add_argument("--time-box-s", type=float, default=390.0, help="stop launching runs after this")
    parser.add_argument("--budget-gib", type=float, default=6.0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="tiny models (checks the script itself quickly)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        _fail(3, "TRITON_INTERPRET=1 is set: Triton kernels would run in the interpreter, not compiled; unset it")
    env = _environment()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    triton_cache = out / "triton_cache"
    os.environ["TRITON_CACHE_DIR"] = str(triton_cache)  # inherited by the spawned ranks
    print("gpu.py environment: " + json.dumps(env), flush=True)

    from benchmarks._harness import ModelSpec, RunSpec, launch, result_to_dict
    from benchmarks.peers import PEERS, peer_available

    shapes = {"gpt2": GPT2_LARGE, "opt": OPT_1_3B}
    if args.tiny:
        shapes = {"gpt2": dict(GPT2_LARGE, n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=128),
                  "opt": dict(OPT_1_3B, n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=128)}
    seq = min(args.seq_len, shapes["gpt2"]["n_positions"])
    gpt2 = ModelSpec(**shapes["gpt2"], batch_size=args.batch_size, seq_len=seq)
    opt = ModelSpec(**shapes["opt"], batch_size=args.batch_size, seq_len=seq)
    budget = int(args.budget_gib * GIB) if not args.tiny else 2 * 2**20
    threads = max(1, (os.cpu_count() or 2))
    plan = [("plain", gpt2, {}), ("elixir_resident", gpt2, {}),
            ("elixir_budget", gpt2, {"budget_bytes": budget, "profile_dir": str(out / "profile")}),
            ("fsdp2_offload", gpt2, {}), ("ds_zero3_offload", gpt2, {}),
            ("elixir_budget", opt, {"budget_bytes": budget})]
    start = time.perf_counter()
    rows, records, skipped = [], [], []
    elixir_failed = []
    for peer, model, options in plan:
        label = f"{PEERS[peer].label} / {model.family}"
        reason = peer_available(PEERS[peer])
        left = args.time_box_s - (time.perf_counter() - start)
        if reason or left < 60:
            skipped.append(f"{label}: {reason or f'time box ({args.time_box_s:.0f} s) nearly used up'}")
            print("skip " + skipped[-1], flush=True)
            continue
        spec = RunSpec(peer=peer, world_size=1, model=model, warmup_steps=args.warmup, steps=args.steps,
                       threads_per_rank=threads, options=options, device="cuda")
        print(f"[{time.perf_counter() - start:6.0f} s] running {label} ({left:.0f} s left) ...", flush=True)
        result = launch(spec, out / "logs", timeout_s=max(30.0, left - 20))
        records.append(result_to_dict(result))
        if not result.ok:
            print(f"  FAILED: {result.error}", flush=True)
            rows.append([label, "FAILED", "", "", "", "", "", result.error.splitlines()[0][:160]])
            if peer.startswith("elixir"):
                elixir_failed.append(label)
            continue
        e = result.extra
        note = ""
        if "htod_copies_per_stream" in e:
            note = (f"H2D copies per stream {e['htod_copies_per_stream']}, "
                    f"{e['htod_copies_overlapping_compute']}/{e['num_htod_copies']} overlap compute; "
                    f"triton kernels: {len(e.get('kernel_names_sample', []))}")
        rows.append([label, f"{result.median_s:.3f}", f"{min(result.step_times_s):.3f}/{max(result.step_times_s):.3f}",
                     f"{result.tokens_per_s:.0f}", f"{e.get('cuda_max_allocated_bytes', 0) / GIB:.2f}",
                     f"{e['device_peak_bytes'] / GIB:.2f}" if "device_peak_bytes" in e else "-",
                     f"{e['h2d_bytes_per_step'] / GIB:.2f}" if "h2d_bytes_per_step" in e else "-", note])
        print(f"  median {result.median_s:.3f} s/step, {result.tokens_per_s:.0f} tok/s", flush=True)
    compiled = sorted(p.name for p in triton_cache.rglob("*") if p.suffix in (".cubin", ".ptx")) \
        if triton_cache.exists() else []
    columns = ["run", "median step (s)", "min/max (s)", "tokens/s", "torch.cuda max allocated (GiB)",
               "hf_elixir device peak (GiB)", "H2D/step (GiB)", "notes"]
    lines = ["# hf_elixir GPU benchmark", "", f"- environment: `{json.dumps(env)}`",
             f"- command: `bash benchmarks/gpu.sh` (gpu.py {' '.join(argv if argv is not None else sys.argv[1:])})",
             f"- batch {args.batch_size} x seq {seq}, fp32 params + TF32 matmuls, AdamW, {args.warmup} warm-up + "
             f"{args.steps} timed steps; hf_elixir budget {budget / GIB:.2f} GiB",
             f"- Triton binaries compiled in this run: {len(compiled)}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    lines += ["", "Skipped:"] + [f"- {s}" for s in skipped] + [f"- took {time.perf_counter() - start:.0f} s"]
    (out / "gpu_results.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_results.json").write_text(json.dumps({"env": env, "runs": records, "skipped": skipped,
                                                      "triton_compiled": compiled}, indent=1, default=str))
    shutil.rmtree(out / "profile", ignore_errors=True)  # traces are large; the summary is in the json
    print("\n".join(lines), flush=True)
    if elixir_failed:
        print(f"gpu.py: ERROR: hf_elixir runs failed: {elixir_failed}", file=sys.stderr, flush=True)
        return 1
    if not compiled:
        print("gpu.py: WARNING: no Triton binary was compiled: the hf_elixir CUDA path did not use Triton",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
