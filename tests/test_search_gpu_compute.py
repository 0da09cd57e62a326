"""The search prices compute on another device than the profiled one: counted FLOPs at
the device's rate; and the cost model overlaps only what the runtime overlaps ([Note: overlap] in
``hf_elixir/search/_cost.py``)."""

import copy
from dataclasses import replace

import pytest
from torch.utils.flop_counter import FlopCounterMode

from hf_elixir.profiler import HardwareProfile, profile_step
from hf_elixir.search import build_chunked_step, predict, search
from hf_elixir.search._cost import SAME_PASS_CAST_FRACTION, Knobs, _refresh_times
from tests._models import batch, tiny_model

GIB = 2**30
BF16_RATE = 500e12
FP32_RATE = 50e12


def _gpu(world_size: int = 1) -> HardwareProfile:
    return HardwareProfile(device_kind="cuda", device_name="test-gpu", device_total_bytes=16 * GIB,
                           device_free_bytes=16 * GIB, host_total_bytes=128 * GIB, host_available_bytes=128 * GIB,
                           h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, allgather_bytes_per_s=50e9,
                           reduce_scatter_bytes_per_s=50e9, host_adam_numel_per_s=1e9, device_adam_numel_per_s=4e10,
                           device_flops_per_s=BF16_RATE, device_fp32_flops_per_s=FP32_RATE, can_overlap=True,
                           world_size=world_size)


def _counted_flops(model, sample) -> float:
    """FLOPs of one plain forward + backward, counted independently of the profiler."""
    probe = copy.deepcopy(model)
    with FlopCounterMode(display=False) as counter:
        probe(**sample).loss.backward()
    return float(counter.get_total_flops())


@pytest.mark.parametrize("precision, rate", [("fp32", FP32_RATE), ("bf16", BF16_RATE)])
def test_cpu_profile_priced_for_a_gpu_takes_counted_flops_at_the_device_rate(precision, rate):
    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 4, seq=16)
    flops = _counted_flops(model, sample)
    assert flops > 0
    result = search(model, _gpu(), sample_batch=sample, precision=precision, device_memory_budget_bytes=GIB)
    profile = result.profile
    assert profile.device == "cpu" and profile.forward_s > 0  # measured times kept (not spoiled by the counter)
    assert profile.forward_flops + profile.backward_flops == pytest.approx(flops, rel=1e-9)
    # per access unit: every module that runs a matmul got its share
    assert sum(e.flops for e in profile.events) == pytest.approx(flops, rel=1e-9)
    assert any(e.flops > 0 for e in profile.events if e.module.endswith("attn.c_attn"))
    assert result.best.prediction.compute_s == pytest.approx(flops / rate, rel=1e-6)


def test_auto_plan_of_a_model_still_on_the_cpu_for_a_gpu_prices_its_compute():
    from hf_elixir import ElixirConfig
    from hf_elixir.search import auto_plan

    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 4, seq=16)
    flops = _counted_flops(model, sample)
    plan = auto_plan(model, sample, ElixirConfig(device_memory_budget_bytes=GIB, search="auto"), hardware=_gpu())
    # the compute part of the step is the counted FLOPs at the fp32 rate; the rest is hooks, copies, optimizer
    assert plan.predicted_step_s >= flops / FP32_RATE > 0
    compute = [r for r in plan.reasons if r.startswith("predicted step")]
    assert compute and f"compute {flops / FP32_RATE:.4g} s" in compute[0]


def test_profile_without_flops_cannot_be_priced_on_another_device():
    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 2, seq=8)
    profile = profile_step(model, sample, device="cpu")  # timed, no FLOPs counted
    with pytest.raises(ValueError, match="count_flops=True"):
        build_chunked_step(profile, 4096, world_size=1, precision="fp32", hardware=_gpu())


def _step(world_size: int):
    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 2, seq=8)
    profile = profile_step(model, sample, device="cpu", count_flops=True)
    return build_chunked_step(profile, 4096, world_size=world_size, precision="fp32", hardware=_gpu(world_size))


