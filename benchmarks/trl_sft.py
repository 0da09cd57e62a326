"""TRL ``SFTTrainer`` side by side at 2 gloo ranks: hf_elixir at a 50% device budget against DeepSpeed ZeRO-3 offload,
FSDP2 + CPUOffload and plain DDP, on GPT-2 small (124M, built from its config: random init, no hub), full
fine-tune and LoRA. Run from the repository root::

    python -m benchmarks.trl_sft --json trl_out/trl_sft.json    # minutes on 2 busy cores
    python -m benchmarks.trl_sft --quick                         # a microscopic GPT-2, 1 step each (seconds)

Every system trains the same model (seed 0, fp32) on the same pre-tokenized sequences of ``--seq-len`` tokens, with
TRL's defaults (its fused LM-head loss, AdamW, ``max_grad_norm=1.0``, linear schedule) except ``bf16=False`` (fp32 on
CPU) and ``gradient_checkpointing=False``; LoRA is peft's r16 on GPT-2's ``c_attn``/``c_proj``/``c_fc``, applied
before the model is wrapped. How each system reaches the Trainer:

- ``elixir``: ``SFTTrainer(..., callbacks=[ElixirCallback(ElixirConfig(device_memory_budget_bytes=B, search="auto"))])``
  with ``B`` = ``--budget-fraction`` x the model data an all-resident rank holds (fp32: 16 B per trained parameter,
  4 B per frozen one; activations outside the budget, as for every peer); where ``B`` is under
  ``hf_elixir.min_device_budget_bytes`` it runs at that floor and says so (LoRA at 2 ranks: the frozen base is kept
  whole on every rank and copied in from the host, ``frozen_placement="auto"``, so its floor is 36% of the model data
  and 50% places; sharded it was 74%).
- ``ddp``: the plain ``SFTTrainer`` (accelerate wraps the model in ``DistributedDataParallel``).
- ``fsdp2_offload``: ``fully_shard(CPUOffloadPolicy)`` on every GPT-2 block and the root before the Trainer, which
  is told the model is prepared (accelerate runs FSDP only on accelerators, so its own FSDP path cannot run here).
- ``ds_zero3_offload``: accelerate runs DeepSpeed only on accelerators too, so the Trainer builds the data loader and
  computes TRL's loss (``trainer.compute_loss``) while a ZeRO-3 engine (parameters and optimizer offloaded,
  ``DeepSpeedCPUAdam``, clipping 1.0, constant LR) does backward and step. Skipped, saying why, without DeepSpeed.

Each (system, mode) runs in its own spawned process group (``benchmarks/_harness.py``); a step's time is the slowest
rank's (a barrier before each); tokens/s = ranks x batch x seq / median step; peak RSS is each rank's high-water mark.
Exit status 1 when a row that could run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import ModelSpec, RunResult, RunSpec, launch, launch_group, result_to_dict  # noqa: E402
from benchmarks._report import log, md_table, machine, verdict  # noqa: E402

__all__ = ["main", "measure", "SYSTEMS", "MODES"]

MIB = 2**20
SYSTEMS = {"elixir": "hf_elixir, 50% budget (ElixirCallback)", "ds_zero3_offload": "DeepSpeed ZeRO-3 offload",
           "fsdp2_offload": "FSDP2 + CPUOffload", "ddp": "DDP"}
MODES = ("full", "lora")
GPT2_SMALL = ModelSpec(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, batch_size=2, seq_len=128)
TINY = ModelSpec(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, batch_size=2, seq_len=16)
LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]


def why_not(system: str) -> str:
    """'' when ``system`` can run here, else why not."""
    import importlib.util

    need = {"ds_zero3_offload": "deepspeed"}.get(system)
    if need and importlib.util.find_spec(need) is None:
        return f"python package {need!r} is not installed (pip install deepspeed; its CPUAdam compiles on first use)"
    return ""


# ---------------------------------------------------------------------------------------------------------------
# worker side (every rank)


class _StepTimer:
    """A ``TrainerCallback`` timing each optimizer step: a barrier at its start, so a step's time is the slowest
    rank's, and process CPU seconds beside wall-clock."""

    def __init__(self) -> None:
        self.times, self.cpu_times, self._start = [], [], (0.0, 0.0)

    def begin(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        self._start = (time.perf_counter(), time.process_time())

    def end(self) -> None:
        self.times.append(time.perf_counter() - self._start[0])
        self.cpu_times.append(time.process_time() - self._start[1])

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.begin()

            def on_step_end(self, args, state, control, **kwargs):
                timer.end()

        return _Callback()


def _tokenizer():
    """A word-level tokenizer built offline: the data is pre-tokenized, TRL only needs its pad and eos ids (0)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"<eos>": 0, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<eos>", eos_token="<eos>", unk_token="<unk>")


def _dataset(spec: RunSpec, num_steps: int):
    import torch
    from datasets import Dataset

    m = spec.model
    gen = torch.Generator().manual_seed(1000)
    ids = torch.randint(2, m.vocab_size, (spec.world_size * m.batch_size * num_steps, m.seq_len), generator=gen)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def _lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0, fan_in_fan_out=True)
    return get_peft_model(model, config)


def _model_data_bytes(model) -> int:
    """What an all-resident rank holds in fp32: param + grad + two AdamW moments a trained parameter, the frozen ones
    once."""
    return sum(p.numel() * (16 if p.requires_grad else 4) for p in model.parameters())


def _elixir_config(model, spec: RunSpec, extra: dict[str, Any]):
    """``budget_fraction`` of the all-resident model data. Where that is under ``hf_elixir.min_device_budget_bytes``
    for this run's config and world size (which ``prepare`` would refuse: two adjacent units' chunks and the gradient
    buffers must fit), the run takes that floor instead, the nearest budget ``prepare`` accepts, and
    ``extra["budget_note"]`` says so."""
    import torch
    import torch.distributed as dist

    from hf_elixir import ElixirConfig, min_device_budget_bytes

    data = _model_data_bytes(model)
    budget = int(spec.options["budget_fraction"] * data)
    trained = [p for p in model.parameters() if p.requires_grad]
    config = ElixirConfig(device_memory_budget_bytes=budget, budget_covers_activations=False,
                          search=spec.options.get("search", "auto"))
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    floor = int(min_device_budget_bytes(model, torch.optim.AdamW(trained), config, world_size))
    extra.update(budget_bytes=max(budget, floor), model_data_bytes=data, floor_bytes=floor)
    if budget >= floor:
        return config
    extra["budget_note"] = (f"{spec.options['budget_fraction']:.0%} of the model data ({budget / MIB:.0f} of "
                            f"{data / MIB:.0f} MiB) is under hf_elixir's floor ({floor / MIB:.0f} MiB, "
                            f"{floor / data:.0%}): ran at the floor")
    return dataclasses.replace(config, device_memory_budget_bytes=floor)


def _wrap(system: str, model, spec: RunSpec, extra: dict[str, Any]) -> list:
    """Wrap ``model`` in place as ``system`` needs before the Trainer sees it; returns the Trainer's extra callbacks."""
    if system == "elixir":
        from hf_elixir.integrations import ElixirCallback

        return [ElixirCallback(_elixir_config(model, spec, extra), log_memory_stats=False)]
    if system == "fsdp2_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        for block in [m for m in model.modules() if isinstance(m, GPT2Block)]:
            fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        model._is_accelerate_prepared = True  # accelerate: register it, no DDP on top of FSDP2
    return []


