"""``hf-elixir plan``: the target's rates, the model's checks, the search, and what both commands share.

[Note: target rates]
A plan is for a target machine, and every rate the cost model prices with is the target's: the device side
from the ``--gpu`` preset (spec sheet, derated: ``hf_elixir/profiler/_gpu_presets.py``), the host side from
:data:`TARGET_HOST_RATES` (a GPU server's host, not this one), each replaced by its flag where given
(``--h2d-gbps``, ``--host-adam-gelems``, ...). This machine is timed only when the plan is for it:
``--measure-here``, or no ``--gpu`` on a machine with a GPU. Planning for an 8 x H100 node from a loaded laptop
used to time the laptop's AdamW (picking expert parallel 1 at 12.15 s where the node's host gives expert parallel
8 at about 1 s), and the same flags gave other plans as the load changed. Now the same flags give the same plan
on any machine, busy or idle, and the report names each rate and where it came from.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from hf_elixir.cli import DEFAULT_PRESET, OPTIMIZER_TERMS

__all__ = ["TARGET_HOST_RATES", "check_config", "cmd_plan", "target_hardware"]

#: the host side of a GPU server, used unless this machine is measured ([Note: target rates]): host AdamW
#: elements/s per GPU (4.5 G: about 1 B parameters in 0.22 s, the order of DeepSpeed's CPU-Adam on a 2-socket
#: server in the ZeRO-Offload paper, as ``benchmarks/predicted_gpu.py`` assumes) and hf_elixir's own overheads
#: per module call, per chunk onload and per optimizer tensor (what ``probe_hardware`` times on a quiet machine)
TARGET_HOST_RATES = {"host_adam_numel_per_s": 4.5e9, "hook_event_s": 2e-5, "onload_fixed_s": 1e-4,
                     "optim_tensor_s": 5e-6}
_TARGET_HOST_SOURCE = "a GPU server's host (default; --measure-here times this machine)"


def _expert_count(config) -> int:
    """The routed experts per MoE layer the config declares (0: a dense model)."""
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def head_counts(config) -> tuple[int, ...]:
    """The attention head counts a tensor-parallel degree must divide (query heads, key/value heads)."""
    names = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")
    return tuple(sorted({int(v) for n in names if isinstance(v := getattr(config, n, None), int) and v > 0}))


def check_config(args: argparse.Namespace, config) -> None:
    """The flags against the model's config, before the model is built ([Note: CLI checks] in ``__init__``).

    Raises:
        ValueError: a --seq-len beyond the model's positions, a --tensor-parallel-size that does not divide its
            head counts, an --expert-parallel-size on a model without experts or not dividing their count.
    """
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if limit and args.seq_len > limit:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's {limit} positions; use at most {limit}")
    tp = getattr(args, "tensor_parallel_size", 1)
    heads = head_counts(config)
    if isinstance(tp, int) and tp > 1 and any(h % tp for h in heads):
        fits = [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= args.num_gpus and all(h % d == 0 for h in heads)]
        raise ValueError(f"--tensor-parallel-size={tp} does not divide the model's attention heads "
                         f"({', '.join(map(str, heads))}); use one of {fits} or auto")
    ep = getattr(args, "expert_parallel_size", None) or 1
    experts = _expert_count(config)
    if ep > 1 and not experts:
        raise ValueError(f"--expert-parallel-size={ep}: {args.model} has no MoE experts; leave "
                         "--expert-parallel-size out (or give 1)")
    if ep > 1 and experts % ep:
        raise ValueError(f"--expert-parallel-size={ep} does not divide the model's {experts} experts per layer; use "
                         "a divisor of both it and --num-gpus")


def _rate_rows(hw, args: argparse.Namespace, sources: dict[str, str]) -> list[dict[str, Any]]:
    """The rates the plan is priced with, each with its unit and where it came from."""
    flops = hw.flops_rate(args.precision)
    link = hw.link_rate(False) if args.num_gpus > 1 else None
    rows = [("device matmul", flops / 1e12, "TFLOP/s", "device"),
            ("device AdamW", hw.device_adam_numel_per_s / 1e9, "G elements/s", "device_adam"),
            ("host<->device copies", hw.h2d_bytes_per_s / 1e9, "GB/s", "h2d"),
            ("GPU<->GPU in a machine", None if link is None else link / 1e9, "GB/s per direction", "device"),
            ("GPU<->other machines", (hw.inter_node_bytes_per_s or 0) / 1e9, "GB/s per direction", "internode"),
            ("host AdamW", hw.host_adam_numel_per_s / 1e9, "G elements/s per GPU", "host_adam"),
            ("hf_elixir overhead per module call", hw.hook_event_s * 1e6, "us", "host"),
            ("hf_elixir overhead per chunk onload", hw.onload_fixed_s * 1e6, "us", "host")]
    return [{"rate": name, "value": round(value, 4), "unit": unit, "source": sources[key]}
            for name, value, unit, key in rows if value is not None]


def target_hardware(args: argparse.Namespace):
    """``(HardwareProfile, rate rows, hardware label, notes)`` for the target ([Note: target rates])."""
    import psutil
    import torch

    from hf_elixir.profiler import HardwareProfile
    from hf_elixir.profiler._gpu_presets import GPU_PRESETS, preset_hardware

    cuda_here = torch.cuda.is_available()
    measure = bool(getattr(args, "measure_here", False)) or (args.gpu is None and cuda_here)
    notes: list[str] = []
    if measure:
        from hf_elixir._hardware_probe import probe_hardware  # with the runtime probe ([Note: runtime probe])

        base = probe_hardware()
        host_source = "measured on this machine (--measure-here)" if args.gpu or not cuda_here else \
            "measured on this machine"
    else:
        total = int(psutil.virtual_memory().total)
        base = HardwareProfile(device_name="", host_total_bytes=total, host_available_bytes=total,
                               **TARGET_HOST_RATES)
        host_source = _TARGET_HOST_SOURCE
    preset = args.gpu or (None if cuda_here and measure else DEFAULT_PRESET)
    sources = dict.fromkeys(("host_adam", "host"), host_source)
    if preset is not None:
        hw = preset_hardware(preset, base, world_size=args.num_gpus)
        device_source = f"{preset} preset ({GPU_PRESETS[preset].source}, derated)"
        label = f"{args.num_gpus} x {hw.device_name} ({preset} preset)"
        if args.gpu is None:
            notes.append(f"no GPU on this machine: device rates from the {preset} preset (pass --gpu "
                         f"{'|'.join(GPU_PRESETS)} for another target)")
    else:
        hw, device_source = base, "measured on this machine"
        label = f"{args.num_gpus} x {hw.device_name} (this machine, measured)"
    sources.update(dict.fromkeys(("device", "device_adam", "h2d", "internode"), device_source))
    changes: dict = {"world_size": args.num_gpus}
    memory_source = {"device": device_source, "host": "this machine's (pass --host-memory for the target's)"}
    if args.gpu_memory is not None:
        changes.update(device_total_bytes=args.gpu_memory, device_free_bytes=args.gpu_memory)
        memory_source["device"] = "--gpu-memory"
    if args.host_memory is not None:
        changes.update(host_total_bytes=args.host_memory, host_available_bytes=args.host_memory)
        memory_source["host"] = "--host-memory"
    for flag, key, fields, scale in (
            ("h2d_gbps", "h2d", ("h2d_bytes_per_s", "d2h_bytes_per_s"), 1e9),
            # one rate for every precision: a measured fp32 rate must not override it
            ("device_tflops", "device", ("device_flops_per_s", "device_fp32_flops_per_s"), 1e12),
            ("device_adam_gelems", "device_adam", ("device_adam_numel_per_s",), 1e9),
            ("internode_gbps", "internode", ("inter_node_bytes_per_s",), 1e9),
            ("host_adam_gelems", "host_adam", ("host_adam_numel_per_s",), 1e9)):
        value = getattr(args, flag, None)
        if value is not None:
            changes.update(dict.fromkeys(fields, value * scale))
            sources[key] = f"--{flag.replace('_', '-')}"
            if flag == "host_adam_gelems":
                notes.append(f"host AdamW {value} G elements/s given")
    hw = replace(hw, **changes)
    rates = _rate_rows(hw, args, sources)
    rates += [{"rate": "device memory per GPU", "value": hw.device_total_bytes, "unit": "bytes",
               "source": memory_source["device"]},
              {"rate": "host memory per machine", "value": hw.host_total_bytes, "unit": "bytes",
               "source": memory_source["host"]}]
    return hw, rates, label, notes


def common_search_args(args: argparse.Namespace, budget: int) -> dict:
    """The search arguments the shared flags give (every command, every degree)."""
    optim_states, snapshot_rollback = OPTIMIZER_TERMS[args.optimizer]
    return dict(world_size=args.num_gpus, precision=args.precision, optim_states=optim_states,
                snapshot_rollback=snapshot_rollback, reduce_dtype=None if args.reduce_dtype == "compute" else "fp32",
                device_memory_budget_bytes=budget, safety_margin=args.safety_margin,
                activations_on_device=args.activations_on_device,
                activation_checkpointing={"auto": None, "on": True, "off": False}[args.activation_checkpointing],
                host_memory_name="--host-memory (bytes per machine, e.g. 2TiB)")


def run_search(args: argparse.Namespace, profile, hardware, budget: int, placements_at=None, heads: tuple = (),
               **extra):
    """The search both commands run, from the shared flags. ``plan`` tries the expert-parallel degrees of
    ``--expert-parallel-size`` (``search_expert_parallel``) at the tensor-parallel degree of
    ``--tensor-parallel-size`` (``placements_at(tp)``: the placements there); with ``auto`` the tensor-parallel
    degrees (``search_tensor_parallel``; ``heads``: the head counts they must divide) and, for a MoE model without
    ``--expert-parallel-size``, the expert-parallel ones too: the fastest per token of the whole job wins.
    ``profile`` tries none."""
    from hf_elixir.search import search, search_expert_parallel, search_parallel

    common = common_search_args(args, budget)
    if args.command != "plan":
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


def placements(model, args: argparse.Namespace, expert_parallel_size: int, tensor_parallel_size: int) -> dict:
    """Every parameter-owning module's placement (``hf_elixir.placement.resolve_placements``) at those degrees."""
    from hf_elixir.config import ElixirConfig
    from hf_elixir.placement import resolve_placements

    config = ElixirConfig(tensor_parallel_size=tensor_parallel_size, expert_parallel_size=expert_parallel_size)
    return resolve_placements(model, config)


