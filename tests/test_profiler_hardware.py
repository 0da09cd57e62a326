"""Hardware probe: measured, cached per machine, collectives timed on the current group (gloo)."""

import json

import torch

from hf_elixir.profiler import HardwareProfile, probe_hardware
from hf_elixir.profiler import _hardware


def test_hardware_probe_measures_and_caches_per_machine(tmp_path, monkeypatch):
    cache = tmp_path / "hw.json"
    hw = probe_hardware("cpu", budget_bytes=123456, cache_path=cache, size_bytes=2**20, repeats=1)
    assert isinstance(hw, HardwareProfile)
    assert hw.device_total_bytes == 123456 and hw.host_total_bytes > 0 and not hw.can_overlap
    for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "host_adam_numel_per_s", "device_flops_per_s"):
        assert getattr(hw, name) > 0
    assert hw.allgather_bytes_per_s is None  # no process group here
    stored = json.loads(cache.read_text())
    assert len(stored) == 1 and next(iter(stored)).startswith(hw.hostname)

    def boom(*args, **kwargs):
        raise AssertionError("should have used the cache")

    monkeypatch.setattr(_hardware, "_measure", boom)
    again = probe_hardware("cpu", budget_bytes=999, cache_path=cache)
    assert again.h2d_bytes_per_s == hw.h2d_bytes_per_s and again.device_total_bytes == 999


def _probe_worker(rank, world, port, cache_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # rank 0 finds a (partial) cache entry, rank 1 none: both must still time the collectives together
        hw = probe_hardware("cpu", cache_path=f"{cache_dir}/hw{rank}.json", size_bytes=2**18, repeats=1)
        assert hw.world_size == world and hw.allgather_bytes_per_s > 0 and hw.reduce_scatter_bytes_per_s > 0
        assert hw.allreduce_bytes_per_s > 0
    finally:
        dist.destroy_process_group()


def test_hardware_probe_times_collectives_on_the_current_group(tmp_path):
    import socket

    import torch.multiprocessing as mp

    (tmp_path / "hw0.json").write_text(json.dumps({f"{socket.gethostname()}|cpu|world2": {"h2d_bytes_per_s": 1.0}}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_probe_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)


def test_cached_adam_rate_timed_without_the_fused_kernel_is_measured_again(tmp_path):
    """ElixirOptimizer runs PyTorch's fused AdamW on shards; a cache entry timed with the default
    (per-tensor) implementation under-rates the host optimizer several-fold and skews the search."""
    cache = tmp_path / "hw.json"
    first = probe_hardware("cpu", cache_path=cache, size_bytes=2**20, repeats=1)
    stored = json.loads(cache.read_text())
    key = next(iter(stored))
    assert stored[key]["adam_impl"] == "fused"
    del stored[key]["adam_impl"]
    stored[key]["host_adam_numel_per_s"] = 1.0  # as an old cache that timed another implementation
    cache.write_text(json.dumps(stored))
    again = probe_hardware("cpu", cache_path=cache, size_bytes=2**20, repeats=1)
    assert again.host_adam_numel_per_s > 1.0 and first.host_adam_numel_per_s > 1.0
    assert json.loads(cache.read_text())[key]["adam_impl"] == "fused"


def test_the_public_probe_times_hf_elixirs_own_overheads_and_the_profilers_reuses_them(tmp_path):
    """The profiler's probe does not import the façade: without a runtime probe the three overhead fields stay 0
    and are not cached; ``hf_elixir.probe_hardware`` hands it ``prepare`` and times them, and the cached values are
    then what the profiler's probe returns too."""
    import hf_elixir

    cache = tmp_path / "hw.json"
    bare = probe_hardware("cpu", cache_path=cache, size_bytes=2**20, repeats=1)
    assert (bare.hook_event_s, bare.onload_fixed_s, bare.optim_tensor_s) == (0.0, 0.0, 0.0)
    assert "optim_tensor_s" not in next(iter(json.loads(cache.read_text()).values()))
    full = hf_elixir.probe_hardware("cpu", cache_path=cache, size_bytes=2**20, repeats=1)
    assert full.optim_tensor_s > 0 and full.hook_event_s >= 0 and full.onload_fixed_s >= 0
    again = probe_hardware("cpu", cache_path=cache)
    assert again.optim_tensor_s == full.optim_tensor_s and again.h2d_bytes_per_s == full.h2d_bytes_per_s


def test_prepare_hands_the_search_a_runtime_probe_on_itself(monkeypatch):
    import hf_elixir
    from hf_elixir.profiler._runtime_probe import RuntimeProbe

    from _models import batch, fixed_cpu_hardware, tiny_model

    seen = {}

    def probe(*args, **kwargs):
        seen.update(kwargs)
        return fixed_cpu_hardware()

    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", probe)
    model = tiny_model("gpt2")
    hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), hf_elixir.ElixirConfig(search="auto"),
                      sample_batch=batch("gpt2", 0, 2, 8))
    given = seen["runtime_probe"]
    assert isinstance(given, RuntimeProbe) and given.prepare is hf_elixir.prepare
    assert given.memory_stats is hf_elixir.memory_stats