def _trainer(system: str, model, spec: RunSpec, out_dir: str, timer: _StepTimer, extra: dict[str, Any]):
    from trl import SFTConfig, SFTTrainer

    num_steps = spec.warmup_steps + spec.steps
    args = SFTConfig(output_dir=out_dir, max_steps=num_steps, per_device_train_batch_size=spec.model.batch_size,
                     max_length=spec.model.seq_len, logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0,
                     disable_tqdm=True, save_strategy="no", bf16=False, gradient_checkpointing=False,
                     dataloader_drop_last=True)
    callbacks = _wrap(system, model, spec, extra) + [timer.callback()]
    return SFTTrainer(model=model, args=args, train_dataset=_dataset(spec, num_steps), processing_class=_tokenizer(),
                      callbacks=callbacks)


def _deepspeed_loop(trainer, spec: RunSpec, timer: _StepTimer) -> list[float]:
    """ZeRO-3 offload driven by TRL's data loader and loss (see the module docstring for why not ``train()``)."""
    import dataclasses as dc

    import torch.distributed as dist

    from benchmarks.peers import deepspeed_engine

    engine = deepspeed_engine(trainer.model, dc.replace(spec, lr=trainer.args.learning_rate), stage=3,
                              gradient_clipping=trainer.args.max_grad_norm)
    engine.train()
    losses = []
    for batch in trainer.get_train_dataloader():
        if len(losses) == spec.warmup_steps + spec.steps:
            break
        timer.begin()
        loss = trainer.compute_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        timer.end()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the mean over ranks, as the Trainer logs it
        losses.append(mean.item() / dist.get_world_size())
    return losses