def _widest_expert_parallel(args: argparse.Namespace, config) -> int:
    """The largest expert-parallel degree ``plan`` searches: ``--expert-parallel-size``, else the largest dividing
    ``--num-gpus`` and the expert count (1 for a dense model, or with tensor parallelism fixed above 1)."""
    if getattr(args, "expert_parallel_size", None):
        return args.expert_parallel_size
    tp = getattr(args, "tensor_parallel_size", 1)
    experts = _expert_count(config)
    if not experts or (isinstance(tp, int) and tp > 1):
        return 1
    return max(d for d in range(1, args.num_gpus + 1) if args.num_gpus % d == 0 and experts % d == 0)


def splits_experts(args: argparse.Namespace, model, budget_bytes: int | None) -> bool:
    """Whether to plan ``model`` with its fused MoE experts split per expert: ``--split-fused-experts`` /
    ``--no-split-fused-experts`` as given; by default as ``ElixirConfig(split_fused_experts="auto")`` decides in
    ``prepare`` (``search/_floor.py: split_needed``): split when ``budget_bytes`` (the device memory a rank, bytes;
    ``None``: no budget) is below the fused model's ``min_device_budget_bytes`` at ``--num-gpus`` ranks. Where the
    search tries expert parallelism above 1, the fused layout is kept: a rank then holds ``1 / ep`` of each layer's
    fused experts (what ``prepare`` decides on the parallelized model), and one chunk unit per expert of a
    61-layer, 256-expert model made the search take tens of minutes."""
    if args.split_fused_experts is not None:
        return args.split_fused_experts
    if _widest_expert_parallel(args, model.config) > 1:
        return False
    import torch

    from hf_elixir.config import ElixirConfig
    from hf_elixir.search._floor import split_needed

    optimizer = None if args.optimizer == "none" else torch.optim.SGD(model.parameters(), lr=0.0)
    config = ElixirConfig(precision=args.precision, budget_covers_activations=False,
                          offload_optimizer=True, split_fused_experts="auto")
    return split_needed(model, optimizer, config, budget_bytes, args.num_gpus, None)


