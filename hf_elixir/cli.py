"""``hf-elixir``: plan and profile from the command line.

``hf-elixir plan --model facebook/opt-30b --num-gpus 1 --gpu-memory 40GiB --host-memory 512GiB
--batch-size 1 --seq-len 2048 --precision bf16 --output plan.yaml`` profiles one step on the meta
device (nothing big is materialised), searches, prints the memory breakdown, the chosen plan, its
predicted step time and the runners-up, and writes the plan (``ElixirConfig(plan="plan.yaml")`` reads it).
``--optimizer none`` searches for inference instead (``hf_elixir.prepare(model, None, ...)``): one forward
under ``torch.no_grad()`` is profiled and priced, with no backward, gradient buffers or optimizer states.

``hf-elixir profile --output step.png`` runs a real step of a small model on this machine, searches a plan
for the given budget and draws the predicted device-memory curve with chunk onloads, and the measured
vs predicted step time.

``hf-elixir launch [accelerate launch args] train.py [script args]`` runs an unchanged Accelerate or
``Trainer`` script under hf_elixir (``hf_elixir/integrations/launch.py``; docs/launch.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from typing import Sequence

from hf_elixir.config import parse_bytes
from hf_elixir.plan import policy_summary
from hf_elixir.profiler._gpu_presets import DEFAULT_PRESET, GPU_PRESETS

__all__ = ["main", "parse_bytes"]


def _gib(value: float | int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def _human_s(seconds: float | None) -> str:
    """A duration in the unit a person reads: ``"812 ms"``, ``"3.41 s"``, ``"2.5 min"``, ``"1.2 h"``."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120.0:
        return f"{seconds:.3g} s"
    if seconds < 7200.0:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-elixir", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("launch", add_help=False, help="run an unchanged Accelerate/Trainer script under hf_elixir: "
                   "hf-elixir launch [accelerate launch args] train.py [script args]")
    plan = sub.add_parser("plan", help="search a plan offline for a model config (meta device)")
    plan.add_argument("--model", required=True, help="built-in name (gpt2-xl, facebook/opt-30b, "
                      "switch-base-8, ...), a local model directory or a config.json")
    _add_step_flags(plan)
    plan.add_argument("--gpu", default=None, choices=tuple(GPU_PRESETS),
                      help="target GPU: device rates and memory from its spec sheet (default: this machine's GPU, "
                      f"measured; without one, the {DEFAULT_PRESET} preset)")
    plan.add_argument("--gpu-memory", default=None, help="device memory per rank, e.g. 40GiB "
                      "(default: the --gpu preset's, or measured on this machine)")
    plan.add_argument("--host-memory", default=None, help="host memory per node, e.g. 512GiB (default: measured)")
    plan.add_argument("--batch-size", type=int, default=1, help="micro-batch per rank")
    plan.add_argument("--seq-len", type=int, default=1024)
    plan.add_argument("--h2d-gbps", type=float, default=None, help="host->device GB/s of the target "
                      "(default: measured here)")
    plan.add_argument("--device-tflops", type=float, default=None, help="device matmul TFLOP/s of the target "
                      "(default: measured here)")
    plan.add_argument("--device-adam-gelems", type=float, default=None,
                      help="device AdamW G elements/s of the target (default: measured here)")
    plan.add_argument("--host-adam-gelems", type=float, default=None,
                      help="host AdamW G elements/s of the target's CPU, per rank (default: measured here, which "
                      "says little about a GPU server's host when planning from another machine)")
    plan.add_argument("--tensor-parallel-size", type=_tensor_parallel_flag, default=1,
                      help="tensor-parallel ranks within --num-gpus (placements column/row; the ranks of a "
                      "tensor-parallel group share one --batch-size micro-batch), or auto: the search tries 1, 2, 4 "
                      "and 8 within a node (--gpus-per-node) and keeps the fastest per token that fits")
    plan.add_argument("--expert-parallel-size", type=int, default=None,
                      help="expert-parallel ranks within --num-gpus (MoE experts placed 'expert'); default: the "
                      "search tries 1 and the largest that divides --num-gpus and the expert count, and keeps the "
                      "faster plan")
    plan.add_argument("--gpus-per-node", type=int, default=8,
                      help="GPUs per machine (default 8): --host-memory is shared by that many ranks, and an "
                      "expert-parallel group larger than it sends its all-to-alls over the network")
    plan.add_argument("--internode-gbps", type=float, default=None,
                      help="GB/s per direction one GPU sends to other machines (default: the --gpu preset's 400 "
                      "Gb/s InfiniBand port per GPU, 40 GB/s achieved)")
    plan.add_argument("--output", default=None, help="write the plan (.yaml/.yml or .json)")
    prof = sub.add_parser("profile", help="run one real step of a small model and draw the memory timeline")
    prof.add_argument("--model", default="tiny-gpt2", help="built-in name or local config (small!)")
    prof.add_argument("--batch-size", type=int, default=2)
    prof.add_argument("--seq-len", type=int, default=32)
    _add_step_flags(prof)
    prof.add_argument("--budget", default=None, help="device budget per rank, e.g. 300KiB (default: see "
                      "--budget-fraction)")
    prof.add_argument("--budget-fraction", type=float, default=0.5,
                      help="without --budget: 0 = the smallest budget the search accepts, 1 = the smallest with no "
                      "chunk onload; in between the step offloads and onloads chunks (default: 0.5)")
    prof.add_argument("--chunk-size-numel", type=int, default=None)
    prof.add_argument("--output", default="hf_elixir_profile.png", help="PNG to write")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


