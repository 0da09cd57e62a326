"""benchmarks/gpu.py stays runnable without a GPU: its dry run imports everything, trains the tiny versions of
every section on the CPU, checks the kernels under the interpreter and the OPT-1.3B offload budget on meta.
The GPU run itself is ``bash benchmarks/gpu.sh`` on a machine with one GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_script_dry_run_runs_every_section(tmp_path):
    """``python benchmarks/gpu.py --dry-run`` as benchmarks/RESULTS.md gives it: a script run from the repository
    root, no ``PYTHONPATH`` (the script finds the checkout itself), not ``python -m``."""
    assert "python benchmarks/gpu.py --dry-run" in (ROOT / "benchmarks" / "RESULTS.md").read_text()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for a dry run
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    sections = results["sections"]
    assert results["dry_run"] is True
    assert set(sections) == {"env", "kernels", "adamw_bw", "parity", "search", "opt_elixir", "opt_fsdp2",
                             "opt_plain", "opt_deepspeed"}
    assert all(s["status"] in ("ok", "skipped") for s in sections.values()), {n: s.get("error") for n, s in sections.items()}
    # nothing the lent GPU image lacks is imported
    assert sections["env"]["unneeded_imports"] == []
    # every kernel ran (interpreted) against its reference
    kernels = sections["kernels"]
    assert kernels["status"] == "ok" and kernels["num_checks"] >= 20 and kernels["failed_checks"] == []
    # parity: the plain reference and six hf_elixir runs (fp32/bf16 x resident/half/minimum), each with
    # the pool's peak recorded for every step
    runs = sections["parity"]["rows"]
    assert [r["run"] for r in runs[1:]] == [f"hf_elixir {p} {b}" for p in ("fp32", "bf16")
                                            for b in ("resident", "half", "minimum")]
    assert all(r["ok"] for r in runs[1:])
    assert all("pool_peak_bytes" in step for r in runs[1:] for step in r["steps"])
    minimum = next(r for r in runs if r["run"] == "hf_elixir fp32 minimum")
    assert minimum["budget_bytes"] > 0 and any(step["onloads"] > 0 for step in minimum["steps"])
    # the search priced the step from counted FLOPs (a meta profile) and its plan ran
    search = sections["search"]
    assert search["flops"] > 0 and search["predicted_compute_s"] > 0 and search["measured_step_s"] > 0
    # the OPT-1.3B configuration is real and its budget forces offload
    meta = sections["opt_elixir"]["meta_models"]["opt_1_3b"]
    assert meta["num_params"] > 1.3e9 and meta["min_budget_bytes"] < meta["fp32_adamw_model_data_bytes"]
    assert "deepspeed" in sections["opt_deepspeed"].get("skipped", "deepspeed ran")
    assert "## Parity" in (tmp_path / "summary.md").read_text()


def test_gpu_script_runs_sections_in_subprocesses_and_keeps_going_after_a_failure(tmp_path):
    """As on the GPU: each section in its own process; a section that fails is recorded and the next runs."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--subprocess",
                           "--only", "env", "adamw_bw", "--fail-section", "env", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    results = json.loads((tmp_path / "results.json").read_text())
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert results["sections"]["env"]["status"] == "failed" and "on purpose" in results["sections"]["env"]["error"]
    assert results["sections"]["adamw_bw"]["status"] == "skipped"  # dry run: needs CUDA, skips at once
    assert "**env**" in (tmp_path / "summary.md").read_text()