def _with_lora(model, args: argparse.Namespace):
    """``model`` (on meta) with peft's LoRA adapters of ``--lora-rank`` on ``--lora-targets``: the model a LoRA run
    prepares (peft freezes everything else)."""
    import torch
    from peft import LoraConfig, get_peft_model

    targets = args.lora_targets or "all-linear"
    try:  # the adapters on meta too: DeepSeek-V3's 6.6 B would otherwise take 26 GB of this machine's memory
        with torch.device("meta"):
            return get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                    target_modules=targets))
    except ValueError as err:
        raise ValueError(f"--lora-targets {' '.join(args.lora_targets or ['all-linear'])}: {err}") from None


def nf4_bytes_per_element(precision: str) -> float:
    """Bytes per element of a weight stored as NF4 (torchao's ``to_nf4`` defaults).

    [Note: NF4 pricing] torchao's ``NF4Tensor`` (``torchao.quantization.quantize_.workflows.nf4.nf4_tensor``, once
    ``torchao.dtypes.nf4tensor``) packs two 4-bit codes per byte (0.5 B), one absmax scale per 64-element block,
    double-quantized to int8 (1 / 64 B), and one scale of those per 256 blocks in the weight's dtype (``precision``'s
    bytes / 16384), plus a few bytes per tensor (the scales' mean, the 16-value code book): 0.515747 B in bf16, as
    ``to_nf4`` of a 4096 x 4096 bf16 weight measures. ``--quantize nf4`` prices each frozen parameter at these bytes
    by giving it ``numel * nf4 / b`` elements of the compute dtype (``b`` bytes) in the searched profile: its chunks'
    device and host bytes, gathers and host-to-device copies are the packed ones; compute and activations are the
    compute dtype's (dequantized on gather; the dequantization itself is not priced). The runtime stores these
    bytes (``hf_elixir/chunk/_nf4.py``, [Note: NF4 in chunks]): one formula for both."""
    from hf_elixir.chunk._nf4 import nf4_bytes_per_element as runtime_bytes
    from hf_elixir.search._activation_cost import DTYPE_BYTES

    return runtime_bytes(DTYPE_BYTES[precision])