#: ``--optimizer`` -> the search's optimizer terms (``hf_elixir.optim.optimizer.optimizer_cost_terms`` of that
#: optimizer): fp32 state elements per parameter element, and whether the host lane rolls back by snapshots;
#: ``none``: inference, a forward-only step ([Note: forward-only step] in ``hf_elixir/profiler/_step.py``)
OPTIMIZER_TERMS = {"adamw": (2, False), "adam": (2, False), "adamw-amsgrad": (3, True),
                   "sgd-momentum": (1, True), "sgd": (0, True), "none": (0, False)}


def _tensor_parallel_flag(value: str) -> int | str:
    """``--tensor-parallel-size``: an int, or ``"auto"``."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an int or 'auto'") from None


def _add_step_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``plan`` and ``profile`` share: what is trained and how the budget is counted (the same
    values give the same search, so both accept or both refuse a budget)."""
    parser.add_argument("--num-gpus", type=int, default=1,
                        help="data-parallel ranks (chunks are sharded over them, or replicated on each)")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"),
                        help="compute precision (default: bf16); use the same ElixirConfig(precision=...)")
    parser.add_argument("--activation-checkpointing", default="auto", choices=("auto", "on", "off"),
                        help="auto: the search decides (only when activations count in the budget)")
    parser.add_argument("--safety-margin", type=float, default=0.05, help="fraction of device memory kept free")
    parser.add_argument("--optimizer", default="adamw", choices=tuple(OPTIMIZER_TERMS),
                        help="the torch.optim optimizer trained with (its state bytes per parameter: Adam/AdamW 8, "
                        "AMSGrad 12, SGD with momentum 4, plain SGD 0; default adamw), or none: inference "
                        "(prepare(model, None, ...)): a forward under torch.no_grad() is profiled and priced")
    parser.add_argument("--reduce-dtype", default="fp32", choices=("fp32", "compute"),
                        help="gradient buffers and their reduce: fp32 (default) or the compute precision; use the "
                        "same ElixirConfig(reduce_dtype='fp32' / None)")
    parser.add_argument("--split-fused-experts", default=None, action=argparse.BooleanOptionalAction,
                        help="one chunk unit per expert of fused MoE experts (Mixtral, Qwen3-MoE, gpt-oss, ...); "
                        "--no-split-fused-experts keeps the fused tensors; default: as prepare's "
                        "ElixirConfig(split_fused_experts='auto'), split only when the device memory is below the "
                        "fused model's floor (prepare then follows the plan's layout)")
    on_device = parser.prog.endswith("plan")
    parser.add_argument("--activations-on-device", default=on_device, action=argparse.BooleanOptionalAction,
                        help="count activations in the device budget (a GPU's accounting; default for plan) or "
                        "model data only (the CPU simulated pool's; default for profile, whose step runs on this CPU)")


