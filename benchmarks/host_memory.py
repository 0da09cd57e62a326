"""Host memory per rank: does adding ranks lower every rank's host RAM (ZeRO-3's promise, host side)?

Measures, per rank, the peak and the steady growth of the process's resident set (RSS) over a baseline
taken after every import and ``init_process_group``, at world sizes 1, 2 and 4 (gloo, one spawned
process per rank, a fresh process group per run), for:

- ``elixir_materialised``: every rank builds the fp32 model (``from_pretrained`` of the folder), then
  ``hf_elixir.prepare`` with ``default_placement="sharded"`` under a 25% device budget;
- ``elixir_checkpoint``: the model is built on the meta device and ``prepare(..., checkpoint=folder)``
  reads each rank's shards from the safetensors file;
- ``fsdp2``: ``fully_shard`` (every ``GPT2Block`` and the root, ``CPUOffloadPolicy``) on a meta-device
  model, ``to_empty`` and rank-0 loading (``set_model_state_dict(full_state_dict=True,
  broadcast_from_rank0=True)``: rank 0 reads the whole file, the others receive their shards);
- ``deepspeed_zero3``: ``zero.Init`` with parameter and optimizer offload, where DeepSpeed is installed.

Peak = the kernel's high-water mark ``VmHWM`` after resetting it to the baseline (``/proc/self/clear_refs``
``5``); loading peak (hf_elixir) = the same mark right after ``prepare`` (model built or streamed, chunks,
the optimizer's host gradient shards; before any step); steady = ``VmRSS`` after the last step (model,
optimizer and hf_elixir state alive); at the end each rank also records glibc's heap (``mallinfo2``: live
heap, freed heap still held, own mappings) as growth over the baseline. On CPU
hf_elixir's device pool is host memory too, so its growth includes the device budget. For hf_elixir the
run also reports, labelled as such, the peak growth less the simulated device's model data held at that
moment (``_HostPeak``: what a GPU rank's host would pay); the targets are judged on the raw RSS figures.

The per-rank device budget is 25% of the rank's share of the model state (16 B/param / world size),
raised to ``hf_elixir.min_device_budget_bytes`` where that is larger. Every rank trains 3 AdamW steps
(batch 2 x seq 64). Targets are printed as ratios from this one run.

Run: ``PYTHONPATH=$PWD python benchmarks/host_memory.py [--world-sizes 1,2,4] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/host_memory.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.multiprocessing as mp

SYSTEMS = ("elixir_materialised", "elixir_checkpoint", "fsdp2", "deepspeed_zero3")
MODEL = dict(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, n_positions=64)
# run once before the baseline so lazily imported code (transformers' model modules, autograd, gloo
# paths) is not counted as the model's memory
WARMUP_MODEL = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
BATCH, SEQ, STEPS, LR = 2, 64, 3, 1e-4
STATE_BYTES_PER_PARAM = 16  # fp32 parameter + gradient + two Adam moments
MIB = 2**20
_OVERLAP_ENV = "HF_ELIXIR_BENCH_OVERLAP"  # --overlap-host-optimizer, read by the spawned ranks


def _gpt2_config(shape: dict):
    from transformers import GPT2Config

    return GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _heap() -> dict:
    """glibc's heap (``mallinfo2``, all arenas), bytes: ``heap_in_use`` (live small allocations),
    ``heap_free`` (freed, still in the heap: resident unless trimmed), ``mapped`` (live allocations with
    their own mmap). Empty where the C library is not glibc."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return {}

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {"heap_in_use": info.uordblks, "heap_free": info.fordblks, "mapped": info.hblkhd}


class _HostPeak:
    """The peak of RSS less the simulated device's model data held at that moment (what a GPU rank's host
    pays: on a GPU those bytes are device memory). Model data = the device pool's charges (the gradient
    buffers kept for reuse included, [Note: buffer reuse] in ``hf_elixir/chunk/_grad_buffers.py``); constant
    between two pool charges or releases. So at every charge and
    release the kernel's high-water mark since the previous one (``VmHWM``, then reset through
    ``/proc/self/clear_refs``) less the model data held in between is a candidate. Activations and
    autograd's temporaries stay in (a GPU keeps them on the device too: a lower bound of the device's share).
    Keeps the overall peak as well, since the resets clear ``VmHWM``."""

    def __init__(self, manager) -> None:
        self.manager, self.pool = manager, manager.pool
        self.host_peak = self.rss_peak = 0
        charge, release = self.pool.charge, self.pool.release

        def counted_charge(nbytes, what):
            self.mark()
            charge(nbytes, what)

        def counted_release(nbytes):
            self.mark()
            release(nbytes)
        self.pool.charge, self.pool.release = counted_charge, counted_release

    def device_bytes(self) -> int:
        return self.pool.counters.device_used_bytes  # kept gradient buffers included ([Note: buffer reuse])

    def mark(self) -> None:
        hwm = _status("VmHWM")
        self.rss_peak = max(self.rss_peak, hwm)
        self.host_peak = max(self.host_peak, hwm - self.device_bytes())
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _train(model, optimizer, rank: int, vocab_size: int, backward=None) -> list[float]:
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab_size, (BATCH, SEQ), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().item())
    return losses


