"""The disk tier in the planner: what a plan spills to disk when host memory does not hold it, what that costs
(``hf_elixir/search/_disk_cost.py``, [Note: disk tier pricing]), ``hf-elixir plan --disk`` on the largest
built-in models, its flag errors, and ``hf-elixir probe``'s disk rates ([Note: disk probe])."""

import contextlib
import functools
import io
import json
import math
from dataclasses import replace

import pytest
import torch

from hf_elixir.cli import main
from hf_elixir.profiler import HardwareProfile, profile_step
from hf_elixir.profiler._disk_probe import measure_disk
from hf_elixir.profiler._hardware import _read_cache, probe_disk
from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch
from hf_elixir.search import _plan_search, build_chunked_step, search
from hf_elixir.search._disk_cost import STAGING_BUFFER_BYTES, STAGING_BUFFERS, DiskTier, spill

GIB, TB = 2**30, 10**12


def _gpu(memory_bytes: int, host_bytes: int) -> HardwareProfile:
    """A fixed test machine (ballpark rates of a PCIe A100 node), so nothing depends on this machine's load."""
    return HardwareProfile(device_kind="cuda", device_name="test-gpu", device_total_bytes=memory_bytes,
                           device_free_bytes=memory_bytes, host_total_bytes=host_bytes, host_available_bytes=host_bytes,
                           h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, host_adam_numel_per_s=1e9,
                           device_adam_numel_per_s=4e10, device_flops_per_s=150e12, can_overlap=True)


