"""Side-by-side CPU benchmark: hf_elixir against plain PyTorch, DDP, FSDP2 and DeepSpeed ZeRO offload.

Run from the repository root (about 10-15 minutes on 2 cores)::

    python benchmarks/run_cpu.py --out-dir bench_out

``--quick`` uses a microscopic model and 1 step per peer (what ``tests/test_benchmarks.py`` runs, as above).
``--model gpt2-124m`` / ``--model opt-350m`` run the real Hugging Face shapes (GPT-2 small: 12 layers,
d 768, 12 heads, vocab 50257, 1024 positions; OPT-350m: 24 layers, d 1024, 16 heads, ffn 4096, 512-wide
embeddings projected to 1024, post-LN, vocab 50272, 2048 positions; configs built offline) at 2 ranks,
batch 2 x 256 per rank, for DDP, FSDP2 with and without CPUOffload, DeepSpeed ZeRO-3 offload and
hf_elixir all-resident / 50% budget searched / minimum budget (hours on 2 busy cores: run it on a quiet
machine). ``--model tiny`` (the default) is the 5M-parameter GPT-2 of the full suite.
Writes ``report.md`` (markdown tables, headline ratios against the project's targets), ``results.png``
and ``results.json`` (the raw records) into ``--out-dir`` (default: ``benchmarks/out/``, not tracked); it never
rewrites ``benchmarks/RESULTS.md``, the curated results page, whose tables are copied from a report by hand
(``benchmarks/_cpu_report.py`` writes the report).
Every peer runs in its own spawned process group (see ``benchmarks/_harness.py``); the per-rank logs go to
``--work-dir``. Exit status: 0 when every row ran, 1 when a row failed (the first error is printed).
``--fail-peers`` makes the named peers raise in every rank, to check that exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/run_cpu.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._cpu_report import (BLOCKED_REFERENCE_S, LARGEST_COLUMNS, MAIN_COLUMNS,  # noqa: E402,F401
                                    TRAFFIC_COLUMNS, headline, main_table_rows, round_ratios, write_report)
from benchmarks._elixir import elixir_available  # noqa: E402
from benchmarks._harness import ModelSpec, RunResult, RunSpec, launch  # noqa: E402
from benchmarks._report import log as _log  # noqa: E402
from benchmarks.peers import PEERS, peer_available  # noqa: E402

__all__ = ["main", "run_suite", "SuiteConfig"]

MIB = 2**20

#: ``--model`` presets (real Hugging Face shapes except ``tiny``), batch per rank
PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(),
    "gpt2-124m": ModelSpec(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, batch_size=2,
                           seq_len=256),
    "opt-350m": ModelSpec(family="opt", n_layer=24, n_embd=1024, n_head=16, vocab_size=50272, n_positions=2048,
                          word_embed_proj_dim=512, layer_norm_before=False, batch_size=2, seq_len=256),
}
#: the rows a realistic preset runs (2 ranks)
PRESET_PEERS = ("ddp", "fsdp2", "fsdp2_offload", "ds_zero3_offload", "elixir_resident", "elixir_search", "elixir_min")


@dataclasses.dataclass(kw_only=True)
class SuiteConfig:
    """What the suite runs. ``quick`` = microscopic model, 1 timed step, no warm-up."""

    model: ModelSpec
    largest_base: ModelSpec
    warmup_steps: int = 2
    steps: int = 10
    world_sizes: tuple[int, ...] = (1, 2)
    peers: tuple[str, ...] = tuple(PEERS)
    budget_fraction: float = 0.5
    largest_budget_bytes: int = 64 * MIB
    largest_max_layers: int = 192
    host_bytes: int = 0  # 0 = 80% of this machine's RAM
    run_largest: bool = True
    min_budget_probes: int = 6
    timeout_s: float = 600.0
    shared_process: bool = False  # quick mode: one process group per world size for all peers
    profile: bool = True  # one extra untimed, profiled step for plain / hf_elixir at 1 rank
    run_moe: bool = True  # benchmarks/moe.py: Switch-Transformers vs a dense model of equal size
    fail_peers: tuple[str, ...] = ()  # made to raise in every rank (--fail-peers: checks the exit status)
    rounds: int = 2  # the peers behind the headline ratios run this many times, interleaved ([Note: interleaved rounds])

    @classmethod
    def full(cls) -> "SuiteConfig":
        return cls(model=ModelSpec(), largest_base=ModelSpec(batch_size=1, seq_len=64))

    @classmethod
    def preset(cls, name: str) -> "SuiteConfig":
        """``tiny``: :meth:`full`; a realistic preset: :data:`PRESET_PEERS` at 2 ranks, 1 warm-up + 4 timed steps,
        the headline peers in 3 interleaved rounds.

        Raises:
            ValueError: ``name`` is not a key of :data:`PRESETS`.
        """
        if name not in PRESETS:
            raise ValueError(f"--model {name!r} is not a preset; use one of {', '.join(PRESETS)}")
        if name == "tiny":
            return cls.full()
        return cls(model=PRESETS[name], largest_base=ModelSpec(batch_size=1, seq_len=64), warmup_steps=1, steps=4,
                   world_sizes=(2,), peers=PRESET_PEERS, run_largest=False, run_moe=False, profile=False, rounds=3,
                   timeout_s=4 * 3600.0)

    @classmethod
    def quick(cls) -> "SuiteConfig":
        tiny = ModelSpec(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16, batch_size=2, seq_len=16)
        return cls(model=tiny, largest_base=tiny, warmup_steps=0, steps=1, largest_budget_bytes=MIB // 2,
                   largest_max_layers=8, min_budget_probes=2, timeout_s=120.0, shared_process=True,
                   profile=False, run_moe=False, rounds=1)


def run_suite(cfg: SuiteConfig, work_dir: Path) -> dict[str, Any]:
    """Run every available peer at every world size it supports; return everything measured."""
    from benchmarks._harness import launch_group

    skipped: dict[str, str] = {}
    elixir_reason = elixir_available()
    runs: list[RunResult] = []
    for world_size in cfg.world_sizes:
        specs = []
        for name in cfg.peers:
            peer = PEERS[name]
            if world_size not in peer.world_sizes:
                continue
            reason = peer_available(peer) or (elixir_reason if name.startswith("elixir") else "")
            if reason:
                skipped[name] = reason
                continue
            options = _elixir_options(name, cfg)
            if name in cfg.fail_peers:
                options["fail"] = True
            if cfg.profile and world_size == 1 and name in ("plain", "elixir_resident", "elixir_budget", "elixir_search"):
                options["cpu_profile"] = True
            specs.append(RunSpec(peer=name, world_size=world_size, model=cfg.model, warmup_steps=cfg.warmup_steps,
                                 steps=cfg.steps, options=options))
        if cfg.shared_process and specs:
            _log(f"running {len(specs)} peers at {world_size} rank(s) in one process group ...")
            results = launch_group(specs, work_dir, timeout_s=cfg.timeout_s)
        else:
            results = []
            for spec in specs:
                _log(f"running {spec.key()} ...")
                results.append(launch(spec, work_dir, timeout_s=cfg.timeout_s))
                _log_result(results[-1])
        if cfg.shared_process:
            for result in results:
                _log_result(result)
        runs.extend(results)
    for round_index in range(2, cfg.rounds + 1):
        _repeat_headline_peers(runs, work_dir / f"round{round_index}", cfg, round_index)
    largest: dict[str, Any] = {}
    if cfg.run_largest:
        largest = _run_largest(cfg, work_dir, skipped, elixir_reason)
    moe = _run_moe(cfg) if cfg.run_moe else None
    return {"runs": runs, "skipped": skipped, "largest": largest, "moe": moe}


MOE_ARGS = ["--experts", "8", "--d-model", "256", "--d-ff", "512", "--layers", "2", "--batch", "4", "--seq", "128",
            "--steps", "5", "--warmup", "1", "--device", "cpu"]


def _run_moe(cfg: SuiteConfig) -> dict[str, Any]:
    """``benchmarks/moe.py`` (owned by the expert-parallel work) in a subprocess, 1 thread; its stdout."""
    import subprocess

    script = Path(__file__).resolve().parent / "moe.py"
    if not script.exists():
        return {"error": "benchmarks/moe.py is not in this tree"}
    _log("running benchmarks/moe.py (Switch vs dense) ...")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, str(script), *MOE_ARGS], capture_output=True, text=True,
                              timeout=cfg.timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {cfg.timeout_s:.0f} s", "args": MOE_ARGS}
    if done.returncode:
        return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] }", "args": MOE_ARGS}
    return {"stdout": done.stdout.strip(), "args": MOE_ARGS}


HEADLINE_PEERS = [("plain", 1), ("elixir_resident", 1), ("ddp", 2), ("elixir_resident", 2), ("elixir_budget", 2),
                  ("elixir_search", 2), ("elixir_budget_replicated", 2), ("ds_zero3_offload", 2), ("fsdp2_offload", 2)]


def _repeat_headline_peers(runs: list[RunResult], work_dir: Path, cfg: SuiteConfig, round_index: int) -> None:
    """Run the peers behind the headline ratios once more and pool their timed steps into the first result.

    [Note: interleaved rounds] The machine is shared, so its speed drifts by more than the effects measured
    (consecutive DDP runs of gpt2-124m differed by 12%). Each round runs every headline peer once, in the
    suite's order in odd rounds and reversed in even ones (A B, B A, A B, ...), so a slow phase hits both
    sides of a ratio alike. Every result keeps its per-round medians (``extra["round_medians_s"]``), from
    which :func:`round_ratios` gives one paired ratio per round: the headline reports their spread next to
    the pooled-median ratio.
    """
    order = [(r.spec.peer, r.spec.world_size) for r in runs if (r.spec.peer, r.spec.world_size) in HEADLINE_PEERS]
    for name, world_size in (order if round_index % 2 else list(reversed(order))):
        first = next((r for r in runs if r.ok and r.spec.peer == name and r.spec.world_size == world_size), None)
        if first is None:
            continue
        _log(f"round {round_index}: repeating {first.spec.key()} ...")
        again = launch(first.spec, work_dir, timeout_s=cfg.timeout_s)
        if not again.ok:
            first.extra.setdefault("repeat_errors", []).append(again.error.splitlines()[0])
            first.extra.setdefault("round_medians_s", [first.median_s]).append(None)
            _log(f"  repeat FAILED: {again.error.splitlines()[0]}")
            continue
        first.extra.setdefault("round_medians_s", [first.median_s]).append(again.median_s)
        first.step_times_s.extend(again.step_times_s)
        for mine, theirs in zip(first.cpu_times_s, again.cpu_times_s):
            mine.extend(theirs)
        first.peak_rss_bytes = [max(a, b) for a, b in zip(first.peak_rss_bytes, again.peak_rss_bytes)]
        first.extra["rounds"] = first.extra.get("rounds", 1) + 1
        _log(f"  this round {again.median_s:.4f} s/step; pooled median {first.median_s:.4f} s/step over "
             f"{len(first.step_times_s)} steps")


def _log_result(result: RunResult) -> None:
    _log(f"  {result.spec.key()}: " + (f"median {result.median_s:.4f} s/step, {result.tokens_per_s:.0f} tok/s"
                                       if result.ok else "FAILED: " + result.error.splitlines()[0]))


def _elixir_options(name: str, cfg: SuiteConfig) -> dict[str, Any]:
    """hf_elixir peers find their budget in-process from an all-resident probe (see benchmarks/_elixir.py)."""
    if name == "elixir_budget":
        return {"budget_fraction": cfg.budget_fraction}
    if name == "elixir_search":
        return {"budget_fraction": cfg.budget_fraction, "search": True}
    if name == "elixir_min":
        return {"min_budget_probes": cfg.min_budget_probes}
    if name == "elixir_resident_sharded":
        return {"default_placement": "sharded"}
    if name == "elixir_budget_replicated":
        return {"budget_fraction": cfg.budget_fraction, "default_placement": "replicated"}
    if name == "elixir_search_sharded":
        return {"budget_fraction": cfg.budget_fraction, "search": True, "default_placement": "sharded"}
    return {}


def _run_largest(cfg: SuiteConfig, work_dir: Path, skipped: dict[str, str], elixir_reason: str) -> dict[str, Any]:
    import psutil

    from benchmarks import largest

    host = cfg.host_bytes or int(0.8 * psutil.virtual_memory().total)
    _log(f"largest model at a {cfg.largest_budget_bytes / MIB:.0f} MiB device budget ...")
    results = largest.analytic_limits(cfg.largest_base, cfg.largest_budget_bytes, host,
                                      have_deepspeed="ds_zero3_offload" not in skipped)
    probes: list[dict[str, Any]] = []
    if not elixir_reason:
        for chunk_numel in (None, largest.smallest_chunk_numel(cfg.largest_base)):
            found, found_probes = largest.search_elixir(cfg.largest_base, cfg.largest_budget_bytes,
                                                        cfg.largest_max_layers, work_dir / "largest",
                                                        timeout_s=cfg.timeout_s, log=_log, chunk_size_numel=chunk_numel)
            ok_probes = [p for p in found_probes if p["ok"] and p.get("host_bytes")]
            if ok_probes:
                best = max(ok_probes, key=lambda p: p["num_params"])
                per_param = best["host_bytes"] / best["num_params"]
                found.note += (("; " if found.note else "") + f"measured host {per_param:.1f} B/param -> host RAM ({host / 2**30:.0f} GiB) allows "
                               f"~{largest.host_limited_params(host, per_param) / 1e6:.0f}M params (analytic)")
            failed = [p for p in found_probes if not p["ok"]]
            if failed:
                found.note += ("; " if found.note else "") + f"first failure: n_layer={failed[0]['n_layer']}: {failed[0]['error'][:160]}"
            results.append(found)
            probes += [dict(p, chunk_size_numel=chunk_numel) for p in found_probes]
    return {"budget_bytes": cfg.largest_budget_bytes, "host_bytes": host, "base": dataclasses.asdict(cfg.largest_base),
            "results": [dataclasses.asdict(r) for r in results], "elixir_probes": probes}



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="microscopic model, 1 step per peer (for tests)")
    parser.add_argument("--model", default="tiny", choices=tuple(PRESETS),
                        help="model preset (ignored with --quick); gpt2-124m / opt-350m: the real shapes at 2 ranks")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "out"),
                        help="where report.md, results.json and results.png go (default: benchmarks/out/)")
    parser.add_argument("--work-dir", default=None, help="per-rank logs and records (default: a temp dir)")
    parser.add_argument("--peers", default=None, help="comma-separated PEERS keys (default: the preset's)")
    parser.add_argument("--world-sizes", default=None, help="comma-separated (default: the preset's)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None,
                        help="times the headline peers run, interleaved (default: the preset's; 1 = once)")
    parser.add_argument("--no-largest", action="store_true", help="skip the largest-model search")
    parser.add_argument("--largest-max-layers", type=int, default=None)
    parser.add_argument("--fail-peers", default=None,
                        help="comma-separated PEERS keys made to raise in every rank (checks the exit status)")
    args = parser.parse_args(argv)
    cfg = SuiteConfig.quick() if args.quick else SuiteConfig.preset(args.model)
    if args.peers is not None:
        unknown = [p for p in args.peers.split(",") if p not in PEERS]
        if unknown:
            parser.error(f"--peers: unknown {unknown}; choose from {list(PEERS)}")
        cfg.peers = tuple(args.peers.split(","))
    if args.fail_peers is not None:
        unknown = [p for p in args.fail_peers.split(",") if p not in PEERS]
        if unknown:
            parser.error(f"--fail-peers: unknown {unknown}; choose from {list(PEERS)}")
        cfg.fail_peers = tuple(args.fail_peers.split(","))
    if args.world_sizes is not None:
        cfg.world_sizes = tuple(int(w) for w in args.world_sizes.split(","))
    cfg.steps = args.steps if args.steps is not None else cfg.steps
    cfg.warmup_steps = args.warmup if args.warmup is not None else cfg.warmup_steps
    cfg.run_largest = not args.no_largest
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds {args.rounds}: must be >= 1")
        cfg.rounds = args.rounds
    if args.largest_max_layers is not None:
        cfg.largest_max_layers = args.largest_max_layers
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="hf_elixir_bench_"))
    _log(f"logs in {work_dir}")
    start = time.perf_counter()
    suite = run_suite(cfg, work_dir)
    command = "python benchmarks/run_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    path = write_report(Path(args.out_dir), cfg, suite, command.strip(), time.perf_counter() - start)
    _log(f"wrote {path}")
    return _exit_status(suite["runs"])


def _exit_status(runs: list[RunResult]) -> int:
    """0 when every row ran; else 1, with the number of failed rows and the first error on stderr."""
    failed = [r for r in runs if not r.ok]
    if not failed:
        return 0
    print(f"run_cpu.py: {len(failed)} of {len(runs)} rows FAILED; first ({failed[0].spec.key()}):\n"
          f"{failed[0].error}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
