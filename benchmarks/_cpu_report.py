"""The report of ``benchmarks/run_cpu.py``: report.md (the main table, host<->device traffic against the Belady bound,
the headline ratios against the project's targets, the largest-model search), results.png and results.json."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks._harness import RunResult, count_params, result_to_dict
from benchmarks._report import machine as _machine
from benchmarks._report import md_table as _md_table
from benchmarks._report import verdict as _verdict
from benchmarks._report import versions as _versions
from benchmarks._traffic import all_offload_bytes, belady_onload_bytes, belady_source
from benchmarks.peers import PEERS

__all__ = ["MAIN_COLUMNS", "TRAFFIC_COLUMNS", "LARGEST_COLUMNS", "BLOCKED_REFERENCE_S", "main_table_rows",
           "traffic_rows", "headline", "round_ratios", "write_report"]

MIB = 2**20


def round_ratios(result: RunResult, reference: RunResult) -> list[float]:
    """Per-round ratios ``result / reference`` of median step times, for the rounds both completed
    ([Note: interleaved rounds]); empty when either ran only once."""
    mine, theirs = result.extra.get("round_medians_s") or [], reference.extra.get("round_medians_s") or []
    return [a / b for a, b in zip(mine, theirs) if a is not None and b is not None]




MAIN_COLUMNS = ["peer", "ranks", "median step (s)", "min (s)", "max (s)", "tokens/s", "vs PyTorch",
                "peak RSS/rank (MiB)", "device peak (MiB)", "H2D/step (MiB)", "D2H/step (MiB)",
                "all-gather/step (MiB)", "reduce-scatter/step (MiB)", "blocked in gathers/reduces per step (s)",
                "CPU s/step per rank", "CPU vs PyTorch", "loss first->last"]


def _reference(runs: list[RunResult], world_size: int) -> RunResult | None:
    name = "plain" if world_size == 1 else "ddp"
    return next((r for r in runs if r.ok and r.spec.peer == name and r.spec.world_size == world_size), None)


def main_table_rows(runs: list[RunResult]) -> list[list[str]]:
    rows = []
    for r in runs:
        label = PEERS[r.spec.peer].label
        if not r.ok:
            rows.append([label, str(r.spec.world_size), "FAILED"] + [""] * (len(MAIN_COLUMNS) - 4)
                        + [r.error.splitlines()[0][:120]])
            continue
        ref = _reference(runs, r.spec.world_size)
        ratio = f"{r.median_s / ref.median_s:.2f}x time" if ref else "n/a"
        e = r.extra
        rows.append([
            label, str(r.spec.world_size), f"{r.median_s:.4f}", f"{min(r.step_times_s):.4f}",
            f"{max(r.step_times_s):.4f}", f"{r.tokens_per_s:.0f}", ratio,
            f"{max(r.peak_rss_bytes) / MIB:.0f}",
            f"{e['device_peak_bytes'] / MIB:.2f}" if "device_peak_bytes" in e else "-",
            f"{e['h2d_bytes_per_step'] / MIB:.2f}" if "h2d_bytes_per_step" in e else "-",
            f"{e['d2h_bytes_per_step'] / MIB:.2f}" if "d2h_bytes_per_step" in e else "-",
            f"{e['allgather_bytes_per_step'] / MIB:.2f}" if "allgather_bytes_per_step" in e else "-",
            f"{e['reduce_scatter_bytes_per_step'] / MIB:.2f}" if "reduce_scatter_bytes_per_step" in e else "-",
            _blocked(e), *_cpu_cells(r, ref), f"{r.losses[0]:.3f}->{r.losses[-1]:.3f}",
        ])
    return rows


def _cpu_cells(result: RunResult, reference: RunResult | None) -> list[str]:
    """Median process CPU seconds per step of each rank (``a / b``) and the ratio of their mean to the
    reference's: the figure to compare on a loaded machine, where wall-clock also counts waiting for a core."""
    mine = result.cpu_median_s
    if not mine:
        return ["-", "-"]
    theirs = reference.cpu_median_s if reference is not None else []
    ratio = f"{statistics.fmean(mine) / statistics.fmean(theirs):.3f}x" if theirs else "n/a"
    return [" / ".join(f"{x:.3f}" for x in mine), ratio]


