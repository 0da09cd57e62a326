"""Rank-side cases of ``tests/test_tp_ep.py``: tensor and expert parallel on one mesh ([Note: tp x ep mesh] in
``hf_elixir/parallel/_mesh.py``), through ``hf_elixir.prepare``, against plain PyTorch training the unmodified model.

Every training case builds a tiny fused-expert MoE model (``tests/_moe_models.py``), places attention and dense
MLPs by the config's own tensor-parallel plan and the experts by its expert-parallel plan
(``ElixirConfig(tensor_parallel_size=tp, expert_parallel_size=ep)``), prepares it (ZeRO chunks over the
data-parallel groups; no budget, or a model-data budget of half the 16 B/param state) and trains ``STEPS`` steps
of AdamW with weight decay and clipping, each dp row on its own batch (the tp ranks of a row share it). The
reference is one process training the unmodified model on the mean loss of every row's batch with
``torch.optim.AdamW`` and ``clip_grad_norm_``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests._moe_ep_cases import LR, MAX_NORM, STEPS, _adamw, _batch, rel
from tests._moe_models import make_moe_model

CHUNK_NUMEL = 4096  # at least the largest local parameter (the embedding)
_STATS = ("num_evictions", "host_bytes", "h2d_bytes", "d2h_bytes", "device_total_peak_bytes")


def _config(tp: int, ep: int, budget_bytes: int | None, **kwargs):
    import hf_elixir

    return hf_elixir.ElixirConfig(tensor_parallel_size=tp, expert_parallel_size=ep, chunk_size_numel=CHUNK_NUMEL,
                                  device_memory_budget_bytes=budget_bytes, budget_covers_activations=False,
                                  split_fused_experts=True, **kwargs)


def _reference_step(ref, opt_ref, step: int, num_batches: int):
    opt_ref.zero_grad()
    losses = [ref(**_batch(step, b)).loss for b in range(num_batches)]
    torch.stack(losses).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    opt_ref.step()
    return losses, norm


def train_case(family: str, *, tp: int = 2, ep: int = 2, budget: str = "none", save_dir: str | None = None) -> dict:
    """One parity case (see the module docstring); ``save_dir``: also save a checkpoint after step 3 and resume a
    fresh run from it for the remaining steps (the resumed run must match the reference too)."""
    import hf_elixir
    from hf_elixir.parallel import build_mesh, parallelize

    model = make_moe_model(family)
    ref = copy.deepcopy(model)
    cfg = _config(tp, ep, None)
    mesh = build_mesh(cfg)
    state = parallelize(model, cfg, mesh)
    placements = dict(state.placements)
    budget_bytes = None if budget == "none" else _half_rank_state_bytes(model, state)
    cfg = _config(tp, ep, budget_bytes)
    opt, opt_ref = _adamw(model), _adamw(ref)
    model, opt = hf_elixir.prepare(model, opt, cfg)
    batch, num_batches = mesh.batch_index, mesh.num_batches
    m = {"loss_rel": 0.0, "norm_rel": 0.0, "grad_rel": None, "resumed_rel": None}
    for step in range(STEPS):
        if save_dir is not None and step == 3:
            hf_elixir.save_checkpoint(save_dir, model, opt, step=step)
        opt.zero_grad()
        loss = model(**_batch(step, batch)).loss
        opt.backward(loss)
        norm = opt.clip_grad_norm(MAX_NORM)
        ref_losses, ref_norm = _reference_step(ref, opt_ref, step, num_batches)
        if step == 0:  # full gradients under tp x ep: the unmodified model's names and shapes, clipped
            with hf_elixir.full_gradients(model) as grads:
                ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
                m["grad_keys_match"] = set(grads) == set(ref_grads)
                m["grad_rel"] = max(rel(grads[n], ref_grads[n]) for n in ref_grads if ref_grads[n].norm() > 0)
        opt.step()
        m["loss_rel"] = max(m["loss_rel"], abs(loss.item() - ref_losses[batch].item()) / abs(ref_losses[batch].item()))
        m["norm_rel"] = max(m["norm_rel"], abs(float(norm) - float(ref_norm)) / float(ref_norm))
    full, ref_sd = model.state_dict(), ref.state_dict()  # full tensors ([Note: one state_dict contract])
    m.update(_compare(full, ref_sd), placements=placements, tp_rank=mesh.tp_rank, ep_rank=mesh.ep_rank,
             groups=_group_ranks(mesh), budget_bytes=budget_bytes,
             **{k: v for k, v in hf_elixir.memory_stats(model).items() if k in _STATS},
             local_expert_rows=sorted({tuple(p.shape)[0] for n, p in model.named_parameters() if ".experts." in n}))
    if save_dir is not None:
        m["resumed_rel"] = _resume(family, tp, ep, budget_bytes, save_dir, ref_sd)
    return m


def _half_rank_state_bytes(model, state) -> int:
    """Half of this rank's 16 B/param model state: its tp slices and experts, ZeRO-sharded over their groups (the
    dense data-parallel group, or the ranks holding the same experts). The same on every rank of these meshes."""
    mesh = state.mesh
    world = mesh.world_size
    share = sum(p.numel() / (world // mesh.ep_size if state.is_expert_param(n) else mesh.dp_size)
                for n, p in model.named_parameters())
    return int(16 * share) // 2


def _compare(full: dict, ref_sd: dict) -> dict:
    keys = [k for k in ref_sd if ref_sd[k].norm() > 0]
    return {"same_keys": list(full) == list(ref_sd),
            "param_rel": rel(torch.cat([full[k].flatten() for k in ref_sd]),
                             torch.cat([ref_sd[k].flatten() for k in ref_sd])),
            "param_rel_worst_tensor": max(rel(full[k], ref_sd[k]) for k in keys),
            "worst_tensor": max((rel(full[k], ref_sd[k]), k) for k in keys)[1]}


def _group_ranks(mesh) -> dict:
    def ranks(group):
        return sorted(dist.get_process_group_ranks(group))
    return {"tp": ranks(mesh.tp_group), "ep": ranks(mesh.ep_group), "dp": ranks(mesh.dp_group),
            "expert_dp": ranks(mesh.expert_dp_group)}


def _resume(family: str, tp: int, ep: int, budget_bytes, save_dir: str, ref_sd: dict) -> float:
    """A fresh model and optimizer on the same layout, loaded from the step-3 checkpoint, trains steps 3 and 4:
    its weights must equal the uninterrupted run's reference."""
    import hf_elixir
    from hf_elixir.parallel import build_mesh, parallelize

    model = make_moe_model(family, seed=1)  # other initial weights: all of them come from the checkpoint
    cfg = _config(tp, ep, budget_bytes)
    mesh = build_mesh(cfg)
    parallelize(model, cfg, mesh)
    opt = _adamw(model)
    model, opt = hf_elixir.prepare(model, opt, cfg)
    hf_elixir.load_checkpoint(save_dir, model, opt)
    for step in range(3, STEPS):
        opt.zero_grad()
        opt.backward(model(**_batch(step, mesh.batch_index)).loss)
        opt.clip_grad_norm(MAX_NORM)
        opt.step()
    full = model.state_dict()
    return max(rel(full[k], ref_sd[k]) for k in ref_sd if ref_sd[k].norm() > 0)


def run_cases(rank: int, world_size: int, cases: list[tuple[str, dict]]) -> dict:
    """``run_distributed`` target: every case in order -> ``{name: metrics}``."""
    torch.use_deterministic_algorithms(False)
    run = {"train": train_case}
    return {name: run[dict(kwargs).pop("kind", "train")](**{k: v for k, v in kwargs.items() if k != "kind"})
            for name, kwargs in cases}


__all__ = ["LR", "run_cases", "train_case"]
