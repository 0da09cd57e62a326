"""``ElixirConfig.reduce_dtype`` reaches the search: gradient buffers and their reduces are priced at the dtype the
runtime will use (``None``: the compute precision, as FSDP2 and DeepSpeed reduce bf16 gradients in bf16), the plan
records it, and ``prepare`` refuses a searched plan under another ``reduce_dtype``."""

import dataclasses

import pytest
import torch

import hf_elixir
from hf_elixir import ElixirConfig
from hf_elixir.cli import main
from hf_elixir.plan import ElixirPlan
from hf_elixir.profiler import profile_step
from hf_elixir.search import brute_force_grid, search
from hf_elixir.search._cost import build_chunked_step, predict

from _models import batch, fixed_cpu_hardware, fixed_times, tiny_model

CHUNK = 16384


@pytest.fixture(scope="module")
def profile():
    return fixed_times(profile_step(tiny_model("gpt2"), batch("gpt2", 0, 4, 16)))


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_grid_prices_compute_dtype_reduces_at_half_the_bytes(profile):
    hardware = fixed_cpu_hardware()
    budget = 4 * _numel(tiny_model("gpt2")) * 4
    grids = {dtype: {dataclasses.replace(c.knobs, cache_blocks=0): c.prediction for c in brute_force_grid(
        profile, hardware, world_size=2, precision="bf16", device_memory_budget_bytes=budget, chunk_size_numel=CHUNK,
        reduce_dtype=dtype)} for dtype in ("fp32", None)}
    common = set(grids["fp32"]) & set(grids[None])
    assert common
    for knobs in common:
        fp32, bf16 = grids["fp32"][knobs], grids[None][knobs]
        assert fp32.reduce_scatter_bytes == 2 * bf16.reduce_scatter_bytes > 0


def test_search_records_and_prices_the_reduce_dtype(profile):
    hardware = fixed_cpu_hardware()
    budget = 2 * _numel(tiny_model("gpt2")) * 2
    result = search(profile, hardware, world_size=2, precision="bf16", device_memory_budget_bytes=budget,
                    data_parallel="sharded", reduce_dtype=None)
    best = result.best
    assert result.plan.reduce_dtype is None
    # the searched candidate's prediction is the cost model's on a step with 2-byte gradients, not 4-byte ones
    step = build_chunked_step(profile, best.chunk_size_numel, world_size=2, precision="bf16", hardware=hardware,
                              grad_elem_bytes=2, activation_checkpointing=best.activation_checkpointing,
                              activation_policy=best.activation_policy or None)
    again = predict(step, dataclasses.replace(best.knobs, cache_blocks=0), hardware, pool_bytes=budget)
    assert again is not None
    assert again.reduce_scatter_bytes == best.prediction.reduce_scatter_bytes
    assert again.device_peak_bytes == best.prediction.device_peak_bytes
    with pytest.raises(ValueError, match="reduce_dtype='bf16' must be 'fp32' or None"):
        search(profile, hardware, world_size=2, precision="bf16", device_memory_budget_bytes=budget,
               reduce_dtype="bf16")


def test_a_compute_dtype_plan_runs_as_priced_and_refuses_an_fp32_config(profile):
    """A plan searched with ``reduce_dtype=None`` at bf16 runs in its budget with the predicted onloads and model-data
    peak (bf16 gradient buffers, as priced); the same plan under the default ``reduce_dtype="fp32"`` would need
    twice the gradient bytes: ``prepare`` raises, naming both values and the fix."""
    model = tiny_model("gpt2")
    budget = int(_numel(model) * 2 * 0.9)
    result = search(profile, fixed_cpu_hardware(), precision="bf16", device_memory_budget_bytes=budget,
                    reduce_dtype=None)
    plan, pred = result.plan, result.best.prediction
    assert plan.reduce_dtype is None and pred.onloads > 0  # a plan that offloads: the budget binds
    config = dict(plan=plan, precision="bf16", device_memory_budget_bytes=budget, budget_covers_activations=False)
    with pytest.raises(ValueError, match=r"searched with reduce_dtype=None .* ElixirConfig.reduce_dtype='fp32'"):
        hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ElixirConfig(**config))
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   ElixirConfig(reduce_dtype=None, **config))
    for step in range(3):
        hf_elixir.reset_memory_stats(model) if step == 2 else None
        model(**batch("gpt2", step, 4, 16)).loss.backward()
        opt.step()
        opt.zero_grad()
    stats = hf_elixir.memory_stats(model)
    assert stats["device_peak_bytes"] <= budget
    assert stats["step_num_onloads"] == pred.onloads
    assert abs(stats["device_peak_bytes"] - pred.device_peak_bytes) <= 0.05 * pred.device_peak_bytes


def test_plan_command_reduce_dtype_flag(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "gpt2", "--num-gpus", "2", "--gpu-memory", "2GiB", "--seq-len", "64",
                 "--reduce-dtype", "compute", "--output", str(out)]) == 0
    assert ElixirPlan.load(out).reduce_dtype is None
    assert main(["plan", "--model", "gpt2", "--num-gpus", "2", "--gpu-memory", "2GiB", "--seq-len", "64",
                 "--output", str(out)]) == 0
    assert ElixirPlan.load(out).reduce_dtype == "fp32"


def test_an_older_plan_file_loads_as_fp32(tmp_path):
    import json

    values = ElixirPlan(model_type="gpt2").to_dict()
    del values["reduce_dtype"]
    values["format_version"] = 2
    path = tmp_path / "old.json"
    path.write_text(json.dumps(values))
    assert ElixirPlan.load(path).reduce_dtype == "fp32"