def _blocked(extra: dict[str, Any]) -> str:
    """hf_elixir's blocked-wait timers (rank 0, ``memory_stats``), per timed step: gathers + reduces."""
    if "gather_wait_s_per_step" not in extra:
        return "-"
    gather, reduce = extra["gather_wait_s_per_step"], extra.get("reduce_wait_s_per_step", 0.0)
    return f"{gather + reduce:.4f} ({gather:.4f} + {reduce:.4f})"


TRAFFIC_COLUMNS = ["system", "ranks", "H2D/step (MiB)", "D2H/step (MiB)", "Belady H2D bound (MiB)",
                   "ratio to Belady", "how"]


def traffic_rows(runs: list[RunResult]) -> tuple[list[list[str]], list[dict[str, Any]]]:
    rows, facts = [], []
    for r in runs:
        if not r.ok:
            continue
        peer = PEERS[r.spec.peer]
        if peer.offloads and not r.spec.peer.startswith("elixir"):
            moved = all_offload_bytes(r.spec.peer, r.num_params, r.spec.world_size)
            rows.append([peer.label, str(r.spec.world_size), f"{moved['h2d_bytes'] / MIB:.2f}",
                         f"{moved['d2h_bytes'] / MIB:.2f}", "-", "-", "by construction (analytic)"])
        elif r.spec.peer.startswith("elixir") and "h2d_bytes_per_step" in r.extra:
            e = r.extra
            bound, how = _belady_bytes(e)
            ratio = ("-" if bound is None else "n/a (bound 0)" if not bound
                     else f"{e['h2d_bytes_per_step'] / bound:.2f}x")
            rows.append([peer.label, str(r.spec.world_size), f"{e['h2d_bytes_per_step'] / MIB:.2f}",
                         f"{e['d2h_bytes_per_step'] / MIB:.2f}", "-" if bound is None else f"{bound / MIB:.2f}",
                         ratio, "measured (memory_stats); " + how])
            facts.append({"key": r.spec.key(), "h2d": e["h2d_bytes_per_step"], "bound": bound})
    return rows, facts


def _belady_bytes(extra: dict[str, Any]) -> tuple[float | None, str]:
    """Lower bound on host->device bytes per step for hf_elixir's placement (see RESULTS.md text)."""
    if "optimizer_refresh_h2d_bytes" not in extra:
        return None, "no Belady bound: " + str(extra.get("chunk_trace_error", "no chunk trace / cache size"))
    refresh = int(extra["optimizer_refresh_h2d_bytes"])
    trace, blocks = extra.get("chunk_trace") or [], extra.get("cache_blocks") or 0
    sizes = {int(k): v for k, v in (extra.get("streamed_chunk_bytes") or {}).items()}
    refill = {int(k): v for k, v in (extra.get("refill_chunk_bytes") or {}).items()}
    nbytes, moves = belady_onload_bytes(trace, int(blocks), sizes) if sizes and blocks else (0, 0)
    how = (f"bound = Belady {moves} onloads ({nbytes / MIB:.2f} MiB; {len(trace)} accesses, {len(sizes)} movable "
           f"chunks, {blocks} cache blocks) + {refresh / MIB:.2f} MiB parameter refresh (optimizer on host)")
    if extra.get("world_size", 1) > 1 and sizes and blocks:
        rule, _ = belady_onload_bytes(trace, int(blocks), sizes, refill)
        how += (f"; under hf_elixir's rank-local refill rule (later onloads copy the gathered chunk) the "
                f"bound is {(rule + refresh) / MIB:.2f} MiB")
    return float(nbytes + refresh), how


#: the throughput targets at 2 ranks for the offloading rows: >= 1.5x DeepSpeed ZeRO-3 offload, >= 1.15x
#: FSDP2 + CPUOffload (both offload every parameter and optimizer state)
THROUGHPUT_TARGETS = {"ds_zero3_offload": 1.5, "fsdp2_offload": 1.15}
#: the reference for the blocked-wait target (<= 20% of it): the searched 50%-budget row's time blocked in
#: gathers and reduces, s/step, gpt2-124m at 2 ranks, measured 2026-12-01 01:37 UTC (benchmarks/RESULTS.md)
BLOCKED_REFERENCE_S = 0.380