def _budget(num_params: int, world_size: int, model) -> int:
    import hf_elixir

    cfg = hf_elixir.ElixirConfig(default_placement="sharded")
    # the runs train with AdamW (optimizer=None would be the inference floor: no gradient buffers)
    floor = hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(model.parameters()), cfg, world_size=world_size)
    return max(STATE_BYTES_PER_PARAM * num_params // world_size // 4, floor)


def _run_elixir(rank: int, world_size: int, folder: str, shape: dict, from_checkpoint: bool) -> dict:
    import hf_elixir
    from transformers import GPT2LMHeadModel

    if from_checkpoint:
        with torch.device("meta"):
            model = GPT2LMHeadModel(_gpt2_config(shape))
    else:
        model = GPT2LMHeadModel.from_pretrained(folder)
    num_params = sum(p.numel() for p in model.parameters())
    budget = _budget(num_params, world_size, model)
    overlap = {"auto": None, "on": True, "off": False}[os.environ.get(_OVERLAP_ENV, "auto")]
    cfg = hf_elixir.ElixirConfig(default_placement="sharded", device_memory_budget_bytes=budget,
                                 budget_covers_activations=False,  # a model-data budget
                                 overlap_host_optimizer=overlap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    extra = {"checkpoint": folder} if from_checkpoint else {}
    model, optimizer = hf_elixir.prepare(model, optimizer, config=cfg, **extra)
    load_peak = _status("VmHWM")  # loading: the model (built or streamed), prepare, the optimizer's shards
    tracker = _HostPeak(hf_elixir.get_state(model).manager)
    tracker.host_peak = load_peak - tracker.device_bytes()
    losses = _train(model, optimizer, rank, shape["vocab_size"], backward=optimizer.backward)
    tracker.mark()
    stats = hf_elixir.memory_stats(model)
    return {"losses": losses, "num_params": num_params, "budget_bytes": budget, "host_bytes": stats["host_bytes"],
            "load_peak_vmhwm": load_peak, "peak_vmhwm": max(load_peak, tracker.rss_peak),
            "host_only_peak_vmhwm": tracker.host_peak,
            "device_peak_bytes": stats["device_peak_bytes"], "keep": (model, optimizer)}


def _run_fsdp2(rank: int, world_size: int, folder: str, shape: dict) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(_gpt2_config(shape))
    num_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world_size,))
    policy = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    model.to_empty(device="cpu")
    full = {}
    if rank == 0:
        full = load_file(str(Path(folder) / "model.safetensors"))
        full.setdefault("lm_head.weight", full["transformer.wte.weight"])  # tied: saved once
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    dist.barrier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(model, optimizer, rank, shape["vocab_size"])
    return {"losses": losses, "num_params": num_params, "keep": (model, optimizer)}


def _deepspeed_config() -> dict:
    """ZeRO-3 with parameters and optimizer states offloaded to (unpinned) CPU memory; DeepSpeed's AdamW
    with offload is its CPU Adam (``DeepSpeedCPUAdam``)."""
    offload = {"device": "cpu", "pin_memory": False}
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload},
            "optimizer": {"type": "AdamW", "params": {"lr": LR}}}


def _run_deepspeed(rank: int, world_size: int, folder: str, shape: dict) -> dict:
    """``from_pretrained`` under ``HfDeepSpeedConfig`` (transformers' ZeRO-3 path: ``zero.Init``, so each
    parameter is partitioned as it is created, and the file's weights are loaded module by module from
    rank 0), then ``deepspeed.initialize``."""
    import deepspeed
    from transformers import GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig

    config = _deepspeed_config()
    keep_config = HfDeepSpeedConfig(config)  # must stay alive while from_pretrained runs
    model = GPT2LMHeadModel.from_pretrained(folder)
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    losses = _train(engine, engine, rank, shape["vocab_size"], backward=engine.backward)
    return {"losses": losses, "num_params": num_params, "keep": (engine, optimizer, keep_config)}


