"""Forward all-gathers issued ahead under a budget that covers activations, side by side with the same run
keeping them in their hooks ([Note: agreed gathers ahead] in ``hf_elixir/chunk/_agreed_gathers.py``).

Two gloo ranks train the same sharded GPT-2 twice in one process each: prepared with ``prefetch_depth=2``
("ahead") and with ``prefetch_depth=0`` ("hooks"), a device budget that covers activations (the default on a
GPU) at ``--budget-fraction`` of the all-resident need, and per-rank batches of different lengths (rank 1's
sequences are ``--long-ratio`` times rank 0's, so the ranks' activations, and the chunks they evict, differ).
Steps alternate between the two setups, so both see the same machine load. Printed per setup, from rank 0, over
the timed steps: median seconds per step, seconds blocked in all-gathers per step (``step_gather_wait_s``),
all-gathers issued ahead / in hooks per step, evictions forced by an agreed gather, and the bytes all-gathered
per step (equal in both setups: the same gathers, only issued earlier); then the ratio ahead / hooks.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/agreed_prefetch.py            # ~2 min on 2 cores
    python benchmarks/agreed_prefetch.py --json out.json --steps 8

On CPU the "device" is the host, and a gloo all-gather issued ahead runs on gloo's threads while the rank's
thread computes; with 2 ranks on 2 cores those threads compete with the other rank, so the gain here is a
lower bound of a GPU's, where the collective runs on its own stream.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):  # `python benchmarks/agreed_prefetch.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import free_port  # noqa: E402

_KEYS = ("step_gather_wait_s", "step_num_prefetched_gathers", "step_num_blocking_gathers",
         "step_num_agreed_gather_evictions", "step_allgather_bytes")
_SETUPS = (("ahead", 2), ("hooks", 0))


def _model(args) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                                  vocab_size=args.vocab, n_positions=max(1024, args.seq * args.long_ratio),
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _prepare(args, world_size: int, depth: int):
    import hf_elixir

    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    probe = hf_elixir.ElixirConfig(default_placement="sharded", chunk_size_numel=args.chunk_numel)
    floor = hf_elixir.min_device_budget_bytes(model, opt, probe, world_size=world_size)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # the budget: the floor plus a cache of ``budget_fraction`` of the model, plus the longer rank's activations
    budget = floor + int(args.budget_fraction * model_bytes) + args.activation_room_mib * 2**20
    config = hf_elixir.ElixirConfig(default_placement="sharded", chunk_size_numel=args.chunk_numel,
                                    device_memory_budget_bytes=budget, prefetch_depth=depth)
    model, opt = hf_elixir.prepare(model, opt, config)
    return model, opt, budget


def _train(rank: int, world_size: int, args) -> dict:
    import hf_elixir

    setups = {name: _prepare(args, world_size, depth) for name, depth in _SETUPS}
    seq = args.seq * (args.long_ratio if rank == 1 else 1)
    gen = torch.Generator().manual_seed(100 + rank)
    times: dict[str, list[float]] = {name: [] for name, _ in _SETUPS}
    stats: dict[str, list[dict]] = {name: [] for name, _ in _SETUPS}
    for step in range(args.warmup + args.steps):
        ids = torch.randint(3, args.vocab, (args.batch, seq), generator=gen)
        order = _SETUPS if step % 2 == 0 else _SETUPS[::-1]  # alternate which setup runs first
        for name, _ in order:
            model, opt, _ = setups[name]
            dist.barrier()
            started = time.perf_counter()
            opt.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - started
            if step >= args.warmup:
                times[name].append(elapsed)
                s = hf_elixir.memory_stats(model)
                stats[name].append({k: s[k] for k in _KEYS} | {"total_peak": s["device_total_peak_bytes"]})
    return {"times": times, "stats": stats, "budget": {n: setups[n][2] for n, _ in _SETUPS}, "seq": seq}


def _worker(rank: int, world_size: int, port: int, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
        result = ("ok", _train(rank, world_size, args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run(args) -> dict:
    """Spawn the two ranks and summarise rank 0's timed steps (both ranks' for the agreement checks).

    Raises:
        RuntimeError: a rank failed (its traceback is in the message).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(2, free_port(), args, out_dir), nprocs=2, join=True, start_method="spawn")
        results, errors = [], []
        for rank in range(2):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                errors.append(f"rank {rank} failed:\n{value}")
            results.append(value)
        if errors:  # every rank's: the first to fail makes the other's collective fail too
            raise RuntimeError("\n".join(errors))
    summary: dict = {"ranks_seq": [r["seq"] for r in results], "budget_bytes": results[0]["budget"]}
    for name, _ in _SETUPS:
        rows = results[0]["stats"][name]
        summary[name] = {
            "median_step_s": statistics.median(results[0]["times"][name]),
            "gather_wait_s_per_step": statistics.mean(r["step_gather_wait_s"] for r in rows),
            "gathers_ahead_per_step": statistics.mean(r["step_num_prefetched_gathers"] for r in rows),
            "gathers_in_hooks_per_step": statistics.mean(r["step_num_blocking_gathers"] for r in rows),
            "forced_evictions": sum(r["step_num_agreed_gather_evictions"] for r in rows),
            "allgather_mib_per_step": statistics.mean(r["step_allgather_bytes"] for r in rows) / 2**20,
            "total_peak_within_budget": all(r["total_peak"] <= results[0]["budget"][name] for r in rows),
            # agreed: both ranks issue the same gathers ahead in every step
            "ranks_agree": [r["step_num_prefetched_gathers"] for r in rows] ==
                           [r["step_num_prefetched_gathers"] for r in results[1]["stats"][name]],
        }
    summary["ratio_step_ahead_over_hooks"] = summary["ahead"]["median_step_s"] / summary["hooks"]["median_step_s"]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64, help="rank 0's sequence length (tokens)")
    parser.add_argument("--long-ratio", type=int, default=2, help="rank 1's sequences are this many times longer")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--chunk-numel", type=int, default=1 << 21)
    parser.add_argument("--budget-fraction", type=float, default=0.25,
                        help="cache room above the floor, as a fraction of the model's parameter bytes")
    parser.add_argument("--activation-room-mib", type=int, default=128, help="room for activations (MiB)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (the agreement starts at step 3)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    summary = run(args)
    print(f"ranks' sequence lengths {summary['ranks_seq']}, budget {summary['budget_bytes']['ahead']} bytes")
    print(f"{'setup':8} {'s/step':>8} {'gather wait s':>14} {'ahead':>6} {'in hooks':>9} {'forced ev.':>10} "
          f"{'AG MiB':>8} {'agree':>6} {'in budget':>9}")
    for name, _ in _SETUPS:
        s = summary[name]
        print(f"{name:8} {s['median_step_s']:8.3f} {s['gather_wait_s_per_step']:14.4f} "
              f"{s['gathers_ahead_per_step']:6.1f} {s['gathers_in_hooks_per_step']:9.1f} {s['forced_evictions']:10d} "
              f"{s['allgather_mib_per_step']:8.1f} {str(s['ranks_agree']):>6} {str(s['total_peak_within_budget']):>9}")
    print(f"step time ahead / hooks: {summary['ratio_step_ahead_over_hooks']:.3f}x")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
