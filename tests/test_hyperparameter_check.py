"""Ranks stepping with different optimizer hyperparameters raise at the step instead of drifting apart
([Note: hyperparameter check] in hf_elixir/chunk/_rank_checks.py): a ReduceLROnPlateau stepped with each rank's own
loss gave replicated copies 5.8e-2 apart from PyTorch after a few steps, without an error."""

from __future__ import annotations

import pytest
import torch

import hf_elixir
from tests._dist import run_distributed
from tests._models import rank_batch, tiny_model, two_groups


def _worker(rank, world_size, placement):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=1e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(default_placement=placement))
    get = lambda s: rank_batch("gpt2", s, rank, world_size, 2)  # noqa: E731
    model(**get(0)).loss.backward()
    opt.step()
    opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.param_groups[1]["lr"] = 1e-3 * (1 + rank)  # a rank-local value, as ReduceLROnPlateau(local loss) sets
    model(**get(1)).loss.backward()
    with pytest.raises(RuntimeError, match="different optimizer hyperparameters") as err:
        opt.step()
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    opt.zero_grad()
    opt.param_groups[1]["lr"] = 1e-3  # the same everywhere again: training goes on
    model(**get(2)).loss.backward()
    opt.step()
    opt.zero_grad()
    final = model.state_dict()["transformer.ln_f.weight"].clone()
    return str(err.value), unchanged, final


@pytest.mark.parametrize("placement", ["replicated", "sharded"])
def test_rank_local_lr_raises_at_the_step_and_leaves_the_model_unchanged(placement):
    results = run_distributed(_worker, 2, placement)
    for message, unchanged, _ in results:
        assert "'lr': 0.001" in message or "'lr': 0.002" in message  # names this rank's values
        assert "average the metric over the ranks" in message
        assert unchanged  # nothing was updated by the refused step
    assert torch.equal(results[0][2], results[1][2])  # the ranks agree after going on


def test_one_rank_is_not_checked_and_equal_values_pass():
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=1e-3)
    model, opt = hf_elixir.prepare(model, opt)
    from tests._models import batch
    for s in range(2):
        opt.param_groups[0]["lr"] = 1e-3 * (s + 1)
        model(**batch("gpt2", s, 2)).loss.backward()
        opt.step()
        opt.zero_grad()