def measure(rank: int, spec: RunSpec) -> dict[str, Any]:
    """One (system, mode) in this rank: the record ``benchmarks._harness`` collects (``RunSpec.worker``)."""
    import resource

    import psutil
    import torch
    import transformers

    from benchmarks._harness import build_model
    from benchmarks.peers import PEERS

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(spec.threads_per_rank)
    system, mode = spec.peer, spec.options["mode"]
    PEERS["ds_zero3_offload" if system == "ds_zero3_offload" else "ddp"].init_distributed(spec)
    baseline_rss = psutil.Process().memory_info().rss
    torch.manual_seed(0)
    model = build_model(spec.model)
    model = _lora(model) if mode == "lora" else model
    extra: dict[str, Any] = {"trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    timer = _StepTimer()
    with tempfile.TemporaryDirectory(prefix="trl_sft_") as out_dir:
        trainer = _trainer(system, model, spec, out_dir, timer, extra)
        if system == "ds_zero3_offload":
            losses = _deepspeed_loop(trainer, spec, timer)
        else:
            trainer.train()
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if system == "elixir":
            import hf_elixir

            extra["device_peak_bytes"] = int(hf_elixir.memory_stats(trainer.model)["device_peak_bytes"])
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    warm = spec.warmup_steps
    return {"step_times_s": timer.times[warm:], "cpu_times_s": timer.cpu_times[warm:], "losses": losses,
            "num_params": sum(p.numel() for p in model.parameters()), "peak_rss_bytes": peak_rss,
            "baseline_rss_bytes": baseline_rss, "extra": extra}


# ---------------------------------------------------------------------------------------------------------------
# parent side


COLUMNS = ["system", "mode", "median s/step", "tokens/s", "peak RSS/rank (MiB)", "device peak / budget (MiB)",
           "loss first->last"]


def _row(result: RunResult) -> list[str]:
    head = [SYSTEMS[result.spec.peer], result.spec.tag]
    if not result.ok:
        return head + ["FAILED: " + result.error.splitlines()[0][:100]] + [""] * (len(COLUMNS) - 3)
    e = result.extra
    device = "-"
    if "device_peak_bytes" in e:
        floor = " (floor)" if "budget_note" in e else ""
        device = f"{e['device_peak_bytes'] / MIB:.0f} / {e['budget_bytes'] / MIB:.0f}{floor}"
    return head + [f"{result.median_s:.3f}", f"{result.tokens_per_s:.0f}", f"{max(result.peak_rss_bytes) / MIB:.0f}",
                   device, f"{result.losses[0]:.3f}->{result.losses[-1]:.3f}"]


def ratios(results: list[RunResult]) -> list[str]:
    """Per mode: hf_elixir against the faster offload peer (tokens/s, target >= 1.15x) and DDP (step time, <= 1.05x)."""
    lines = []
    for mode in MODES:
        got = {r.spec.peer: r for r in results if r.ok and r.spec.tag == mode}
        elixir = got.get("elixir")
        if elixir is None:
            continue
        offload = [got[k] for k in ("ds_zero3_offload", "fsdp2_offload") if k in got]
        if offload:
            best = max(offload, key=lambda r: r.tokens_per_s)
            lines.append(verdict(f"{mode}: hf_elixir tokens/s / {SYSTEMS[best.spec.peer]}'s",
                                 elixir.tokens_per_s / best.tokens_per_s, 1.15, lower_is_better=False))
        if "ddp" in got:
            lines.append(verdict(f"{mode}: hf_elixir step time / DDP's", elixir.median_s / got["ddp"].median_s, 1.05,
                                 lower_is_better=True))
    return lines


def _table(results: list[RunResult], skipped: dict[str, str]) -> str:
    skipped_rows = [[SYSTEMS[name], "-", f"skipped: {why}"] + [""] * (len(COLUMNS) - 3) for name, why in skipped.items()]
    return md_table(COLUMNS, [_row(r) for r in results] + skipped_rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a microscopic GPT-2, no warm-up, 1 timed step")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--modes", default=",".join(MODES), help="full, lora or both")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=GPT2_SMALL.seq_len)
    parser.add_argument("--budget-fraction", type=float, default=0.5)
    parser.add_argument("--search", default="auto", choices=("auto", "off"), help="hf_elixir's ElixirConfig.search")
    parser.add_argument("--json", default=None, help="write the raw records here")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per (system, mode)")
    args = parser.parse_args(argv)
    systems, modes = args.systems.split(","), args.modes.split(",")
    bad = [s for s in systems if s not in SYSTEMS] + [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"unknown systems/modes {bad}; systems: {list(SYSTEMS)}, modes: {list(MODES)}")
    model = TINY if args.quick else dataclasses.replace(GPT2_SMALL, seq_len=args.seq_len)
    warmup, steps = (0, 1) if args.quick else (args.warmup, args.steps)
    skipped = {s: why_not(s) for s in systems if why_not(s)}
    work_dir = Path(tempfile.mkdtemp(prefix="trl_sft_bench_"))
    log(f"{model.label()}; {warmup} warm-up + {steps} timed steps at 2 ranks; logs in {work_dir}; {machine()}")
    specs = [RunSpec(peer=system, world_size=2, model=model, warmup_steps=warmup, steps=steps, tag=mode,
                     worker="benchmarks.trl_sft:measure", lr=2e-5,
                     options={"mode": mode, "budget_fraction": args.budget_fraction, "search": args.search})
             for mode in modes for system in systems if system not in skipped]
    if args.quick:  # one process group for every row: the start-up paid once (peak RSS is then the group's)
        results = launch_group(specs, work_dir, timeout_s=args.timeout_s)
    else:
        results = []
        for spec in specs:
            results.append(launch(spec, work_dir, timeout_s=args.timeout_s))
            log(" | ".join(_row(results[-1])))
    print(_table(results, skipped))
    print("\n".join(ratios(results) + [f"- {r.spec.key()}: {r.extra['budget_note']}" for r in results
                                        if r.ok and "budget_note" in r.extra]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": [result_to_dict(r) for r in results], "skipped": skipped},
                                              indent=1, default=str))
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"trl_sft: {len(failed)} row(s) FAILED; first: {failed[0].error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