def frozen_as_nf4(profile, precision: str):
    """``profile`` with every frozen parameter's numel the compute-dtype elements its NF4 storage takes
    ([Note: NF4 pricing])."""
    import dataclasses
    import math

    from hf_elixir.search._activation_cost import DTYPE_BYTES

    ratio = nf4_bytes_per_element(precision) / DTYPE_BYTES[precision]
    numels = [n if trained else math.ceil(n * ratio)
              for n, trained in zip(profile.param_numels, profile.param_requires_grad)]
    return dataclasses.replace(profile, param_numels=numels)


def _profiled(model, batch, args: argparse.Namespace, notes: list[str]):
    """``(model, profile, parameters)``: the model as trained (peft's adapters with ``--lora-rank``), its step
    profiled on meta (the frozen base packed apart from the adapters, as ``prepare`` packs it: [Note: frozen chunks
    apart] in ``hf_elixir/chunk/_frozen_apart.py``; a frozen base priced as NF4 with ``--quantize nf4``: [Note: NF4
    pricing]) and its parameter count."""
    from hf_elixir.profiler import profile_step

    lora, nf4 = getattr(args, "lora_rank", None), getattr(args, "quantize", None) == "nf4"
    if lora:
        model = _with_lora(model, args)
        notes.append(f"LoRA rank {lora} on {', '.join(args.lora_targets or ['all-linear'])}: the base is frozen in "
                     f"{'NF4' if nf4 else 'the compute dtype'} (no gradients, optimizer state or reduce-scatters), "
                     "the adapters are trained with their AdamW state")
    profile = profile_step(model, batch, device="meta", forward_only=args.optimizer == "none")
    parameters = profile.num_params
    if nf4:
        profile = frozen_as_nf4(profile, args.precision)
        notes.append(f"QLoRA: the frozen base stored as NF4 at {nf4_bytes_per_element(args.precision):.6f} bytes "
                     "per element (torchao's layout: 64-element blocks, double-quantized scales), dequantized on "
                     "gather; the plan's chunk sizes count its packed bytes in compute-dtype elements")
    return model, profile, parameters


