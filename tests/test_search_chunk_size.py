"""Chunk-size search: terminates, little padding, tied/shared parameters counted once."""

import random

import torch
from torch import nn

from hf_elixir.chunk import pack_chunks
from hf_elixir.profiler import profile_step
from hf_elixir.search import chunk_groups, search_chunk_size


def test_search_terminates_on_awkward_inputs_and_respects_bounds():
    rng = random.Random(0)
    cases = [[1], [0, 5], [7] * 100, [2**31], [1, 2**30, 3], [rng.randint(1, 10**6) for _ in range(300)]]
    for numels in cases:
        result = search_chunk_size(numels, num_candidates=16)
        assert 1 <= len(result.candidates) <= 18
        assert all(c.chunk_size_numel >= max(numels) for c in result.candidates)
        assert result.chunk_size_numel == result.candidates[0].chunk_size_numel


def test_chosen_size_has_near_minimal_waste():
    numels = [1000, 600, 600, 600, 400, 1000, 10, 10]
    result = search_chunk_size(numels, upper_bound_numel=4000, num_candidates=40, step_numel=1, waste_tolerance=0.0)
    least = min(c.waste_fraction for c in result.candidates)
    assert result.candidates[0].waste_fraction == least
    layout = pack_chunks(numels, result.chunk_size_numel)
    assert layout.padding_numel / sum(layout.chunk_numels) == least
    # brute force over every size in the same range cannot do better than the grid's best by much
    best_any = min(pack_chunks(numels, s).padding_numel / sum(pack_chunks(numels, s).chunk_numels)
                   for s in range(1000, 4001))
    assert least <= best_any + 0.1


def test_moves_rank_candidates_when_cache_given():
    numels = [100] * 8
    trace = [[i] for i in range(8)] + [[i] for i in reversed(range(8))]
    result = search_chunk_size(numels, trace, element_bytes=4, cache_bytes=400 * 4, upper_bound_numel=800,
                               num_candidates=8, step_numel=100)
    feasible = [c for c in result.candidates if c.moves is not None and c.moves >= 0]
    assert feasible
    assert result.candidates[0].moved_bytes == min(c.moved_bytes for c in feasible
                                                   if c.waste_fraction <= min(x.waste_fraction for x in result.candidates) + 0.05)

    # the reason line describes any candidate by its own numbers (a plan search may pick another one)
    assert result.reason == result.describe(result.chunk_size_numel)
    other = next(c for c in result.candidates[1:] if c.num_chunks != result.candidates[0].num_chunks)
    line = result.describe(other.chunk_size_numel)
    assert line.startswith(f"chunk_size_numel={other.chunk_size_numel}: {other.num_chunks} chunks")
    assert f"ranked {result.candidates.index(other) + 1} of {len(result.candidates)}" in line
    assert "not among" in result.describe(12345)


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        h = self.emb(ids)
        h = self.mid(h)
        h = self.mid(h)  # shared module called twice
        return self.head(h).float().logsumexp(-1).mean()


def test_tied_and_shared_parameters_are_packed_once():
    model = _Shared()
    profile = profile_step(model, torch.randint(0, 16, (2, 3)), loss_fn=lambda out: out)
    assert profile.param_names.count("emb.weight") == 1 and "head.weight" not in profile.param_names
    assert profile.num_params == sum(p.numel() for p in model.parameters())
    result = search_chunk_size(profile.param_numels, [e.params for e in profile.events], cache_bytes=10**6)
    layout = pack_chunks(profile.param_numels, result.chunk_size_numel)
    assert sorted(i for m in layout.members for i in m) == list(range(len(profile.param_numels)))
    groups = chunk_groups(layout, [e.params for e in profile.events])
    # an embedding's backward does not access its weight (the runtime does not unshard for it)
    assert len(groups) == sum(1 for e in profile.events if e.params) == len(profile.events) - 1
