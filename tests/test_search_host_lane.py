"""The cost model prices the host optimizer as the runtime runs it ([Note: overlap] in
``hf_elixir/search/_cost.py``, [Note: lane off the CPU device] in ``hf_elixir/optim/_overlap.py``): the
snapshot copies the lane takes, the lane as serial work off CUDA, and ``ElixirConfig.overlap_host_optimizer``
read by the search."""

from dataclasses import replace

import pytest

from hf_elixir.profiler import HardwareProfile, profile_step
from hf_elixir.search import build_chunked_step, predict, search
from hf_elixir.search._cost import Knobs
from tests._models import batch, fixed_times, tiny_model

GIB = 2**30


def _hardware(kind: str) -> HardwareProfile:
    return HardwareProfile(device_kind=kind, device_name=f"test-{kind}", device_total_bytes=16 * GIB,
                           device_free_bytes=16 * GIB, host_total_bytes=128 * GIB, host_available_bytes=128 * GIB,
                           h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9, host_adam_numel_per_s=2e8,
                           device_adam_numel_per_s=2e8 if kind == "cpu" else 4e10, device_flops_per_s=1e11,
                           can_overlap=kind == "cuda")


@pytest.fixture(scope="module")
def profile():
    # fixed per-event seconds: the search's choice below must not hang on this machine's load
    return fixed_times(profile_step(tiny_model("gpt2"), batch("gpt2", 0, 2, seq=8), device="cpu", count_flops=True))


def _host_optimizer_step(profile, hardware, snapshot_rollback=True):
    """``snapshot_rollback``: AMSGrad or another optimizer the lane snapshots (Adam/AdamW: ``False``)."""
    step = build_chunked_step(profile, 4096, world_size=1, precision="fp32", hardware=hardware,
                              snapshot_rollback=snapshot_rollback)
    everything = frozenset(range(step.num_chunks))
    knobs = Knobs(resident=everything, device_shard=everything)  # every optimizer state on the host
    host_numel = sum(step.shard_numel(c) for c in range(step.num_chunks) if step.trained_numels[c])
    return step, knobs, host_numel


def test_off_cuda_the_default_prices_the_serial_step_and_no_snapshots(profile):
    """On a CPU device ``None`` is what the runtime does there: no speculation, so no snapshot bytes and the
    serial host update; forcing the lane on adds its snapshot copies to the serial work (it shares the cores)."""
    cpu = _hardware("cpu")
    step, knobs, host_numel = _host_optimizer_step(profile, cpu)
    default = predict(step, knobs, cpu, pool_bytes=GIB)
    off = predict(step, knobs, cpu, pool_bytes=GIB, overlap_host_optimizer=False)
    on = predict(step, knobs, cpu, pool_bytes=GIB, overlap_host_optimizer=True)
    assert default.step_s == off.step_s and default.host_snapshot_bytes == off.host_snapshot_bytes == 0
    snapshot = host_numel * 4 * (1 + step.optim_states)
    assert on.host_snapshot_bytes == snapshot
    assert on.forward_backward_s == pytest.approx(off.forward_backward_s)
    assert on.step_s - off.step_s == pytest.approx(snapshot / cpu.h2d_bytes_per_s)  # memcpy rate on CPU


def test_on_cuda_the_lane_pays_its_snapshot_copies(profile):
    """On CUDA the lane snapshots then steps each chunk; with the lane outlasting backward the step waits for
    both."""
    gpu = replace(_hardware("cuda"), host_adam_numel_per_s=1e6, h2d_bytes_per_s=1e7)  # the lane outlasts backward
    step, knobs, host_numel = _host_optimizer_step(profile, gpu)
    on = predict(step, knobs, gpu, pool_bytes=GIB)  # None: on for CUDA
    assert on.host_snapshot_bytes == host_numel * 4 * (1 + step.optim_states)
    copy_s = on.host_snapshot_bytes / gpu.h2d_bytes_per_s  # the probe's copy rate
    update_s = host_numel / gpu.host_adam_numel_per_s
    off = predict(step, knobs, gpu, pool_bytes=GIB, overlap_host_optimizer=False)
    # the lane's work (snapshot copies, then updates) bounds the step from below
    assert on.step_s >= update_s + copy_s
    assert off.step_s >= off.forward_backward_s + update_s


