"""``hf-elixir``: plan and profile from the command line.

``hf-elixir plan --model facebook/opt-30b --num-gpus 1 --gpu-memory 40GiB --host-memory 512GiB
--batch-size 1 --seq-len 2048 --precision bf16 --output plan.yaml`` profiles one step on the meta
device (nothing big is materialised), searches, prints what to run and why (step time, tokens/s, memory per
rank), the rates it priced with and where each came from, the memory at the peak, the runners-up, and writes
the plan (``ElixirConfig(plan="plan.yaml")`` reads it); ``--json`` prints the same report as JSON.
``--optimizer none`` searches for inference instead (``hf_elixir.prepare(model, None, ...)``): one forward
under ``torch.no_grad()`` is profiled and priced, with no backward, gradient buffers or optimizer states.

``hf-elixir profile --output step.png`` runs a real step of a small model on this machine, searches a plan
for the given budget and draws the predicted device-memory curve with chunk onloads, and the measured
vs predicted step time.

``hf-elixir launch [accelerate launch args] train.py [script args]`` runs an unchanged Accelerate or
``Trainer`` script under hf_elixir (``hf_elixir/integrations/launch.py``; docs/launch.md).

[Note: CLI checks] Every bad flag exits 2 with argparse's ``error:`` line naming the flag, the value and the fix,
before any model is built: the flag's own value where argparse reads it (``type=``), the flags together and the
model's config (head counts, experts) right after, in :func:`check_args` and ``_plan.check_config``. Nothing here
imports torch: ``hf-elixir --help`` and these errors answer at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import sys
from typing import Sequence

from hf_elixir.cli._disk import add_disk_flags, add_probe_parser, check_disk_args
from hf_elixir.config import parse_bytes

__all__ = ["main", "parse_bytes"]

#: the ``--gpu`` presets (``hf_elixir.profiler._gpu_presets.GPU_PRESETS``, which imports torch: a test checks the
#: two agree) and the one used without ``--gpu`` on a machine without a GPU
GPU_NAMES = ("a100-40gb", "a100-80gb", "h100", "h200", "l4", "rtx4090")
DEFAULT_PRESET = "a100-80gb"

#: ``--optimizer`` -> the search's optimizer terms (``hf_elixir.optim.optimizer.optimizer_cost_terms`` of that
#: optimizer): fp32 state elements per parameter element, and whether the host lane rolls back by snapshots;
#: ``none``: inference, a forward-only step ([Note: forward-only step] in ``hf_elixir/profiler/_step.py``)
OPTIMIZER_TERMS = {"adamw": (2, False), "adam": (2, False), "adamw-amsgrad": (3, True),
                   "sgd-momentum": (1, True), "sgd": (0, True), "none": (0, False)}


def _size(value: str) -> int:
    """A positive size (``--gpu-memory``, ``--host-memory``, ``--budget``): ``40GiB``, ``512GB``, bytes."""
    text = value.strip()
    try:
        size = parse_bytes(text[1:] if text.startswith("-") else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {value!r} as a size; write e.g. 40GiB, 512GB or 1.5TiB") \
            from None
    if text.startswith("-") or size <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive, e.g. 40GiB")
    return size


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number; give one >= 1") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number; give a positive one, e.g. 25") from None
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"{value} must be a positive number, e.g. 25")
    return number


def _fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and 0.0 <= number <= 1.0):
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1], e.g. 0.5")
    return number


def _margin(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and 0.0 <= number < 1.0):
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1), e.g. 0.05")
    return number


def _tensor_parallel_flag(value: str) -> int | str:
    """``--tensor-parallel-size``: an int >= 1, or ``"auto"``."""
    return value if value == "auto" else _positive_int(value)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-elixir", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("launch", add_help=False, help="run an unchanged Accelerate/Trainer script under hf_elixir: "
                   "hf-elixir launch [accelerate launch args] train.py [script args]")
    plan = sub.add_parser("plan", help="search a plan offline for a model config (meta device)")
    plan.add_argument("--model", required=True, help="built-in name (gpt2-xl, facebook/opt-30b, "
                      "switch-base-8, ...), a local model directory or a config.json")
    _add_step_flags(plan)
    target = plan.add_argument_group("the target machine (default: rates of the --gpu preset and of a GPU server's "
                                     "host; this machine is measured only with --measure-here, or without --gpu "
                                     "when it has a GPU)")
    target.add_argument("--gpu", default=None, choices=GPU_NAMES,
                        help="target GPU: device rates and memory from its spec sheet (default: this machine's GPU, "
                        f"measured; without one, the {DEFAULT_PRESET} preset)")
    target.add_argument("--measure-here", action="store_true",
                        help="time this machine's host (AdamW, copies, hf_elixir's overheads) and, with a GPU here "
                        "and no --gpu, its device: the plan is for this machine")
    target.add_argument("--gpu-memory", type=_size, default=None, help="device memory per GPU, e.g. 40GiB "
                        "(default: the --gpu preset's, or measured on this machine)")
    target.add_argument("--host-memory", type=_size, default=None,
                        help="host memory per machine, e.g. 512GiB (default: this machine's)")
    target.add_argument("--h2d-gbps", type=_positive_float, default=None,
                        help="host->device GB/s of the target (default: the preset's PCIe rate, derated)")
    target.add_argument("--device-tflops", type=_positive_float, default=None,
                        help="device matmul TFLOP/s of the target (default: the preset's, derated)")
    target.add_argument("--device-adam-gelems", type=_positive_float, default=None,
                        help="device AdamW G elements/s of the target (default: from the preset's memory bandwidth)")
    target.add_argument("--host-adam-gelems", type=_positive_float, default=None,
                        help="host AdamW G elements/s of the target's CPU, per GPU (default: 4.5, a GPU server's; "
                        "with --measure-here: timed here)")
    target.add_argument("--gpus-per-node", type=_positive_int, default=8,
                        help="GPUs per machine (default 8): --host-memory is shared by that many GPUs, and an "
                        "expert-parallel group larger than it sends its all-to-alls over the network")
    target.add_argument("--internode-gbps", type=_positive_float, default=None,
                        help="GB/s per direction one GPU sends to other machines (default: the preset's 400 Gb/s "
                        "InfiniBand port per GPU, 40 GB/s achieved)")
    add_disk_flags(target, _size, _positive_float)
    plan.add_argument("--batch-size", type=_positive_int, default=1,
                      help="micro-batch per data-parallel rank (the GPUs of a tensor-parallel group share one)")
    plan.add_argument("--seq-len", type=_positive_int, default=1024)
    plan.add_argument("--tensor-parallel-size", type=_tensor_parallel_flag, default=1,
                      help="tensor-parallel GPUs within --num-gpus (placements column/row; the GPUs of a "
                      "tensor-parallel group share one --batch-size micro-batch), or auto: the search tries 1, 2, 4 "
                      "and 8 within a node (--gpus-per-node) and keeps the fastest per token that fits")
    plan.add_argument("--expert-parallel-size", type=_positive_int, default=None,
                      help="expert-parallel GPUs within --num-gpus (MoE experts placed 'expert'); default: the "
                      "search tries 1 and the largest that divides --num-gpus and the expert count, and keeps the "
                      "faster plan")
    plan.add_argument("--lora-rank", type=_positive_int, default=None,
                      help="plan LoRA fine-tuning at this rank (peft's LoraConfig on the meta model): the base frozen "
                      "in the compute dtype (no gradients, optimizer state or reduce-scatters), the adapters trained "
                      "with their AdamW state; data parallel only")
    plan.add_argument("--lora-targets", nargs="+", default=None,
                      help="module names the adapters wrap (peft's target_modules; default: all-linear)")
    plan.add_argument("--quantize", default=None, choices=("nf4",),
                      help="with --lora-rank: the frozen base stored as NF4 (QLoRA; torchao's layout, about 0.52 "
                      "bytes per element with its scales) instead of the compute dtype")
    plan.add_argument("--output", default=None, help="write the plan (.yaml/.yml or .json)")
    plan.add_argument("--json", action="store_true", help="print the report as JSON (for tools) instead of tables")
    add_probe_parser(sub, _size)
    prof = sub.add_parser("profile", help="run one real step of a small model and draw the memory timeline")
    prof.add_argument("--model", default="tiny-gpt2", help="built-in name or local config (small!)")
    prof.add_argument("--batch-size", type=_positive_int, default=2)
    prof.add_argument("--seq-len", type=_positive_int, default=32)
    _add_step_flags(prof)
    prof.add_argument("--budget", type=_size, default=None, help="device budget per rank, e.g. 300KiB (default: see "
                      "--budget-fraction)")
    prof.add_argument("--budget-fraction", type=_fraction, default=0.5,
                      help="without --budget: 0 = the smallest budget the search accepts, 1 = the smallest with no "
                      "chunk onload; in between the step offloads and onloads chunks (default: 0.5)")
    prof.add_argument("--chunk-size-numel", type=_positive_int, default=None)
    prof.add_argument("--output", default="hf_elixir_profile.png", help="PNG to write")
    return parser


def _add_step_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``plan`` and ``profile`` share: what is trained and how the budget is counted (the same
    values give the same search, so both accept or both refuse a budget)."""
    parser.add_argument("--num-gpus", type=_positive_int, default=1,
                        help="all GPUs of the job (data x tensor x expert parallel; chunks are sharded over the "
                        "data-parallel ones, or replicated on each)")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"),
                        help="compute precision (default: bf16); use the same ElixirConfig(precision=...)")
    parser.add_argument("--activation-checkpointing", default="auto", choices=("auto", "on", "off"),
                        help="auto: the search decides (only when activations count in the budget)")
    parser.add_argument("--safety-margin", type=_margin, default=0.05, help="fraction of device memory kept free")
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


