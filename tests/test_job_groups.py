"""Collectives run on the model's own process group, never WORLD by default (docs/design/rules.md: "Every
collective runs on the group it belongs to"): 4 gloo ranks run two independent 2-rank data-parallel
jobs (``ElixirConfig(process_group=...)``, groups [0, 1] and [2, 3]) with different models and data,
clipping on; each matches its own plain-PyTorch reference (one process on the job's global batch)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import hf_elixir
from tests._dist import run_distributed
from tests._models import batch, rel_l2, tiny_model, two_groups

STEPS = 4
ROWS_PER_RANK = 2
CHUNK = 4096
MAX_NORM = 0.05  # below every step's gradient norm: the global norm decides the update
JOBS = (("gpt2", 1234), ("opt", 999))  # (model, data seed) of job 0 (ranks 0, 1) and job 1 (ranks 2, 3)


def _job_batch(job: int, step: int, rows: int) -> dict:
    kind, seed = JOBS[job]
    return batch(kind, step, rows, seed=seed)


def _reference(job: int):
    kind, _ = JOBS[job]
    model = tiny_model(kind)
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    norms = []
    for step in range(STEPS):
        model(**_job_batch(job, step, 2 * ROWS_PER_RANK)).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world_size: int):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in one order
    job, local = rank // 2, rank % 2
    kind, _ = JOBS[job]
    model = tiny_model(kind)
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        process_group=groups[job], chunk_size_numel=CHUNK, default_placement="sharded"))
    norms = []
    for step in range(STEPS):
        full = _job_batch(job, step, 2 * ROWS_PER_RANK)
        mine = {k: v[local * ROWS_PER_RANK:(local + 1) * ROWS_PER_RANK] for k, v in full.items()}
        opt.backward(model(**mine).loss)
        norms.append(float(opt.clip_grad_norm(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    ref_norms, ref_state = _reference(job)
    # the jobs end at different times, and rank 0 hosts the world's store that each job's entry checks use: a rank
    # that left first took it away from the other job ("Connection reset by peer" in its model.state_dict())
    dist.barrier()
    return {"job": job, "param_rel": rel_l2(state, ref_state),
            "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "allgather": hf_elixir.memory_stats(model)["allgather_bytes"]}


def test_two_data_parallel_jobs_in_one_world_each_match_their_reference():
    results = run_distributed(_worker, 4, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["job"] == rank // 2
        assert r["allgather"] > 0, f"rank {rank}: chunks must be sharded over the job's group"
        assert r["norm_rel"] < 1e-5, f"rank {rank}: gradient norm differs from its job's reference: {r}"
        assert r["param_rel"] < 1e-5, f"rank {rank}: parameters differ from its job's reference: {r}"