def test_forward_all_gathers_overlap_when_prefetched_and_local_onloads_do():
    """[Note: overlap] / [Note: gather prefetch]: with 2 ranks and no resident chunk every onload is a gather.
    Without prefetch the step pays every gather on the compute stream; with prefetch the forward gathers
    overlap earlier events' compute (on CUDA and off it), and the saving is at most their time. Where the
    runtime keeps gathers in the hooks (a model with subtree units) prefetch depth changes nothing; with a
    whole-device budget (activations on the device, host copies forced) training issues the forward ones ahead
    and refills backward from the host copies, so prefetch saves the same as with a model-data pool and no
    backward gather is priced ahead. With one rank the onloads are host copies, which the copy stream prefetches
    on CUDA."""
    hw = _gpu(2)
    step = _step(2)
    assert step.num_chunks > 2 and step.gather_prefetch
    serial = predict(step, Knobs(prefetch_depth=0), hw, pool_bytes=GIB)
    deep = predict(step, Knobs(prefetch_depth=2), hw, pool_bytes=GIB)
    gathers_s = serial.allgather_bytes / hw.allgather_bytes_per_s
    assert serial.allgather_bytes > 0 and serial.forward_backward_s >= serial.compute_s + gathers_s
    forward_chunks = {c for g, phase in zip(step.groups, step.event_phase) if phase == "fwd" for c in g}
    forward_gathers_s = sum(step.full_bytes(c) for c in forward_chunks) / hw.allgather_bytes_per_s
    assert deep.allgather_bytes == serial.allgather_bytes
    assert 0 < serial.forward_backward_s - deep.forward_backward_s <= forward_gathers_s + 1e-12
    cpu = replace(hw, can_overlap=False, device_kind="cpu")
    assert predict(step, Knobs(prefetch_depth=2), cpu, pool_bytes=GIB).forward_backward_s < \
        predict(step, Knobs(prefetch_depth=0), cpu, pool_bytes=GIB).forward_backward_s
    kept_in_hooks = replace(step, gather_prefetch=False)
    assert predict(kept_in_hooks, Knobs(prefetch_depth=2), hw, pool_bytes=GIB).forward_backward_s == \
        pytest.approx(predict(kept_in_hooks, Knobs(prefetch_depth=0), hw, pool_bytes=GIB).forward_backward_s)
    whole = {d: predict(step, Knobs(prefetch_depth=d), hw, pool_bytes=GIB, activations_on_device=True) for d in (0, 2)}
    assert whole[2].allgather_bytes == whole[0].allgather_bytes and set(whole[2].gathers_ahead) == {"fwd"}
    assert 0 < whole[0].forward_backward_s - whole[2].forward_backward_s <= forward_gathers_s + 1e-12
    one = _step(1)
    budget = sum(one.full_bytes(c) for c in range(one.num_chunks)) // 2 + one.grad_peak_bytes \
        + max(one.full_bytes(c) for c in range(one.num_chunks)) * 2
    plain = predict(one, Knobs(prefetch_depth=0), _gpu(), pool_bytes=budget)
    ahead = predict(one, Knobs(prefetch_depth=2), _gpu(), pool_bytes=budget)
    assert plain.onloads > 0 and ahead.forward_backward_s < plain.forward_backward_s