def check_args(args: argparse.Namespace) -> None:
    """The checks of flags together, before any work ([Note: CLI checks]).

    Raises:
        ValueError: an --output of the wrong kind or in a folder that does not exist, or a tensor- or
            expert-parallel degree that does not divide --num-gpus.
    """
    check_disk_args(args)
    if args.command == "probe":
        return
    if args.command == "plan" and args.output and not args.output.endswith((".yaml", ".yml", ".json")):
        raise ValueError(f"--output {args.output} must end in .yaml, .yml or .json")
    folder = os.path.dirname(os.path.abspath(args.output)) if args.output else ""
    if folder and not os.path.isdir(folder):
        raise ValueError(f"--output {args.output}: the folder {folder} does not exist; create it first")
    if args.command != "plan":
        return
    tp = 1 if args.tensor_parallel_size == "auto" else args.tensor_parallel_size
    for flag, size in (("--tensor-parallel-size", tp), ("--expert-parallel-size", args.expert_parallel_size or 1)):
        if args.num_gpus % size:
            raise ValueError(f"{flag}={size} must divide --num-gpus={args.num_gpus}; use a divisor of it")
    if args.lora_targets and not args.lora_rank:
        raise ValueError("--lora-targets needs --lora-rank, e.g. --lora-rank 16")
    if args.quantize and not args.lora_rank:
        raise ValueError(f"--quantize {args.quantize} quantizes a frozen base, which needs --lora-rank (e.g. "
                         "--lora-rank 16); full fine-tuning trains the base in the compute dtype")
    if args.lora_rank and importlib.util.find_spec("peft") is None:  # the adapters are peft's own, on meta
        raise ValueError(f"--lora-rank {args.lora_rank} plans peft's LoRA adapters, and peft is not installed here: "
                         "pip install peft (or pip install -e \".[test]\" in a checkout)")
    if args.lora_rank and (args.tensor_parallel_size != 1 or (args.expert_parallel_size or 1) > 1):
        raise ValueError(f"--lora-rank {args.lora_rank} is planned with data parallelism only; leave "
                         "--tensor-parallel-size and --expert-parallel-size out (or give 1)")
    if tp > 1 and (args.expert_parallel_size or 1) > 1:  # dense (dp, tp) and expert (edp, ep) views of the GPUs
        from hf_elixir.parallel._mesh import check_tp_ep_sizes  # noqa: PLC0415

        check_tp_ep_sizes(tp, args.expert_parallel_size, args.num_gpus)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-elixir`` console script; returns the exit status (2 for bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # accelerate's arguments pass through untouched: hf_elixir/integrations/launch.py
        from hf_elixir.integrations.launch import launch_main  # noqa: PLC0415

        try:
            return launch_main(argv[1:])
        except (ValueError, TypeError, FileNotFoundError) as exc:
            print(f"hf-elixir launch: error: {exc}", file=sys.stderr)
            return 2
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or argparse's error line (2)
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    command = parser._subparsers._group_actions[0].choices[args.command]  # noqa: SLF001 (argparse's own error line)
    try:
        check_args(args)
        if args.command == "plan":
            from hf_elixir.cli._plan import cmd_plan  # noqa: PLC0415

            return cmd_plan(args)
        if args.command == "probe":
            from hf_elixir.cli._disk import cmd_probe  # noqa: PLC0415

            return cmd_probe(args)
        from hf_elixir.cli._profile import cmd_profile  # noqa: PLC0415

        return cmd_profile(args)
    except ValueError as exc:
        try:
            command.error(str(exc))  # prints the usage and "hf-elixir plan: error: ...", exits 2
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
