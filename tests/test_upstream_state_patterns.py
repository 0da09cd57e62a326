"""Optimizer-state patterns from accelerate's own checkpointing test (``tests/test_state_checkpointing.py``).

``accelerator.save_state()`` right after ``prepare`` stores an optimizer state with no per-parameter
entries (no step taken yet); training, then ``load_state()`` of that snapshot must bring the optimizer
back to "no step taken", as ``torch.optim.Optimizer.load_state_dict`` does (it replaces ``state``).
hf_elixir kept the moments and step counts of the steps taken in between, so the resumed run differed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hf_elixir


class _Line(nn.Module):
    """``y = x * a + b`` with 0-d parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.3))
        self.b = nn.Parameter(torch.tensor(-0.2))

    def forward(self, x):
        return x * self.a + self.b


def _batches(n: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randn(16, generator=g)
        yield x, 2.0 * x + 3.0


def _train(model, optimizer, batches) -> None:
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("fused", [False, True])  # True: Adam moments in the fused chunk update (the CUDA path)
def test_loading_a_state_saved_before_the_first_step_resets_the_optimizer(monkeypatch, fused):
    monkeypatch.setattr(hf_elixir.ElixirOptimizer, "_force_fused", fused)
    reference = _Line()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    model = copy.deepcopy(reference)
    model, optimizer = hf_elixir.prepare(model, torch.optim.Adam(model.parameters(), lr=0.05))
    initial = (copy.deepcopy(model.state_dict()), optimizer.state_dict())
    ref_initial = (copy.deepcopy(reference.state_dict()), copy.deepcopy(ref_opt.state_dict()))
    assert not initial[1]["state"]  # nothing stepped yet

    _train(model, optimizer, _batches(5))
    _train(reference, ref_opt, _batches(5))
    model.load_state_dict(initial[0])
    optimizer.load_state_dict(initial[1])
    reference.load_state_dict(ref_initial[0])
    ref_opt.load_state_dict(ref_initial[1])
    assert not optimizer.state_dict()["state"]  # as torch.optim: the steps in between are forgotten

    _train(model, optimizer, _batches(3))
    _train(reference, ref_opt, _batches(3))
    got, want = model.state_dict(), reference.state_dict()
    for name in ("a", "b"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
