"""Where the refresh of an uploaded chunk casts its fp32 master to the compute dtype ([Note: refresh cast] in
hf_elixir/optim/_refresh.py): on the host (a bf16 staging buffer uploaded, 2 bytes per element) or on the device
(the fp32 master uploaded, 4 bytes per element, through a charged device staging buffer). Both give the same
parameters (one round-to-nearest-even either side), the byte counters and the device peak are what the cost model
prices, the plan validates the field, and the search picks the side by cost."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_elixir
from hf_elixir.chunk import chunk as chunk_module
from hf_elixir.chunk.memory import DeviceBudgetExceededError
from hf_elixir.plan import ElixirPlan
from hf_elixir.profiler import HardwareProfile, profile_step
from hf_elixir.search import build_chunked_step, predict, search
from hf_elixir.search._cost import Knobs, fixed_memory, refresh_staging_bytes
from tests._models import batch, low_precision_reference, rel_l2, tiny_model, two_groups

STEPS = 4
ROWS = 2
CHUNK = 4096
GIB = 2**30


def _plan(cast: str) -> tuple[hf_elixir.ElixirConfig, ElixirPlan]:
    """The plan ``prepare`` makes for the tiny GPT-2 in bf16 with the optimizer on the host (every chunk
    resident, so every trained chunk's refresh is an upload), with ``refresh_cast=cast``."""
    config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, offload_optimizer=True, precision="bf16")
    model = tiny_model("gpt2")
    model, _ = hf_elixir.prepare(model, torch.optim.AdamW(two_groups(model), lr=5e-3), config)
    return config, dataclasses.replace(hf_elixir.get_state(model).plan, refresh_cast=cast)


def _train(cast: str, budget: int | None = None) -> dict:
    config, plan = _plan(cast)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, dataclasses.replace(config, plan=plan, device_memory_budget_bytes=budget,
                                                                   budget_covers_activations=False))
    manager = hf_elixir.get_state(model).manager
    uploaded = [c for c in manager.chunks if c.trainable and c.shard_on_device and not c.optim_on_device]
    steps = []
    for step in range(STEPS):
        hf_elixir.reset_memory_stats(model)
        model(**batch("gpt2", step, ROWS)).loss.backward()
        opt.step()
        opt.zero_grad()
        stats = hf_elixir.memory_stats(model)
        steps.append({k: stats[k] for k in ("step_h2d_bytes", "device_peak_bytes", "step_num_refreshes_ahead")})
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"state": state, "steps": steps, "uploaded": uploaded, "same_pass": opt.num_same_pass_steps}