def test_optimizer_step_is_host_then_device_not_overlapped():
    hw = _gpu()
    step = _step(1)
    trained = [c for c in range(step.num_chunks) if step.trained_numels[c]]
    everything = frozenset(range(step.num_chunks))
    half = frozenset(trained[: len(trained) // 2])
    knobs = Knobs(resident=everything, device_shard=everything, device_optim=half)
    pred = predict(step, knobs, hw, pool_bytes=GIB, overlap_host_optimizer=False)
    host_numel = sum(step.shard_numel(c) for c in trained if c not in half)
    dev_numel = sum(step.shard_numel(c) for c in trained if c in half)
    host_s, dev_s = host_numel / hw.host_adam_numel_per_s, dev_numel / hw.device_adam_numel_per_s
    refresh_s = host_numel * 4 / hw.h2d_bytes_per_s  # host masters refresh the resident compute copies
    assert host_s > 0 and dev_s > 0
    # serial, not max(host_s, dev_s); on CUDA the uploads refreshing the compute copies overlap the next forward
    # ([Note: overlapped refresh]), on the CPU they are part of the serial step
    assert pred.optimizer_s == pytest.approx(host_s + dev_s)
    cpu = replace(hw, can_overlap=False, device_kind="cpu")
    assert predict(step, knobs, cpu, pool_bytes=GIB, overlap_host_optimizer=False).optimizer_s == \
        pytest.approx(host_s + dev_s + refresh_s)


def test_reduce_of_device_optimizer_chunks_runs_on_the_reduce_stream():
    """[Note: reduce overlap]: on CUDA a device-optimizer chunk's reduce-scatter overlaps the rest of
    backward; a host-optimizer chunk's stays on the compute stream, its device->host copy goes to the offload
    stream ([Note: gradient offload])."""
    step = _step(2)
    everything = frozenset(range(step.num_chunks))
    knobs = Knobs(resident=everything, device_shard=everything, device_optim=everything)
    cuda = predict(step, knobs, _gpu(2), pool_bytes=GIB)
    serial = predict(step, knobs, replace(_gpu(2), can_overlap=False), pool_bytes=GIB)
    assert cuda.reduce_scatter_bytes > 0 and cuda.forward_backward_s < serial.forward_backward_s
    host = Knobs(resident=everything, device_shard=everything)
    # uploads of the refreshed compute copies are instant here, so the next forward waits for none of them
    # ([Note: overlapped refresh], test_refresh_uploads_overlap_the_next_forward): only the gradient copies differ
    instant_h2d = replace(_gpu(2), h2d_bytes_per_s=1e30)
    on_cuda = predict(step, host, instant_h2d, pool_bytes=GIB)
    serial_host = predict(step, host, replace(instant_h2d, can_overlap=False), pool_bytes=GIB)
    d2h_s = on_cuda.d2h_bytes / _gpu(2).d2h_bytes_per_s
    assert d2h_s > 0
    # the collectives still block the compute stream: only the copies leave it
    assert serial_host.forward_backward_s - d2h_s - 1e-12 <= on_cuda.forward_backward_s < serial_host.forward_backward_s


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_host_optimizer_steps_on_the_lane_during_backward(precision):
    """[Note: host lane]: with ``overlap_host_optimizer`` each host chunk is stepped as soon as its
    gradient is on the host; the optimizer step pays only what the lane has left, and the host holds the
    rollback snapshots (``snapshot_rollback``: an optimizer without an inverse update, e.g. AMSGrad; Adam/AdamW
    keep none, ``tests/test_search_host_lane.py``)."""
    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 2, seq=8)
    # the host step dominates; the compute is slow enough that backward outlasts the lane's snapshot copies
    # (which the lane pays before it steps a chunk), so overlapping the rest with backward wins
    slow_host = replace(_gpu(), host_adam_numel_per_s=1e6, device_flops_per_s=1e8, device_fp32_flops_per_s=1e8)
    step = build_chunked_step(profile_step(model, sample, device="cpu", count_flops=True), 4096, world_size=1,
                              precision=precision, hardware=slow_host, snapshot_rollback=True)
    everything = frozenset(range(step.num_chunks))
    knobs = Knobs(resident=everything, device_shard=everything)  # every optimizer state on the host
    serial = predict(step, knobs, slow_host, pool_bytes=GIB, overlap_host_optimizer=False)
    lane = predict(step, knobs, slow_host, pool_bytes=GIB)
    trained = [c for c in range(step.num_chunks) if step.trained_numels[c]]
    host_numel = sum(step.shard_numel(c) for c in trained)
    host_s = host_numel / slow_host.host_adam_numel_per_s
    assert serial.optimizer_s >= host_s
    assert lane.forward_backward_s == pytest.approx(serial.forward_backward_s)
    # the lane starts at the first reduce: it ends after backward by less than the whole host step
    assert lane.step_s < serial.step_s
    assert lane.step_s >= max(serial.forward_backward_s, host_s)
    per_numel = 4 * (1 + step.optim_states + (precision == "fp16"))
    assert lane.host_bytes == serial.host_bytes and lane.host_snapshot_bytes == per_numel * host_numel
    # snapshots only while the host has room: none, the serial step; some, in between
    tight = predict(step, knobs, slow_host, pool_bytes=GIB, host_budget_bytes=serial.host_bytes)
    assert tight.step_s == pytest.approx(serial.step_s) and tight.host_snapshot_bytes == 0
    half = predict(step, knobs, slow_host, pool_bytes=GIB,
                   host_budget_bytes=serial.host_bytes + lane.host_snapshot_bytes // 2)
    assert 0 < half.host_snapshot_bytes <= lane.host_snapshot_bytes // 2
    # both beat the serial step; more snapshots are not always faster: a chunk reduced at the very end of
    # backward gains nothing from the lane and still pays its snapshot copy
    assert lane.step_s < serial.step_s and half.step_s < serial.step_s


def test_plan_device_tflops_applies_to_fp32_plans_too(monkeypatch):
    """``hf-elixir plan --device-tflops`` gives the target's rate; this machine's measured fp32 rate must not
    replace it for an fp32 plan."""
    from hf_elixir import cli
    from hf_elixir.cli._plan import target_hardware

    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", lambda *a, **k: replace(
        _gpu(), device_kind="cpu", device_flops_per_s=1e11, device_fp32_flops_per_s=1e11))
    args = cli._build_parser().parse_args(["plan", "--model", "gpt2", "--gpu-memory", "40GiB", "--device-tflops", "300"])
    hardware = target_hardware(args)[0]
    assert hardware.flops_rate("fp32") == hardware.flops_rate("bf16") == 300e12


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_copies_within_the_device_are_not_priced_at_the_pcie_rate(precision):
    """Everything resident with its optimizer on the device moves nothing over PCIe: the gradient copies into
    their buffers and the refresh of the compute copies run at the device's memory rate (derived from the
    fused AdamW rate), so the predicted step does not depend on the host<->device bandwidth."""
    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 2, seq=8)
    step = build_chunked_step(profile_step(model, sample, device="cpu", count_flops=True), 4096, world_size=1,
                              precision=precision, hardware=_gpu())
    everything = frozenset(range(step.num_chunks))
    knobs = Knobs(resident=everything, device_shard=everything, device_optim=everything)
    fast = predict(step, knobs, _gpu(), pool_bytes=GIB)
    slow = predict(step, knobs, replace(_gpu(), h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6), pool_bytes=GIB)
    assert fast.h2d_bytes == fast.d2h_bytes == 0
    assert slow.step_s == pytest.approx(fast.step_s, rel=1e-9)


