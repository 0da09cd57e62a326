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

    kwargs = {"chunk_size_numel": CHUNK_NUMEL, "split_fused_experts": True, **kwargs}
    return hf_elixir.ElixirConfig(tensor_parallel_size=tp, expert_parallel_size=ep,
                                  device_memory_budget_bytes=budget_bytes, budget_covers_activations=False, **kwargs)


def _reference_step(ref, opt_ref, step: int, num_batches: int):
    opt_ref.zero_grad()
    losses = [ref(**_batch(step, b)).loss for b in range(num_batches)]
    torch.stack(losses).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    opt_ref.step()
    return losses, norm


def train_case(family: str, *, tp: int = 2, ep: int = 2, budget: str = "none", save_dir: str | None = None) -> dict:
    """One parity case (see the module docstring); ``budget``: ``"none"``, ``"half"`` (of this rank's 16 B/param
    state) or ``"tight"`` (5% above ``hf_elixir.min_device_budget_bytes``); ``save_dir``: also save a checkpoint after step 3 and resume a
    fresh run from it for the remaining steps (the resumed run must match the reference too)."""
    import hf_elixir
    from hf_elixir.parallel import build_mesh, parallelize
    from hf_elixir.runtime._state import get_state

    model = make_moe_model(family)
    ref = copy.deepcopy(model)
    cfg = _config(tp, ep, None)
    mesh = build_mesh(cfg)
    state = parallelize(model, cfg, mesh)
    placements = dict(state.placements)
    budget_bytes = None if budget == "none" else _half_rank_state_bytes(model, state)
    cfg = _config(tp, ep, budget_bytes)
    opt, opt_ref = _adamw(model), _adamw(ref)
    if budget == "tight":  # 5% above the smallest budget prepare accepts (half the state is below it at 8 ranks)
        budget_bytes = int(hf_elixir.min_device_budget_bytes(model, opt, cfg) * 1.05) + 1024
        cfg = _config(tp, ep, budget_bytes)
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
    manager = get_state(model).manager  # what the planner prices per rank: the chunks' shards and their groups
    m["shard_numel"] = sum(c.shard_numel for c in manager.chunks)
    m["chunk_group_sizes"] = sorted({c.world_size for c in manager.chunks})
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


def stream_case(family: str, *, folder: str, tp: int = 2, ep: int = 2) -> dict:
    """Streamed load under tp x ep: ``prepare(model_on_meta, checkpoint=folder)`` on a folder plain ``save_pretrained``
    wrote, against the same model loaded by ``from_pretrained``, parallelized and prepared; two training steps each.
    Then ``save_pretrained`` of the streamed model (collective: full tensors) loads into plain ``from_pretrained``."""
    import transformers as T

    import hf_elixir
    from hf_elixir.parallel import parallelize

    if dist.get_rank() == 0:
        make_moe_model(family).save_pretrained(folder)
    dist.barrier()
    T.logging.set_verbosity_error()
    runs = []
    for streamed in (False, True):
        cfg = _config(tp, ep, None)
        if streamed:
            with torch.device("meta"):
                model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(folder),
                                                           attn_implementation="eager")
        else:
            model = T.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").train()
        mesh = parallelize(model, cfg).mesh
        opt = _adamw(model)
        model, opt = hf_elixir.prepare(model, opt, cfg, checkpoint=folder if streamed else None)
        losses = []
        for step in range(2):
            loss = model(**_batch(step, mesh.batch_index)).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, model.state_dict(), model))
    (plain_losses, plain_sd, _), (streamed_losses, streamed_sd, streamed_model) = runs
    streamed_model.save_pretrained(folder + "-trained")  # every rank: the full tensors, written by rank 0
    loaded = T.AutoModelForCausalLM.from_pretrained(folder + "-trained").state_dict()
    return {
        "same_losses": plain_losses == streamed_losses,
        "bitwise": plain_sd.keys() == streamed_sd.keys() and all(torch.equal(plain_sd[k], streamed_sd[k])
                                                                  for k in plain_sd),
        "saved_loads_bitwise": loaded.keys() == streamed_sd.keys() and all(torch.equal(loaded[k], streamed_sd[k])
                                                                           for k in loaded),
    }


def reshard_case(family: str, *, save_dir: str) -> dict:
    """Weights only across layouts: a checkpoint saved at tp=2 x ep=2 loads (``optimizer=None``) into a tp=2 x ep=4
    model and into a plain data-parallel one, both ending with the saved model's full state dict."""
    import hf_elixir
    from hf_elixir.parallel import parallelize

    out = {}
    for tp, ep in ((2, 2), (2, 4), (1, 1)):
        model = make_moe_model(family, seed=tp * 10 + ep)
        # fused experts kept fused: a checkpoint of split experts loads on its own layout only
        cfg = _config(tp, ep, None, chunk_size_numel=CHUNK_NUMEL * 2, split_fused_experts=False)
        if tp > 1:
            parallelize(model, cfg)
        opt = _adamw(model)
        model, opt = hf_elixir.prepare(model, opt, cfg)
        if (tp, ep) == (2, 2):
            opt.backward(model(**_batch(0, 0)).loss)
            opt.step()
            hf_elixir.save_checkpoint(save_dir, model, opt, step=1)
            saved = model.state_dict()
            continue
        hf_elixir.load_checkpoint(save_dir, model, None)
        now = model.state_dict()
        out[f"tp{tp}_ep{ep}_bitwise"] = now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in now)
    return out


def run_cases(rank: int, world_size: int, cases: list[tuple[str, dict]]) -> dict:
    """``run_distributed`` target: every case in order -> ``{name: metrics}``."""
    torch.use_deterministic_algorithms(False)
    run = {"train": train_case, "stream": stream_case, "reshard": reshard_case}
    return {name: run[dict(kwargs).pop("kind", "train")](**{k: v for k, v in kwargs.items() if k != "kind"})
            for name, kwargs in cases}


__all__ = ["LR", "reshard_case", "run_cases", "stream_case", "train_case"]
