"""The host optimizer overlapped with backward ([Note: host lane] in hf_elixir/optim/_overlap.py):
speculative host steps during backward, validated at ``step()`` and rolled back where clipping
triggered, gradients overflowed (fp16), or another backward came. Parity with plain PyTorch (AdamW,
weight decay, two param groups, an LR schedule) at 1 and 2 gloo ranks, with steps that clip and steps
that do not.
"""

from __future__ import annotations

import threading

import pytest
import torch

import hf_elixir
from hf_elixir.optim.optimizer import ElixirOptimizer
from tests._dist import run_distributed
from tests._models import batch, float_state, rank_batch, rel_l2, tiny_model, two_groups

STEPS = 6
ROWS = 2
CHUNK = 4096
# the gradient norm of tiny GPT-2 falls from ~2.9 to ~1.3 over these steps (1 and 2 ranks): the first
# steps clip (speculation rolled back), the later ones do not (speculation stands)
MAX_NORM = 1.6
# seconds backward waits for the host lane's first step (see _elixir); far above the milliseconds it takes
LANE_WAIT_S = 60.0


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))


def _reference(world_size: int, accum: int, max_norm: float = MAX_NORM, amsgrad: bool = False):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3, amsgrad=amsgrad)
    sched = _schedule(opt)
    for step in range(STEPS):
        for micro in range(accum):
            (model(**batch("gpt2", step * accum + micro, ROWS * world_size)).loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        sched.step()
    return float_state(model)


def _elixir(rank: int, world_size: int, accum: int, overlap: bool | None, placement: str = "sharded",
            precision: str = "fp32", inf_step: int | None = None, max_norm: float = MAX_NORM, amsgrad: bool = False,
            inf_param: str | None = None, **config):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3, amsgrad=amsgrad)
    # export_dtype="compute": state_dict is the compute copy, which a skipped step leaves bitwise unchanged; the
    # masters (rolled back to ~1 ulp by the inverse update) are compared by masters_drift
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, offload_optimizer=True, overlap_host_optimizer=overlap,
        default_placement=placement, precision=precision, export_dtype="compute", **config))
    sched = _schedule(opt)
    in_backward = []
    if opt._lane is not None:
        step_views = opt._step_views
        stepped = threading.Event()

        def spy(views, hyper):
            in_backward.append(opt.manager.backward_pending)
            stepped.set()
            step_views(views, hyper)
        opt._step_views = spy
        # Deterministic, not a race with the thread scheduler: the embedding's gradient is the last of backward
        # (tied with the LM head). Once a chunk has been handed to the lane, its hook holds backward until the
        # lane has stepped one (once per run; a lane that only steps in ``step()`` never does, and the wait ends
        # after LANE_WAIT_S with ``in_backward`` false, which fails the test).
        handed = threading.Event()  # a chunk went to the lane to be stepped in this run
        take_over = opt._lane.on_grad_offloaded

        def take(chunk, staging, event):
            waiting = take_over(chunk, staging, event)
            if waiting is not None:
                handed.set()
            return waiting
        opt._lane.on_grad_offloaded = take

        def hold_backward(grad):
            if handed.is_set():
                stepped.wait(LANE_WAIT_S)
        model.get_input_embeddings().weight.register_hook(hold_backward)
    skipped_unchanged = None
    masters_drift = None
    overflow = {}
    if inf_param is not None:  # an overflow in one parameter's gradient only (its chunk is reduced late)
        dict(model.named_parameters())[inf_param].register_hook(
            lambda g: g * float("inf") if overflow.get("now") else g)
    for step in range(STEPS):
        before = float_state(model) if step == inf_step else None
        masters_before = _masters(opt) if step == inf_step else None
        rolled_back = opt._lane.num_rolled_back if opt._lane is not None else 0
        for micro in range(accum):
            loss = model(**rank_batch("gpt2", step * accum + micro, rank, world_size, ROWS)).loss / accum
            overflow["now"] = step == inf_step and micro == accum - 1
            if overflow["now"] and inf_param is None:
                loss = loss * float("inf")  # injected fp16 overflow
            opt.backward(loss)
        opt.clip_grad_norm(max_norm)
        opt.step()
        opt.zero_grad()
        sched.step()
        if before is not None:
            skipped_unchanged = all(torch.equal(v, before[k]) for k, v in float_state(model).items())
            after = _masters(opt)
            masters_drift = ({k: rel_l2(after[k], masters_before[k]) for k in after},
                             (opt._lane.num_rolled_back if opt._lane is not None else 0) - rolled_back)
    lane = opt._lane
    counts = (lane.num_speculated, lane.num_rolled_back) if lane is not None else (0, 0)
    return {"state": float_state(model), "counts": counts, "in_backward": any(in_backward),
            "skipped_unchanged": skipped_unchanged, "scale": opt.loss_scale, "masters_drift": masters_drift,
            "snapshots": len(lane._snapshots) if lane is not None else 0}