def headline(runs: list[RunResult], traffic_facts: list[dict[str, Any]], largest: dict[str, Any]) -> list[str]:
    """One line per target: measured ratio, target, met or missed (and by how much)."""
    lines = []

    def get(peer, ws):
        return next((r for r in runs if r.ok and r.spec.peer == peer and r.spec.world_size == ws), None)

    for ws in (1, 2):
        ref, res = _reference(runs, ws), get("elixir_resident", ws)
        if ref and res:
            ratio = res.median_s / ref.median_s
            alt = f"min-step ratio {min(res.step_times_s) / min(ref.step_times_s):.2f}x"
            per_round, note = round_ratios(res, ref), ""
            if res.cpu_median_s and ref.cpu_median_s:  # less sensitive to a loaded machine than wall-clock
                cpu_ratio = statistics.fmean(res.cpu_median_s) / statistics.fmean(ref.cpu_median_s)
                note = f"; CPU seconds per step per rank {cpu_ratio:.3f}x"
            if len(per_round) > 1:
                note += (f"; per interleaved round {', '.join(f'{x:.3f}' for x in per_round)}x (median "
                        f"{statistics.median(per_round):.3f}x, spread {min(per_round):.3f}-{max(per_round):.3f})")
            # the target is 0.95x of DDP at 2 ranks; the single-rank target is the original 1.05x of PyTorch
            lines.append(_verdict(f"hf_elixir all-resident step time / {'PyTorch' if ws == 1 else 'DDP'} "
                                  f"({ws} rank{'s' if ws > 1 else ''})", ratio, 1.05 if ws == 1 else 0.95,
                                  lower_is_better=True, alt=alt) + note)
    for name in ("elixir_budget", "elixir_search", "elixir_budget_replicated"):
        offload, ref = get(name, 2), _reference(runs, 2)
        if name == "elixir_search" and offload and ref:  # the cost of offload hidden
            per_round = round_ratios(offload, ref)
            note = f"; per interleaved round {', '.join(f'{x:.3f}' for x in per_round)}x" if len(per_round) > 1 else ""
            lines.append(_verdict(f"{PEERS[name].label} step time / DDP (2 ranks)", offload.median_s / ref.median_s,
                                  1.0, lower_is_better=True,
                                  alt=f"min-step ratio {min(offload.step_times_s) / min(ref.step_times_s):.2f}x")
                         + note)
        if name == "elixir_search" and offload and "gather_wait_s_per_step" in offload.extra:
            blocked = offload.extra["gather_wait_s_per_step"] + offload.extra.get("reduce_wait_s_per_step", 0.0)
            lines.append(_verdict(f"{PEERS[name].label} time blocked in gathers/reduces, s/step / "
                                  f"{BLOCKED_REFERENCE_S} s (the 2026-12-01 01:37 figure, 2 ranks)",
                                  blocked / BLOCKED_REFERENCE_S, 0.2, lower_is_better=True))
        for peer in ("ds_zero3_offload", "fsdp2_offload"):
            other = get(peer, 2)
            if offload and other:
                alt = f"min-step ratio {min(other.step_times_s) / min(offload.step_times_s):.2f}x"
                lines.append(_verdict(f"{PEERS[name].label} throughput / {PEERS[peer].label} (2 ranks)",
                                      offload.tokens_per_s / other.tokens_per_s, THROUGHPUT_TARGETS[peer],
                                      lower_is_better=False, alt=alt))
    for fact in traffic_facts:
        if fact["key"].startswith(("elixir_budget", "elixir_search")) and fact["bound"]:
            lines.append(_verdict(f"host<->device onload bytes / Belady bound ({fact['key']})",
                                  fact["h2d"] / fact["bound"], 1.10, lower_is_better=True))
    results = {r["system"]: r for r in largest.get("results", [])}
    plain, elixir = results.get("PyTorch (plain)"), results.get("hf_elixir")
    if plain and elixir and plain["num_params"]:
        ratio = elixir["num_params"] / plain["num_params"]
        what = "largest trainable model, hf_elixir / plain PyTorch"
        if elixir["capped"] and ratio < 15.0:
            lines.append(f"- **{what}: >= {ratio:.2f}x** (target >= 15x): not determined - the search stopped at "
                         "its cap before reaching the target")
        else:
            lines.append(_verdict(what + (" (lower bound: search capped)" if elixir["capped"] else ""), ratio, 15.0,
                                  lower_is_better=False))
    return lines


