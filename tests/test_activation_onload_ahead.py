"""Offloaded activations copied back ahead ([Note: activation onload ahead] in
``hf_elixir/runtime/activations.py``): when the backward of an offloaded block starts, the tensors of the
offloaded block before it come back at once, so its own backward finds them on the device
(``num_prefetched_act_onloads``); only the last offloaded block waits at its first unpack
(``num_blocking_act_onloads``). Parity with plain PyTorch at 1 and 2 gloo ranks, the bytes moved unchanged, and
no host sync added (the offload copies are non-blocking, as on CUDA).
"""

from __future__ import annotations

import torch

import hf_elixir
from tests._dist import run_distributed
from tests._models import rank_batch, rel_l2, tiny_model, two_groups
from tests.test_activation_policy import BLOCKS, CHUNK, ROWS, STEPS, _budget, _reference, _state
from tests.test_host_syncs import _check as _check_syncs
from tests.test_host_syncs import _train as _train_counting_syncs
from tests.test_host_syncs import see_inside_pack_hooks

OFFLOAD = {b: "offload" for b in BLOCKS}
KEYS = ("step_num_prefetched_act_onloads", "step_num_blocking_act_onloads", "step_h2d_bytes", "step_d2h_bytes")


def _run(rank: int, world_size: int) -> dict:
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, device_memory_budget_bytes=_budget(world_size), default_placement="sharded",
        activation_policy=OFFLOAD, budget_covers_activations=False))
    steps = []
    for step in range(STEPS):
        opt.backward(model(**rank_batch("gpt2", step, rank, world_size, ROWS)).loss)
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        stats = hf_elixir.memory_stats(model)
        steps.append({k: stats[k] for k in KEYS})
    return {"rel": rel_l2(_state(model), _reference(world_size)), "steps": steps}


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["rel"] < 1e-5, f"rank {rank}: parameters rel L2 {r['rel']:.2e}"
        for step in r["steps"]:
            # two offloaded blocks: the last one's backward waits for its copy, the first one's is ahead
            assert step["step_num_blocking_act_onloads"] == 1, step
            assert step["step_num_prefetched_act_onloads"] == len(BLOCKS) - 1, step
        # each offloaded byte comes back once a step (the first step onloads more chunks: no order to prefetch by)
        assert len({(s["step_h2d_bytes"], s["step_d2h_bytes"]) for s in r["steps"][1:]}) == 1, r["steps"]


def test_offloaded_activations_come_back_ahead_with_parity_one_rank(single_rank_group):
    _check([_run(0, 1)])


def test_offloaded_activations_come_back_ahead_with_parity_two_ranks():
    _check(run_distributed(_run, 2, timeout_s=300))


def test_activation_offload_adds_no_host_sync(single_rank_group, monkeypatch):
    """Offload out and back (ahead) inside the step: still at most the optimizer's one host read per step (the
    copies out are non-blocking, as on CUDA; the counter looks inside the pack hooks)."""
    see_inside_pack_hooks(monkeypatch)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=1e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=4096,
                                                                      activation_policy="offload"))
    _check_syncs(_train_counting_syncs(model, opt, [rank_batch("gpt2", s, 0, 1, 2) for s in range(3)], max_norm=0.05))
    assert hf_elixir.memory_stats(model)["step_num_prefetched_act_onloads"] > 0