def cmd_plan(args: argparse.Namespace) -> int:
    """``hf-elixir plan``: check, profile on meta, search (progress on stderr), report, write the plan."""
    import torch

    from hf_elixir.cli._disk import disk_tier
    from hf_elixir.cli._report import build_report, print_json, print_report
    from hf_elixir.parallel._expert_units import split_fused_experts, splittable_names
    from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch
    from hf_elixir.search._coarse import PeriodicLines, progress_reporter

    config = load_config(args.model)
    check_config(args, config)
    if args.lora_rank and args.expert_parallel_size is None:  # LoRA: data parallel only (check_args)
        args.expert_parallel_size = 1
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    model, batch = meta_model_and_batch(config, batch_size=args.batch_size, seq_len=args.seq_len, dtype=dtype)
    hardware, rates, label, notes = target_hardware(args)
    disk, disk_rates = disk_tier(args, hardware)  # [Note: disk tier pricing] in hf_elixir/search/_disk_cost.py
    rates += disk_rates
    if splits_experts(args, model, hardware.device_total_bytes):  # [Note: split fused experts]
        split_fused_experts(model)
        notes.append("fused MoE experts split per expert (one chunk unit each)")
    elif splittable_names(model):
        notes.append("fused MoE experts kept fused (one chunk unit per layer's experts; a rank holds 1/ep of them "
                     "under expert parallel ep; --split-fused-experts splits them per expert)")
    model, profile, parameters = _profiled(model, batch, args, notes)
    fixed_tp = 1 if args.tensor_parallel_size == "auto" else args.tensor_parallel_size
    first = placements(model, args, args.expert_parallel_size or 1, fixed_tp)
    # replicated data parallelism (whole chunks, gradient all-reduce) is searched for plain data parallel
    model_parallel = fixed_tp > 1 or (args.expert_parallel_size or 1) > 1
    with progress_reporter(PeriodicLines(sys.stderr.write)):
        result = run_search(args, profile, hardware, hardware.device_total_bytes,
                            host_memory_bytes=hardware.host_total_bytes, disk=disk,
                            data_parallel="sharded" if model_parallel else "auto",
                            replicated_placements={fqn: "replicated" for fqn in first},
                            placements_at=lambda tp: placements(model, args, 1, tp), heads=head_counts(config))
    plan, best = result.plan, result.best
    plan.reasons.extend(notes)
    if best.data_parallel == "sharded":
        plan.placements = (first if (best.expert_parallel_size, best.tensor_parallel_size)
                           == (args.expert_parallel_size or 1, fixed_tp)
                           else placements(model, args, best.expert_parallel_size, best.tensor_parallel_size))
    if profile.static:
        plan.reasons.append("the model could not run on meta; a static trace (module order) was used")
    report = build_report(args, profile, result, hardware, rates, label)
    report["parameters"] = int(parameters)  # the model's, not the NF4 storage's ([Note: NF4 pricing])
    if args.output:
        plan.save(args.output)
        report["plan_file"] = args.output
    if args.json:
        print_json(report)
    else:
        print_report(report, plan)
    return 0
