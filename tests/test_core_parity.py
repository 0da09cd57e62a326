"""Parity of hf_elixir with plain PyTorch (same seeds, dropout off): GPT-2, OPT, Switch; world sizes
1, 2, 4; everything resident (replicated by ``default_placement="auto"`` at world size > 1, and
forced sharded; replicated with the optimizer on the host under a budget), about half the chunks off the device, and the smallest budget that runs.

Reference (docs/design/rules.md, *The reference for parity tests*): one process running plain
``torch.optim.AdamW`` on the concatenation of every
rank's batch (same per-rank shapes, mean loss). 10 steps, two param groups, a LR schedule, clipping.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import hf_elixir
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model, two_groups

STEPS = 10
ROWS_PER_RANK = 2
CHUNK = 8192
KINDS = ("gpt2", "opt", "switch")


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))


def _reference(kind: str, world_size: int):
    model = tiny_model(kind)
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    sched = _schedule(opt)
    losses = []
    for step in range(STEPS):
        loss = model(**batch(kind, step, ROWS_PER_RANK * world_size)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _budget(kind: str, mode: str, world_size: int) -> int | None:
    if mode.startswith("resident"):
        return None
    model = tiny_model(kind)
    if mode == "replicated-offload":  # whole parameters + a few gradient buffers; optimizer on the host
        return sum(p.numel() * 4 for p in set(model.parameters())) + 4 * CHUNK * 4
    cfg = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK)
    smallest = hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(model.parameters()), cfg,
                                                 world_size=world_size)
    if mode == "min":
        return smallest
    params_bytes = sum(p.numel() * 4 for p in set(model.parameters()))
    return smallest + params_bytes // world_size


def _elixir_run(rank: int, world_size: int, kind: str, mode: str):
    model = tiny_model(kind)
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    budget = _budget(kind, mode, world_size)
    # "resident": default_placement="auto", which replicates when everything fits (world size > 1)
    placement = {"resident-sharded": "sharded", "replicated-offload": "replicated"}.get(mode, "auto")
    # the budgets are model-data budgets (sized from the model-data floor): activations outside them
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, device_memory_budget_bytes=budget, default_placement=placement,
        budget_covers_activations=False))
    sched = _schedule(opt)
    losses = []
    for step in range(STEPS):
        mine = rank_batch(kind, step, rank, world_size, ROWS_PER_RANK)
        loss = model(**mine).loss
        opt.backward(loss)
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
        global_loss = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(global_loss)
            global_loss /= world_size
        losses.append(global_loss.item())
    stats = hf_elixir.memory_stats(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, stats, budget


def _worker(rank: int, world_size: int):
    out = {}
    for kind in KINDS:
        ref_losses, ref_state = _reference(kind, world_size)
        modes = ("resident", "resident-sharded", "half", "min") + (("replicated-offload",) if world_size > 1 else ())
        for mode in modes:
            losses, state, stats, budget = _elixir_run(rank, world_size, kind, mode)
            out[(kind, mode)] = {
                "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                "param_rel": rel_l2(state, ref_state),
                "peak": stats["device_peak_bytes"], "budget": budget, "h2d": stats["h2d_bytes"],
                "evictions": stats["num_evictions"], "allgather": stats["allgather_bytes"],
                "allreduce": stats["reduce_scatter_bytes"],
            }
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp32_parity_all_models_all_budgets(world_size):
    results = run_distributed(_worker, world_size, timeout_s=300)
    for rank, out in enumerate(results):
        for (kind, mode), r in out.items():
            where = f"rank {rank} {kind} {mode}"
            assert r["loss_rel"] < 1e-5, f"{where}: loss rel diff {r['loss_rel']:.2e}"
            assert r["param_rel"] < 1e-5, f"{where}: param rel L2 {r['param_rel']:.2e}"
            if r["budget"] is not None:
                assert r["peak"] <= r["budget"], f"{where}: device peak {r['peak']} > budget {r['budget']}"
                assert r["h2d"] > 0, f"{where}: a budgeted run must onload from the host"
            if world_size > 1 and mode in ("resident", "replicated-offload"):  # DDP's traffic, no all-gather
                assert r["allgather"] == 0 and r["allreduce"] > 0, f"{where}: not replicated: {r}"
            if world_size > 1 and mode not in ("resident", "replicated-offload"):
                assert r["allgather"] > 0, f"{where}: sharded chunks must all-gather"
            if mode == "min":
                assert r["evictions"] > 0, f"{where}: the smallest budget must evict"


def _accumulation_worker(rank: int, world_size: int):
    out = {}
    for kind, placement in (("gpt2", "auto"), ("switch", "auto"), ("gpt2", "sharded")):
        model = tiny_model(kind)
        opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
        model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK,
                                                                          default_placement=placement))
        for step in range(3):
            for micro in range(2):
                mine = rank_batch(kind, 2 * step + micro, rank, world_size, ROWS_PER_RANK)
                opt.backward(model(**mine).loss / 2)
            opt.step()
            opt.zero_grad()
        ref = tiny_model(kind)
        ref_opt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
        for step in range(3):
            for micro in range(2):
                (ref(**batch(kind, 2 * step + micro, ROWS_PER_RANK * world_size)).loss / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out[(kind, placement)] = (rel_l2(state, ref.state_dict()), hf_elixir.memory_stats(model)["allgather_bytes"])
    return out


def test_gradient_accumulation_matches_reference_replicated_and_sharded():
    """Two micro-batches per step at 2 ranks: replicated chunks all-reduce the first micro-batch's
    gradients in the optimizer's shard and later ones through a buffer; sharded chunks reduce-scatter."""
    for rank, out in enumerate(run_distributed(_accumulation_worker, 2, timeout_s=300)):
        for (kind, placement), (rel, allgather) in out.items():
            assert rel < 1e-5, f"rank {rank} {kind} {placement}: param rel L2 {rel:.2e}"
            assert (allgather == 0) == (placement == "auto"), f"rank {rank} {kind} {placement}: {allgather}"