def test_adam_rolls_back_by_the_inverse_update_and_prices_no_snapshot(profile):
    """Adam/AdamW (``snapshot_rollback=False``, the default): the lane keeps no snapshot ([Note: inverse
    rollback] in ``optim/_inverse_adam.py``), so no snapshot bytes and no copies: on CPU the forced lane costs
    what the serial step costs; on CUDA the lane pays only its updates, and a host budget with no room left
    still lets it speculate (as ``HostLane._snapshot_fits``)."""
    cpu = _hardware("cpu")
    step, knobs, _ = _host_optimizer_step(profile, cpu, snapshot_rollback=False)
    assert build_chunked_step(profile, 4096, world_size=1, precision="fp32", hardware=cpu).snapshot_rollback is False
    off = predict(step, knobs, cpu, pool_bytes=GIB, overlap_host_optimizer=False)
    on = predict(step, knobs, cpu, pool_bytes=GIB, overlap_host_optimizer=True)
    assert on.host_snapshot_bytes == 0 and on.step_s == pytest.approx(off.step_s)
    gpu = replace(_hardware("cuda"), host_adam_numel_per_s=1e6, h2d_bytes_per_s=1e7)
    step, knobs, _ = _host_optimizer_step(profile, gpu, snapshot_rollback=False)
    snap_step, _, _ = _host_optimizer_step(profile, gpu)
    inverse = predict(step, knobs, gpu, pool_bytes=GIB)
    snapshots = predict(snap_step, knobs, gpu, pool_bytes=GIB)
    assert inverse.host_snapshot_bytes == 0 and inverse.step_s < snapshots.step_s
    tight = predict(step, knobs, gpu, pool_bytes=GIB, host_budget_bytes=1)
    assert tight.step_s == pytest.approx(inverse.step_s)


def test_search_reads_overlap_host_optimizer(profile):
    """``search(overlap_host_optimizer=...)`` prices the candidates with it: on CPU, forcing the lane costs its
    snapshot copies, so the same plan is predicted slower; ``False`` and the CPU default agree."""
    cpu = _hardware("cpu")
    step, knobs, host_numel = _host_optimizer_step(profile, cpu)
    kwargs = dict(precision="fp32", device_memory_budget_bytes=GIB, chunk_size_numel=4096, data_parallel="sharded",
                  snapshot_rollback=True)
    budget_knobs = dict(kwargs, device_memory_budget_bytes=sum(step.full_bytes(c) for c in range(step.num_chunks))
                        + step.grad_peak_bytes + 2 * 4096 * 4)  # room for the chunks, not their optimizer states
    default = search(profile, cpu, **budget_knobs)
    off = search(profile, cpu, overlap_host_optimizer=False, **budget_knobs)
    on = search(profile, cpu, overlap_host_optimizer=True, **budget_knobs)
    assert default.best.prediction.step_s == off.best.prediction.step_s
    assert off.best.knobs.device_optim != frozenset(range(step.num_chunks)), "some optimizer state on the host"
    assert on.best.prediction.host_snapshot_bytes > 0 and off.best.prediction.host_snapshot_bytes == 0
    assert on.best.prediction.step_s > off.best.prediction.step_s
    with pytest.raises(TypeError, match="overlap_host_optimizer='yes'"):
        search(profile, cpu, overlap_host_optimizer="yes", **kwargs)
    with pytest.raises(TypeError, match="snapshot_rollback='yes'"):
        search(profile, cpu, **dict(kwargs, snapshot_rollback="yes"))


def test_auto_plan_passes_the_config_setting(monkeypatch):
    from hf_elixir import ElixirConfig
    from hf_elixir.search import _plan_search

    seen = []
    real = _plan_search.search

    def spy(*args, **kwargs):
        seen.append(kwargs.get("overlap_host_optimizer"))
        return real(*args, **kwargs)
    monkeypatch.setattr(_plan_search, "search", spy)
    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 2, seq=8)
    for value in (None, False, True):
        _plan_search.auto_plan(model, sample, ElixirConfig(device_memory_budget_bytes=GIB, overlap_host_optimizer=value),
                               hardware=_hardware("cpu"))
    assert seen == [None, False, True]


