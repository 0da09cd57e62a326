"""[Note: late reduce waits] in ``hf_elixir/chunk/_reduce.py``: off CUDA the last gradient collectives of a
backward stay in flight after it and are finished by whatever reads gradients next (the optimizer step, which
first steps the chunks already reduced; clipping; ``zero_grad``; the next backward). Parity with plain PyTorch
at 2 gloo ranks, sharded and replicated, with clipping, gradient accumulation and a ``zero_grad`` that
discards a backward."""

from __future__ import annotations

import torch

import hf_elixir
from tests._dist import run_distributed
from tests._models import batch, float_state, rank_batch, rel_l2, tiny_model, two_groups

STEPS = 4
ROWS = 2
CHUNK = 4096
MAX_NORM = 1.6


def _reference(world_size: int, accum: int):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    for step in range(STEPS):
        for micro in range(accum):
            (model(**batch("gpt2", step * accum + micro, ROWS * world_size)).loss / accum).backward()
        if step % 2:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return float_state(model)


def _elixir(rank: int, world_size: int, placement: str, accum: int, offload: bool):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, default_placement=placement, offload_optimizer=offload))
    manager = opt.manager
    in_flight = []
    # a backward whose gradients are discarded: its reduces are finished by zero_grad, then dropped
    opt.backward(model(**rank_batch("gpt2", 99, rank, world_size, ROWS)).loss)
    in_flight.append(manager.reduces_in_flight())
    opt.zero_grad()
    for step in range(STEPS):
        for micro in range(accum):
            opt.backward(model(**rank_batch("gpt2", step * accum + micro, rank, world_size, ROWS)).loss / accum)
            in_flight.append(manager.reduces_in_flight())
        if step % 2:
            opt.clip_grad_norm(MAX_NORM)
            assert not manager.reduces_in_flight(), "clipping reads every gradient"
        opt.step()
        assert not manager.reduces_in_flight()
        opt.zero_grad()
    last = manager._reduce_order[-1].chunk_id
    return float_state(model), [last in ids for ids in in_flight]


def _worker(rank: int, world_size: int):
    out = {}
    for placement, accum, offload in (("sharded", 1, False), ("replicated", 2, False), ("replicated", 1, True)):
        state, late = _elixir(rank, world_size, placement, accum, offload)
        out[(placement, accum, offload)] = (rel_l2(state, _reference(world_size, accum)), late)
    return out


def test_last_reduces_finish_after_backward_with_parity_at_two_ranks():
    for rank, out in enumerate(run_distributed(_worker, 2, timeout_s=300)):
        for key, (rel, late) in out.items():
            assert all(late), f"rank {rank} {key}: the last chunk's collective was waited inside backward: {late}"
            assert rel < 1e-5, f"rank {rank} {key}: param rel L2 {rel:.2e}"


def test_gradient_buffers_are_reused_off_cuda(single_rank_group):
    """[Note: buffer reuse]: off CUDA the gradient buffers of one backward are the next backward's (no fresh
    allocation, whose pages fault in on first write, per chunk per step); the result is unchanged."""
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, offload_optimizer=True))
    manager = opt.manager
    handed: list[set[int]] = []
    grad_buffer = manager.grad_buffer

    def spy(numel, dtype, what, zero=True):
        buffer = grad_buffer(numel, dtype, what, zero)
        handed[-1].add(buffer.data_ptr())
        assert not zero or not buffer.any(), "a reused gradient buffer must start at zero"
        return buffer
    manager.grad_buffer = spy
    for step in range(3):
        handed.append(set())
        opt.backward(model(**batch("gpt2", step, ROWS)).loss)
        opt.step()
        opt.zero_grad()
    assert handed[0] and handed[1] == handed[0] and handed[2] == handed[0]
    ref = tiny_model("gpt2")
    ref_opt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    for step in range(3):
        ref(**batch("gpt2", step, ROWS)).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert rel_l2(float_state(model), float_state(ref)) < 1e-5