def _masters(opt) -> dict[str, dict[str, torch.Tensor]]:
    """The fp32 masters and the Adam moments of the host chunks (what a rollback must restore), by kind."""
    out = {"master": {str(cid): m.clone() for cid, m in opt.masters.items()}, "exp_avg": {}, "exp_avg_sq": {}}
    for tensor, entry in opt.inner.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in entry:
                out[key][str(id(tensor))] = entry[key].clone()
    return out


def _check_overlapped(result: dict, where: str) -> None:
    speculated, rolled_back = result["counts"]
    assert result["in_backward"], f"{where}: no host step ran while backward was still going"
    assert 0 < rolled_back < speculated, f"{where}: want steps that clip and steps that do not: {result['counts']}"


@pytest.mark.parametrize("accum", [1, 2])
def test_overlapped_host_step_matches_pytorch_one_rank(single_rank_group, accum):
    ref = _reference(1, accum)
    on = _elixir(0, 1, accum, True)
    off = _elixir(0, 1, accum, False)
    _check_overlapped(on, f"accum {accum}")
    assert off["counts"] == (0, 0)
    assert rel_l2(on["state"], ref) < 1e-5, rel_l2(on["state"], ref)
    # rolled back by the inverse update ([Note: inverse rollback]): not bitwise, within the parity with PyTorch
    # (lane off vs PyTorch: ~2.5e-6 here, from the reduction order)
    assert rel_l2(on["state"], off["state"]) < 1e-5


def _two_rank_worker(rank: int, world_size: int):
    out = {}
    for placement, accum in (("sharded", 1), ("replicated", 1), ("sharded", 2)):
        ref = _reference(world_size, accum)
        result = _elixir(rank, world_size, accum, True, placement)
        out[(placement, accum)] = (rel_l2(result["state"], ref), result["counts"], result["in_backward"])
    return out


def test_overlapped_host_step_matches_pytorch_two_ranks():
    for rank, out in enumerate(run_distributed(_two_rank_worker, 2, timeout_s=300)):
        for (placement, accum), (rel, counts, in_backward) in out.items():
            where = f"rank {rank} {placement} accum {accum}"
            _check_overlapped({"counts": counts, "in_backward": in_backward}, where)
            assert rel < 1e-5, f"{where}: param rel L2 {rel:.2e}"


def test_fp16_overflow_and_clipping_roll_back_exactly(single_rank_group):
    """fp16 with an overflow injected at step 2: the speculative updates of that step are rolled back
    (the step is skipped, the loss scale backs off), clipped steps are redone; the result is the one
    the serial host step gives. AMSGrad: the snapshot path, exact (the inverse path, not bitwise, is
    ``test_inverse_rollback_after_fp16_overflow_restores_the_state``)."""
    on = _elixir(0, 1, 1, True, precision="fp16", inf_step=2, amsgrad=True)
    off = _elixir(0, 1, 1, False, precision="fp16", inf_step=2, amsgrad=True)
    _check_overlapped(on, "fp16")
    assert on["snapshots"] > 0
    assert on["skipped_unchanged"] and off["skipped_unchanged"], "the overflow step must change nothing"
    assert on["scale"] == off["scale"] == 2.0 ** 15
    assert rel_l2(on["state"], off["state"]) < 1e-6, rel_l2(on["state"], off["state"])


