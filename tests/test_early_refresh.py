"""Uploads of host-stepped chunks issued during backward ([Note: early refresh] in hf_elixir/optim/_refresh.py):
they happen while backward runs, a validated step keeps them, a clipped one is redone and uploaded again, and a
forward that comes before ``step()`` (the host lane mispredicted the step) sees the values from before the
speculative update. Parity with plain PyTorch, AdamW, two param groups, on the simulated device (where a read of
a compute copy whose upload is pending without the wait raises)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

import hf_elixir
from hf_elixir.optim._overlap import HostLane
from tests._models import batch, float_state, rel_l2, tiny_model, two_groups

CHUNK = 4096
ROWS = 2
# micro-batches per step: the lane learns 1 from step 0 and mispredicts step 1 (its first backward is not the
# last), and so on
SCHEDULE = (1, 2, 1, 2, 2)


@pytest.fixture(autouse=True)
def _lane_keeps_up(monkeypatch):
    """The host lane's worker finishes each chunk's step before backward goes on, so which uploads are issued in
    backward follows from the step's order, not from how soon the worker's thread gets a core: on a loaded machine
    (two test workers on two cores) it often got none before backward ended, and nothing was issued early. The
    thread, its futures and the main thread's joins are unchanged."""
    submit = HostLane._submit

    def submit_and_finish(self, fn, *args):
        future = submit(self, fn, *args)
        concurrent.futures.wait([future])
        return future
    monkeypatch.setattr(HostLane, "_submit", submit_and_finish)


def _reference(max_norm: float) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    seen = 0
    for accum in SCHEDULE:
        for _ in range(accum):
            (model(**batch("gpt2", seen, ROWS)).loss / accum).backward()
            seen += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return float_state(model)


def _elixir(max_norm: float, overlap: bool) -> dict:
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, offload_optimizer=True, overlap_host_optimizer=overlap))
    manager = opt.manager
    out = {"speculative_before_step": [], "early_before_step": [], "fenced": 0}
    lane = opt._lane
    if overlap:
        fence = lane.early_fence

        def counting_fence(chunk):
            out["fenced"] += int(chunk.chunk_id in lane.speculations)
            fence(chunk)
        lane.early_fence = counting_fence
    seen = 0
    for accum in SCHEDULE:
        issued = lane.num_early_refreshes if overlap else 0
        for _ in range(accum):
            opt.backward(model(**batch("gpt2", seen, ROWS)).loss / accum)
            seen += 1
        out["early_before_step"].append((lane.num_early_refreshes if overlap else 0) - issued)
        out["speculative_before_step"].append(
            sum(c.pending_refresh is not None and c.pending_refresh.speculative for c in manager.chunks))
        opt.clip_grad_norm(max_norm)
        opt.step()
        assert not any(c.pending_refresh is not None and c.pending_refresh.speculative for c in manager.chunks)
        opt.zero_grad()
    out["state"] = float_state(model)
    out["early"] = lane.num_early_refreshes if overlap else 0
    out["rolled_back"] = lane.num_rolled_back if overlap else 0
    return out


def test_uploads_issued_in_backward_match_pytorch(single_rank_group):
    """No clipping: the lane's speculative steps stand, their uploads issued in backward are the step's."""
    ref = _reference(max_norm=1e9)
    on = _elixir(max_norm=1e9, overlap=True)
    off = _elixir(max_norm=1e9, overlap=False)
    assert on["early"] > 0 and off["early"] == 0
    # step 0 has no previous order to know when backward is done with a chunk; the others issue early
    assert on["speculative_before_step"][0] == 0 and on["early_before_step"][0] == 0
    assert max(on["speculative_before_step"][1:]) > 0 and sum(on["early_before_step"][1:]) > 0
    assert on["fenced"] > 0, "the mispredicted steps' next forward must undo the early uploads"
    assert rel_l2(on["state"], ref) < 1e-5, rel_l2(on["state"], ref)
    assert rel_l2(on["state"], off["state"]) < 1e-5