@pytest.fixture(scope="module")
def gpt2_profile():
    model, batch = meta_model_and_batch(load_config("gpt2"), batch_size=1, seq_len=128, dtype=torch.bfloat16)
    return profile_step(model, batch, device="meta")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_a_disk_holds_what_the_host_does_not(gpt2_profile):
    """GPT-2 (124M) on a 1 GiB GPU keeps about 1.7 GiB on the host: no plan on a 512 MiB host without a disk (the error
    names the least host memory); with one, the plan spills masters and moments first, fits the host, and its step
    is at least the disk's."""
    hw, host = _gpu(GIB, GIB // 2), GIB // 2
    with pytest.raises(ValueError, match="no configuration fits host memory") as without:
        search(gpt2_profile, hw, precision="bf16", host_memory_bytes=host, refine_starts=0)
    disk = DiskTier(capacity_bytes=100 * GIB, read_bytes_per_s=5e9, write_bytes_per_s=5e9)
    result = search(gpt2_profile, hw, precision="bf16", host_memory_bytes=host, disk=disk, refine_starts=0)
    pred = result.best.prediction
    info = pred.disk
    assert info is not None and info.optimizer_bytes > 0
    assert pred.host_bytes <= host and 0 < info.staging_bytes <= STAGING_BUFFERS * STAGING_BUFFER_BYTES
    assert info.param_bytes == 0 or info.optimizer_bytes >= 10 * info.param_bytes  # masters and moments first
    assert pred.step_s == pytest.approx(max(info.step_without_disk_s, info.disk_s))
    assert info.disk_s == pytest.approx(info.read_bytes / 5e9 + info.write_bytes / 5e9)
    assert any(r.startswith("disk tier:") for r in result.plan.reasons)
    # the least host memory the error names drops with a disk (what is left: gradients, parameters, staging)
    tiny = replace(disk, capacity_bytes=100 * GIB)
    with pytest.raises(ValueError, match="beside a") as with_disk:
        search(gpt2_profile, hw, precision="bf16", host_memory_bytes=GIB // 64, disk=tiny, refine_starts=0)
    least = lambda err: int(str(err.value).split("the least ")[1].split(" ")[0])  # noqa: E731
    assert least(with_disk) < least(without) / 4


def test_disk_time_and_hiding_tokens_are_monotone(gpt2_profile):
    """The same configuration on a faster disk: fewer disk seconds and no more tokens to hide them; a step of the
    hiding tokens covers the disk and one token fewer does not."""
    hw = _gpu(GIB, 64 * GIB)
    result = search(gpt2_profile, hw, precision="bf16", host_memory_bytes=64 * GIB, refine_starts=0)
    best, plain = result.best, result.best.prediction
    assert plain.disk is None and plain.host_bytes > GIB  # the host holds it all: no disk priced
    step = build_chunked_step(result.profile, best.chunk_size_numel, world_size=1, precision="bf16", hardware=hw,
                              activation_policy=best.activation_policy or None)
    tokens = 128
    last_s, last_tokens = math.inf, math.inf
    for gbps in (0.5, 1, 4, 16, 64):
        disk = DiskTier(capacity_bytes=100 * GIB, read_bytes_per_s=gbps * 1e9, write_bytes_per_s=gbps * 1e9)
        info = spill(step, best.knobs, plain, disk, GIB // 2, 1).disk
        hide = info.hide_tokens(tokens)
        assert info.disk_s < last_s and hide <= last_tokens
        last_s, last_tokens = info.disk_s, hide
        scaled = lambda n: info.step_without_disk_s + (n / tokens - 1) * info.compute_s  # noqa: B023, E731
        assert scaled(hide) >= info.disk_s and info.step_s(hide, tokens) == pytest.approx(scaled(hide))
        assert hide == tokens or scaled(hide - 1) < info.disk_s
    assert spill(step, best.knobs, plain, replace(disk, capacity_bytes=1), GIB // 2, 1) is None  # the disk is too small


def _check_disk_report(report: dict) -> None:
    """A plan that needs the disk: it fits host and disk, its step is the longer of compute and disk, and the
    tokens at which the disk hides agree with the report's own numbers ([Note: disk tier pricing])."""
    disk, chosen = report["disk"], report["chosen"]
    assert disk is not None and disk["disk_bytes_per_machine"] <= 30 * TB
    spilled = disk["optimizer_bytes_per_gpu"] + disk["param_bytes_per_gpu"] + disk["grad_bytes_per_gpu"]
    assert chosen["host_bytes_per_gpu"] * 8 <= 2**40 < (chosen["host_bytes_per_gpu"] + spilled) * 8
    assert disk["optimizer_bytes_per_gpu"] > 0  # masters and moments go first
    assert chosen["step_s"] == pytest.approx(max(disk["step_without_disk_s"], disk["disk_s"]), rel=1e-5)
    tokens, hide = chosen["tokens_per_step"], disk["hide_tokens_per_step"]
    scaled = lambda n: disk["step_without_disk_s"] + (n / tokens - 1) * disk["compute_s"]  # noqa: E731
    assert hide > tokens and scaled(hide) >= disk["disk_s"] * (1 - 1e-6) > scaled(hide * 0.999)  # JSON rounds
    assert disk["hide_tokens_per_s"] == pytest.approx(hide / disk["hide_step_s"], rel=1e-3)
    assert any(r["rate"] == "disk read" and r["source"] == "--disk-gbps" for r in report["rates"])


NODE = ["--gpu", "h100", "--num-gpus", "8", "--host-memory", "1TiB", "--disk", "30TB"]


def test_deepseek_v3_fits_one_node_with_a_disk():
    """``hf-elixir plan --model deepseek-v3 --gpu h100 --num-gpus 8 --host-memory 1TiB --disk 30TB``: without the
    disk the least it needs is 1.72 TB of host memory a GPU (expert parallel 8); with it, a plan."""
    code, out, err = _run(["plan", "--model", "deepseek-v3", *NODE, "--disk-gbps", "25", "--json"])
    assert code == 0, err[-2000:]
    report = json.loads(out)
    assert report["chosen"]["expert_parallel"] == 8
    _check_disk_report(report)
    _check_pinned(report)


# the plan this command printed before the search was made faster (quiet spans in the replay, linear-time steps,
# the chunk-size search's memo: none changes a number); a change to the cost model that moves one of these says why
PINNED_CHOSEN = {"tensor_parallel": 1, "expert_parallel": 8, "data_parallel": 8, "data_parallel_kind": "sharded",
                 "chunk_size_numel": 1666897920, "resident_chunks": 0, "cache_blocks": 2, "device_optimizer_chunks": 0,
                 "prefetch_depth": 2, "activations": "recompute 61/61", "tokens_per_step": 8192,
                 "device_peak_bytes": 80998236164, "host_bytes_per_gpu": 136954064896}
PINNED_DISK = {"optimizer_bytes_per_gpu": 1183463098368, "param_bytes_per_gpu": 2818572288,
               "grad_bytes_per_gpu": 394487699456, "staging_bytes_per_gpu": 268435456,
               "disk_bytes_per_machine": 12646154960896, "read_bytes_per_step_per_gpu": 1580769370112,
               "write_bytes_per_step_per_gpu": 1580769370112, "hide_tokens_per_step": 14369428}


def _check_pinned(report: dict) -> None:
    chosen, disk = report["chosen"], report["disk"]
    assert {k: chosen[k] for k in PINNED_CHOSEN} == PINNED_CHOSEN
    assert {k: disk[k] for k in PINNED_DISK} == PINNED_DISK
    assert chosen["step_s"] == pytest.approx(1011.692397, abs=1e-6) and disk["disk_s"] == chosen["step_s"]
    assert disk["step_without_disk_s"] == pytest.approx(29.94011, abs=1e-6)
    assert disk["compute_s"] == pytest.approx(0.560016, abs=1e-6)
    assert report["searched_configurations"] == 1361
    assert [(a["prefetch_depth"], a["resident_chunks"], a["step_s"]) for a in report["alternatives"][:5]] == [
        (2, 0, 1011.692397), (0, 0, 1011.692397), (1, 0, 1011.692397), (0, 1, 1017.173839), (1, 1, 1017.173839)]
    assert "110227342340 bytes per rank" in report["degrees"]["expert_parallel"]["1"]  # expert parallel 1's need


@pytest.mark.parametrize("model, flags", [("kimi-k2-like", ["--expert-parallel-size", "8"]), ("llama-3.1-405b", [])])
def test_a_1t_moe_and_llama_405b_fit_one_node_with_a_disk(model, flags, monkeypatch):
    """The same node for the 1T-parameter Kimi-K2-like MoE and Llama-3.1-405B, searched coarsely to keep this quick
    (one chunk size, a small grid, no local refinement: a plan found so is one the full search also finds)."""
    real = _plan_search.search
    monkeypatch.setattr(_plan_search, "search", functools.partial(real, num_chunk_sizes=1, grid_points=4,
                                                                  refine_starts=0))
    code, out, err = _run(["plan", "--model", model, *NODE, "--disk-gbps", "25", "--json", *flags])
    assert code == 0, err[-2000:]
    report = json.loads(out)
    assert report["parameters"] > (1.0e12 if model == "kimi-k2-like" else 4.0e11)
    _check_disk_report(report)


@pytest.mark.parametrize("argv, words", [
    (["--disk", "30XB"], ["--disk", "30XB", "e.g."]),
    (["--disk", "30TB", "--disk-gbps", "0"], ["--disk-gbps", "0", "positive"]),
    (["--disk", "30TB", "--disk-gbps", "fast"], ["--disk-gbps", "fast", "positive"]),
    (["--disk-gbps", "25"], ["--disk-gbps", "--disk", "30TB"]),
])
def test_bad_disk_flags_name_the_flag_the_value_and_the_fix(argv, words):
    code, _, err = _run(["plan", "--model", "gpt2", *argv])
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "error:" in line and all(w in line for w in words), line


def test_probe_measures_a_tiny_file_and_keeps_the_rates(tmp_path, monkeypatch):
    rates = measure_disk(tmp_path, size_bytes=64 * 1024, repeats=1)
    assert rates.write_bytes_per_s > 0 and rates.read_bytes_per_s > 0 and rates.size_bytes == 64 * 1024
    assert rates.method in ("direct", "fadvise", "cached") and not list(tmp_path.iterdir())  # the file is gone
    cache = tmp_path / "cache" / "hardware.json"
    stored = probe_disk(tmp_path, size_bytes=4096, repeats=1, cache_path=cache)
    entry = next(v for k, v in _read_cache(cache).items() if k.endswith("|disk"))
    profile = HardwareProfile.from_dict(entry)
    assert profile.disk_read_bytes_per_s == stored.read_bytes_per_s > 0 and profile.disk_dir == stored.directory
    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path / "cli"))
    code, out, err = _run(["probe", "--disk-dir", str(tmp_path), "--disk-size", "8KiB", "--repeats", "1", "--json"])
    assert code == 0, err
    printed = json.loads(out)
    assert printed["write_gbps"] > 0 and printed["read_gbps"] > 0
    code, _, err = _run(["probe", "--disk-dir", str(tmp_path / "missing")])
    assert code == 2 and "--disk-dir" in err and "missing" in err and "create it" in err


def test_disk_tier_refuses_non_positive_values():
    with pytest.raises(ValueError, match="capacity_bytes=0"):
        DiskTier(capacity_bytes=0, read_bytes_per_s=1e9, write_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="write_bytes_per_s=0"):
        DiskTier(capacity_bytes=1, read_bytes_per_s=1e9, write_bytes_per_s=0.0)


def test_prepare_search_prices_the_config_disk(tmp_path):
    """``ElixirConfig(offload_dir=..., disk_budget_bytes=...)`` gives ``prepare``'s search a disk of that budget a
    rank at the rates ``hf-elixir probe`` kept (else the default one, which the CLI names too)."""
    from types import SimpleNamespace

    from hf_elixir.cli._disk import DEFAULT_DISK_GBPS
    from hf_elixir.search._disk_cost import DEFAULT_DISK_BYTES_PER_S, config_disk_tier

    assert DEFAULT_DISK_GBPS * 1e9 == DEFAULT_DISK_BYTES_PER_S
    hw = _gpu(GIB, GIB)
    assert config_disk_tier(SimpleNamespace(), hw, 8) is None  # no offload_dir: no disk tier
    tier = config_disk_tier(SimpleNamespace(offload_dir=str(tmp_path), disk_budget_bytes=10 * GIB), hw, 8)
    assert tier == DiskTier(80 * GIB, DEFAULT_DISK_BYTES_PER_S, DEFAULT_DISK_BYTES_PER_S, runtime=True)
    probed = replace(hw, disk_read_bytes_per_s=3e9, disk_write_bytes_per_s=2e9)
    free = config_disk_tier(SimpleNamespace(offload_dir=str(tmp_path), disk_budget_bytes=None), probed, 1)
    assert free.capacity_bytes > 0 and (free.read_bytes_per_s, free.write_bytes_per_s) == (3e9, 2e9)


def test_an_optimizer_only_disk_holds_masters_and_moments_only(gpt2_profile):
    """A tier that holds fp32 masters and moments only (``optimizer_only``) spills only those; the CLI's tier (``plan
    --disk``) may spill the rest."""
    hw = _gpu(GIB, GIB)
    full = DiskTier(capacity_bytes=100 * GIB, read_bytes_per_s=5e9, write_bytes_per_s=5e9)
    runtime = replace(full, optimizer_only=True)
    for host in (GIB, GIB // 2):
        try:
            result = search(gpt2_profile, hw, precision="bf16", host_memory_bytes=host, disk=runtime, refine_starts=0)
        except ValueError as err:  # what is left after masters and moments does not fit this host
            assert "no configuration fits host memory" in str(err)
            continue
        info = result.best.prediction.disk
        assert info is not None and info.optimizer_bytes > 0 and info.param_bytes == info.grad_bytes == 0
        assert result.best.prediction.host_bytes <= host
    squeezed = search(gpt2_profile, hw, precision="bf16", host_memory_bytes=GIB // 4, disk=full, refine_starts=0)
    assert squeezed.best.prediction.disk.param_bytes + squeezed.best.prediction.disk.grad_bytes > 0
    with pytest.raises(ValueError, match="no configuration fits host memory"):
        search(gpt2_profile, hw, precision="bf16", host_memory_bytes=GIB // 4, disk=runtime, refine_starts=0)


def test_prepare_prices_the_disk_as_its_runtime_spills(gpt2_profile):
    """``prepare``'s tier (``runtime``, optim/_disk_state.py) spills masters and moments, then gradient shards, then
    parameter host shards of trained chunks: at a host that the masters and moments on disk do not leave room enough,
    it fits with gradients on disk too, and never counts on a frozen chunk's shard or a refill copy."""
    hw = _gpu(GIB, GIB)
    runtime = DiskTier(capacity_bytes=100 * GIB, read_bytes_per_s=5e9, write_bytes_per_s=5e9, runtime=True)
    squeezed = search(gpt2_profile, hw, precision="bf16", host_memory_bytes=GIB // 4, disk=runtime, refine_starts=0)
    info = squeezed.best.prediction.disk
    assert info.optimizer_bytes > 0 and info.grad_bytes > 0 and squeezed.best.prediction.host_bytes <= GIB // 4
    step = build_chunked_step(gpt2_profile, squeezed.plan.chunk_size_numel, world_size=1, precision="bf16", hardware=hw)
    knobs = squeezed.best.knobs
    from hf_elixir.search._disk_cost import _runtime_units  # noqa: PLC0415

    units = _runtime_units(step, knobs, {})
    kinds = [u[0] for u in units]
    assert kinds == sorted(kinds, key=[0, 2, 1].index), "masters and moments, then gradients, then parameters"
    trained = [c for c in range(step.num_chunks) if step.trained_numels[c] and c not in knobs.device_optim]
    assert sum(u[1] for u in units if u[0] == 2) == sum(4 * step.shard_numel(c) for c in trained)