def test_state_read_between_backward_and_step_sees_the_last_step(single_rank_group):
    """A state dict taken after backward (speculative steps in flight) holds the last step's values;
    training then goes on exactly as without the read."""
    def train(read: bool):
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
        model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK,
                                                                          offload_optimizer=True,
                                                                          overlap_host_optimizer=True))
        reads = []
        for step in range(3):
            before = (float_state(model), opt.state_dict()) if read else None
            opt.backward(model(**batch("gpt2", step, ROWS)).loss)
            if read:
                assert opt._lane.speculations or opt._lane._futures, "nothing was speculated"
                reads.append((before, (float_state(model), opt.state_dict())))
            opt.step()
            opt.zero_grad()
        return float_state(model), reads

    plain, _ = train(False)
    after, reads = train(True)
    # the read rolls back by the inverse update ([Note: inverse rollback]): ~1 ulp, not bitwise
    assert rel_l2(after, plain) < 1e-5
    for (model_before, opt_before), (model_mid, opt_mid) in reads:
        # the chunks' uploads were issued during backward ([Note: early refresh]): the read undid them, and the
        # compute copies hold the masters as the inverse update restored them (~1 ulp, like the masters below)
        assert rel_l2(model_mid, model_before) < 1e-6
        for name, entry in opt_before["state"].items():
            for key, value in entry.items():
                mid = opt_mid["state"][name][key]
                if key == "step":
                    assert torch.equal(value, mid), (name, key)
                else:
                    assert rel_l2({key: mid}, {key: value}) < 1e-6, (name, key)


def test_an_error_on_the_host_lane_surfaces_on_the_main_thread(single_rank_group, monkeypatch):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, offload_optimizer=True,
                                                                      overlap_host_optimizer=True))

    def broken(self, views, hyper):
        raise ValueError("injected host step failure")
    monkeypatch.setattr(ElixirOptimizer, "_step_views", broken)
    opt.backward(model(**batch("gpt2", 0, ROWS)).loss)
    with pytest.raises(RuntimeError, match="host optimizer lane failed.*injected host step failure"):
        opt.step()


def test_overlap_host_optimizer_is_validated():
    with pytest.raises(TypeError, match="overlap_host_optimizer='yes'"):
        hf_elixir.ElixirConfig(overlap_host_optimizer="yes")
    assert hf_elixir.ElixirConfig(overlap_host_optimizer=False).overlap_host_optimizer is False


def test_default_does_not_speculate_on_a_cpu_compute_device(single_rank_group):
    """[Note: lane off the CPU device]: ``overlap_host_optimizer=None`` speculates only where the compute device
    is an accelerator; on the CPU the host update runs in ``step()`` (no snapshot copies, no snapshot RAM),
    with the same result as ``False``."""
    default = _elixir(0, 1, 1, None)
    off = _elixir(0, 1, 1, False)
    assert default["counts"] == (0, 0) and not default["in_backward"]
    assert rel_l2(default["state"], off["state"]) == 0.0
    from hf_elixir.optim._overlap import speculates
    assert speculates(None, torch.device("cuda")) and not speculates(None, torch.device("cpu"))
    assert speculates(True, torch.device("cpu")) and not speculates(False, torch.device("cuda"))


def _host_bytes_after(overlap, budget=None, amsgrad=False):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3, amsgrad=amsgrad)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, offload_optimizer=True, overlap_host_optimizer=overlap,
        host_memory_budget_bytes=budget))
    for step in range(2):
        opt.backward(model(**batch("gpt2", step, ROWS)).loss)
        opt.step()
        opt.zero_grad()
    host = {c.chunk_id: c.shard_numel for c in opt.manager.chunks if c.trainable and not c.optim_on_device}
    speculating = [cid for cid in host if opt._lane._may_speculate.get(cid)]
    return hf_elixir.memory_stats(model)["host_bytes"], speculating, host, opt._lane