def test_refresh_uploads_overlap_the_next_forward():
    """[Note: overlapped refresh]: bf16 compute copies resident, masters on the host. The step pays the host
    AdamW and the host cast into the staging buffers (in the same pass: the measured fraction of the AdamW), not
    the uploads: on CUDA they run on the copy stream from the start of the next step, in first-use order, and each
    forward event waits for its own chunks' uploads (all of them before backward). On the CPU they stay in the
    serial step."""
    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 2, seq=8)
    step = build_chunked_step(profile_step(model, sample, device="cpu", count_flops=True), 4096, world_size=1,
                              precision="bf16", hardware=_gpu())
    everything = frozenset(range(step.num_chunks))
    knobs = Knobs(resident=everything, device_shard=everything)
    slow_link = replace(_gpu(), h2d_bytes_per_s=1e8)  # the uploads take longer than the forward
    cuda = predict(step, knobs, slow_link, pool_bytes=GIB, overlap_host_optimizer=False, timeline=True)
    cpu = predict(step, knobs, replace(slow_link, can_overlap=False, device_kind="cpu"), pool_bytes=GIB,
                  overlap_host_optimizer=False)
    trained = [c for c in range(step.num_chunks) if step.trained_numels[c]]
    numel = sum(step.shard_numel(c) for c in trained)
    host_s = numel / slow_link.host_adam_numel_per_s
    cast_s = numel / slow_link.host_adam_numel_per_s * SAME_PASS_CAST_FRACTION  # [Note: same-pass host step]
    upload = {c: step.shard_numel(c) * 2 / slow_link.h2d_bytes_per_s for c in trained}
    assert cuda.h2d_bytes == cpu.h2d_bytes == numel * 2
    assert cuda.optimizer_s == pytest.approx(host_s + cast_s)
    assert cpu.optimizer_s == pytest.approx(host_s + cast_s + sum(upload.values()))
    done = _refresh_times(step, upload)
    assert sorted(done.values()) == list(done.values())  # back to back
    first = [c for g in step.groups for c in g if c in upload]
    assert list(done) == list(dict.fromkeys(first))  # in first-use order
    backward = step.event_phase.index("bwd")
    for k in range(backward):  # each forward event ends after its chunks' uploads plus its compute
        if step.groups[k]:
            wait = max(done[c] for c in step.groups[k] if c in done)
            assert cuda.timeline[k][0] >= wait + step.event_compute_s[k] - 1e-12
    assert cuda.timeline[backward][0] >= max(done.values()) + step.event_compute_s[backward] - 1e-12
    fast = predict(step, knobs, _gpu(), pool_bytes=GIB, overlap_host_optimizer=False)
    # a fast link hides the uploads under the forward: the step is no longer than without any upload to wait for
    assert fast.forward_backward_s < cuda.forward_backward_s
    assert cuda.step_s < cuda.forward_backward_s + cuda.optimizer_s + 1e-12 < \
        cpu.optimizer_s + cuda.forward_backward_s + 1e-12


