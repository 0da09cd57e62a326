"""The planner's speed-ups change no number: the replay that takes quiet events a span at a time ([Note: quiet
spans] in ``hf_elixir/search/_quiet_spans.py``) prices every point a search prices exactly as the event-by-event
replay does (same floats, same counts, same recorded step description), on dense and MoE steps, one rank and
several, CUDA and CPU rates, training and inference, recomputed and offloaded blocks. Pure arithmetic on meta
profiles."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_elixir.chunk.schedule import EventRecorder
from hf_elixir.profiler import HardwareProfile, profile_step
from hf_elixir.profiler._gpu_presets import preset_hardware
from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch
from hf_elixir.search import _cost, _grid, _quiet_spans, _refine, search
from hf_elixir.search._quiet_spans import quiet_events
from hf_elixir.search._replay import StepReplay, _NoRoom

GIB = 2**30


def _h100(world_size: int) -> HardwareProfile:
    base = HardwareProfile(hostname="test", host_total_bytes=64 * GIB, host_available_bytes=64 * GIB,
                           host_adam_numel_per_s=1.5e9, hook_event_s=2e-5, onload_fixed_s=1e-4, optim_tensor_s=5e-6)
    return preset_hardware("h100", base, world_size=world_size)


def _cpu() -> HardwareProfile:
    return HardwareProfile(device_kind="cpu", device_name="cpu", device_total_bytes=GIB, device_free_bytes=GIB,
                           host_total_bytes=64 * GIB, host_available_bytes=64 * GIB, h2d_bytes_per_s=8e9,
                           d2h_bytes_per_s=8e9, host_adam_numel_per_s=1e9, device_adam_numel_per_s=1e9,
                           device_flops_per_s=1e11, can_overlap=False)


def _profile(name: str, seq: int, forward_only: bool = False):
    model, batch = meta_model_and_batch(load_config(name), batch_size=1, seq_len=seq, dtype=torch.bfloat16)
    return profile_step(model, batch, device="meta", forward_only=forward_only)


@pytest.fixture(scope="module")
def gpt2():
    return _profile("gpt2", 256)


CASES = {  # name -> (profile fixture or model name, hardware, search keyword arguments)
    "gpt2-one-gpu": ("gpt2", lambda: _h100(1), dict(world_size=1, device_memory_budget_bytes=GIB)),
    "gpt2-two-gpus": ("gpt2", lambda: _h100(2), dict(world_size=2, device_memory_budget_bytes=GIB // 2)),
    "gpt2-offload": ("gpt2", lambda: _h100(1), dict(world_size=1, device_memory_budget_bytes=GIB,
                                                    activation_policy={"transformer.h.0": "offload",
                                                                       "transformer.h.1": "recompute"})),
    "gpt2-cpu-two-ranks": ("gpt2", _cpu, dict(world_size=2, device_memory_budget_bytes=GIB // 2)),
    "gpt2-inference": ("gpt2-infer", lambda: _h100(2), dict(world_size=2, device_memory_budget_bytes=GIB // 3,
                                                             activations_on_device=False)),
    "switch-expert-parallel": ("switch-base-8", lambda: _h100(2),
                               dict(world_size=2, expert_parallel_size=2, device_memory_budget_bytes=GIB)),
}


def _replay_state(step, knobs, hw, spans: bool, pool_bytes=None, activations_on_device=False,
                  host_budget_bytes=None, overlap_host_optimizer=None) -> dict:
    """Everything a replay holds once it has run (its clocks, counters, pool, per-chunk recency and next uses, the
    early uploads), or ``None`` where the step does not fit."""
    replay = StepReplay(step, knobs, hw, pool_bytes=pool_bytes, activations_on_device=activations_on_device,
                        timeline=False, overlap_host_optimizer=overlap_host_optimizer,
                        host_budget_bytes=host_budget_bytes, recorder=None, refresh_prev=None, spans=spans)
    try:
        replay.run()
    except _NoRoom:
        return None
    state = dict(vars(replay))
    del state["spans"]
    return state


UPLOADS_IN_SPANS = {"gpt2-one-gpu", "gpt2-two-gpus", "gpt2-offload", "switch-expert-parallel"}


@pytest.mark.parametrize("case", list(CASES))
def test_spans_price_every_point_as_event_by_event(case, gpt2, monkeypatch):
    name, hardware, kwargs = CASES[case]
    if name == "gpt2":
        profile = gpt2
    else:
        profile = _profile("gpt2", 256, forward_only=True) if name == "gpt2-infer" else _profile(name, 64)
    priced, quiet_seen = [], []

    def both(step, knobs, hw, **kw):
        assert _replay_state(step, knobs, hw, True, **kw) == _replay_state(step, knobs, hw, False, **kw), knobs
        fast = _cost.predict(step, knobs, hw, **kw)
        slow = _cost.predict(step, knobs, hw, _spans=False, **kw)
        assert (fast is None) == (slow is None), knobs
        if fast is not None:
            assert dataclasses.asdict(fast) == dataclasses.asdict(slow), knobs
        priced.append(fast)
        quiet_seen.append(sum(quiet_events(step)) / len(step.groups))
        return fast

    uploads = []
    real = _quiet_spans._span_uploads
    monkeypatch.setattr(_quiet_spans, "_span_uploads", lambda replay, *a: uploads.append(1) or real(replay, *a))
    monkeypatch.setattr(_grid, "predict", both)
    monkeypatch.setattr(_refine, "predict", both)
    result = search(profile, hardware(), precision="bf16", num_chunk_sizes=1, grid_points=4, refine_starts=2,
                    refine_max_priced=40, **kwargs)
    assert result.best is not None and len(priced) >= 10
    assert any(p is not None and p.onloads for p in priced), "no point fills a chunk: the spans were not tested"
    assert max(quiet_seen) > 0.5, "most events of a step are quiet"
    # backward spans with early refresh uploads queued (the host lane on CUDA, [Note: early refresh pricing])
    assert bool(uploads) == (case in UPLOADS_IN_SPANS), len(uploads)


def test_spans_record_the_same_step_description(gpt2):
    """The events the replay records (fills, evictions, reduces at their places: what the runtime executes) are the
    same taken a span at a time, on points that evict and refill."""
    hw = _h100(2)
    result = search(gpt2, hw, world_size=2, precision="bf16", device_memory_budget_bytes=GIB // 2,
                    num_chunk_sizes=1, grid_points=4, refine_starts=0, max_alternatives=8)
    step = _cost.build_chunked_step(gpt2, result.best.chunk_size_numel, world_size=2, precision="bf16", hardware=hw,
                                    activation_policy=result.best.activation_policy or None)
    checked = 0
    for cand in [result.best] + result.alternatives:
        if cand.chunk_size_numel != step.chunk_size_numel or cand.activation_policy != step.activation_policy:
            continue
        fast, slow = EventRecorder(), EventRecorder()
        kw = dict(pool_bytes=GIB // 2, activations_on_device=True)
        a = _cost.predict(step, cand.knobs, hw, recorder=fast, **kw)
        b = _cost.predict(step, cand.knobs, hw, recorder=slow, _spans=False, **kw)
        assert dataclasses.asdict(a) == dataclasses.asdict(b)
        assert fast.events == slow.events and fast.events
        checked += 1
    assert checked >= 2