def _search(args: argparse.Namespace, profile, hardware, budget: int, placements_at=None, heads: tuple = (),
            **extra):
    """The search both commands run, from the shared flags (:func:`_add_step_flags`). ``plan`` tries the
    expert-parallel degrees of ``--expert-parallel-size`` (``search_expert_parallel``) at the tensor-parallel degree
    of ``--tensor-parallel-size`` (``placements_at(tp)``: the placements there); with ``auto`` the tensor-parallel
    degrees (``search_tensor_parallel``; ``heads``: the head counts they must divide) and, for a MoE model without
    ``--expert-parallel-size``, the expert-parallel ones too: the fastest per token of the whole job wins.
    ``profile`` tries none."""
    from hf_elixir.search import search, search_expert_parallel, search_parallel

    common = _common_search_args(args, budget)
    if not hasattr(args, "gpus_per_node"):  # profile
        return search(profile, hardware, **common, **extra)
    extra["ranks_per_host"] = args.gpus_per_node
    tp, ep = args.tensor_parallel_size, args.expert_parallel_size
    if tp != "auto" or (ep or 1) > 1:  # one tensor-parallel degree (1 beside expert parallel: ElixirConfig)
        tp = 1 if tp == "auto" else tp
        ep = ep or (1 if tp > 1 else None)
        return search_expert_parallel(profile, hardware, expert_parallel_sizes=(ep,) if ep else None,
                                      tensor_parallel_size=tp,
                                      tensor_parallel_placements=placements_at(tp) if tp > 1 else None,
                                      **common, **extra)
    return search_parallel(profile, hardware, tensor_parallel_placements=placements_at, heads=heads,
                           **({"expert_parallel_sizes": (1,)} if ep == 1 else {}), **common, **extra)


def _common_search_args(args: argparse.Namespace, budget: int) -> dict:
    """The search arguments the shared flags give (every command, every degree)."""
    optim_states, snapshot_rollback = OPTIMIZER_TERMS[args.optimizer]
    return dict(world_size=args.num_gpus, precision=args.precision, optim_states=optim_states,
                snapshot_rollback=snapshot_rollback, reduce_dtype=None if args.reduce_dtype == "compute" else "fp32",
                device_memory_budget_bytes=budget, safety_margin=args.safety_margin,
                activations_on_device=args.activations_on_device,
                activation_checkpointing={"auto": None, "on": True, "off": False}[args.activation_checkpointing],
                host_memory_name="--host-memory (bytes per machine, e.g. 2TiB)")