def test_lane_uploads_go_out_during_backward(monkeypatch):
    """[Note: early refresh pricing]: with the host lane on (the CUDA default), a chunk the lane has stepped is
    uploaded during backward, after its last access, instead of at the start of the next step; with a link
    too slow for the uploads to hide under the forward, the next forward then waits only for what backward did
    not finish. The same bytes move. Not under fp16 loss scaling, and nothing changes when the lane only
    finishes after backward."""
    from hf_elixir.search import _replay

    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 2, seq=8)
    profile = profile_step(model, sample, device="cpu", count_flops=True)
    # slow compute (backward outlasts the lane) and a slow link (the uploads outlast the forward)
    hw = replace(_gpu(), h2d_bytes_per_s=1e7, device_flops_per_s=1e8, device_fp32_flops_per_s=1e8)

    def both(precision, hardware):
        step = build_chunked_step(profile, 4096, world_size=1, precision=precision, hardware=hardware)
        everything = frozenset(range(step.num_chunks))
        knobs = Knobs(resident=everything, device_shard=everything)  # every optimizer state on the host
        early = predict(step, knobs, hardware, pool_bytes=GIB)
        with monkeypatch.context() as m:
            m.setattr(_replay, "_early_refresh", lambda step, hardware: False)
            late = predict(step, knobs, hardware, pool_bytes=GIB)
        return early, late

    early, late = both("bf16", hw)
    assert early.h2d_bytes == late.h2d_bytes > 0 and early.d2h_bytes == late.d2h_bytes
    assert early.forward_backward_s < late.forward_backward_s and early.step_s < late.step_s
    early16, late16 = both("fp16", hw)
    assert early16.step_s == late16.step_s
    slow_lane = replace(hw, host_adam_numel_per_s=1e3)  # the lane finishes its first chunk after backward
    early_slow, late_slow = both("bf16", slow_lane)
    assert early_slow.step_s == late_slow.step_s