def _run(system: str, rank: int, world_size: int, folder: str, shape: dict) -> dict:
    if system == "fsdp2":
        return _run_fsdp2(rank, world_size, folder, shape)
    if system == "deepspeed_zero3":
        return _run_deepspeed(rank, world_size, folder, shape)
    return _run_elixir(rank, world_size, folder, shape, from_checkpoint=system == "elixir_checkpoint")


def _rank_main(rank: int, system: str, world_size: int, port: int, folder: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), HF_HUB_OFFLINE="1",
                      TRITON_INTERPRET="1")
    torch.set_num_threads(1)
    record: dict = {}
    try:
        import safetensors.torch  # noqa: F401 - every import before the baseline
        import transformers
        import hf_elixir  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401

        if system == "deepspeed_zero3":  # before zero.Init patches torch.Tensor.__new__: importing
            import deepspeed  # noqa: F401 - torch._dynamo (transformers' masking utils) under it fails
            import torch._dynamo as _dynamo  # noqa: F401 - binds _dynamo, not torch (a local here)
            import transformers.generation.utils  # noqa: F401
            import transformers.masking_utils  # noqa: F401

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        warnings.filterwarnings("ignore")
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=300))
        _run(system, rank, world_size, str(Path(folder).parent / "warmup"), WARMUP_MODEL)
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark VmHWM to the current RSS
        baseline = _status("VmRSS")
        heap_base = _heap()
        start = time.perf_counter()
        result = _run(system, rank, world_size, folder, MODEL)
        gc.collect()
        record = {k: v for k, v in result.items() if not k.endswith("vmhwm") and k != "keep"}
        if "load_peak_vmhwm" in result:
            record["load_peak_growth_bytes"] = result["load_peak_vmhwm"] - baseline
        if "host_only_peak_vmhwm" in result:
            record["host_only_peak_growth_bytes"] = result["host_only_peak_vmhwm"] - baseline
        peak = max(_status("VmHWM"), result.get("peak_vmhwm", 0))  # hf_elixir's tracker resets VmHWM
        record.update(peak_growth_bytes=peak - baseline, steady_growth_bytes=_status("VmRSS") - baseline,
                      baseline_bytes=baseline, wall_s=time.perf_counter() - start)
        # where the steady growth is: live heap, freed-but-kept heap, own mappings (growth over the baseline)
        record.update({f"{k}_growth_bytes": v - heap_base[k] for k, v in _heap().items()})
        dist.barrier()
    except Exception:  # reported to the parent
        record = {"error": traceback.format_exc()[-3000:]}
    Path(out_dir, f"{system}_ws{world_size}_rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.destroy_process_group()


def _skip_reason(system: str) -> str:
    if system == "deepspeed_zero3":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return "DeepSpeed is not installed here (pip install deepspeed); zero.Init with offload not measured"
        return ""
    if system == "elixir_checkpoint":
        import inspect

        import hf_elixir

        if "checkpoint" not in inspect.signature(hf_elixir.prepare).parameters:
            return "hf_elixir.prepare has no checkpoint= argument in this version"
    return ""


def _launch(system: str, world_size: int, folder: str, work: str) -> list[dict]:
    from benchmarks._harness import free_port

    mp.start_processes(_rank_main, args=(system, world_size, free_port(), folder, work), nprocs=world_size,
                       join=True, start_method="spawn")
    return [json.loads(Path(work, f"{system}_ws{world_size}_rank{r}.json").read_text()) for r in range(world_size)]


def _write_checkpoint(folder: Path, shape: dict) -> int:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_gpt2_config(shape))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _targets(results: dict, num_params: int) -> list[str]:
    """The issue's targets as ratios (None where a run is missing)."""
    state, fp32 = STATE_BYTES_PER_PARAM * num_params, 4 * num_params
    peak = {k: max(r["peak_growth_bytes"] for r in rs) for k, rs in results.items()}
    lines = []

    def line(text: str, ratio: float | None, target: float) -> None:
        verdict = "n/a" if ratio is None else ("met" if ratio <= target else "MISSED")
        lines.append(f"- {text}: {'-' if ratio is None else f'{ratio:.2f}x'} (target <= {target}x): {verdict}")

    for system in ("elixir_materialised", "elixir_checkpoint"):
        one, two = peak.get((system, 1)), peak.get((system, 2))
        line(f"{system}: peak growth per rank at world size 2 / world size 1", two / one if one and two else None, 0.75)
        line(f"{system}: peak growth at world size 1 / 16 B/param state ({state / MIB:.0f} MiB)",
             one / state if one else None, 1.5)
        host = results.get((system, 1))
        host = max(r["host_only_peak_growth_bytes"] for r in host) if host else None
        line(f"{system}: (informational, not the target's figure) peak growth at world size 1 less the simulated "
             "device's model data held at that moment (what a GPU rank's host pays) / 16 B/param state",
             host / state if host else None, 1.5)
    for (system, ws), rs in sorted(results.items()):
        if system.startswith("elixir"):
            worst = max(r["load_peak_growth_bytes"] / (0.6 * fp32 + r["budget_bytes"]) for r in rs)
            line(f"{system} ws{ws}: worst rank's peak growth while loading (through prepare) / (0.6 x fp32 model "
                 "+ device budget)", worst, 1.0)
    for system in ("elixir_materialised", "elixir_checkpoint"):
        for ws in sorted({w for _, w in results}):
            a, b = peak.get((system, ws)), peak.get(("fsdp2", ws))
            line(f"{system} / FSDP2 peak growth per rank at world size {ws}", a / b if a and b else None, 1.0)
    return lines


