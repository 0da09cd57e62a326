"""[Note: deferred gradient zeroing] (hf_elixir/chunk/_chunk_grads.py): ``zero_grad`` does not write the gradient shards
that backward accumulates into directly (all resident, optimizer state on the device); backward writes each
parameter's first gradient instead of adding it to zeros, and what it leaves unwritten (a parameter without a
gradient, padding) is zeroed before anything reads the shard. Checked by the ops on the shards (no whole-shard
pass at zero_grad) and by parity with plain PyTorch where the unwritten parts matter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_elixir
from hf_elixir.runtime._state import get_state
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model


class _ShardWrites(TorchDispatchMode):
    """Records ``(op, numel)`` of every in-place/out= op whose output shares storage with a gradient shard."""

    def __init__(self, shards: list[torch.Tensor]):
        super().__init__()
        self.storages = {s.untyped_storage().data_ptr() for s in shards}
        self.writes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = kwargs.get("out")
        target = out if isinstance(out, torch.Tensor) else (args[0] if args and name.endswith("_") else None)
        if isinstance(target, torch.Tensor) and target.untyped_storage().data_ptr() in self.storages:
            self.writes.append((name, target.numel()))
        return func(*args, **kwargs)


class _Skips(torch.nn.Module):
    """Two layers, the second used only when asked (its gradient slot stays unwritten otherwise)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.sometimes = torch.nn.Linear(8, 8)

    def forward(self, x, use: bool):
        h = torch.tanh(self.first(x))
        if use:
            h = h + self.sometimes(h)
        return h.square().mean()


def _prepare(model, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    return hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(budget_covers_activations=False))


def test_zero_grad_writes_no_direct_gradient_shard_and_backward_writes_each_element_once():
    model, opt = _prepare(tiny_model("gpt2"))
    manager = get_state(model).manager
    shards = list(manager.grad_shards.values())
    assert shards and all(manager.chunks[cid].direct_grad_shard() is not None for cid in manager.grad_shards)
    shard_numel = sum(s.numel() for s in shards)
    opt.backward(model(**batch("gpt2", 0, 2)).loss)
    opt.step()
    with _ShardWrites(shards) as record:
        opt.zero_grad()
    assert record.writes == [], record.writes  # before: one zero_ over every shard
    with _ShardWrites(shards) as record:
        opt.backward(model(**batch("gpt2", 1, 2)).loss)
        opt.step()
    written = sum(n for name, n in record.writes if name in ("copy_", "mul", "add_", "zero_"))
    # GPT-2 uses every parameter once per backward (the tied embedding's two uses arrive summed): one write
    # per element, no add into zeros
    assert written == shard_numel, (written, shard_numel, record.writes[:8])
    assert not any(name == "add_" for name, _ in record.writes), record.writes[:8]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_unwritten_gradients_read_as_zero_in_step_and_clipping(set_to_none):
    torch.manual_seed(0)
    ref = _Skips()
    model, opt = _prepare(copy.deepcopy(ref))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        use = step in (0, 3)  # "sometimes" gets no gradient in steps 1, 2, 4: its slot stays unwritten
        ref(x, use).backward()
        opt.backward(model(x, use))
        if step == 2:  # clipping reads every gradient shard, including the unwritten slot
            rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
            norm = opt.clip_grad_norm(1e9)
            assert torch.allclose(torch.as_tensor(norm).float(), rnorm.float(), rtol=1e-5)
        ropt.step()
        opt.step()
        ropt.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
    # a step with no backward since zero_grad: zero gradients (set_to_none=False) or none at all
    ropt.step()
    opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert rel_l2(state, ref.state_dict()) < 1e-6


def _replicated(rank: int, world_size: int):
    model = tiny_model("gpt2")
    model, opt = _prepare(model)
    manager = get_state(model).manager
    replicated = all(manager.chunks[cid].replicate_group is not None for cid in manager.grad_shards)
    for step in range(3):
        opt.backward(model(**rank_batch("gpt2", step, rank, world_size, 2)).loss)
        opt.step()
        opt.zero_grad()
    return replicated, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_replicated_first_writes_are_pre_divided_and_match_pytorch_at_two_ranks():
    ref = tiny_model("gpt2")
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        ref(**batch("gpt2", step, 4)).loss.backward()
        ropt.step()
        ropt.zero_grad()
    for replicated, state in run_distributed(_replicated, 2, timeout_s=180):
        assert replicated
        assert rel_l2(state, ref.state_dict()) < 1e-5


def _waits_in_backward(rank: int, world_size: int, in_place: bool):
    """Where a rank waits for its gradient collectives in one backward: ``(waits while backward still runs
    (inside the window of in-flight reduces), total waits, number of chunks)``; and the trained state."""
    from hf_elixir.chunk import packing

    model = tiny_model("gpt2")
    packing.REPLICATED_BUCKET_BYTES = 4096 * 4  # several small buckets, as GPT-2 124M has 17
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = hf_elixir.ElixirConfig(budget_covers_activations=False, offload_optimizer=not in_place)
    model, opt = hf_elixir.prepare(model, opt, config)
    manager = get_state(model).manager
    sites = []
    finish = manager.reduces.finish_oldest

    def counted():
        sites.append("in backward" if manager.backward_pending and not ending else "later")
        finish()

    ending = False
    end = manager.finish_backward

    def finishing():
        nonlocal ending
        ending = True
        end()

    manager.reduces.finish_oldest, manager.finish_backward = counted, finishing
    for step in range(2):
        ending = False
        opt.backward(model(**rank_batch("gpt2", step, rank, world_size, 2)).loss)
        opt.step()
        opt.zero_grad()
    return (sites.count("in backward"), len(sites), len(manager.chunks),
            {k: v.detach().clone() for k, v in model.state_dict().items()})


def test_in_place_all_reduces_do_not_stop_backward_at_two_ranks():
    """[Note: in-place reduces] in chunk/_reduce.py: buckets all-reduced in place hold no buffer, so backward does not
    wait for them inside the in-flight window; nor, with every chunk resident, for host-optimizer buckets."""
    ref = tiny_model("gpt2")
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        ref(**batch("gpt2", step, 4)).loss.backward()
        ropt.step()
        ropt.zero_grad()
    for in_place in (True, False):
        for in_backward, total, num_chunks, state in run_distributed(_waits_in_backward, 2, in_place, timeout_s=180):
            assert num_chunks > 3 and total >= 2 * num_chunks, (num_chunks, total)
            # before: every bucket past the first two. Host-optimizer buckets hold buffers, but every chunk stays
            # on the device and no host lane steps in backward, so [Note: reduce window] lifts the window for
            # them too (tests/test_reduce_window.py checks that a plan with evictable chunks keeps it)
            assert in_backward == 0, (in_place, in_backward)
            assert rel_l2(state, ref.state_dict()) < 1e-5
