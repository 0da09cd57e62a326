"""torch.compile on CPU: hf_elixir compiled vs eager beside DDP compiled vs eager, 2 gloo ranks, in one run.

    PYTHONPATH=$PWD python benchmarks/compile_bench.py            # GPT-2 124M, inductor (compiles for minutes)
    PYTHONPATH=$PWD python benchmarks/compile_bench.py --quick    # a tiny GPT-2, seconds per peer

Each rank trains the same GPT-2 (fp32, AdamW, seed 0, dropout off) four ways, one after the other in the same
process group (``torch._dynamo.reset()`` between peers): ``ddp_eager`` (``DistributedDataParallel``),
``ddp_compiled`` (``torch.compile`` of the DDP model: dynamo's DDP optimizer splits the graph at the gradient
buckets), ``elixir_eager`` (``hf_elixir.prepare``) and ``elixir_compiled`` (``ElixirConfig(compile=...)``: each
transformer block's forward compiled, [Note: compiled blocks] in ``hf_elixir/runtime/compile.py``). The first
``--warmup`` steps (which compile) are timed apart; the table gives the median of the timed steps (slowest rank,
a barrier before each step), the compile time (first step minus a timed step), the graph breaks dynamo counted
and the last loss. Writes ``--output`` (JSON) and prints a Markdown table. The absolute times depend on this
shared machine; the compiled/eager ratio of each system is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/compile_bench.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PEERS = ("ddp_eager", "ddp_compiled", "elixir_eager", "elixir_compiled")


def _model(quick: bool):
    import transformers

    torch.manual_seed(0)
    shape = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128) if quick else {}
    cfg = transformers.GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _setup(peer: str, quick: bool, backend: str):
    """``(step(ids) -> loss, stats() -> dict)`` for one peer."""
    import hf_elixir

    model = _model(quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if peer.startswith("ddp"):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        run = torch.compile(ddp, backend=backend) if peer == "ddp_compiled" else ddp

        def step(ids):
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        return step, dict
    config = hf_elixir.ElixirConfig(compile=backend if peer == "elixir_compiled" else False)
    model, opt = hf_elixir.prepare(model, opt, config)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step, lambda: {k: v for k, v in hf_elixir.memory_stats(model).items() if "compile" in k}


def _run_peer(rank: int, peer: str, args) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step, stats = _setup(peer, args.quick, args.backend)
    gen = torch.Generator().manual_seed(1000 + rank)
    seq, vocab = args.seq_len, 512 if args.quick else 50257
    times, loss = [], None
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch_size, seq), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        loss = step(ids)
        times.append(time.perf_counter() - start)
    timed = times[args.warmup:]
    return {"peer": peer, "step_s": timed, "first_step_s": times[0], "loss": loss,
            "graph_breaks": sum(counters["graph_break"].values()), "unique_graphs": counters["stats"]["unique_graphs"],
            **stats()}


def _worker(rank: int, world_size: int, port: int, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = [_run_peer(rank, peer, args) for peer in args.peers]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _table(rows: list[dict]) -> str:
    eager = {r["peer"].split("_")[0]: r["median_step_s"] for r in rows if r["peer"].endswith("eager")}
    lines = ["| peer | median step s | compiled / eager | compile s | graph breaks | graphs | last loss |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = eager.get(r["peer"].split("_")[0])
        ratio = f"{r['median_step_s'] / base:.2f}x" if base and r["peer"].endswith("compiled") else "-"
        lines.append(f"| {r['peer']} | {r['median_step_s']:.3f} | {ratio} | {r['compile_s']:.1f} | "
                     f"{r['graph_breaks']} | {r['unique_graphs']} | {r['loss']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2 and few steps (seconds per peer)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None, help="per rank (default: 2 quick, 1 full)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 64 quick, 128 full")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 3 quick, 5 full)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--output", default="compile_bench.json")
    args = parser.parse_args(argv)
    args.batch_size = args.batch_size or (2 if args.quick else 1)
    args.seq_len = args.seq_len or (64 if args.quick else 128)
    args.steps = args.steps or (3 if args.quick else 5)
    import tempfile

    from benchmarks._harness import free_port

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(args.world_size, free_port(), args, out_dir), nprocs=args.world_size,
                           join=True, start_method="spawn")
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.world_size)]
    rows = []
    for per_rank in zip(*ranks):
        slowest = [max(s) for s in zip(*(r["step_s"] for r in per_rank))]
        row = dict(per_rank[0])
        row["median_step_s"] = statistics.median(slowest)
        row["compile_s"] = max(r["first_step_s"] for r in per_rank) - row["median_step_s"]
        rows.append(row)
    record = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "wall_s": time.perf_counter() - start, "machine": f"{platform.machine()} {os.cpu_count()} cores",
              "load_avg": os.getloadavg(), "torch": torch.__version__, "rows": rows}
    Path(args.output).write_text(json.dumps(record, indent=1))
    print(_table(rows))
    print(f"wall {record['wall_s']:.0f} s, load average {record['load_avg']}; written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