def _heap_line(records: list[dict]) -> str:
    free = max(r["heap_free_growth_bytes"] for r in records) / MIB
    live = max(r["heap_in_use_growth_bytes"] + r["mapped_growth_bytes"] for r in records) / MIB
    return f"heap at the end: free-but-kept max {free:.1f} MiB, live heap + mapped max {live:.1f} MiB, "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--json", default=None, help="also write the per-rank records to this JSON file")
    parser.add_argument("--overlap-host-optimizer", choices=("auto", "on", "off"), default="auto",
                        help="hf_elixir's ElixirConfig.overlap_host_optimizer: auto = None (the default: on, "
                             "with the host lane; AdamW rolls back by the inverse update, no snapshots), on = True, off = False")
    args = parser.parse_args(argv)
    os.environ[_OVERLAP_ENV] = args.overlap_host_optimizer
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or any(w < 1 for w in world_sizes):
        parser.error(f"--systems: unknown {unknown} (choose from {SYSTEMS}); --world-sizes must be >= 1")
    start = time.perf_counter()
    results: dict = {}
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "gpt2"
        num_params = _write_checkpoint(folder, MODEL)
        _write_checkpoint(Path(work) / "warmup", WARMUP_MODEL)
        print(f"GPT-2 {MODEL}: {num_params / 1e6:.2f}M params, fp32 {4 * num_params / MIB:.0f} MiB, "
              f"16 B/param state {STATE_BYTES_PER_PARAM * num_params / MIB:.0f} MiB; {STEPS} AdamW steps, "
              f"batch {BATCH} x seq {SEQ} per rank; hf_elixir overlap_host_optimizer="
              f"{args.overlap_host_optimizer}", flush=True)
        for system in systems:
            reason = _skip_reason(system)
            if reason:
                print(f"{system}: skipped: {reason}", flush=True)
                continue
            for ws in world_sizes:
                records = _launch(system, ws, str(folder), work)
                errors = [r["error"] for r in records if "error" in r]
                if errors:
                    print(f"{system} ws{ws}: FAILED\n{errors[0]}", flush=True)
                    failed.append(f"{system} ws{ws}: {errors[0]}")
                    continue
                results[(system, ws)] = records
                peak = [r["peak_growth_bytes"] / MIB for r in records]
                steady = [r["steady_growth_bytes"] / MIB for r in records]
                host = [r.get("host_bytes", 0) / MIB for r in records]
                budget = records[0].get("budget_bytes")
                load = [r["load_peak_growth_bytes"] / MIB for r in records if "load_peak_growth_bytes" in r]
                print(f"{system:20s} ws{ws}: peak growth/rank max {max(peak):7.1f} MiB (ranks "
                      f"{', '.join(f'{p:.0f}' for p in peak)}), steady max {max(steady):7.1f} MiB, "
                      + (f"loading peak max {max(load):.1f} MiB, host_bytes {max(host):.1f} MiB, device budget "
                         f"{budget / MIB:.1f} MiB, peak growth less the device's model data at that moment max "
                         f"{max(r['host_only_peak_growth_bytes'] for r in records) / MIB:.1f} MiB, "
                         if budget else "")
                      + (_heap_line(records) if "heap_free_growth_bytes" in records[0] else "")
                      + f"loss {records[0]['losses'][0]:.4f}->{records[0]['losses'][-1]:.4f}, "
                      f"{max(r['wall_s'] for r in records):.1f} s", flush=True)
    print("\nTargets:")
    for text in _targets(results, num_params):
        print(text)
    print(f"\ntook {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{s}_ws{w}": rs for (s, w), rs in results.items()}, indent=1))
    if failed:  # a row that failed must not read as a result: exit 1 with the first error
        print(f"host_memory.py: {len(failed)} row(s) FAILED; first: {failed[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
