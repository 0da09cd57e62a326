"""The refresh of device compute copies from host masters overlaps the next forward ([Note: overlapped refresh]
in hf_elixir/optim/_refresh.py): one upload per chunk issued without a wait, waited for at the chunk's first
use; on the simulated device the copy happens at the wait and the parameters are stale placeholders until
then, so a read that skips the wait fails loudly. Parity with plain PyTorch at 1 and 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

import hf_elixir
from hf_elixir.chunk.chunk import Chunk
from hf_elixir.chunk.params import StaleParameterError
from tests._dist import run_distributed
from tests._models import batch, low_precision_reference, rank_batch, rel_l2, tiny_model, two_groups

STEPS = 4
ROWS = 2
CHUNK = 4096
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _prepare(precision: str, **config):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    return hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, offload_optimizer=True, precision=precision, **config))


def _uploaded(model) -> list[Chunk]:
    manager = hf_elixir.get_state(model).manager
    return [c for c in manager.chunks if c.trainable and c.shard_on_device and not c.optim_on_device]


def _reference(world_size: int, precision: str) -> dict[str, torch.Tensor]:
    """Plain PyTorch: fp32 masters stepped by AdamW, the model computing in ``precision`` (a copy cast from the
    masters after every step), gradients of the global batch."""
    _, model = low_precision_reference(STEPS, ROWS * world_size, DTYPES[precision])
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world_size: int, precision: str):
    model, opt = _prepare(precision)
    uploaded = _uploaded(model)
    stats = []
    for step in range(STEPS):
        model(**rank_batch("gpt2", step, rank, world_size, ROWS)).loss.backward()
        opt.step()
        opt.zero_grad()
        stats.append(hf_elixir.memory_stats(model)["step_num_refreshes_ahead"])
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return state, stats, len(uploaded)


@pytest.mark.parametrize("world_size, precision", [(1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")])
def test_parity_with_plain_pytorch_host_optimizer(world_size, precision):
    """Every trained chunk's refresh is an upload issued ahead (one per chunk and step), and training matches
    plain PyTorch: fp32 to 1e-5 relative (as the host lane's parity), bf16 to its rounding."""
    if world_size == 1:
        results = [_train(0, 1, precision)]
    else:
        results = run_distributed(_train, world_size, precision)
    ref = _reference(world_size, precision)
    for state, stats, num_uploaded in results:
        assert num_uploaded > 0 and stats == [num_uploaded] * STEPS
        assert rel_l2(state, ref) < (1e-5 if precision == "fp32" else 1e-2)


def test_refresh_is_waited_at_first_use_and_state_dict_drains_it():
    """Right after ``step()`` the uploads are pending: the device copy still holds the old values (the copy is
    in flight), the parameters are stale placeholders; ``state_dict`` waits (the compute copy is then the
    masters cast to bf16) and returns the new values (the fp32 masters); a forward waits chunk by chunk."""
    model, opt = _prepare("bf16")
    uploaded = _uploaded(model)
    model(**batch("gpt2", 0, ROWS)).loss.backward()
    before = {c.chunk_id: c.full.clone() for c in uploaded}
    opt.step()
    assert all(c.pending_refresh is not None for c in uploaded)
    for chunk in uploaded:
        assert torch.equal(chunk.full, before[chunk.chunk_id])  # not there until the wait
        with pytest.raises(StaleParameterError):
            chunk.slots[0].param.sum()
    state = model.state_dict()
    assert all(c.pending_refresh is None for c in uploaded)
    for chunk in uploaded:
        expected = opt.masters[chunk.chunk_id].to(torch.bfloat16)
        assert torch.equal(chunk.full, expected) and not torch.equal(chunk.full, before[chunk.chunk_id])
        master = opt.masters[chunk.chunk_id]  # what state_dict writes by default ([Note: fp32 exports])
        for slot in chunk.slots:
            assert torch.equal(state[slot.name], master[slot.offset:slot.offset + slot.numel].view(slot.shape))
    opt.zero_grad()
    model(**batch("gpt2", 1, ROWS)).loss.backward()
    opt.step()
    with torch.no_grad():
        model(**batch("gpt2", 2, ROWS))  # eval: each chunk's access waits for its upload
    assert all(c.pending_refresh is None for c in uploaded)
    assert torch.isfinite(uploaded[0].slots[0].param.sum())


def test_a_read_that_skips_the_wait_fails_loudly(monkeypatch):
    """Injected bug: the access does not wait for the upload. The forward must raise, not compute with the
    old values (what the hardware would silently do)."""
    model, opt = _prepare("bf16")
    model(**batch("gpt2", 0, ROWS)).loss.backward()
    opt.step()
    opt.zero_grad()
    monkeypatch.setattr(Chunk, "wait_refresh", lambda self, stream=None: None)
    with pytest.raises(StaleParameterError):
        model(**batch("gpt2", 1, ROWS))


def test_uploads_follow_the_next_forwards_first_use():
    """Issued in the order the previous step's trace first used the chunks (not chunk id order)."""
    model, opt = _prepare("bf16")
    manager = hf_elixir.get_state(model).manager
    issued = []
    original = Chunk.issue_refresh

    def spy(self, source, side_stream=None, **kwargs):
        issued.append(self.chunk_id)
        return original(self, source, side_stream, **kwargs)

    Chunk.issue_refresh = spy
    try:
        model(**batch("gpt2", 0, ROWS)).loss.backward()
        first = list(dict.fromkeys(manager.trace))
        opt.step()
    finally:
        Chunk.issue_refresh = original
    uploaded = {c.chunk_id for c in _uploaded(model)}
    assert issued == [cid for cid in first if cid in uploaded] + sorted(uploaded - set(first))
