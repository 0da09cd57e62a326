"""The disk tier: its read and write GB/s against ``dd`` on the same file system, and a GPT-2 124M-shaped model at 2
ranks with its optimizer state, gradients and parameter shards on disk against in host memory.

    python benchmarks/disk_tier.py                    # 1 GiB of IO, 89M-parameter GPT-2, 2 gloo ranks, 3 timed steps
    python benchmarks/disk_tier.py --quick            # 64 MiB, a tiny GPT-2 (seconds)
    python -m benchmarks.disk_tier --quick --skip-gpt2  # the same as a module; IO figures only

IO ([Note: disk tier] in ``hf_elixir/chunk/_disk.py``): one ``DiskFile`` of ``--gib`` GiB in ``--region-mib``
regions under ``--dir``. *write*: region by region, copy a source tensor into the mapped region and
``write_back`` it (the step's order: at most the window in flight), then wait for all: bytes / seconds. *read*:
every region evicted, then region by region ``prefetch`` the next and ``ready`` this one: bytes / seconds.
``dd`` reads the tier's own file (same bytes, same extents) after evicting its pages, ``dd if=F of=/dev/null bs=4M``
(buffered) and ``iflag=direct`` (O_DIRECT), and writes a file of its own, ``dd if=/dev/zero of=G bs=4M count=N``
``oflag=direct`` and ``conv=fdatasync`` (buffered), then reads that back (buffered, evicted first:
``read_ratio_dd_own_file``). ``--rounds`` rounds of: the tier writes, then the tier's read and
dd's buffered read, the first of the two alternating (on a shared VM disk the rate moves by 2x from one second to
the next). The ratios are the medians over rounds of the tier's GB/s over buffered dd's in the same round (the
target is >= 0.8x); the direct columns say whether O_DIRECT would help here.

GPT-2 124M's shape with a 4096-token vocabulary (``GPT2Config(vocab_size=4096)``, 89M parameters: the 50257-token
embedding would be a third of the model in one chunk, whose regions in flight alone exceed a quarter of the state),
chunks of ``--chunk-numel`` (4 Mi) elements, fp32, AdamW with weight decay, clipping at 1.0, 1 x 128 tokens a rank,
seed 0, at 2 gloo ranks, ``offload_optimizer=True`` each time: *host* (the default host budget: every master and moment
in host memory), *disk* (``offload_dir=--dir`` and a host budget of a quarter of the 16 B/param state: the masters,
moments and gradient shards in the file) and *params* (the same, with the device budget at its floor, so the
parameter shards live on the host, and most of them in the file too: [Note: disk parameters] in
``hf_elixir/chunk/_disk_pages.py``), against *host_params* (that device budget, everything in host memory). Median
step time of the ``--steps`` timed steps after one warm-up, slowest rank; the ratios disk / host and params /
host_params are the result, and the last losses must agree (same arithmetic). ``host_peak_bytes``: the most host
memory a rank used at the ends of forward, backward, clip and step (``memory_stats()["host_bytes"]`` plus the file's
pages in memory). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/disk_tier.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_MIB = 1 << 20


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed_dd(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args], check=True, capture_output=True)
    return time.perf_counter() - start


def _dd_own(directory: str, nbytes: int) -> dict[str, float]:
    """GB/s of ``dd`` writing ``nbytes`` of zeros to a file of its own in ``directory`` (buffered + fdatasync, and
    O_DIRECT) and reading it back (evicted first, buffered)."""
    path, count = os.path.join(directory, "dd_probe.bin"), f"count={nbytes // (4 * _MIB)}"
    try:
        direct = _timed_dd("if=/dev/zero", f"of={path}", "bs=4M", count, "oflag=direct")
        buffered = _timed_dd("if=/dev/zero", f"of={path}", "bs=4M", count, "conv=fdatasync")
        _evict(path)
        read = _timed_dd(f"if={path}", "of=/dev/null", "bs=4M")
        return {"write_gbps": nbytes / buffered / 1e9, "direct_write_gbps": nbytes / direct / 1e9,
                "own_read_gbps": nbytes / read / 1e9}
    finally:
        os.unlink(path)


def _tier(directory: str, nbytes: int, region_bytes: int, rounds: int) -> dict:
    """GB/s of the tier's write-back and read-ahead path over ``nbytes`` in regions of ``region_bytes``, and of
    ``dd`` reading the tier's own file (evicted first) beside it, per round; the ratios' medians over rounds."""
    from hf_elixir.chunk._disk import DiskFile

    numel = region_bytes // 4
    regions = {r: [("x", numel)] for r in range(nbytes // region_bytes)}
    file = DiskFile(directory, 0, regions)
    file.evict_all()
    source = torch.randn(numel)

    def tier_read() -> float:
        file.evict_all()
        start = time.perf_counter()
        file.prefetch(0)
        for region in regions:
            if region + 1 in regions:
                file.prefetch(region + 1)
            file.ready(region)
        return nbytes / (time.perf_counter() - start) / 1e9

    def dd_read(*flags: str) -> float:
        file.evict_all()
        return nbytes / _timed_dd(f"if={file.path}", "of=/dev/null", "bs=4M", *flags) / 1e9

    runs = []
    for round_ in range(rounds):
        start = time.perf_counter()
        for region in regions:
            file.tensor(region, "x").copy_(source)
            file.write_back(region)
        file.settle()
        run = {"write_gbps": nbytes / (time.perf_counter() - start) / 1e9}
        for name in ("read_gbps", "dd_read_gbps") if round_ % 2 == 0 else ("dd_read_gbps", "read_gbps"):
            run[name] = tier_read() if name == "read_gbps" else dd_read()
        assert float(file.tensor(len(regions) - 1, "x")[:4].sum()) == float(source[:4].sum()), \
            "the tier read back other bytes than it wrote"
        run["dd_direct_read_gbps"] = dd_read("iflag=direct")
        run.update({f"dd_{key}": value for key, value in _dd_own(directory, nbytes).items()})
        runs.append(run)
    file.close()
    return {"rounds": runs, "median": {key: statistics.median(run[key] for run in runs) for key in runs[0]},
            "read_ratio": statistics.median(run["read_gbps"] / run["dd_read_gbps"] for run in runs),
            "read_ratio_dd_own_file": statistics.median(run["read_gbps"] / run["dd_own_read_gbps"] for run in runs),
            "write_ratio": statistics.median(run["write_gbps"] / run["dd_write_gbps"] for run in runs)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(quick: bool):
    import transformers

    torch.manual_seed(0)
    shape = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128) if quick else dict(vocab_size=4096)
    cfg = transformers.GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _least_host_bytes(config, quick: bool) -> int:
    """``hf_elixir.min_host_budget_bytes`` with a disk for a model prepared under ``config`` (a separate copy)."""
    import hf_elixir

    model = _model(quick)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}])
    model, opt = hf_elixir.prepare(model, opt, config)
    return hf_elixir.min_host_budget_bytes(model, opt).with_disk_bytes


def _rank(rank: int, world_size: int, port: int, mode: str, directory: str, steps: int, quick: bool,
          out: str, chunk_numel: int = 1 << 22) -> None:
    import hf_elixir

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = _model(quick)
    num_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-4)
    config = hf_elixir.ElixirConfig(offload_optimizer=True, default_placement="sharded",
                                    chunk_size_numel=None if quick else chunk_numel)
    if mode in ("params", "host_params"):  # no room for shards on the device: they live on the host (or disk)
        floor = hf_elixir.min_device_budget_bytes(model, opt, config, world_size)
        config = dataclasses.replace(config, device_memory_budget_bytes=floor, budget_covers_activations=False)
    if mode in ("disk", "params"):  # a quarter of the state, or the least that works (the regions in flight)
        config = dataclasses.replace(config, offload_dir=directory, host_memory_budget_bytes=max(
            16 * num_params // world_size // 4, _least_host_bytes(config, quick)))
    model, opt = hf_elixir.prepare(model, opt, config)
    file = opt._disk.file if getattr(opt, "_disk", None) is not None else None
    peak = 0

    def used() -> int:
        return hf_elixir.memory_stats(model)["host_bytes"] + (file.resident_bytes() if file is not None else 0)
    vocab = model.config.vocab_size
    times, loss = [], None
    for step in range(steps + 1):
        ids = torch.randint(0, vocab, (1, 128), generator=torch.Generator().manual_seed(1000 * step + rank))
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        peaks = [used()]
        opt.backward(loss)
        peaks.append(used())
        opt.clip_grad_norm(1.0)
        peaks.append(used())
        opt.step()
        peaks.append(used())
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        peak = max(peak, *peaks)
    pages = opt.manager.disk_pages
    result = {"step_s": times[1:], "loss": float(loss.detach()), "num_params": num_params,
              "disk_bytes": file.nbytes if file is not None else 0, "host_peak_bytes": peak,
              "host_budget_bytes": config.host_memory_budget_bytes,
              "on_disk": {"grads": len(pages.grads), "params": len(pages.params)} if pages is not None else None}
    with open(os.path.join(out, f"{mode}{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _gpt2(mode: str, directory: str, steps: int, quick: bool, chunk_numel: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(2, _free_port(), mode, directory, steps, quick, out, chunk_numel), nprocs=2,
                           start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"{mode}{r}.json"))) for r in range(2)]
    slowest = [max(ts) for ts in zip(*(r["step_s"] for r in ranks))]
    return {"step_s": statistics.median(slowest), "loss": ranks[0]["loss"], "num_params": ranks[0]["num_params"],
            "disk_bytes_per_rank": ranks[0]["disk_bytes"], "host_peak_bytes": max(r["host_peak_bytes"] for r in ranks),
            "host_budget_bytes": ranks[0]["host_budget_bytes"], "on_disk": ranks[0]["on_disk"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk to test (default: a temporary one)")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of IO for the GB/s figures")
    parser.add_argument("--region-mib", type=int, default=64, help="MiB per region (a chunk's state)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="IO rounds (each: the tier writes, then its read and "
                        "dd's, alternating which goes first)")
    parser.add_argument("--quick", action="store_true", help="64 MiB of IO and a tiny GPT-2")
    parser.add_argument("--skip-gpt2", action="store_true")
    parser.add_argument("--chunk-numel", type=int, default=1 << 22, help="elements per chunk (GPT-2 runs)")
    parser.add_argument("--modes", default="host,disk,host_params,params",
                        help="GPT-2 runs, comma-separated: host, disk, host_params, params")
    args = parser.parse_args(argv)
    nbytes = (64 * _MIB) if args.quick else int(args.gib * (1 << 30))
    region = min(args.region_mib * _MIB, nbytes)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        io = _tier(directory, nbytes, region, args.rounds)
        result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                  "bytes": nbytes, "region_bytes": region, **io, "free_bytes": shutil.disk_usage(directory).free}
        if not args.skip_gpt2:
            runs = {mode: _gpt2(mode, directory, args.steps, args.quick, args.chunk_numel)
                    for mode in args.modes.split(",")}
            result.update({f"gpt2_{mode}": run for mode, run in runs.items()})
            for slow, fast in (("disk", "host"), ("params", "host_params")):
                if slow in runs and fast in runs:
                    result[f"{slow}_step_ratio"] = runs[slow]["step_s"] / runs[fast]["step_s"]
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
