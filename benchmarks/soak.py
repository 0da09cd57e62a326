"""Soak test: many training steps of a tiny GPT-2 at the smallest device budget on several gloo ranks.

Checks, after a warm-up:

* host RSS is flat (no host leak): the median RSS of the last quarter of the samples exceeds the median
  of the first quarter by at most ``--rss-tolerance-mib``;
* live tensors (counted through ``gc``) do not grow (minimum of the first vs the last quarter);
* the device pool's used bytes at the end of every step are identical, and its peak never exceeds
  the budget (no device leak);
* counters are consistent: every step moves the same bytes (all-gather, reduce-scatter, host<->device),
  ranks agree on the collective byte counts, cumulative counters equal the sum of the per-step ones,
  no fp16 step was skipped (fp32), and the loss is finite and falls;
* nothing hangs: every collective runs under the process group's timeout (``--timeout-s``), and the
  parent kills the ranks when none of them has advanced (started, prepared, finished a step) for
  ``--timeout-s`` + 60 s. There is no deadline on the whole run: how long it takes depends on the
  machine and its load (a run at load average 20 on 2 cores took longer than a fixed 220 s), while a
  hang is a rank that stops advancing.

Usage::

    python benchmarks/soak.py                      # 1000 steps, 2 ranks
    python benchmarks/soak.py --steps 60 --warmup 20

Prints one JSON summary line; exits 1 if a check failed. ``run_soak`` is the same as a function
(tests/test_reliability_soak.py runs a short version).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):  # `python benchmarks/soak.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_TRAFFIC = ("step_allgather_bytes", "step_reduce_scatter_bytes", "step_h2d_bytes", "step_d2h_bytes")
_MIB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_gpt2() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o))


def _beat(out_dir: str, rank: int, what: str) -> None:
    """Record this rank's progress for the parent's watchdog (a small file rewritten in place)."""
    with open(os.path.join(out_dir, f"rank{rank}.progress"), "w") as f:
        f.write(what)


def _train(rank: int, world_size: int, steps: int, sample_every: int, beat=lambda what: None) -> dict:
    import psutil

    import hf_elixir

    model = _tiny_gpt2()
    probe = hf_elixir.ElixirConfig(chunk_size_numel=8192, offload_optimizer=True)
    budget = hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(model.parameters()), probe,
                                               world_size=world_size)
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                   hf_elixir.ElixirConfig(chunk_size_numel=8192, offload_optimizer=True,
                                                          device_memory_budget_bytes=budget,
                                                          budget_covers_activations=False))  # model-data floor
    beat("prepared")
    process = psutil.Process()
    gen = torch.Generator().manual_seed(1000 + rank)
    data = torch.randint(3, 128, (16, 2, 16), generator=gen)  # a small fixed set, revisited: loss falls
    samples, losses, per_step = [], [], []
    for step in range(steps):
        ids = data[step % len(data)]
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        stats = hf_elixir.memory_stats(model)
        per_step.append({k: stats[k] for k in (*_TRAFFIC, "device_used_bytes", "device_peak_bytes")})
        if step % sample_every == 0 or step == steps - 1:
            samples.append({"step": step, "rss_bytes": process.memory_info().rss, "live_tensors": _live_tensors()})
        beat(f"step {step + 1}")
    stats = hf_elixir.memory_stats(model)
    return {"budget_bytes": budget, "losses": losses, "per_step": per_step, "samples": samples,
            "final": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}


def _worker(rank, world_size, port, steps, sample_every, timeout_s, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        _beat(out_dir, rank, "started")
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        _beat(out_dir, rank, "initialized")
        result = ("ok", _train(rank, world_size, steps, sample_every, lambda what: _beat(out_dir, rank, what)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def _watch(context, out_dir: str, world_size: int, stall_s: float, clock=time.monotonic) -> None:
    """Wait for the ranks of ``context`` (``torch.multiprocessing.ProcessContext``); kill them and raise
    ``TimeoutError`` once none has advanced (:func:`_beat`) for ``stall_s`` seconds of ``clock``."""
    progress, last_advance = None, clock()
    while not context.join(timeout=1.0):
        now_progress = _progress(out_dir, world_size)
        if now_progress != progress:
            progress, last_advance = now_progress, clock()
        elif clock() - last_advance > stall_s:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"soak: no rank advanced for {stall_s} s (hang?); last progress {progress}")


def _progress(out_dir: str, world_size: int) -> list[str]:
    """Each rank's last recorded progress (``""`` before it wrote any)."""
    found = []
    for rank in range(world_size):
        try:
            with open(os.path.join(out_dir, f"rank{rank}.progress")) as f:
                found.append(f.read())
        except OSError:
            found.append("")
    return found


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _check_rank(rank: int, r: dict, warmup: int, rss_tolerance_bytes: int) -> list[str]:
    problems = []
    steady = r["per_step"][warmup:]
    for key in (*_TRAFFIC, "device_used_bytes"):
        values = {s[key] for s in steady}
        if len(values) != 1:
            problems.append(f"rank {rank}: {key} varies after warm-up: {sorted(values)[:5]}")
    peak = max(s["device_peak_bytes"] for s in r["per_step"])
    if peak > r["budget_bytes"]:
        problems.append(f"rank {rank}: device peak {peak} bytes exceeds the budget {r['budget_bytes']}")
    final = r["final"]
    for key in _TRAFFIC:
        total = sum(s[key] for s in r["per_step"])
        if total != final[key.removeprefix("step_")]:
            problems.append(f"rank {rank}: cumulative {key.removeprefix('step_')}={final[key.removeprefix('step_')]} "
                            f"but the per-step deltas sum to {total}")
    if final.get("num_skipped_steps", 0):
        problems.append(f"rank {rank}: {final['num_skipped_steps']} skipped steps in fp32")
    samples = [s for s in r["samples"] if s["step"] >= warmup]
    quarter = max(1, len(samples) // 4)
    growth = _median([s["rss_bytes"] for s in samples[-quarter:]]) - _median([s["rss_bytes"] for s in samples[:quarter]])
    if growth > rss_tolerance_bytes:
        problems.append(f"rank {rank}: host RSS grew by {growth / _MIB:.1f} MiB after warm-up")
    # Minimum of each quarter: a leak raises the floor, a transient only adds. A transient is real here:
    # gloo's worker thread drops its reference to a collective's tensor shortly after ``wait()`` returns,
    # so a just-reduced 0-d tensor (clip_grad_norm's sum) is sometimes still alive when a sample is taken.
    tensors = [s["live_tensors"] for s in samples]
    first, last = min(tensors[:quarter]), min(tensors[-quarter:])
    if last > first:
        problems.append(f"rank {rank}: live tensors grew from {first} to {last} after warm-up (quarter minima)")
    losses = r["losses"]
    if not all(map(lambda x: x == x and abs(x) != float("inf"), losses)):
        problems.append(f"rank {rank}: non-finite loss")
    head, tail = losses[:warmup], losses[-warmup:]
    if sum(tail) / len(tail) >= sum(head) / len(head):
        problems.append(f"rank {rank}: loss did not fall ({sum(head) / len(head):.3f} -> {sum(tail) / len(tail):.3f})")
    return problems, growth


def run_soak(steps: int = 1000, world_size: int = 2, warmup: int = 50, timeout_s: int = 60,
             sample_every: int = 10, rss_tolerance_mib: float = 8.0) -> dict:
    """Run the soak on ``world_size`` gloo ranks; return the summary (``summary["ok"]``, ``["problems"]``).

    Raises:
        TimeoutError: no rank advanced for ``timeout_s`` + 60 s (a hang; the process-group timeout
            usually reports a hang inside a collective first, as a RuntimeError).
        RuntimeError: a rank raised (its traceback is in the message).
    """
    if warmup >= steps:
        raise ValueError(f"warmup={warmup} must be below steps={steps}")
    stall_s = timeout_s + 60
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world_size, _free_port(), steps, sample_every, timeout_s,
                                                    out_dir), nprocs=world_size, join=False, start_method="spawn")
        _watch(context, out_dir, world_size, stall_s)
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"soak: rank {rank} failed:\n{value}")
            results.append(value)
    problems, growths = [], []
    for rank, r in enumerate(results):
        found, growth = _check_rank(rank, r, warmup, int(rss_tolerance_mib * _MIB))
        problems += found
        growths.append(growth)
    for key in ("step_allgather_bytes", "step_reduce_scatter_bytes"):
        values = {r["per_step"][-1][key] for r in results}
        if len(values) != 1:
            problems.append(f"ranks disagree on {key}: {sorted(values)}")
    last = results[0]
    return {
        "ok": not problems, "problems": problems, "steps": steps, "world_size": world_size, "warmup": warmup,
        "budget_bytes": last["budget_bytes"], "device_peak_bytes": max(s["device_peak_bytes"] for s in last["per_step"]),
        "device_used_bytes_steady": last["per_step"][-1]["device_used_bytes"],
        "rss_growth_mib": [round(g / _MIB, 2) for g in growths],
        "rss_mib_first_last": [round(last["samples"][0]["rss_bytes"] / _MIB, 1),
                               round(last["samples"][-1]["rss_bytes"] / _MIB, 1)],
        "live_tensors_first_last": [last["samples"][0]["live_tensors"], last["samples"][-1]["live_tensors"]],
        "step_traffic_bytes": {k: last["per_step"][-1][k] for k in _TRAFFIC},
        "loss_first_last": [round(last["losses"][0], 4), round(last["losses"][-1], 4)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--timeout-s", type=int, default=60, help="process-group timeout of every collective")
    parser.add_argument("--sample-every", type=int, default=10, help="steps between RSS / live-tensor samples")
    parser.add_argument("--rss-tolerance-mib", type=float, default=8.0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    summary = run_soak(args.steps, args.world_size, args.warmup, args.timeout_s, args.sample_every,
                       args.rss_tolerance_mib)
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
