"""Forward all-gathers issued ahead under a pool that charges activations ([Note: overlap] in
``hf_elixir/search/_cost.py``; [Note: gather prefetch] in ``hf_elixir/chunk/_prefetch.py``).

At several ranks a whole-device budget (``activations_on_device``) makes the runtime keep a rank-local host copy
of every offloadable chunk (``host_copies_forced``). In training the ranks then agree at each optimizer step on
the chunks each had room for, and from the third step on issue the forward all-gathers ``prefetch_depth`` events
ahead, evicting what the hooks would: the cost model prices them ahead (forward only; backward refills are local
copies), with the same memory figures as prefetch depth 0. MoE-expert models and inference keep them in the hooks.
"""

from __future__ import annotations

import dataclasses

import pytest

from hf_elixir.profiler import HardwareProfile, profile_step
from hf_elixir.search import search
from hf_elixir.search._cost import Knobs, build_chunked_step, host_copies_forced, predict
from tests._models import batch, tiny_model

GIB = 2**30
CHUNK = 4096
WS = 2


def _gpu() -> HardwareProfile:
    """Ballpark PCIe-4 rates, two ranks; the overlap rules, not the rates, are under test."""
    return HardwareProfile(device_kind="cuda", device_name="test-gpu", device_total_bytes=16 * GIB,
                           device_free_bytes=16 * GIB, host_total_bytes=128 * GIB, host_available_bytes=128 * GIB,
                           h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, allgather_bytes_per_s=5e9,
                           reduce_scatter_bytes_per_s=5e9, host_adam_numel_per_s=1e9, device_adam_numel_per_s=4e10,
                           device_flops_per_s=1e11, device_fp32_flops_per_s=1e11, can_overlap=True, world_size=WS)


@pytest.fixture(scope="module")
def profiles():
    """A tiny GPT-2 profiled for training and for inference on the CPU, FLOPs counted (priced at the test GPU's
    rate)."""
    sample = batch("gpt2", 0, 2, seq=8)
    train = profile_step(tiny_model("gpt2"), sample, count_flops=True)
    infer = profile_step(tiny_model("gpt2"), {"input_ids": sample["input_ids"]}, forward_only=True, count_flops=True)
    return train, infer


def _pools(step) -> dict[str, int]:
    """A pool holding every chunk, and one holding about half of them (chunks evicted and refilled in the step)."""
    total = sum(step.full_bytes(c) for c in range(step.num_chunks))
    tight = total // 2 + step.grad_peak_bytes + 2 * max(step.full_bytes(c) for c in range(step.num_chunks))
    return {"roomy": GIB, "tight": tight}


def _memory(pred) -> tuple:
    return (pred.device_model_bytes, pred.device_peak_bytes, pred.onloads, pred.allgather_bytes, pred.h2d_bytes,
            pred.d2h_bytes, pred.host_bytes, dict(pred.chunk_onloads))


def test_training_under_an_activation_pool_prices_forward_gathers_ahead(profiles):
    hw = _gpu()
    step = build_chunked_step(profiles[0], CHUNK, world_size=WS, precision="fp32", hardware=hw)
    assert step.num_chunks > 2 and step.gather_prefetch and host_copies_forced(step, True)
    for name, pool in _pools(step).items():
        serial = predict(step, Knobs(prefetch_depth=0), hw, pool_bytes=pool, activations_on_device=True)
        for depth in (1, 2):
            ahead = predict(step, Knobs(prefetch_depth=depth), hw, pool_bytes=pool, activations_on_device=True)
            assert serial is not None and ahead is not None, name
            assert serial.gathers_ahead == {}, (name, serial.gathers_ahead)
            assert ahead.gathers_ahead.get("fwd", 0) > 0, (name, depth, ahead.gathers_ahead)
            assert "bwd" not in ahead.gathers_ahead, (name, depth, ahead.gathers_ahead)
            # only the timing changes: the same gathers, evictions and refills as in the hooks
            assert _memory(ahead) == _memory(serial), (name, depth)
            assert ahead.step_s <= serial.step_s, (name, depth, ahead.step_s, serial.step_s)
            assert ahead.forward_backward_s < serial.forward_backward_s, (name, depth)
        tight = predict(step, Knobs(prefetch_depth=2), hw, pool_bytes=pool, activations_on_device=True)
        if name == "tight":  # the budget binds: refills within the step, local copies of the host copies
            assert tight.onloads > step.num_chunks, tight.onloads
        # the forced copies are what lets them run ahead: the same point with its copies and a model-data pool
        # prices the same gathers ahead in forward
        model_data = predict(step, Knobs(prefetch_depth=2, host_copies=True), hw, pool_bytes=pool)
        assert model_data.gathers_ahead.get("fwd") == tight.gathers_ahead["fwd"], name


def test_moe_and_inference_keep_gathers_in_the_hooks_under_an_activation_pool(profiles):
    hw = _gpu()
    train = build_chunked_step(profiles[0], CHUNK, world_size=WS, precision="fp32", hardware=hw)
    moe = dataclasses.replace(train, gather_prefetch=False)  # what a profile with subtree units builds
    infer = build_chunked_step(profiles[1], CHUNK, world_size=WS, precision="fp32", hardware=hw)
    assert infer.forward_only
    for name, step in (("moe", moe), ("inference", infer)):
        for pool in _pools(step).values():
            serial = predict(step, Knobs(prefetch_depth=0), hw, pool_bytes=pool, activations_on_device=True)
            deep = predict(step, Knobs(prefetch_depth=2), hw, pool_bytes=pool, activations_on_device=True)
            assert deep.gathers_ahead == {}, (name, deep.gathers_ahead)
            assert deep.allgather_bytes == serial.allgather_bytes
    # inference with a model-data pool does issue them ahead (the later forwards): the check above could fail
    pool = _pools(infer)["tight"]
    assert predict(infer, Knobs(prefetch_depth=2), hw, pool_bytes=pool).gathers_ahead.get("fwd", 0) > 0


def test_plan_reasons_say_where_the_gathers_run(profiles):
    """A dense training plan under a budget covering activations says its forward gathers go ahead from the third
    step on; an inference plan and an MoE (Switch) plan say they wait in their hooks."""
    hw = _gpu()
    moe = profile_step(tiny_model("switch"), batch("switch", 0, 2, seq=8), count_flops=True)
    assert moe.subtree_units
    reasons = {}
    for name, profile in (("train", profiles[0]), ("infer", profiles[1]), ("moe", moe)):
        result = search(profile, hw, world_size=WS, device_memory_budget_bytes=int(profile.num_params * 4 * 3),
                        data_parallel="sharded", activations_on_device=True, precision="fp32", prefetch_depths=(2,),
                        chunk_size_numel=CHUNK)
        assert name == "train" or result.best.prediction.gathers_ahead == {}, name
        reasons[name] = result.plan.reasons
    assert any("forward all-gathers are issued ahead (2 events) from the third step on" in r
               and "each rank votes, per chunk, whether it had room in the previous step" in r
               for r in reasons["train"]), reasons["train"]
    assert not any("not issued ahead" in r for r in reasons["train"])
    assert any("all-gathers are not issued ahead" in r and "inference" in r and "wait" in r
               for r in reasons["infer"]), reasons["infer"]
    assert any("all-gathers are not issued ahead: MoE-expert chunks" in r and "waits in its hook" in r
               for r in reasons["moe"]), reasons["moe"]
    assert not any("issued ahead from the third step" in r for r in reasons["moe"] + reasons["infer"])
