"""A forward with grad enabled and no backward (an evaluation without ``torch.no_grad()``, a loss computed only to
log, a forward that raised) frees its graph and activations when its output goes, as in plain PyTorch. The
activation accounting's pack hook once returned each saved tensor itself: a saved output then held its own
``grad_fn``, a cycle the garbage collector cannot see, so the graph and its activations stayed alive and charged
to the budget for good, until a later training step raised ``DeviceBudgetExceededError`` on that rank alone
([Note: pack without a cycle] in hf_elixir/chunk/_activations.py)."""

from __future__ import annotations

import torch

import hf_elixir
from hf_elixir import ElixirConfig
from tests._dist import run_distributed
from tests._models import batch, rel_l2, tiny_model

CHUNK = 4096
SEQ = 24


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _train(model, opt, steps: int, rank: int = 0, world_size: int = 1, forwards_between: int = 0) -> list[int]:
    """``steps`` steps on ``batch("gpt2", step * world_size + rank, 1, SEQ)``, each followed by
    ``forwards_between`` evaluation forwards with grad enabled whose outputs are dropped; returns the activation
    bytes ``memory_stats`` counts after each of those forwards."""
    left = []
    for step in range(steps):
        model(**batch("gpt2", step * world_size + rank, 1, SEQ)).loss.backward()  # ranks average their gradients
        opt.step()
        opt.zero_grad()
        for i in range(forwards_between):
            model.eval()
            logits = model(**batch("gpt2", 100 + 10 * step + i, 1, SEQ)).logits  # no torch.no_grad(), no backward
            assert logits.requires_grad
            del logits
            model.train()
            left.append(hf_elixir.memory_stats(model)["activation_bytes"])
    return left


def _reference(steps: int, world_size: int) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2")
    opt = _opt(model)
    for step in range(steps):
        for rank in range(world_size):
            (model(**batch("gpt2", step * world_size + rank, 1, SEQ)).loss / world_size).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _budget(world_size: int) -> int:
    """The floor plus room for one step's activations (about 205 KB at 24 tokens) and a few chunks: far less
    than the activations of the five dropped forwards per step that the test runs (a leak overflows it)."""
    model = tiny_model("gpt2")
    config = ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded")
    return hf_elixir.min_device_budget_bytes(model, _opt(model), config, world_size=world_size) + 260_000


def test_a_forward_without_backward_frees_its_activations():
    steps = 3
    model = tiny_model("gpt2")
    config = ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded", device_memory_budget_bytes=_budget(1))
    model, opt = hf_elixir.prepare(model, _opt(model), config)
    left = _train(model, opt, steps, forwards_between=5)
    assert left == [0] * (5 * steps), left
    stats = hf_elixir.memory_stats(model)
    assert stats["device_total_peak_bytes"] <= config.device_memory_budget_bytes
    with hf_elixir.full_parameters(model):
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert rel_l2(state, _reference(steps, 1)) < 1e-5


def _ranks_worker(rank: int, world_size: int, steps: int) -> dict:
    model = tiny_model("gpt2")
    config = ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded",
                          device_memory_budget_bytes=_budget(world_size))
    model, opt = hf_elixir.prepare(model, _opt(model), config)
    left = _train(model, opt, steps, rank, world_size, forwards_between=2)
    with hf_elixir.full_parameters(model):
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"left": left, "state": state, "peak": hf_elixir.memory_stats(model)["device_total_peak_bytes"],
            "budget": config.device_memory_budget_bytes}


def test_ranks_keep_training_after_forwards_without_backward_under_an_activation_budget():
    """At two ranks (gathers agreed ahead, [Note: agreed gathers ahead]): before, the third step's forward ran out
    of budget on a rank, the other one waited in its collective."""
    steps = 4
    out = run_distributed(_ranks_worker, 2, steps, timeout_s=90)
    ref = _reference(steps, 2)
    for r in out:
        assert r["left"] == [0] * (2 * steps), r["left"]
        assert r["peak"] <= r["budget"]
        assert rel_l2(r["state"], ref) < 1e-5


class _InPlaceOnSaved(torch.nn.Module):
    """``exp`` saves its output, which the forward then doubles in place: plain PyTorch's backward raises."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).exp()
        y.mul_(2)
        return y.sum()


def test_a_saved_activation_modified_in_place_raises_as_in_pytorch():
    """The accounting's pack hook replaces autograd's own version check of saved tensors (it does not run for
    tensors packed by hooks): before, backward silently used the modified values ([Note: pack without a
    cycle] in hf_elixir/chunk/_activations.py)."""
    import pytest

    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _InPlaceOnSaved()(x).backward()
    model = _InPlaceOnSaved()
    model, _ = hf_elixir.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), ElixirConfig())
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch.float32, shape \(4, 8\)\] is "
                                           r"at version 1; expected version 0"):
        model(x).backward()