def _reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch: fp32 masters stepped by AdamW, a bf16 model cast from them after every step."""
    _, model = low_precision_reference(STEPS, ROWS, torch.bfloat16)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("staging_numel", [chunk_module.REFRESH_STAGING_NUMEL, 1000])
def test_host_and_device_cast_train_identical_parameters(staging_numel, monkeypatch):
    """bf16 compute, host optimizer: the device cast (through the whole shard at once, or in blocks of 1000
    elements with a partial last one) gives bitwise the parameters of the host cast, both as plain PyTorch to
    bf16 rounding; one upload per uploaded chunk and step either way."""
    monkeypatch.setattr(chunk_module, "REFRESH_STAGING_NUMEL", staging_numel)
    host, device = _train("host"), _train("device")
    assert host["uploaded"] and len(host["uploaded"]) == len(device["uploaded"])
    for run in (host, device):
        assert [s["step_num_refreshes_ahead"] for s in run["steps"]] == [len(run["uploaded"])] * STEPS
    assert host["same_pass"] > 0 and device["same_pass"] == 0  # the device side casts nothing on the host
    assert host["state"].keys() == device["state"].keys()
    differing = [k for k in host["state"] if not torch.equal(host["state"][k], device["state"][k])]
    assert not differing, differing
    assert rel_l2(device["state"], _reference()) < 2e-2


def _hardware(host_adam: float, h2d: float, kind: str = "cpu", onload_fixed_s: float = 0.0) -> HardwareProfile:
    return HardwareProfile(onload_fixed_s=onload_fixed_s, device_kind=kind, device_name="test",
                           device_total_bytes=16 * GIB,
                           device_free_bytes=16 * GIB, host_total_bytes=128 * GIB, host_available_bytes=128 * GIB,
                           h2d_bytes_per_s=h2d, d2h_bytes_per_s=h2d, allgather_bytes_per_s=50e9,
                           reduce_scatter_bytes_per_s=50e9, host_adam_numel_per_s=host_adam,
                           device_adam_numel_per_s=4e10, device_flops_per_s=500e12, device_fp32_flops_per_s=50e12,
                           can_overlap=kind == "cuda")


def _step():
    profile = profile_step(tiny_model("gpt2"), batch("gpt2", 0, ROWS), repeats=1, count_flops=True)
    return build_chunked_step(profile, CHUNK, world_size=1, precision="bf16", hardware=_hardware(1e9, 1e10))


def _all_resident(step, cast: str) -> Knobs:
    everything = frozenset(range(step.num_chunks))
    return Knobs(resident=everything, device_shard=everything, refresh_cast=cast)


def test_h2d_bytes_and_device_peak_are_what_the_cost_model_prices():
    """Per step, ``step_h2d_bytes`` equals ``Prediction.h2d_bytes`` for both sides (the device side twice the
    host's at bf16), and the device side's peak is the host side's plus the one fp32 staging buffer the cost
    model adds to the fixed device bytes; both runs stay within a budget that has room for it."""
    step = _step()
    preds = {cast: predict(step, _all_resident(step, cast), _hardware(1e9, 1e10), pool_bytes=GIB)
             for cast in ("host", "device")}
    staging = refresh_staging_bytes(step, _all_resident(step, "device"))
    assert staging == 4 * min(max(step.shard_numel(c) for c in range(step.num_chunks)),
                              chunk_module.REFRESH_STAGING_NUMEL) > 0
    fixed = {cast: fixed_memory(step, _all_resident(step, cast))[0] for cast in preds}
    assert fixed["device"] - fixed["host"] == staging
    assert preds["device"].device_peak_bytes - preds["host"].device_peak_bytes == staging
    assert preds["device"].h2d_bytes == 2 * preds["host"].h2d_bytes > 0
    runs = {cast: _train(cast) for cast in preds}
    for cast, run in runs.items():
        assert len(run["uploaded"]) == sum(1 for c in range(step.num_chunks) if step.trained_numels[c])
        assert {s["step_h2d_bytes"] for s in run["steps"]} == {preds[cast].h2d_bytes}, cast
    peaks = {cast: run["steps"][-1]["device_peak_bytes"] for cast, run in runs.items()}
    assert peaks["device"] - peaks["host"] == staging
    budget = peaks["device"]
    assert _train("device", budget=budget)["steps"][-1]["device_peak_bytes"] <= budget


def test_device_staging_is_charged_to_the_budget():
    """A budget that holds the host side's peak but not the staging buffer on top refuses the device side."""
    peak = _train("host")["steps"][-1]["device_peak_bytes"]
    _train("host", budget=peak)
    with pytest.raises(DeviceBudgetExceededError, match="device memory budget exceeded"):
        _train("device", budget=peak)


def test_plan_validates_and_round_trips_refresh_cast(tmp_path):
    with pytest.raises(ValueError, match=r"ElixirPlan.refresh_cast='gpu' must be one of \('host', 'device'\)"):
        ElixirPlan(precision="bf16", refresh_cast="gpu")
    with pytest.raises(ValueError, match="refresh_cast='device' with precision='fp32'.*use refresh_cast='host'"):
        ElixirPlan(precision="fp32", refresh_cast="device")
    with pytest.raises(TypeError, match="refresh_cast=1 has type int"):
        ElixirPlan(precision="bf16", refresh_cast=1)
    plan = ElixirPlan(precision="bf16", refresh_cast="device", chunk_size_numel=CHUNK)
    for name in ("plan.yaml", "plan.json"):
        plan.save(tmp_path / name)
        assert ElixirPlan.load(tmp_path / name) == plan
    old = plan.to_dict()
    del old["refresh_cast"]  # a plan written before the field
    assert ElixirPlan.from_dict(old).refresh_cast == "host"


def _searched(hardware: HardwareProfile, precision: str = "bf16"):
    """Search the tiny GPT-2 (model data only in the budget) with a budget that holds every chunk resident and
    the device staging buffer, but no chunk's optimizer states (``16 * CHUNK`` bytes each, four times the
    staging buffer), so that every trained chunk's refresh is an upload."""
    profile = profile_step(tiny_model("gpt2"), batch("gpt2", 0, ROWS), repeats=1, count_flops=True)
    step = build_chunked_step(profile, CHUNK, world_size=1, precision=precision, hardware=hardware)
    params = sum(step.full_bytes(c) for c in range(step.num_chunks))
    budget = int((params + step.grad_peak_bytes + 6 * CHUNK) / 0.95)
    return search(profile, hardware, precision=precision, device_memory_budget_bytes=budget,
                  chunk_size_numel=CHUNK, activations_on_device=False, activation_checkpointing=False)


def test_search_casts_on_the_device_when_the_host_is_slow_and_pcie_fast():
    """A slow host (its cast lengthens the host lane past backward) and a fast bus: the device side wins; a
    fast host and a slow bus (the fp32 upload no longer hides under the forward): the host side wins. Both
    sides are priced in the same search; fp32 offers only the host side. (A 10 ms cost per onload keeps every
    chunk resident.)"""
    slow_host = _searched(_hardware(host_adam=1e6, h2d=1e11, kind="cuda", onload_fixed_s=1e-2))
    assert slow_host.plan.refresh_cast == "device", slow_host.best.summary()
    assert "refresh cast on the device" in " ".join(slow_host.plan.reasons)
    assert slow_host.best.prediction.breakdown["refresh_staging"] > 0
    slow_bus = _searched(_hardware(host_adam=1e12, h2d=1e6, kind="cuda", onload_fixed_s=1e-2))
    assert slow_bus.plan.refresh_cast == "host", slow_bus.best.summary()
    assert slow_bus.best.prediction.breakdown["refresh_staging"] == 0
    # the same knobs priced both ways: the chosen side is the faster one
    for result, hardware in ((slow_host, _hardware(1e6, 1e11, "cuda", 1e-2)),
                             (slow_bus, _hardware(1e12, 1e6, "cuda", 1e-2))):
        step = build_chunked_step(result.profile, CHUNK, world_size=1, precision="bf16", hardware=hardware)
        knobs = result.best.knobs
        other = dataclasses.replace(knobs, refresh_cast="host" if knobs.refresh_cast == "device" else "device")
        times = [predict(step, k, hardware, pool_bytes=GIB, activations_on_device=False).step_s for k in (knobs, other)]
        assert times[0] < times[1], (knobs.refresh_cast, times)
    fp32 = _searched(_hardware(host_adam=1e6, h2d=1e11, kind="cuda", onload_fixed_s=1e-2), precision="fp32")
    assert fp32.plan.refresh_cast == "host"
    assert all(c.knobs.refresh_cast == "host" for c in [fp32.best, *fp32.alternatives])
