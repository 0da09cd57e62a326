"""A refresh's host source is not written between its issue and its wait ([Note: strict refresh source] in
hf_elixir/chunk/_chunk_refresh.py). On CUDA the upload is a non-blocking copy queued at the issue, so such a write races
it (the old values, or a torn mix, reach the device); the simulated device copies at the wait and would upload
the new values, hiding the race. So the wait compares the source's data_ptr and version counter with the issue's
and raises. Checked: a direct write, a rebound storage, the writers of masters bump the counter (also the fused
Adam/AdamW kernel, which does not by itself), and an injected bug (a step with no backward since the last that
writes the masters / staging buffers without waiting for the pending uploads) is caught on both sources."""

from __future__ import annotations

import pytest
import torch

import hf_elixir
from hf_elixir.chunk.host_blocks import HostBlockAllocator
from hf_elixir.optim._inverse_adam import undo_adam_step
from hf_elixir.optim._same_pass import SamePassTable, ViewTensors, step_and_cast
from hf_elixir.optim.optimizer import ElixirOptimizer
from tests._models import batch, tiny_model, two_groups

ROWS = 2
CHUNK = 4096
RACE = "would have read the values of the issue time"


def _prepare(precision: str):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    return hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, offload_optimizer=True, precision=precision))


def _stepped(precision: str):
    """A model after one backward and step: every trained chunk's upload is pending."""
    model, opt = _prepare(precision)
    model(**batch("gpt2", 0, ROWS)).loss.backward()
    opt.step()
    uploaded = [c for c in hf_elixir.get_state(model).manager.chunks if c.pending_refresh is not None]
    assert uploaded
    return model, opt, uploaded


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_write_to_the_source_before_the_wait_raises(precision):
    """fp32: the upload reads the master itself; bf16: the pinned staging buffer cast from it. Writing either
    after ``step()`` and before the forward's wait raises, naming the chunk; the other chunks are unaffected."""
    model, opt, uploaded = _stepped(precision)
    chunk = uploaded[0]
    source = chunk.pending_refresh.source
    assert source is (opt.masters[chunk.chunk_id] if precision == "fp32" else opt._refresh_staging[chunk.chunk_id])
    source.add_(1)
    with pytest.raises(RuntimeError, match=rf"chunk {chunk.chunk_id}: .*version counter .*{RACE}"):
        chunk.wait_refresh()
    assert chunk.pending_refresh is None  # dropped: the shard keeps its old values
    for other in uploaded[1:]:
        other.wait_refresh()  # untouched sources pass


def test_a_rebound_source_raises():
    """The stamp holds the data_ptr too: a source whose storage was swapped (``.data =``, which starts a new
    version counter at 0) is caught as well."""
    _, _, uploaded = _stepped("fp32")
    chunk = uploaded[0]
    source = chunk.pending_refresh.source
    source.data = source.detach().clone()
    with pytest.raises(RuntimeError, match=rf"rebound to other storage.*{RACE}"):
        chunk.wait_refresh()


def test_without_a_write_the_forward_waits_as_before():
    """No false positive: the forward after ``step()`` waits for every upload, a second step follows."""
    model, opt, uploaded = _stepped("bf16")
    opt.zero_grad()
    model(**batch("gpt2", 1, ROWS)).loss.backward()
    assert all(c.pending_refresh is None for c in uploaded)
    opt.step()
    assert all(c.pending_refresh is not None for c in uploaded)


def test_host_buffers_have_their_own_version_counter():
    """Host buffers are slices of a few large blocks ([Note: host blocks]); a view would share the block's version
    counter, so a write to one buffer (a gradient shard) would look like a write to every other (a master)."""
    alloc = HostBlockAllocator(pin=False)
    a, b = alloc.empty(300, torch.float32), alloc.empty(300, torch.bfloat16)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one block
    before = b._version
    a.add_(1)
    a[3:9].mul_(2)  # a view of a buffer shares the buffer's counter
    assert b._version == before and a._version >= 2


def _views(numel: int = 300):
    master = torch.randn(numel)
    param = torch.nn.Parameter(master[10:250])
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
             "maximize": False, "decoupled_weight_decay": True}
    tensors = ViewTensors(param.detach(), torch.randn(240), torch.zeros(240), torch.zeros(240), None,
                          torch.zeros(()), group)
    return master, param, group, tensors


def test_the_writers_of_a_master_bump_its_version_counter():
    """What the check relies on. ``torch._fused_adamw_`` alone leaves the counter unchanged (the reason for the
    explicit bump); the same-pass step, the inverse rollback and ``copy_`` bump it."""
    master, _, group, tensors = _views()
    before = master._version
    torch._fused_adamw_([tensors.param], [tensors.grad], [tensors.exp_avg], [tensors.exp_avg_sq], [],
                        [tensors.step.add(1)], amsgrad=False, lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1,
                        eps=1e-8, maximize=False)
    assert master._version == before  # PyTorch's fused kernel: not seen by the counter

    staging = torch.empty(master.numel(), dtype=torch.bfloat16)
    table = SamePassTable.build([(10, 250)], master.numel(), 64)
    master_before, staging_before = master._version, staging._version
    step_and_cast(table, [tensors], master, staging)
    assert master._version > master_before and staging._version > staging_before

    before = master._version
    undo_adam_step(torch.optim.AdamW, group, 1, [tensors.param], [tensors.grad], [tensors.exp_avg],
                   [tensors.exp_avg_sq])
    assert master._version > before

    before = master._version
    master.copy_(torch.zeros_like(master))
    assert master._version > before


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_injected_missing_release_is_caught(monkeypatch, precision):
    """Injected bug: the optimizer forgets to wait for the pending uploads before it writes their sources in a
    step with no backward since the last one (no drain at the start of backward ran). fp32: the inner fused AdamW
    step writes the master an upload reads (seen only thanks to the explicit bump); bf16: the same-pass step casts
    into the staging buffer an upload reads. The next wait (the new issue's) raises; with the release the same
    sequence runs."""
    model, opt, uploaded = _stepped(precision)
    monkeypatch.setattr(ElixirOptimizer, "_release_staging", lambda self, chunk: None)
    with pytest.raises(RuntimeError, match=RACE):
        opt.step()  # the gradients are still there (no zero_grad): the masters are stepped again
    monkeypatch.undo()
    model, opt, uploaded = _stepped(precision)
    opt.step()
    assert all(c.pending_refresh is not None for c in uploaded)