def write_report(out_dir: Path, cfg, suite: dict[str, Any], command: str, elapsed_s: float,
                 notes: list[str] | None = None) -> Path:
    """Write report.md, results.png and results.json into ``out_dir``; return the report.md path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[RunResult] = suite["runs"]
    t_rows, facts = traffic_rows(runs)
    largest = suite["largest"]
    chart = _chart(out_dir / "results.png", runs, largest)
    lines = [
        "# hf_elixir side-by-side benchmark (CPU)", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {_machine()}", f"- versions: {_versions()}",
        f"- command: `{command}` (took {elapsed_s / 60:.1f} min)",
        f"- model: {cfg.model.label()}, {count_params(cfg.model) / 1e6:.2f}M params, fp32, AdamW, "
        f"{cfg.warmup_steps} warm-up + {cfg.steps} timed steps, 1 thread per rank, every peer in its own "
        "spawned process group",
        "- absolute times depend on this (shared, noisy) machine; the ratios are the result.", "",
        "## Headline (ratios against the project's targets)", "",
        *(headline(runs, facts, largest) or ["- (no ratio could be computed: see skipped peers below)"]), "",
        "## Step time, throughput, memory", "",
        "Step times are the slowest rank's per step; tokens/s = ranks x batch x seq / median step. "
        f"The peers behind the headline ratios ran {cfg.rounds} times, interleaved (odd rounds in the suite's "
        "order, even rounds reversed), and their timed steps are pooled (see `rounds` and `round_medians_s` "
        "in results.json). "
        "`vs PyTorch` = median step / the plain PyTorch (1 rank) or DDP (2 ranks) median. "
        "Peak RSS is the rank process's high-water mark (getrusage), including the Python/torch runtime. "
        "`device peak` is hf_elixir's simulated device pool (model data only). Traffic and blocked time are "
        "hf_elixir's rank-0 counters (`memory_stats`: all-gather + reduce-scatter wait) averaged over the timed "
        "steps; the peers' traffic by construction is in the next section.", "",
        _md_table(MAIN_COLUMNS, main_table_rows(runs)), "",
    ]
    keys = ("resident_peak_bytes", "budget_bytes", "library_min_budget_bytes", "min_budget_probes_log", "search_s",
            "plan_chunk_size_numel", "plan_resident_chunks", "plan_device_shard_chunks", "plan_device_optim_chunks",
            "plan_prefetch_depth", "plan_predicted_step_s")
    budgets = {r.spec.key(): {k: r.extra[k] for k in keys if k in r.extra}
               for r in runs if r.ok and r.spec.peer in ("elixir_budget", "elixir_search", "elixir_min",
                                                          "elixir_budget_replicated")}
    if budgets:
        lines += ["hf_elixir budgets per rank (bytes; resident peak from an all-resident probe in the same process): "
                  "`" + json.dumps(budgets) + "`", ""]
    lines += ["## Host<->device traffic per rank per step", "",
              "Belady/MIN bound for hf_elixir: the fewest chunk onloads any eviction policy could make for the "
              "chunk access order the library recorded in the last step, with the same chunks (size, which ones "
              "live on the host) and the same cache (budget minus the device bytes that stay put, in chunks), "
              "x each chunk's shard bytes, plus the parameter refresh that hf_elixir's optimizer placement forces "
              "(chunks kept on the device whose optimizer state is on the host get their updated parameters "
              f"back every step) (Belady implementation: {belady_source}). All-offload peers: what their design moves by "
              "construction (every parameter shard onloaded for forward and again for backward, every "
              "gradient shard offloaded), computed from the parameter count.", "",
              _md_table(TRAFFIC_COLUMNS, t_rows) if t_rows else "(no offloading peer ran)", ""]
    lines += _profile_section(runs)
    moe = suite.get("moe")
    if moe:
        lines += ["## Switch-Transformers vs a dense model of equal total parameters (plain PyTorch, 1 rank)", "",
                  f"`python benchmarks/moe.py {' '.join(moe.get('args', []))}` (OMP_NUM_THREADS=1):", ""]
        lines += (["```", moe["stdout"], "```"] if "stdout" in moe else [f"- failed: {moe['error']}"]) + [""]
    lines += _largest_section(largest)
    skipped = dict(suite["skipped"])
    skipped.setdefault("ColossalAI Gemini", "not run: Gemini's chunk manager and GeminiDDP require CUDA "
                                            "(torch.cuda / NCCL); it cannot run on this CPU-only machine")
    lines += ["## Not run", ""] + [f"- {k}: {v}" for k, v in skipped.items()] + [""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    lines += [f"![results]({chart.name})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    dump = {"runs": [result_to_dict(r) for r in runs], "skipped": skipped, "largest": largest,
            "command": command}
    (out_dir / "results.json").write_text(json.dumps(dump, indent=1, default=str))
    return path


def _profile_section(runs: list[RunResult]) -> list[str]:
    profiled = [r for r in runs if r.ok and r.extra.get("profile_top")]
    if not profiled:
        return []
    out = ["## Where the time goes (1 rank, one extra profiled step, top ops by self CPU time)", ""]
    for r in profiled:
        top = r.extra["profile_top"]
        out.append(f"- **{PEERS[r.spec.peer].label}**: " + "; ".join(f"{name} {ms:.1f} ms x{calls}"
                                                                   for name, ms, calls in top))
    return out + [""]


LARGEST_COLUMNS = ["system", "largest n_layer", "params (M)", "vs plain PyTorch", "method", "note"]


def _largest_section(largest: dict[str, Any]) -> list[str]:
    if not largest:
        return []
    results = largest["results"]
    plain = next((r for r in results if r["system"] == "PyTorch (plain)"), None)
    rows = []
    for r in results:
        ratio = f"{r['num_params'] / plain['num_params']:.1f}x" if plain and plain["num_params"] else "-"
        n = ("none" if r["n_layer"] < 0 else (">= " if r["capped"] else "") + str(r["n_layer"]))
        rows.append([r["system"], n, f"{r['num_params'] / 1e6:.1f}", ratio, r["method"], r["note"]])
    base = largest["base"]
    return ["## Largest trainable model at a fixed device budget", "",
            f"Budget: {largest['budget_bytes'] / MIB:.2f} MiB of device memory for model data (params, grads, "
            f"optimizer states; activations excluded for all), host RAM limit {largest['host_bytes'] / 2**30:.1f} GiB. "
            f"Family: GPT-2 d={base['n_embd']}, V={base['vocab_size']}, n_layer searched (1 rank). "
            "Analytic rows are used where this CPU-only machine has no device to measure or where "
            "materialising the model would not fit in RAM; hf_elixir's row is measured with real steps.", "",
            _md_table(LARGEST_COLUMNS, rows), ""]


def _chart(path: Path, runs: list[RunResult], largest: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r.ok]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.32 * max(len(ok), 8) + 1.5))
    labels = [f"{PEERS[r.spec.peer].label} - {r.spec.world_size} rank{'s' if r.spec.world_size > 1 else ''}" for r in ok]
    colors = ["tab:green" if r.spec.peer.startswith("elixir") else "tab:gray" for r in ok]
    axes[0].barh(range(len(ok)), [r.tokens_per_s for r in ok], color=colors)
    axes[0].set_yticks(range(len(ok)), labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("tokens/s, median step (higher is better)")
    axes[0].set_title("Training throughput (CPU, fp32, shared machine)")
    results = largest.get("results", []) if largest else []
    if results:
        heights = [r["num_params"] / 1e6 for r in results]
        bars = axes[1].bar(range(len(results)), heights,
                           color=["tab:green" if r["system"].startswith("hf_elixir") else "tab:gray" for r in results])
        for bar, r in zip(bars, results):
            if r["method"].startswith("analytic"):
                bar.set_hatch("//")
                bar.set_alpha(0.6)
            tag = (">= " if r["capped"] else "") + f"{r['num_params'] / 1e6:.0f}M"
            axes[1].annotate(tag, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                             va="bottom", fontsize=7)
        import textwrap

        axes[1].set_xticks(range(len(results)), [textwrap.fill(r["system"], 16) for r in results], fontsize=7)
        axes[1].set_yscale("log")
        axes[1].set_ylabel("parameters (M, log)")
        axes[1].set_title(f"Largest model at {largest['budget_bytes'] / MIB:.0f} MiB device budget\n"
                          "(hatched: analytic, bounded by host RAM; solid: measured; >=: search capped)", fontsize=9)
    else:
        axes[1].set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
