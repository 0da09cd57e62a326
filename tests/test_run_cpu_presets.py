"""``benchmarks/run_cpu.py --model tiny|gpt2-124m|opt-350m`` (issue 14 item 4): the presets are the real
Hugging Face shapes, and the main table reports per step the collective traffic and the time hf_elixir was
blocked in all-gathers and reduce-scatters."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import run_cpu
from benchmarks._harness import count_params


def test_presets_are_the_published_models():
    # parameter counts of the released checkpoints (tied LM head counted once)
    assert count_params(run_cpu.PRESETS["gpt2-124m"]) == 124_439_808
    assert count_params(run_cpu.PRESETS["opt-350m"]) == 331_196_416
    cfg = run_cpu.SuiteConfig.preset("opt-350m")
    assert cfg.world_sizes == (2,) and cfg.peers == run_cpu.PRESET_PEERS
    assert (cfg.model.batch_size, cfg.model.seq_len) == (2, 256)
    assert run_cpu.SuiteConfig.preset("tiny").model == run_cpu.SuiteConfig.full().model
    with pytest.raises(ValueError, match="gpt2-124m"):
        run_cpu.SuiteConfig.preset("gpt2-xl")


def _row(report: str, label: str) -> dict[str, str]:
    lines = [ln for ln in report.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == label:
            return dict(zip(header, cells))
    raise AssertionError(f"no row {label!r} in:\n{report}")


def test_two_rank_rows_report_collective_bytes_and_blocked_time(tmp_path: Path):
    assert run_cpu.main(["--quick", "--world-sizes", "2", "--peers", "ddp,elixir_search", "--no-largest",
                         "--out-dir", str(tmp_path), "--work-dir", str(tmp_path / "work")]) == 0
    report = (tmp_path / "RESULTS.md").read_text()
    row = _row(report, run_cpu.PEERS["elixir_search"].label)
    blocked = row["blocked in gathers/reduces per step (s)"]
    total, parts = blocked.split(" ", 1)
    gather, reduce = (float(x) for x in parts.strip("()").split(" + "))
    assert float(total) == pytest.approx(gather + reduce, abs=2e-4) and float(total) > 0
    assert float(row["all-gather/step (MiB)"]) + float(row["reduce-scatter/step (MiB)"]) > 0
    assert _row(report, run_cpu.PEERS["ddp"].label)["blocked in gathers/reduces per step (s)"] == "-"
