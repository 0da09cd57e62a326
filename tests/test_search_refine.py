"""Local refinement after the search ([Note: local refinement] in hf_elixir/search/_refine.py): never slower nor
over budget, reaches the brute-force grid's best where the greedy search misses it, deterministic, bounded.
Predicted times only (meta profiles with counted FLOPs, fixed hardware numbers)."""

import pytest
import torch

from hf_elixir.profiler import HardwareProfile, profile_step
from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch
from hf_elixir.search import brute_force_grid, build_chunked_step, predict, search
from hf_elixir.search._refine import _policy_moves, floor_bytes

GIB = 2**30
SIZE = 4096  # tiny-gpt2 at this chunk size: 13 chunks (the grid stays small)


def _gpu(memory_bytes: int) -> HardwareProfile:
    """Fixed test rates (a PCIe-4 node with a fast GPU link), no measured overheads."""
    return HardwareProfile(device_kind="cuda", device_name="test-gpu", device_total_bytes=memory_bytes,
                           device_free_bytes=memory_bytes, host_total_bytes=64 * GIB, host_available_bytes=64 * GIB,
                           h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, host_adam_numel_per_s=1e9,
                           device_adam_numel_per_s=4e10, device_flops_per_s=150e12, can_overlap=True,
                           allgather_bytes_per_s=50e9, reduce_scatter_bytes_per_s=50e9)


@pytest.fixture(scope="module")
def profile():
    model, batch = meta_model_and_batch(load_config("tiny-gpt2"), batch_size=2, seq_len=64, dtype=torch.bfloat16)
    return profile_step(model, batch, device="meta")


def _budget(profile, fraction: float, world_size: int) -> int:
    step = build_chunked_step(profile, SIZE, world_size=world_size, precision="bf16", hardware=_gpu(GIB))
    return int(sum(step.chunk_numels) * 2 * fraction)


def _search(profile, budget: int, world_size: int, **kwargs):
    return search(profile, _gpu(budget), world_size=world_size, precision="bf16", device_memory_budget_bytes=budget,
                  chunk_size_numel=SIZE, activations_on_device=False, activation_checkpointing=False,
                  host_memory_bytes=64 * GIB, **kwargs)


@pytest.mark.parametrize("world_size,fraction", [(1, 4.0), (1, 5.5)])
def test_refinement_reaches_the_grid_best_where_the_greedy_search_misses_it(profile, world_size, fraction):
    budget = _budget(profile, fraction, world_size)
    greedy = _search(profile, budget, world_size, refine_starts=0).best
    refined = _search(profile, budget, world_size).best
    grid = brute_force_grid(profile, _gpu(budget), world_size=world_size, precision="bf16",
                            device_memory_budget_bytes=budget, chunk_size_numel=SIZE, prefetch_depths=(0, 1, 2))
    best = grid[0].prediction.step_s
    # the case: the greedy fill misses the grid's best (by 0.2-0.3% here; at 2 ranks the search's prefix points
    # now reach it without the refinement, and by 1.5% before the search priced the refresh cast on the device
    # with a fill that leaves room for its staging buffer)
    assert greedy.prediction.step_s > best * (1 + 5e-4)
    assert refined.prediction.step_s <= best * (1 + 1e-9)


@pytest.mark.parametrize("world_size,fraction", [(1, 1.5), (1, 4.0), (1, 6.0), (2, 1.0), (2, 3.0), (2, 6.0)])
def test_refinement_is_never_slower_nor_over_budget(profile, world_size, fraction):
    budget = _budget(profile, fraction, world_size)
    plain = _search(profile, budget, world_size, refine_starts=0)
    result = _search(profile, budget, world_size)
    best = result.best
    assert best.prediction.step_s <= plain.best.prediction.step_s
    # re-priced from scratch with the search's pool and limit: the same prediction, and it fits
    step = build_chunked_step(profile, SIZE, world_size=world_size, precision="bf16", hardware=_gpu(budget))
    pred = predict(step, best.knobs, _gpu(budget), pool_bytes=budget)
    assert pred is not None and pred.step_s == pytest.approx(best.prediction.step_s, rel=1e-12)
    assert pred.device_model_bytes <= budget
    assert floor_bytes(step, best.knobs) <= int(budget * 0.95)
    assert best.knobs.device_optim <= best.knobs.resident | best.knobs.device_shard
    # the refinement's priced configurations are counted, within its bound
    assert plain.evaluated < result.evaluated <= plain.evaluated + max(500, min(1000, plain.evaluated))


def test_refinement_is_deterministic_and_bounded(profile):
    budget = _budget(profile, 5.0, 2)
    runs = [_search(profile, budget, 2) for _ in range(2)]
    assert runs[0].best.knobs == runs[1].best.knobs and runs[0].evaluated == runs[1].evaluated
    assert [c.summary() for c in runs[0].alternatives] == [c.summary() for c in runs[1].alternatives]
    plain = _search(profile, budget, 2, refine_starts=0).evaluated
    capped = _search(profile, budget, 2, refine_max_priced=7)
    assert plain < capped.evaluated <= plain + 7


def test_refinement_of_the_activation_policy_stays_within_the_budget():
    model, batch = meta_model_and_batch(load_config("gpt2"), batch_size=4, seq_len=512, dtype=torch.bfloat16)
    prof = profile_step(model, batch, device="meta")
    hw = _gpu(2 * GIB)
    plain = search(prof, hw, precision="bf16", refine_starts=0, num_chunk_sizes=1)
    result = search(prof, hw, precision="bf16", num_chunk_sizes=1)
    assert result.best.prediction.step_s <= plain.best.prediction.step_s
    assert result.best.prediction.device_peak_bytes <= int(2 * GIB * 0.95)
    assert set(result.best.activation_policy) == set(plain.best.activation_policy)  # every block has a policy


def test_policy_moves_change_one_block_at_the_ends_of_each_kind():
    policy = {"h.0": "recompute", "h.1": "recompute", "h.2": "keep", "h.3": "keep"}
    moves = _policy_moves(policy)
    for move in moves:
        assert sum(move[b] != policy[b] for b in policy) == 1
    changed = {(b, move[b]) for move in moves for b in policy if move[b] != policy[b]}
    assert changed == {("h.0", "keep"), ("h.1", "keep"), ("h.0", "offload"), ("h.1", "offload"),
                       ("h.2", "recompute"), ("h.3", "recompute"), ("h.2", "offload"), ("h.3", "offload")}


@pytest.mark.parametrize("kwargs", [{"refine_starts": -1}, {"refine_max_priced": -5}, {"refine_starts": 1.5}])
def test_bad_refinement_arguments_raise(profile, kwargs):
    with pytest.raises(ValueError, match="refine_"):
        _search(profile, _budget(profile, 2.0, 1), 1, **kwargs)