def test_optimizer_cost_terms_follow_the_optimizer():
    """The search's optimizer terms come from the user's optimizer: state elements per parameter element (x 4
    bytes) and whether the host lane keeps snapshots ([Note: inverse rollback])."""
    import torch

    from hf_elixir import ElixirConfig, LossScalePolicy
    from hf_elixir.optim.optimizer import optimizer_cost_terms

    params = tiny_model("gpt2").parameters
    fp32 = ElixirConfig()
    cases = {"adamw": (torch.optim.AdamW(params()), 2, False),
             "adam": (torch.optim.Adam(params()), 2, False),
             "amsgrad": (torch.optim.AdamW(params(), amsgrad=True), 3, True),
             "sgd-momentum": (torch.optim.SGD(params(), lr=0.1, momentum=0.9), 1, True),
             "sgd": (torch.optim.SGD(params(), lr=0.1), 0, True)}
    for name, (opt, states, snapshots) in cases.items():
        assert optimizer_cost_terms(opt, fp32) == {"optim_states": states, "snapshot_rollback": snapshots}, name
    adamw = cases["adamw"][0]
    assert optimizer_cost_terms(None, fp32) == {"optim_states": 2, "snapshot_rollback": False}
    assert not optimizer_cost_terms(adamw, ElixirConfig(precision="fp16"))["snapshot_rollback"]
    odd_scale = ElixirConfig(precision="fp16", loss_scale=LossScalePolicy(backoff_factor=0.3))
    assert optimizer_cost_terms(adamw, odd_scale)["snapshot_rollback"], "fp16 unscale not exactly invertible"


def _record_optimizer_terms(monkeypatch) -> list[tuple]:
    """Patch the search to record the ``(optim_states, snapshot_rollback)`` each call is given."""
    from hf_elixir.search import _plan_search

    seen = []
    real = _plan_search.search

    def spy(*args, **kwargs):
        seen.append((kwargs.get("optim_states"), kwargs.get("snapshot_rollback")))
        return real(*args, **kwargs)
    monkeypatch.setattr(_plan_search, "search", spy)
    return seen


def test_auto_plan_prices_the_users_optimizer(monkeypatch):
    """``auto_plan(..., optimizer=)`` hands the optimizer's terms to the search (``None``: AdamW's), and they change
    the plan: at one budget, fewer optimizer state bytes leave room for more device optimizer chunks."""
    import torch

    from hf_elixir import ElixirConfig
    from hf_elixir.search import _plan_search

    seen = _record_optimizer_terms(monkeypatch)
    model, sample = tiny_model("gpt2"), batch("gpt2", 0, 2, seq=8)
    numel = sum(p.numel() for p in model.parameters())
    config = ElixirConfig(device_memory_budget_bytes=16 * numel, chunk_size_numel=4096, budget_covers_activations=False)
    device_optim = {}
    for name, opt in (("none", None), ("adamw", torch.optim.AdamW(model.parameters())),
                      ("sgd-momentum", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
                      ("sgd", torch.optim.SGD(model.parameters(), lr=0.1))):
        plan = _plan_search.auto_plan(model, sample, config, hardware=_hardware("cuda"), optimizer=opt)
        device_optim[name] = len(plan.device_optim_chunks)
    assert seen == [(2, False), (2, False), (1, True), (0, True)]
    assert device_optim["none"] == device_optim["adamw"] < device_optim["sgd-momentum"] < device_optim["sgd"], device_optim


def test_prepare_search_auto_gives_auto_plan_the_optimizer(single_rank_group, monkeypatch):
    """``prepare(model, SGD, ElixirConfig(search="auto"))`` prices SGD (0 state bytes, snapshots), not AdamW."""
    import torch

    import hf_elixir

    seen = _record_optimizer_terms(monkeypatch)
    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", lambda *a, **k: _hardware("cpu"))
    model = tiny_model("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(search="auto", device_memory_budget_bytes=GIB),
                                   sample_batch=batch("gpt2", 0, 2, seq=8))
    assert seen == [(0, True)]
    opt.backward(model(**batch("gpt2", 1, 2, seq=8)).loss)
    opt.step()
