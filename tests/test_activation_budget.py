"""An explicit ``device_memory_budget_bytes`` covers the whole device by default: activations and autograd's
temporaries are charged against it, not only model data ([Note: activations in the budget] in
hf_elixir/chunk/memory.py). Chunks are evicted to make room for activations, a step that
cannot fit raises naming activations, placement keeps a plan's activation bytes out of the budget, and
``budget_covers_activations=False`` keeps the model-data-only meaning. Every run is checked against plain
PyTorch and against the pool's measured total peak (``device_total_peak_bytes``: model data plus the real
storages autograd saved)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_elixir
from hf_elixir import ElixirConfig, ElixirPlan
from hf_elixir.chunk.memory import DeviceBudgetExceededError
from tests._models import batch, rel_l2, tiny_model

CHUNK = 4096
# offloaded optimizer states are updated by the host optimizer (fused CPU AdamW): a few ulps from torch's
TOL = 1e-5
ROWS, SEQ, STEPS = 1, 4, 3


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _measured() -> dict[str, int]:
    """One step at no budget: the model-data peak with every chunk resident, the activation peak the pool
    measures, and the largest parameter's gradient (the temporary autograd holds before it lands in its
    chunk)."""
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, _opt(model), ElixirConfig(chunk_size_numel=CHUNK))
    model(**batch("gpt2", 0, ROWS, SEQ)).loss.backward()
    opt.step()
    stats = hf_elixir.memory_stats(model)
    largest_grad = max(p.numel() for p in model.parameters()) * 4
    return {"resident": stats["device_peak_bytes"], "activations": stats["activation_peak_bytes"],
            "temporaries": largest_grad}


def _reference() -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2")
    opt = _opt(model)
    for step in range(STEPS):
        model(**batch("gpt2", step, ROWS, SEQ)).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(config: ElixirConfig, rows: int = ROWS):
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, _opt(model), config)
    peaks = []
    for step in range(STEPS):
        model(**batch("gpt2", step, rows, SEQ)).loss.backward()
        opt.step()
        opt.zero_grad()
        peaks.append(hf_elixir.memory_stats(model)["device_total_peak_bytes"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, state, peaks


@pytest.fixture(scope="module")
def measured():
    return _measured()


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _tight_budget(measured) -> int:
    """Less than every chunk resident (so placement offloads and caches), more than the model-data floor plus
    twice the activations and temporaries (placement, not told of them, keeps half of what the floor leaves
    for shards on the device and the rest as cache): the cache fills the budget with model data unless
    activations evict it."""
    floor = hf_elixir.min_device_budget_bytes(tiny_model("gpt2"), _opt(tiny_model("gpt2")),
                                              ElixirConfig(chunk_size_numel=CHUNK))
    budget = floor + 2 * (measured["activations"] + measured["temporaries"]) + CHUNK * 4
    assert budget < measured["resident"], "the budget must not hold every chunk resident"
    return budget


def test_explicit_budget_evicts_chunks_for_activations_and_keeps_the_total_within_it(measured, reference):
    budget = _tight_budget(measured)
    model, state, peaks = _train(ElixirConfig(chunk_size_numel=CHUNK, device_memory_budget_bytes=budget))
    stats = hf_elixir.memory_stats(model)
    assert stats["activation_peak_bytes"] == measured["activations"]
    # model data, activations and temporaries together never passed the budget, at any step
    assert max(peaks) <= budget, f"total peaks {peaks} above the budget {budget}"
    assert stats["num_evictions"] > 0
    assert rel_l2(state, reference) < TOL


def test_model_data_only_budget_keeps_the_old_meaning(measured, reference):
    """``budget_covers_activations=False``: the same budget bounds model data only; activations are measured
    on top of it (the caller left their room outside it)."""
    budget = _tight_budget(measured)
    model, state, peaks = _train(ElixirConfig(chunk_size_numel=CHUNK, device_memory_budget_bytes=budget,
                                              budget_covers_activations=False))
    stats = hf_elixir.memory_stats(model)
    assert stats["device_peak_bytes"] <= budget
    assert max(peaks) > budget, "activations are not charged: model data alone fills the budget's cache"
    assert stats["activation_peak_bytes"] == measured["activations"]
    assert rel_l2(state, reference) < TOL


def test_activations_that_cannot_fit_raise_naming_them_and_the_fixes(measured):
    budget = _tight_budget(measured)
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, _opt(model), ElixirConfig(chunk_size_numel=CHUNK,
                                                                    device_memory_budget_bytes=budget))
    with pytest.raises(DeviceBudgetExceededError) as info:
        model(**batch("gpt2", 0, 16 * ROWS, SEQ)).loss.backward()
    message = str(info.value)
    assert "activations do not fit the device budget" in message
    assert f"device_memory_budget_bytes={budget}" in message
    assert "gradient_checkpointing_enable" in message and "smaller batch" in message
    assert "budget_covers_activations=False" in message
    assert "search='auto'" in message and "part-way through the forward" in message  # not a final figure


def test_floor_with_activations_is_exact_and_the_plan_reserves_them(measured, reference):
    """``min_device_budget_bytes(activation_bytes=A)`` is the model-data floor plus ``A``; ``prepare`` with a
    plan carrying ``activation_peak_bytes=A`` places chunks in the budget less ``A``: it refuses one byte
    less (naming the activations) and trains at exactly that budget, within it, as plain PyTorch does."""
    room = measured["activations"] + measured["temporaries"]
    config = ElixirConfig(chunk_size_numel=CHUNK, plan=ElixirPlan(model_type="gpt2", activation_peak_bytes=room))
    floor = hf_elixir.min_device_budget_bytes(tiny_model("gpt2"), _opt(tiny_model("gpt2")),
                                              dataclasses.replace(config, plan=None))
    need = hf_elixir.min_device_budget_bytes(tiny_model("gpt2"), _opt(tiny_model("gpt2")), config,
                                             activation_bytes=room)
    assert need == floor + room
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match=f"plus {room} bytes of activations.* needs {need} bytes"):
        hf_elixir.prepare(model, _opt(model), dataclasses.replace(config, device_memory_budget_bytes=need - 1))
    model, state, peaks = _train(dataclasses.replace(config, device_memory_budget_bytes=need))
    assert max(peaks) <= need, f"total peaks {peaks} above the budget {need}"
    assert hf_elixir.get_state(model).plan.activation_peak_bytes == room
    assert rel_l2(state, reference) < TOL
    # a batch larger than the one the plan measured: the error says the reserve came from the plan (search again
    # with the largest batch), not "search='auto'", which is how such a plan is made
    with pytest.raises(DeviceBudgetExceededError) as info:
        model(**batch("gpt2", 0, 16 * ROWS, SEQ)).loss.backward()
    message = str(info.value)
    assert f"placement kept {room} bytes of the budget for activations" in message, message
    assert "largest batch" in message and "search='auto'" not in message, message
    # the model-data-only meaning ignores the plan's activations: the floor is the model data's
    opt_out = dataclasses.replace(config, budget_covers_activations=False)
    assert hf_elixir.min_device_budget_bytes(tiny_model("gpt2"), _opt(tiny_model("gpt2")), opt_out,
                                             activation_bytes=room) == floor
    model = tiny_model("gpt2")
    hf_elixir.prepare(model, _opt(model), dataclasses.replace(opt_out, device_memory_budget_bytes=floor))


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_plan_round_trip_carries_activation_bytes(tmp_path, suffix):
    plan = ElixirPlan(model_type="gpt2", chunk_size_numel=CHUNK, activation_peak_bytes=123_456)
    path = tmp_path / f"plan{suffix}"
    plan.save(path)
    loaded = ElixirPlan.load(path)
    assert loaded.activation_peak_bytes == 123_456 and loaded == plan
    assert loaded.format_version == 3


def test_a_version_1_plan_file_loads_without_activation_bytes(tmp_path):
    import json

    values = ElixirPlan(model_type="gpt2").to_dict()
    del values["activation_peak_bytes"]
    values["format_version"] = 1
    path = tmp_path / "old.json"
    path.write_text(json.dumps(values))
    loaded = ElixirPlan.load(path)
    assert loaded.activation_peak_bytes is None and loaded.format_version == 1
