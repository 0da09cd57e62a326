"""The inverse Adam/AdamW update ([Note: inverse rollback] in hf_elixir/optim/_inverse_adam.py): one step of
``torch.optim`` undone in place comes back to the state before it within about one ulp (p, m) and the precision
the note derives for v; the cases without an inverse are refused."""

from __future__ import annotations

import pytest
import torch

from hf_elixir.optim._inverse_adam import group_invertible, power_of_two, undo_adam_step

CASES = {
    "adamw": (torch.optim.AdamW, dict(weight_decay=0.1, fused=True)),
    "adam-l2": (torch.optim.Adam, dict(weight_decay=0.1, fused=True)),
    "adam-maximize": (torch.optim.Adam, dict(maximize=True, fused=True)),
    "adamw-foreach": (torch.optim.AdamW, dict(weight_decay=0.01, foreach=True)),
    "adam-decoupled": (torch.optim.Adam, dict(weight_decay=0.1, decoupled_weight_decay=True)),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("steps_before", [0, 5])
def test_undo_restores_the_state_before_the_step(name, steps_before):
    cls, options = CASES[name]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 37)]
    opt = cls(params, lr=1e-2, **options)
    for _ in range(steps_before):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * 10  # a gradient larger than the history (what clipping reacts to)
    opt.step()
    state = [opt.state[p] for p in params]
    step = int(state[0]["step"])
    assert step == steps_before + 1
    undo_adam_step(cls, opt.param_groups[0], step, [p.detach() for p in params], [p.grad for p in params],
                   [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state])
    for p, (p0, s0), s in zip(params, before, state):
        # a few ulp of the larger of p and the update (lr: Adam's update is about lr per element)
        bound = 4 * torch.finfo(torch.float32).eps * (p0.abs() + 1e-2)
        assert ((p.detach() - p0).abs() <= bound).all(), float(((p.detach() - p0).abs() / bound).max())
        if steps_before:
            assert _rel(s["exp_avg"], s0["exp_avg"]) < 1e-6
            assert _rel(s["exp_avg_sq"], s0["exp_avg_sq"]) < 1e-6


def test_what_has_no_inverse_is_refused():
    group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False)
    assert group_invertible(torch.optim.AdamW, group) and group_invertible(torch.optim.Adam, group)
    assert not group_invertible(torch.optim.AdamW, {**group, "amsgrad": True})
    assert not group_invertible(torch.optim.AdamW, {**group, "capturable": True})
    assert not group_invertible(torch.optim.AdamW, {**group, "lr": torch.tensor(1e-3)})
    assert not group_invertible(torch.optim.AdamW, {**group, "betas": (0.0, 0.999)})
    assert not group_invertible(torch.optim.AdamW, {**group, "lr": 1.0, "weight_decay": 1.0})
    assert not group_invertible(torch.optim.SGD, group)
    assert power_of_two(2.0 ** 16) and power_of_two(0.5) and not power_of_two(3.0) and not power_of_two(0.0)