def _target_hardware(args: argparse.Namespace):
    """The target's :class:`HardwareProfile` and notes saying where each rate came from: a ``--gpu``
    preset (the default one when this machine has no GPU), else this machine's GPU, measured; then the
    explicit ``--gpu-memory`` / ``--h2d-gbps`` / ``--device-tflops`` / ... flags."""
    from hf_elixir.profiler import probe_hardware
    from hf_elixir.profiler._gpu_presets import preset_hardware

    for flag, value in (("--gpu-memory", args.gpu_memory), ("--host-memory", args.host_memory)):
        if value is not None and parse_bytes(value) <= 0:
            raise SystemExit(f"hf-elixir plan: {flag} {value} must be a positive size, e.g. 40GiB")
    hw = probe_hardware()
    notes = [f"host-side rates measured on {hw.hostname}"]
    preset = args.gpu
    if preset is None and hw.device_kind != "cuda":
        preset = DEFAULT_PRESET
        notes.append(f"no GPU on this machine: device rates from the {preset} preset (pass --gpu "
                     f"{'|'.join(GPU_PRESETS)} for another target)")
    if preset is not None:
        hw = preset_hardware(preset, hw, world_size=args.num_gpus)
        notes.append(f"device: {hw.device_name}, rates from the {GPU_PRESETS[preset].source} derated to what a step reaches")
    else:
        notes.append(f"device rates measured on this machine's {hw.device_name}")
    changes: dict = {"world_size": args.num_gpus}
    if args.gpu_memory is not None:
        size = parse_bytes(args.gpu_memory)
        changes.update(device_total_bytes=size, device_free_bytes=size)
    if args.host_memory is not None:
        size = parse_bytes(args.host_memory)
        changes.update(host_total_bytes=size, host_available_bytes=size)
    if args.h2d_gbps is not None:
        changes.update(h2d_bytes_per_s=args.h2d_gbps * 1e9, d2h_bytes_per_s=args.h2d_gbps * 1e9)
        notes.append(f"host<->device {args.h2d_gbps} GB/s given")
    if args.device_tflops is not None:
        # one rate for every precision: the measured fp32 rate of this machine must not override it
        changes["device_flops_per_s"] = changes["device_fp32_flops_per_s"] = args.device_tflops * 1e12
        notes.append(f"device {args.device_tflops} TFLOP/s given")
    if args.device_adam_gelems is not None:
        changes["device_adam_numel_per_s"] = args.device_adam_gelems * 1e9
    if getattr(args, "internode_gbps", None) is not None:
        changes["inter_node_bytes_per_s"] = args.internode_gbps * 1e9
    if args.host_adam_gelems is not None:
        changes["host_adam_numel_per_s"] = args.host_adam_gelems * 1e9
        notes[0] = (f"host AdamW {args.host_adam_gelems} G elements/s given; other host-side rates measured on "
                    f"{hw.hostname}")
    return replace(hw, **changes), notes


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.output and not args.output.endswith((".yaml", ".yml", ".json")):
        raise SystemExit(f"hf-elixir plan: --output {args.output} must end in .yaml, .yml or .json")
    # a bad degree fails before the model is built and the host measured (seconds to tens of seconds)
    _check_degrees(args, 1 if args.tensor_parallel_size == "auto" else args.tensor_parallel_size,
                   args.expert_parallel_size or 1)
    import torch
    from rich.console import Console
    from rich.table import Table

    from hf_elixir.profiler import profile_step
    from hf_elixir.parallel._expert_units import split_fused_experts, splittable_names
    from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch

    console = Console(width=None if sys.stdout.isatty() else 140)
    config = load_config(args.model)
    _check_positions(config, args.seq_len)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    model, batch = meta_model_and_batch(config, batch_size=args.batch_size, seq_len=args.seq_len, dtype=dtype)
    hardware, notes = _target_hardware(args)
    if _splits_experts(args, model, hardware.device_total_bytes):  # [Note: split fused experts]
        split_fused_experts(model)
        notes.append("fused MoE experts split per expert (one chunk unit each)")
    elif splittable_names(model):
        notes.append("fused MoE experts kept fused (one chunk unit per layer's experts; --split-fused-experts "
                     "splits them per expert)")
    profile = profile_step(model, batch, device="meta", forward_only=args.optimizer == "none")
    fixed_tp = 1 if args.tensor_parallel_size == "auto" else args.tensor_parallel_size
    placements = _placements(model, args, args.expert_parallel_size or 1, fixed_tp)
    # replicated data parallelism (whole chunks, gradient all-reduce) is searched for plain data parallel
    model_parallel = fixed_tp > 1 or (args.expert_parallel_size or 1) > 1
    result = _search(args, profile, hardware, hardware.device_total_bytes, host_memory_bytes=hardware.host_total_bytes,
                     data_parallel="sharded" if model_parallel else "auto",
                     replicated_placements={fqn: "replicated" for fqn in placements},
                     placements_at=lambda tp: _placements(model, args, 1, tp), heads=_head_counts(config))
    plan, best = result.plan, result.best
    plan.reasons.extend(notes)
    if best.data_parallel == "sharded":
        plan.placements = (placements if (best.expert_parallel_size, best.tensor_parallel_size)
                           == (args.expert_parallel_size or 1, fixed_tp)
                           else _placements(model, args, best.expert_parallel_size, best.tensor_parallel_size))
    if profile.static:
        plan.reasons.append("the model could not run on meta; a static trace (module order) was used")

    data = profile.model_data_bytes(args.precision, args.num_gpus)
    table = Table(title=f"{args.model}: {profile.num_params / 1e9:.3g} B parameters, {args.precision}, "
                        f"{args.num_gpus} rank(s), batch {args.batch_size} x {args.seq_len}")
    table.add_column("memory (per rank)")
    table.add_column("bytes", justify="right")
    for key in ("params", "grads", "optimizer", "total"):
        table.add_row(f"model data: {key}", _gib(data[key]))
    table.add_row("activations (as profiled, no checkpointing)",
                  _gib(profile.activation_peak_bytes * {"fp32": 4}.get(args.precision, 2) // profile.activation_dtype_bytes))
    for key, value in best.prediction.peak_breakdown.items():  # at the peak: the rows sum to it
        if value:
            table.add_row(f"plan device at peak: {key}", _gib(value))
    table.add_row("plan device peak", _gib(best.prediction.device_peak_bytes))
    table.add_row("plan host", _gib(best.prediction.host_bytes))
    console.print(table)

    chosen = Table(title="chosen plan")
    chosen.add_column("field")
    chosen.add_column("value")
    chosen.add_row("data parallel", f"{best.data_parallel} over {args.num_gpus // best.tensor_parallel_size} rank(s)")
    chosen.add_row("tensor parallel", f"{best.tensor_parallel_size}" + (
        f" (all-reduces/all-gathers {_gib(best.prediction.tensor_parallel_bytes)} a step per rank)"
        if best.tensor_parallel_size > 1 else ""))
    if profile.moe_layers:
        chosen.add_row("expert parallel", f"{best.expert_parallel_size} (all-to-all "
                       f"{_gib(best.prediction.alltoall_bytes)} a step per rank)")
    for key in ("chunk_size_numel", "resident_chunks", "device_shard_chunks", "device_optim_chunks",
                "host_copy_chunks", "prefetch_depth", "activation_checkpointing", "refresh_cast"):
        value = getattr(plan, key)
        if key == "activation_checkpointing" and plan.activation_policy:
            value = "per block (activation policy below)"  # the uniform flag does not apply
        if isinstance(value, list):
            value = f"{len(value)} chunks {value[:12]}{'...' if len(value) > 12 else ''}"
        chosen.add_row(key, str(value))
    chosen.add_row("activation policy", policy_summary(plan.activation_policy))
    chosen.add_row("predicted step time", _human_s(plan.predicted_step_s))
    chosen.add_row("predicted peak device", _gib(plan.predicted_peak_device_bytes))
    chosen.add_row("onloads / step", str(best.prediction.onloads))
    console.print(chosen)

    alts = Table(title="next-best alternatives")
    for col in ("data parallel", "TP", "EP", "chunk", "resident", "cache blocks", "device optim", "prefetch",
                "activations",
                "step time", "device peak", "host"):
        alts.add_column(col)
    others = [c for c in result.best_by_mode.values() if c is not best and c not in result.alternatives]
    shown = set()
    for cand in [best] + result.alternatives + others:
        k = cand.knobs
        row = (cand.data_parallel, str(cand.tensor_parallel_size), str(cand.expert_parallel_size),
               str(cand.chunk_size_numel), str(len(k.resident)),
               str(k.cache_blocks), str(len(k.device_optim)), str(k.prefetch_depth),
               policy_summary(cand.activation_policy), _human_s(cand.prediction.step_s),
               _gib(cand.prediction.device_peak_bytes), _gib(cand.prediction.host_bytes))
        if row not in shown:  # candidates that differ only in what the table does not show read as one
            shown.add(row)
            alts.add_row(*row)
    console.print(alts)
    if plan.activation_policy:
        console.print(_policy_table(plan.activation_policy))
    console.print(_placement_table(plan.placements))
    for line in plan.reasons:
        console.print(f"- {line}")
    console.print(f"searched {result.evaluated} configurations in {_human_s(result.search_s)}")
    if args.output:
        plan.save(args.output)
        console.print(f"plan written to {args.output}")
    return 0


def _check_degrees(args: argparse.Namespace, tensor_parallel_size: int, expert_parallel_size: int) -> None:
    """Raises ValueError: a degree below 1 or not dividing ``--num-gpus``."""
    for name, size in (("tensor_parallel_size", tensor_parallel_size),
                       ("expert_parallel_size", expert_parallel_size)):
        if size < 1 or args.num_gpus % size:
            raise ValueError(f"--{name.replace('_', '-')}={size} must be >= 1 and divide --num-gpus={args.num_gpus}")


def _placements(model, args: argparse.Namespace, expert_parallel_size: int,
                tensor_parallel_size: int) -> dict[str, str]:
    """Every parameter-owning module's placement (``hf_elixir.placement.resolve_placements``) at those
    expert- and tensor-parallel degrees.

    Raises:
        ValueError: a degree below 1 or not dividing ``--num-gpus``, or placements the model refuses at it.
    """
    from hf_elixir.config import ElixirConfig
    from hf_elixir.placement import resolve_placements

    _check_degrees(args, tensor_parallel_size, expert_parallel_size)
    config = ElixirConfig(tensor_parallel_size=tensor_parallel_size, expert_parallel_size=expert_parallel_size)
    return resolve_placements(model, config)


def _head_counts(config) -> tuple[int, ...]:
    """The attention head counts a tensor-parallel degree must divide (query heads, key/value heads)."""
    names = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")
    return tuple(int(v) for v in {getattr(config, n, None) for n in names} if isinstance(v, int) and v > 0)


def _policy_table(policy: dict[str, str]):
    """Each transformer block's activation policy, consecutive blocks with the same one on one row
    (``transformer.h.0 .. transformer.h.3``)."""
    from rich.table import Table

    table = Table(title=f"activation policy per block ({len(policy)} blocks, forward order)")
    for col in ("blocks", "count", "policy"):
        table.add_column(col)
    runs: list[list] = []
    for block, kind in policy.items():
        if runs and runs[-1][2] == kind:
            runs[-1][1] = block
            runs[-1][3] += 1
        else:
            runs.append([block, block, kind, 1])
    for first, last, kind, count in runs:
        table.add_row(first if first == last else f"{first} .. {last}", str(count), kind)
    return table


def _placement_table(placements: dict[str, str]):
    """Placements grouped by pattern: layer indices folded into ``*`` (``h.*.attn.c_attn``)."""
    from rich.table import Table

    grouped: dict[tuple[str, str], int] = {}
    for fqn, placement in placements.items():
        pattern = ".".join("*" if part.isdigit() else part for part in fqn.split("."))
        grouped[(pattern, placement)] = grouped.get((pattern, placement), 0) + 1
    table = Table(title=f"module placements ({len(placements)} modules with parameters)")
    for col in ("modules", "count", "placement"):
        table.add_column(col)
    for (pattern, placement), count in grouped.items():
        table.add_row(pattern or "(root)", str(count), placement)
    return table


def _splits_experts(args: argparse.Namespace, model, budget_bytes: int | None) -> bool:
    """Whether to plan ``model`` with its fused MoE experts split per expert: ``--split-fused-experts`` /
    ``--no-split-fused-experts`` as given; by default as ``ElixirConfig(split_fused_experts="auto")`` decides in
    ``prepare`` (``search/_floor.py: split_needed``): split when ``budget_bytes`` (the device memory a rank, bytes;
    ``None``: no budget) is below the fused model's ``min_device_budget_bytes`` at ``--num-gpus`` ranks."""
    if args.split_fused_experts is not None:
        return args.split_fused_experts
    import torch

    from hf_elixir.config import ElixirConfig
    from hf_elixir.search._floor import split_needed

    optimizer = None if args.optimizer == "none" else torch.optim.SGD(model.parameters(), lr=0.0)
    config = ElixirConfig(precision=args.precision, budget_covers_activations=False,
                          offload_optimizer=True, split_fused_experts="auto")
    return split_needed(model, optimizer, config, budget_bytes, args.num_gpus, None)


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from hf_elixir.profiler import probe_hardware, profile_step
    from hf_elixir.parallel._expert_units import split_fused_experts
    from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch
    from hf_elixir.search import build_chunked_step, predict

    torch.manual_seed(0)
    config = load_config(args.model)
    _check_positions(config, args.seq_len)
    model, batch = meta_model_and_batch(config, batch_size=args.batch_size, seq_len=args.seq_len, device="cpu")
    if _splits_experts(args, model, parse_bytes(args.budget) if args.budget else None):  # [Note: split fused experts]
        split_fused_experts(model)
    # probe_hardware() below describes the GPU where there is one: price the CPU-profiled step by its FLOPs there
    profile = profile_step(model, batch, device="cpu", count_flops=torch.cuda.is_available(),
                           forward_only=args.optimizer == "none")
    hardware = probe_hardware(budget_bytes=1)  # the CPU's rates; the budget is set below
    budget = parse_bytes(args.budget) if args.budget else _budget_from_fraction(args, profile, hardware)
    hardware = replace(hardware, device_total_bytes=budget, device_free_bytes=budget)
    result = _search(args, profile, hardware, budget, chunk_size_numel=args.chunk_size_numel)
    best = result.best
    step = build_chunked_step(profile, best.chunk_size_numel, world_size=args.num_gpus, precision=args.precision,
                              hardware=hardware, activation_checkpointing=best.activation_checkpointing,
                              activation_policy=best.activation_policy or None,
                              replicated=best.data_parallel == "replicated")
    pred = predict(step, best.knobs, hardware, activations_on_device=args.activations_on_device, timeline=True)
    assert pred is not None, "the search's best candidate must fit when priced again"
    measured = (profile.forward_s or 0.0) + (profile.backward_s or 0.0)
    import matplotlib.pyplot as plt

    plt.close(_draw_profile(args, best, pred, budget, measured))
    print(f"wrote {args.output}: measured {_step_name(args)} {_human_s(measured)} (fp32 step on this CPU), predicted "
          f"{_human_s(pred.forward_backward_s)}, {pred.onloads} onloads, peak {pred.device_model_bytes} bytes of model "
          f"data in a budget of {budget} ({args.num_gpus} rank(s), {args.precision})")
    return 0


def _step_name(args: argparse.Namespace) -> str:
    """What the profiled step runs: ``"forward"`` for ``--optimizer none`` (inference), else
    ``"forward+backward"``."""
    return "forward" if args.optimizer == "none" else "forward+backward"


def _budget_from_fraction(args: argparse.Namespace, profile, hardware) -> int:
    """``--budget-fraction`` F: ``lo + F * (hi - lo)`` bytes, where ``lo`` is the smallest budget the search
    accepts and ``hi`` the smallest at which its plan onloads no chunk (both found by bisection to 1%, with
    the same flags; a search of a small model takes milliseconds). Below 1.0 the step offloads and onloads.

    Raises:
        ValueError: F is not in [0, 1], or no budget up to 64x the model data fits.
    """
    import math

    if not (math.isfinite(args.budget_fraction) and 0.0 <= args.budget_fraction <= 1.0):
        raise ValueError(f"--budget-fraction {args.budget_fraction} must be in [0, 1], e.g. 0.5")
    ceiling = 64 * profile.model_data_bytes(args.precision, args.num_gpus)["total"] + 2**24

    def best_at(budget: int):
        try:
            return _search(args, profile, hardware, budget, chunk_size_numel=args.chunk_size_numel).best
        except ValueError:
            return None

    def smallest(ok) -> int:
        lo, hi = 0, ceiling  # ok(hi) holds, ok(lo) does not
        while hi - lo > max(64, lo // 100):
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi

    if best_at(ceiling) is None:
        raise ValueError(f"no budget up to {ceiling} bytes fits {args.model} at batch {args.batch_size} x "
                         f"{args.seq_len}; pass a smaller --batch-size/--seq-len or more --num-gpus")
    lo = smallest(lambda b: best_at(b) is not None)
    hi = max(lo, smallest(lambda b: (c := best_at(b)) is not None and c.prediction.onloads == 0))
    return int(lo + args.budget_fraction * (hi - lo))


def _draw_profile(args: argparse.Namespace, best, pred, budget: int, measured_s: float):
    """The PNG: device model data over the predicted step (y from 0, onloads marked, legend outside the
    axes, an entry only for series that have points) and measured vs predicted forward+backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times_ms = [0.0] + [t * 1e3 for t, _, _ in pred.timeline]
    used_mib = [pred.timeline[0][1] / 2**20] + [u / 2**20 for _, u, _ in pred.timeline]
    onload_ms = [t * 1e3 for (t, _, label) in pred.timeline
                 if label.endswith(" onloads") and not label.endswith(":0 onloads")]
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 1]})
    ax.step(times_ms, used_mib, where="post", label="device model data")
    ax.axhline(budget / 2**20, color="red", linestyle="--", label="budget")
    activations = pred.breakdown.get("activations", 0)
    if activations:
        ax.axhline((budget - activations) / 2**20, color="orange", linestyle=":", label="budget minus activations")
    for i, t in enumerate(onload_ms):  # one legend entry for the series, none when it is empty
        ax.axvline(t, color="gray", alpha=0.35, linewidth=1, label="chunk onload" if i == 0 else None)
    ax.set_ylim(bottom=0, top=max(budget / 2**20, max(used_mib)) * 1.08)
    ax.set_xlim(left=0)
    ax.set_xlabel("predicted time in step (ms)")
    ax.set_ylabel("MiB")
    k = best.knobs
    ax.set_title(f"{args.model}, {args.num_gpus} rank(s), {args.precision}: chunk {best.chunk_size_numel}, "
                 f"resident {len(k.resident)}, cache blocks {k.cache_blocks}, ckpt {best.activation_checkpointing} "
                 f"(activations: {policy_summary(best.activation_policy)})",
                 fontsize=10, pad=28)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(labels), frameon=False,
              fontsize=9)  # above the axes: never over the curve
    bar.bar(["measured\n(fp32, CPU)", "predicted"], [measured_s * 1e3, pred.forward_backward_s * 1e3])
    bar.set_title(_step_name(args), fontsize=10)
    bar.set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(args.output, dpi=100, bbox_inches="tight")
    return fig


def _check_args(args: argparse.Namespace) -> None:
    """Flag checks both commands share, before any work (each error names the flag).

    Raises:
        ValueError: a count below 1, a rate that is not a positive finite number, an --output in a
            folder that does not exist, or a --seq-len beyond the model's positions.
    """
    import math
    import os

    for flag in ("batch_size", "seq_len", "num_gpus", "gpus_per_node"):
        if getattr(args, flag, 1) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    for flag in ("h2d_gbps", "device_tflops", "device_adam_gelems", "host_adam_gelems", "budget_fraction",
                 "internode_gbps"):
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be a positive number")
    folder = os.path.dirname(os.path.abspath(args.output)) if args.output else ""
    if folder and not os.path.isdir(folder):
        raise ValueError(f"--output {args.output}: the folder {folder} does not exist")


def _check_positions(config, seq_len: int) -> None:
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if limit and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's {limit} positions")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-elixir`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # accelerate's arguments pass through untouched: hf_elixir/integrations/launch.py
        from hf_elixir.integrations.launch import launch_main  # noqa: PLC0415

        try:
            return launch_main(argv[1:])
        except (ValueError, TypeError, FileNotFoundError) as exc:
            print(f"hf-elixir launch: error: {exc}", file=sys.stderr)
            return 2
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        _check_args(args)
        if args.command == "plan":
            return _cmd_plan(args)
        return _cmd_profile(args)
    except ValueError as exc:
        print(f"hf-elixir {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
