"""A short soak (benchmarks/soak.py): 2 gloo ranks at the smallest device budget, host RSS / live tensors /
device pool flat after warm-up, per-step traffic constant and consistent with the cumulative counters,
ranks agree, the loss falls, nothing hangs (process-group timeout + a deadline on the whole run).
The full 1,000-step run is `python benchmarks/soak.py`."""

from __future__ import annotations

from benchmarks.soak import run_soak


def test_short_soak_is_flat_consistent_and_does_not_hang():
    summary = run_soak(steps=50, world_size=2, warmup=20, timeout_s=60, sample_every=2)  # 16 samples: 4 per quarter
    assert summary["ok"], summary["problems"]
    assert summary["device_peak_bytes"] <= summary["budget_bytes"]
    traffic = summary["step_traffic_bytes"]
    assert traffic["step_allgather_bytes"] > 0 and traffic["step_reduce_scatter_bytes"] > 0
    assert traffic["step_h2d_bytes"] > 0  # the smallest budget really offloads
