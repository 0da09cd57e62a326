"""The host optimizer overlapped with backward ([Note: host lane] in hf_elixir/optim/_overlap.py):
speculative host steps during backward, validated at ``step()`` and rolled back where clipping
triggered, gradients overflowed (fp16), or another backward came. Parity with plain PyTorch (AdamW,
weight decay, two param groups, an LR schedule) at 1 and 2 gloo ranks, with steps that clip and steps
that do not.
"""

from __future__ import annotations

import pytest
import torch

import hf_elixir
from hf_elixir.optim.optimizer import ElixirOptimizer
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model, two_groups

STEPS = 6
ROWS = 2
CHUNK = 4096
# the gradient norm of tiny GPT-2 falls from ~2.9 to ~1.3 over these steps (1 and 2 ranks): the first
# steps clip (speculation rolled back), the later ones do not (speculation stands)
MAX_NORM = 1.6


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _reference(world_size: int, accum: int):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    sched = _schedule(opt)
    for step in range(STEPS):
        for micro in range(accum):
            (model(**batch("gpt2", step * accum + micro, ROWS * world_size)).loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        sched.step()
    return _state(model)


def _elixir(rank: int, world_size: int, accum: int, overlap: bool | None, placement: str = "sharded",
            precision: str = "fp32", inf_step: int | None = None, **config):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, offload_optimizer=True, overlap_host_optimizer=overlap,
        default_placement=placement, precision=precision, **config))
    sched = _schedule(opt)
    in_backward = []
    if opt._lane is not None:
        step_views = opt._step_views

        def spy(views):
            in_backward.append(opt.manager.backward_pending)
            step_views(views)
        opt._step_views = spy
    skipped_unchanged = None
    for step in range(STEPS):
        before = _state(model) if step == inf_step else None
        for micro in range(accum):
            loss = model(**rank_batch("gpt2", step * accum + micro, rank, world_size, ROWS)).loss / accum
            if step == inf_step and micro == accum - 1:
                loss = loss * float("inf")  # injected fp16 overflow
            opt.backward(loss)
        opt.clip_grad_norm(MAX_NORM)
        opt.step()
        opt.zero_grad()
        sched.step()
        if before is not None:
            skipped_unchanged = all(torch.equal(v, before[k]) for k, v in _state(model).items())
    lane = opt._lane
    counts = (lane.num_speculated, lane.num_rolled_back) if lane is not None else (0, 0)
    return {"state": _state(model), "counts": counts, "in_backward": any(in_backward),
            "skipped_unchanged": skipped_unchanged, "scale": opt.loss_scale}


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
    assert rel_l2(on["state"], off["state"]) < 1e-6


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
    the serial host step gives."""
    on = _elixir(0, 1, 1, True, precision="fp16", inf_step=2)
    off = _elixir(0, 1, 1, False, precision="fp16", inf_step=2)
    _check_overlapped(on, "fp16")
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
            before = (_state(model), opt.state_dict()) if read else None
            opt.backward(model(**batch("gpt2", step, ROWS)).loss)
            if read:
                assert opt._lane.speculations or opt._lane._futures, "nothing was speculated"
                reads.append((before, (_state(model), opt.state_dict())))
            opt.step()
            opt.zero_grad()
        return _state(model), reads

    plain, _ = train(False)
    after, reads = train(True)
    assert rel_l2(after, plain) < 1e-6
    for (model_before, opt_before), (model_mid, opt_mid) in reads:
        assert all(torch.equal(v, model_before[k]) for k, v in model_mid.items())
        for name, entry in opt_before["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, opt_mid["state"][name][key]), (name, key)


def test_an_error_on_the_host_lane_surfaces_on_the_main_thread(single_rank_group, monkeypatch):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, offload_optimizer=True,
                                                                      overlap_host_optimizer=True))

    def broken(self, views):
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


def test_snapshot_bytes_are_counted_and_bounded(single_rank_group):
    """The lane's snapshots are host memory: ``host_bytes`` grows by exactly ``(1 + k) * 4`` bytes per host shard
    element of each speculating chunk, and never past ``host_memory_budget_bytes``."""
    def host_bytes_after(overlap, budget=None):
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
        model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
            chunk_size_numel=CHUNK, offload_optimizer=True, overlap_host_optimizer=overlap,
            host_memory_budget_bytes=budget))
        for step in range(2):
            opt.backward(model(**batch("gpt2", step, ROWS)).loss)
            opt.step()
            opt.zero_grad()
        host = {c.chunk_id: c.shard_numel for c in opt.manager.chunks if c.trainable and not c.optim_on_device}
        speculating = [cid for cid in host if opt._lane._may_speculate.get(cid)]
        return hf_elixir.memory_stats(model)["host_bytes"], speculating, host

    serial, _, host = host_bytes_after(False)
    lane, speculating, _ = host_bytes_after(True)
    assert speculating == list(host), "every host chunk speculates when the host has room"
    assert lane - serial == sum(host.values()) * 4 * (1 + 2)
    budget = serial + (lane - serial) // 2
    bounded, some, _ = host_bytes_after(True, budget)
    assert 0 < len(some) < len(host) and bounded <= budget


def test_no_lane_without_host_optimizer_state(single_rank_group):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK,
                                                                      offload_optimizer=False))
    assert opt._lane is None


def test_no_snapshot_room_no_speculation(single_rank_group):
    """The lane speculates only while its snapshots fit ``host_memory_budget_bytes``; with no room the
    host step runs in ``step()`` and nothing changes in the result."""
    tight = _elixir(0, 1, 1, True, host_memory_budget_bytes=1)
    off = _elixir(0, 1, 1, False)
    assert tight["counts"] == (0, 0)
    assert rel_l2(tight["state"], off["state"]) == 0.0