def test_snapshot_bytes_are_counted_and_bounded(single_rank_group):
    """The lane's snapshots (AMSGrad: the snapshot path) are host memory: ``host_bytes`` grows by exactly
    ``(1 + k) * 4`` bytes per host shard element of each speculating chunk, and never past
    ``host_memory_budget_bytes``."""
    serial, _, host, _ = _host_bytes_after(False, amsgrad=True)
    lane, speculating, _, _ = _host_bytes_after(True, amsgrad=True)
    assert speculating == list(host), "every host chunk speculates when the host has room"
    assert lane - serial == sum(host.values()) * 4 * (1 + 3)
    budget = serial + (lane - serial) // 2
    bounded, some, _, _ = _host_bytes_after(True, budget, amsgrad=True)
    assert 0 < len(some) < len(host) and bounded <= budget


def test_inverse_rollback_keeps_no_snapshot(single_rank_group):
    """[Note: inverse rollback]: Adam/AdamW chunks roll back by the inverse update, so the lane allocates no
    snapshot buffer: ``host_bytes`` with the lane on is the lane-off value, and a host budget with no room
    left still lets every chunk speculate."""
    serial, _, host, _ = _host_bytes_after(False)
    lane, speculating, _, hl = _host_bytes_after(True)
    assert speculating == list(host) and hl.inverse_chunks == set(host)
    assert not hl._snapshots and hl.num_speculated > 0
    assert lane == serial
    tight, speculating, _, hl = _host_bytes_after(True, budget=1)
    assert speculating == list(host) and tight == serial and not hl._snapshots


def test_inverse_rollback_after_a_strong_clip_matches_pytorch(single_rank_group):
    """Every step clips hard (coefficient ~0.03-0.08): every speculative update is undone by the inverse update
    and redone clipped; over the steps the result stays within 1e-5 relative of plain PyTorch."""
    ref = _reference(1, 1, max_norm=0.1)
    on = _elixir(0, 1, 1, True, max_norm=0.1)
    speculated, rolled_back = on["counts"]
    assert speculated > 0 and rolled_back == speculated and on["snapshots"] == 0
    assert rel_l2(on["state"], ref) < 1e-5, rel_l2(on["state"], ref)


def test_inverse_rollback_after_fp16_overflow_restores_the_state(single_rank_group):
    """fp16, an overflow in the position embedding's gradient only (its chunk is reduced last): the chunks
    reduced before it were stepped by the lane, the step is skipped, and their inverse rollback brings the
    masters and moments back to ~1 ulp (lane off: bitwise); the run then matches the lane-off one."""
    kwargs = dict(precision="fp16", inf_step=2, inf_param="transformer.wpe.weight")
    on = _elixir(0, 1, 1, True, **kwargs)
    off = _elixir(0, 1, 1, False, **kwargs)
    drift, rolled_back = on["masters_drift"]
    assert rolled_back > 0 and on["snapshots"] == 0
    assert on["skipped_unchanged"] and off["skipped_unchanged"]
    assert on["scale"] == off["scale"] == 2.0 ** 15
    assert drift["master"] < 1e-7 and drift["exp_avg"] < 1e-6 and drift["exp_avg_sq"] < 1e-6, drift
    assert all(v == 0.0 for v in off["masters_drift"][0].values())


def test_amsgrad_falls_back_to_exact_snapshots(single_rank_group):
    """AMSGrad's running max is not invertible: its chunks keep the snapshot path, exact (lane on = lane off)."""
    ref = _reference(1, 1, amsgrad=True)
    on = _elixir(0, 1, 1, True, amsgrad=True)
    off = _elixir(0, 1, 1, False, amsgrad=True)
    _check_overlapped(on, "amsgrad")
    assert on["snapshots"] > 0
    assert rel_l2(on["state"], off["state"]) < 1e-6
    assert rel_l2(on["state"], ref) < 1e-5


def test_no_lane_without_host_optimizer_state(single_rank_group):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK,
                                                                      offload_optimizer=False))
    assert opt._lane is None


def test_no_snapshot_room_no_speculation(single_rank_group):
    """The lane speculates only while its snapshots fit ``host_memory_budget_bytes``; with no room the
    host step runs in ``step()`` and nothing changes in the result."""
    tight = _elixir(0, 1, 1, True, host_memory_budget_bytes=1, amsgrad=True)  # snapshots: AMSGrad
    off = _elixir(0, 1, 1, False, amsgrad=True)
    assert tight["counts"] == (0, 0)
    assert rel_l2(tight["state"], off["state"]) == 0.0
