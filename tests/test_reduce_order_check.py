"""Ranks whose forwards differ reduce their chunks in different orders ([Note: reduce order check] in
hf_elixir/chunk/_rank_checks.py): equal-size chunks then pair with the wrong chunk in their collectives, which gloo and
NCCL accept. The step must raise before it updates anything, and training must go on after ``zero_grad``.
"""

from __future__ import annotations

import pytest
import torch

import hf_elixir
from tests._dist import run_distributed
from tests._models import float_state, rel_l2

WIDTH = 16
CHUNK = WIDTH * WIDTH + WIDTH  # one Linear per chunk: equal sizes, so a wrong pairing is silent in gloo


class _TwoPaths(torch.nn.Module):
    """Two equal Linear layers; ``order`` picks which runs first, ``"a"``: only ``a`` runs."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(WIDTH, WIDTH)
        self.b = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, order: str):
        if order == "ab":
            h = self.b(torch.tanh(self.a(x)))
        elif order == "ba":
            h = self.a(torch.tanh(self.b(x)))
        else:
            h = self.a(x)
        return h.square().mean()


def _train(rank: int, placement: str, orders: list[tuple[str, str, int]], **config):
    """One step per entry of ``orders`` (rank 0's order, rank 1's, the batch's seed); returns per step ``None``
    or the error text, the state before and after each step."""
    torch.manual_seed(0)
    model = _TwoPaths()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, default_placement=placement, budget_covers_activations=False, **config))
    out = []
    for *pair, seed in orders:
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * seed + rank))
        opt.backward(model(x, pair[rank]))
        before = float_state(model)
        try:
            opt.step()
            error = None
        except RuntimeError as exc:
            error = str(exc)
        out.append((error, before, float_state(model)))
        opt.zero_grad()
    return out


def _worker(rank: int, world_size: int):
    results = {}
    lane = {"offload_optimizer": True, "overlap_host_optimizer": True}  # speculative host steps in backward
    for name, placement, config in (("sharded", "sharded", {}), ("replicated", "replicated", {}),
                                    ("host lane", "sharded", lane)):
        bad = _train(rank, placement, [("ab", "ab", 0), ("ab", "ba", 7), ("ab", "ab", 1), ("ab", "a", 8),
                                       ("ab", "ab", 2)], **config)
        good = _train(rank, placement, [("ab", "ab", 0), ("ab", "ab", 1), ("ab", "ab", 2)], **config)
        results[name] = (bad, good)
    return results


def test_ranks_with_different_forwards_fail_loudly_and_change_nothing():
    per_rank = run_distributed(_worker, 2, timeout_s=300)
    for rank, results in enumerate(per_rank):
        for placement, (bad, good) in results.items():
            where = f"rank {rank} {placement}"
            errors = [error for error, _, _ in bad]
            assert errors[0] is None and errors[2] is None and errors[4] is None, (where, errors)
            for i in (1, 3):  # another order; a module run on one rank only
                assert errors[i] is not None and "different orders" in errors[i], (where, i, errors[i])
                _, before, after = bad[i]
                assert all(torch.equal(v, before[k]) for k, v in after.items()), f"{where}: step {i} changed state"
            # the refused steps changed nothing and zero_grad discarded their gradients: the good steps of the bad
            # run are exactly the steps of a run without the bad ones
            for bad_step, good_step in ((2, 1), (4, 2)):
                if placement == "host lane":  # its speculation was rolled back by the inverse update: ~1 ulp
                    assert rel_l2(bad[bad_step][2], good[good_step][2]) < 1e-6, where
                else:
                    assert all(torch.equal(v, good[good_step][2][k]) for k, v in bad[bad_step][2].items()), where
    assert all(torch.equal(v, per_rank[1]["sharded"][0][4][2][k]) for k, v in per_rank[0]["sharded"][0][4][2].items())


@pytest.mark.parametrize("placement", ["sharded"])
def test_one_rank_has_no_order_to_check(single_rank_group, placement):
    """At one rank there is no flag group, so nothing is exchanged and any forward order is fine."""
    out = _train(0, placement, [("ab", "ab", 0), ("ba", "ba", 1), ("a", "a", 2)])
    assert [error for error, _, _ in out] == [None, None, None]
