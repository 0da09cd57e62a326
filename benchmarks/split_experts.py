"""Fused MoE experts kept fused or split per expert (``ElixirConfig.split_fused_experts``), side by side.

Two parts, one process, CPU:

1. **Floors** (no data moves): ``hf_elixir.min_device_budget_bytes`` of today's MoE models built on the meta device
   from the built-in configs (``hf_elixir/profiler/_model_zoo.py``: Mixtral-8x7B, Qwen3-30B-A3B, gpt-oss-20b), bf16,
   AdamW, 1 rank, fused (``split_fused_experts=False``) and split (``True``). A fused expert tensor
   is one chunk slot, so it sets the chunk floor at E experts; split, at one.
2. **Step time**: a small Mixtral-style model (``MixtralForCausalLM`` from a config built offline, fp32, AdamW,
   1 process) trained under hf_elixir at a device budget both layouts fit (10% above the fused floor), fused and
   split, with transformers' ``eager`` and ``grouped_mm`` experts implementations, on two shapes (8 experts of
   width 512, and 64 tiny experts where the per-expert call weighs most); the runs are interleaved over
   ``--rounds`` and the timed steps pooled (median). Split calls every expert as its own module (own hooks), which
   is what ``"auto"`` pays only where the budget needs it. Also the split model at 10% above *its* floor (below the
   fused floor: only the split layout runs there). Both layouts train the same numbers: the losses are compared.

Usage (from the repository root)::

    python benchmarks/split_experts.py --out split_out/split_experts.json
    python benchmarks/split_experts.py --quick --out split_out/split_experts.json   # tiny shapes, seconds

Prints a markdown table per part and writes the JSON record. Exit status 1 when a run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # `python benchmarks/split_experts.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["SHAPES", "QUICK_SHAPES", "floors", "step_times", "main"]

FLOOR_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b")
#: name -> (hidden, layers, experts, expert width, top-k, batch, seq): a Mixtral-like layer (8 experts, expert MLPs
#: dominating), and 64 tiny experts where the per-expert call (hooks, launches) weighs most
SHAPES = {"8-experts-h256": dict(hidden=256, layers=2, experts=8, width=512, top_k=2, batch=4, seq=128),
          "64-experts-h64": dict(hidden=64, layers=2, experts=64, width=64, top_k=4, batch=4, seq=128)}
QUICK_SHAPES = {"4-experts-h32": dict(hidden=32, layers=2, experts=4, width=32, top_k=2, batch=2, seq=16)}


def floors(names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """``{name: {"fused": bytes, "split": bytes}}``: ``min_device_budget_bytes`` at 1 rank, bf16, AdamW."""
    import hf_elixir
    from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch

    out = {}
    for name in names:
        model, _ = meta_model_and_batch(load_config(name), batch_size=1, seq_len=16, dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters())
        out[name] = {layout: hf_elixir.min_device_budget_bytes(
            model, optimizer, hf_elixir.ElixirConfig(precision="bf16", split_fused_experts=layout == "split"))
            for layout in ("fused", "split")}
    return out


def _model(shape: dict[str, int], implementation: str):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=512, hidden_size=shape["hidden"], intermediate_size=shape["width"],
                           num_hidden_layers=shape["layers"], num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                           max_position_embeddings=shape["seq"], bos_token_id=0, eos_token_id=1)
    config._experts_implementation = implementation
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def _batch(shape: dict[str, int], step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(2, 512, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _run(shape: dict[str, int], implementation: str, split: bool, budget: int, steps: int) -> dict[str, Any]:
    """``steps`` AdamW steps (the first untimed) of a fresh model under hf_elixir; seconds and losses."""
    import hf_elixir

    model = _model(shape, implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = hf_elixir.ElixirConfig(device_memory_budget_bytes=budget, budget_covers_activations=False,
                                    split_fused_experts=split)
    model, optimizer = hf_elixir.prepare(model, optimizer, config)
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = model(**_batch(shape, step)).loss
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    return {"step_s": times[1:], "losses": losses, "evictions": hf_elixir.memory_stats(model)["num_evictions"]}


def step_times(shape: dict[str, int], steps: int, rounds: int) -> dict[str, Any]:
    """Fused against split at 10% above the fused floor, per experts implementation, interleaved over ``rounds``;
    and split alone at 10% above its own floor. Returns the JSON record of part 2."""
    import hf_elixir

    probe = _model(shape, "eager")
    probe_opt = torch.optim.AdamW(probe.parameters())
    kw = dict(budget_covers_activations=False)
    fused_floor = hf_elixir.min_device_budget_bytes(probe, probe_opt, hf_elixir.ElixirConfig(
        split_fused_experts=False, **kw))
    split_floor = hf_elixir.min_device_budget_bytes(probe, probe_opt, hf_elixir.ElixirConfig(
        split_fused_experts=True, **kw))
    roomy, tight = int(fused_floor * 1.1), int(split_floor * 1.1)
    runs: dict[str, dict[str, Any]] = {}
    keys = [(impl, split) for impl in ("eager", "grouped_mm") for split in (False, True)]
    for r in range(rounds):
        for impl, split in (keys if r % 2 == 0 else keys[::-1]):
            result = _run(shape, impl, split, roomy, steps)
            entry = runs.setdefault(f"{impl}/{'split' if split else 'fused'}", {"step_s": [], "losses": None})
            entry["step_s"] += result["step_s"]
            entry["losses"] = entry["losses"] or result["losses"]
            entry["evictions"] = result["evictions"]
    tight_run = _run(shape, "eager", True, tight, steps) if tight < fused_floor else None
    for entry in runs.values():
        entry["median_step_s"] = statistics.median(entry["step_s"])
    ratios = {impl: runs[f"{impl}/split"]["median_step_s"] / runs[f"{impl}/fused"]["median_step_s"]
              for impl in ("eager", "grouped_mm")}
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(runs["eager/split"]["losses"], runs["eager/fused"]["losses"]))
    return {"shape": shape, "fused_floor_bytes": fused_floor, "split_floor_bytes": split_floor,
            "budget_bytes": roomy, "tight_budget_bytes": tight, "runs": runs, "split_over_fused": ratios,
            "loss_max_rel_diff": loss_diff,
            "tight_split": None if tight_run is None else {
                "median_step_s": statistics.median(tight_run["step_s"]), "evictions": tight_run["evictions"]}}


def _tables(record: dict[str, Any]) -> str:
    gib = 2 ** 30
    lines = ["| model (bf16, AdamW, 1 rank) | fused floor GiB | split floor GiB | split / fused |", "|---|---|---|---|"]
    for name, f in record["floors"].items():
        lines.append(f"| {name} | {f['fused'] / gib:.2f} | {f['split'] / gib:.2f} | {f['split'] / f['fused']:.2f}x |")
    lines += ["", "| shape | experts implementation | budget (fused floor, split floor) bytes | fused s/step | split s/step "
              "| split / fused | split below the fused floor s/step (evictions) | loss rel diff |",
              "|---|---|---|---|---|---|---|---|"]
    for name, part in record["step_times"].items():
        tight = part["tight_split"]
        for impl in ("eager", "grouped_mm"):
            fused, split = part["runs"][f"{impl}/fused"], part["runs"][f"{impl}/split"]
            lines.append(f"| {name} | {impl} | {part['budget_bytes']} ({part['fused_floor_bytes']}, "
                         f"{part['split_floor_bytes']}) | {fused['median_step_s']:.4f} | {split['median_step_s']:.4f} | "
                         f"{part['split_over_fused'][impl]:.2f}x | "
                         + (f"{tight['median_step_s']:.4f} ({tight['evictions']})" if tight and impl == "eager" else "-")
                         + f" | {part['loss_max_rel_diff']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 3 steps, 1 round, one floor model")
    parser.add_argument("--out", default="split_out/split_experts.json", help="the JSON record's path")
    parser.add_argument("--steps", type=int, default=None, help="steps per run, the first untimed (default 8)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved repeats (default 3; quick 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps or (3 if args.quick else 8)
    rounds = args.rounds or (1 if args.quick else 3)
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores", "torch": torch.__version__, "quick": args.quick}
    try:
        import transformers

        record["transformers"] = transformers.__version__
        record["floors"] = floors(FLOOR_MODELS[:1] if args.quick else FLOOR_MODELS)
        record["step_times"] = {name: step_times(shape, steps, rounds)
                                for name, shape in (QUICK_SHAPES if args.quick else SHAPES).items()}
    except Exception as exc:  # noqa: BLE001 (reported, exit status 1)
        print(f"split_experts: a run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(_tables(record))
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