def test_clipped_steps_redo_and_upload_again(single_rank_group):
    """Every step clips: every speculative step is rolled back after its upload was issued, redone clipped and
    uploaded again; the forward after it sees the clipped update."""
    ref = _reference(max_norm=0.1)
    on = _elixir(max_norm=0.1, overlap=True)
    assert on["early"] > 0 and on["rolled_back"] > 0
    assert rel_l2(on["state"], ref) < 1e-5, rel_l2(on["state"], ref)


def _bf16(cast: str, overlap: bool, max_norm: float | None = None) -> dict:
    import dataclasses

    from tests.test_refresh_cast import _plan

    config, plan = _plan(cast)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, dataclasses.replace(config, plan=plan, overlap_host_optimizer=overlap))
    start = float_state(model)
    for step in range(4):
        model(**batch("gpt2", step, ROWS)).loss.backward()
        if max_norm is not None:
            opt.clip_grad_norm(max_norm)
        opt.step()
        opt.zero_grad()
    state = float_state(model)
    return {"state": state, "update": {k: v - start[k] for k, v in state.items()},
            "early": opt._lane.num_early_refreshes if overlap else 0,
            "rolled_back": opt._lane.num_rolled_back if overlap else 0}


def test_bf16_uploads_in_backward_cast_on_the_host_or_the_device(single_rank_group):
    """bf16 compute copies, fp32 masters on the host: the early uploads read the staging buffer the lane cast
    into, or the master itself cast on the device ([Note: refresh cast]); either way bitwise the parameters of
    the lane-off run, whose uploads the step issues."""
    for cast in ("host", "device"):
        on, off = _bf16(cast, True), _bf16(cast, False)
        assert on["early"] > 0, cast
        assert all(torch.equal(v, off["state"][k]) for k, v in on["state"].items()), cast


def _checkpointed(elixir: bool, max_norm: float) -> dict:
    """Tiny GPT-2 under reentrant activation checkpointing (its blocks' forward runs under ``no_grad``), AdamW."""
    model = tiny_model("gpt2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    if elixir:
        model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
            chunk_size_numel=CHUNK, offload_optimizer=True, overlap_host_optimizer=True))
    seen = 0
    for accum in SCHEDULE:
        for _ in range(accum):
            (model(**batch("gpt2", seen, ROWS)).loss / accum).backward()
            seen += 1
        if elixir:
            opt.clip_grad_norm(max_norm)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return {"state": float_state(model), "early": opt._lane.num_early_refreshes if elixir else 0}


def test_reentrant_checkpointing_gradient_after_first_reduce_is_not_uploaded_early(single_rank_group):
    """Reentrant checkpointing runs a block's forward under ``no_grad``: a chunk holding the block's last bias and
    ``ln_f`` is reduced once for ``ln_f``'s gradient and again when the recomputed block's bias gradient comes.
    Between the two, the bias gradient sits in the chunk (``READY_FOR_REDUCE``) after the chunk's last access in
    the previous step's order: the early upload must wait for the second reduce (it used to be issued there, and
    the second gradient then raised "got a gradient after backward had used it for the last time")."""
    for max_norm in (1e9, 0.1):
        ref = _checkpointed(False, max_norm)
        on = _checkpointed(True, max_norm)
        assert on["early"] > 0, max_norm
        assert rel_l2(on["state"], ref["state"]) < 1e-5, (max_norm, rel_l2(on["state"], ref["state"]))


def test_bf16_clipped_steps_upload_the_clipped_update(single_rank_group):
    """bf16 compute copies, a hard clip every step (factor ~0.03-0.08): every early upload carried the unclipped
    speculative update and is replaced by the redone, clipped one. The parameters' change over the steps is the
    lane-off run's to bf16 rounding (the inverse rollback's ulp can flip a bf16 rounding, so the runs drift apart
    slowly); with the clipped chunks' early uploads left in place the changes differ by 0.17 (checked by hand)."""
    for cast in ("host", "device"):
        on, off = _bf16(cast, True, max_norm=0.1), _bf16(cast, False, max_norm=0.1)
        assert on["early"] > 0 and on["rolled_back"] > 0, cast
        assert rel_l2(on["update"], off["update"]) < 2e-2, (cast, rel_l2(on["update"], off["update"]))
