"""Rank-side cases of ``tests/test_moe_expert_parallel.py``: today's fused-expert MoE families under
``expert_parallel_size=2`` and ``hf_elixir.prepare``, against plain PyTorch training the unmodified model.

Every case trains a tiny model (``tests/_moe_models.py``) for ``STEPS`` steps on every rank twice: once
placed by the glob ``ElixirConfig(placements={"*.mlp.experts": "expert"}, expert_parallel_size=2)``,
rewritten by ``hf_elixir.parallel.parallelize`` and prepared (chunks sharded over the data-parallel
groups; no budget, or a model-data budget of half the 16 B/param state), each rank on its own batch,
through ``optimizer.backward / clip_grad_norm / step``; once as the single-process reference (the
unmodified model, loss = mean of every rank's batch loss, router auxiliary loss included, plain
``torch.optim.AdamW`` with weight decay on matrices only, ``clip_grad_norm_`` at the same norm).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.distributed as dist

from tests._moe_models import make_moe_model

STEPS = 5
LR = 3e-3
WEIGHT_DECAY = 0.1
MAX_NORM = 0.5  # below every step's gradient norm: clipping is exercised
CHUNK_NUMEL = 4096  # one expert-parallel slice of a tiny fused gate_up_proj


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _adamw(model) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (and fused 3-D experts) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR)


def _batch(step: int, index: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + index)
    ids = torch.randint(2, 128, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _silence_experts(model, experts: tuple[int, ...]) -> None:
    """gpt-oss routers have a bias: -30 on ``experts`` so no token ever picks them (their ep rank gets no
    row; plain PyTorch gives their fused slices a zero gradient, and AdamW decays them)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.router.bias"):
                p[list(experts)] = -30.0


def ep_case(family: str, *, budget: str, idle: bool = False, save_dir: str | None = None, ep: int = 2,
            precision: str = "fp32", checkpointing: bool = False, split: bool | str = True) -> dict:
    """One parity case; ``budget`` = ``"none"``, ``"half"`` (half of 16 B/param of the full model) or
    ``"tight"`` (5% above ``hf_elixir.min_device_budget_bytes``, which forces evictions). ``precision="bf16"``:
    bf16 compute with fp32 master weights against the fp32 reference. ``split``: ``ElixirConfig.
    split_fused_experts`` (``True`` here: these cases check the split layout at every budget)."""
    import hf_elixir
    from hf_elixir.parallel import build_mesh, gather_full_state_dict, parallelize

    model = make_moe_model(family)
    if checkpointing:  # HF activation checkpointing: the dispatch (and its all-to-alls) re-runs in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if idle:
        _silence_experts(model, (2, 3))
    ref = copy.deepcopy(model)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    numel = sum(p.numel() for p in model.parameters())
    budget_bytes = None if budget == "none" else 16 * numel // 2
    placements = {"*.mlp.experts": "expert"} if ep > 1 else {}
    cfg = hf_elixir.ElixirConfig(placements=placements, expert_parallel_size=ep,
                                 chunk_size_numel=CHUNK_NUMEL * (2 // ep), device_memory_budget_bytes=budget_bytes,
                                 budget_covers_activations=False, precision=precision, split_fused_experts=split)
    mesh = build_mesh(cfg)
    state = parallelize(model, cfg, mesh) if ep > 1 else None  # ep=1: the plain ZeRO path, for comparison
    local_expert_shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if ".mlp.experts." in n}
    opt, opt_ref = _adamw(model), _adamw(ref)
    if budget == "tight":  # 5% above the smallest budget prepare accepts: chunks get evicted
        budget_bytes = int(hf_elixir.min_device_budget_bytes(model, opt, cfg, world_size=mesh.dp_size) * 1.05) + 1024
        cfg = dataclasses.replace(cfg, device_memory_budget_bytes=budget_bytes)
    model, opt = hf_elixir.prepare(model, opt, cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_rel, norm_rel = 0.0, 0.0
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(**_batch(step, rank)).loss
        opt.backward(loss)
        norm = opt.clip_grad_norm(MAX_NORM)
        opt.step()
        opt_ref.zero_grad()
        ref_losses = [ref(**_batch(step, b)).loss for b in range(world)]
        torch.stack(ref_losses).mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt_ref.step()
        loss_rel = max(loss_rel, abs(loss.float().item() - ref_losses[rank].item()) / abs(ref_losses[rank].item()))
        norm_rel = max(norm_rel, abs(float(norm) - float(ref_norm)) / float(ref_norm))
    full = gather_full_state_dict(model, rank0_only=False) if ep > 1 else model.state_dict()
    ref_sd = ref.state_dict()
    stats = hf_elixir.memory_stats(model)
    metrics = {
        "loss_rel": loss_rel,
        "norm_rel": norm_rel,
        "param_rel": rel(torch.cat([full[k].flatten() for k in ref_sd]), torch.cat([ref_sd[k].flatten() for k in ref_sd])),
        "param_rel_worst_tensor": max(rel(full[k], ref_sd[k]) for k in ref_sd if ref_sd[k].norm() > 0),
        "worst_tensor": max((rel(full[k], ref_sd[k]), k) for k in ref_sd if ref_sd[k].norm() > 0)[1],
        "same_keys": list(full) == list(ref_sd),
        "params_moved": min(rel(ref_sd[k], init[k]) for k in ref_sd if ".mlp.experts." in k and ref_sd[k].dim() >= 2),
        "local_expert_shapes": local_expert_shapes,
        "expert_containers": dict(state.expert_containers) if ep > 1 else {},
        "num_evictions": stats["num_evictions"],
        "budget_bytes": budget_bytes,
        # ElixirConfig.split_fused_experts=True: each layer's local experts, one unit each
        "split_pieces": sorted({m._hf_elixir_split_experts.num_pieces for m in model.modules()
                                if hasattr(m, "_hf_elixir_split_experts")}),
    }
    if idle:  # PyTorch decays the never-routed slices (zero gradient, weight decay); they moved by exactly that
        decay = (1 - LR * WEIGHT_DECAY) ** STEPS
        idle_keys = [k for k in ref_sd if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")]
        metrics["idle_decay_rel"] = max(rel(full[k][2:], init[k][2:] * decay) for k in idle_keys)
        metrics["idle_moved"] = min(rel(full[k][2:], init[k][2:]) for k in idle_keys)
    if save_dir is not None:
        metrics.update(_save_and_reload(family, model, full, save_dir))
    return metrics


def _save_and_reload(family: str, model, full: dict, save_dir: str) -> dict:
    """``save_pretrained`` of the ep model (collective) -> plain ``from_pretrained``: the layout on disk is
    what plain transformers writes (per-expert tensors where its conversion mapping un-fuses them)."""
    import transformers as T
    from safetensors import safe_open

    model.save_pretrained(save_dir)
    plain_dir = save_dir + "-plain"
    if dist.get_rank() == 0:
        make_moe_model(family).save_pretrained(plain_dir)
    dist.barrier()
    keys = []
    for d in (save_dir, plain_dir):
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            keys.append(sorted(f.keys()))
    loaded = T.AutoModelForCausalLM.from_pretrained(save_dir, attn_implementation="eager")
    loaded_sd = loaded.state_dict()
    return {
        "disk_keys_as_plain": keys[0] == keys[1],
        "loaded_bitwise": all(torch.equal(loaded_sd[k], full[k]) for k in full),
        "loaded_keys_match": set(loaded_sd) == set(full),
    }


def stream_case(family: str, *, folder: str) -> dict:
    """``prepare(model_on_meta, checkpoint=folder)`` under ep=2 on a folder plain ``save_pretrained`` wrote
    (per-expert tensors, fused by transformers' converters; each rank builds its own experts only), against
    the same model loaded by ``from_pretrained``, parallelized and prepared; two training steps each."""
    import transformers as T

    import hf_elixir
    from hf_elixir.chunk import _stream_load
    from hf_elixir.parallel import gather_full_state_dict, parallelize

    if dist.get_rank() == 0:
        make_moe_model(family).save_pretrained(folder)
    dist.barrier()
    T.logging.set_verbosity_error()
    readers = []
    original = _stream_load.CheckpointReader.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        readers.append(self)

    runs = []
    for streamed in (False, True):
        cfg = hf_elixir.ElixirConfig(placements={"*.mlp.experts": "expert"}, expert_parallel_size=2,
                                     chunk_size_numel=CHUNK_NUMEL)
        if streamed:
            with torch.device("meta"):
                model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(folder))
        else:
            model = T.AutoModelForCausalLM.from_pretrained(folder).train()  # from_config's mode
        parallelize(model, cfg)
        opt = _adamw(model)
        _stream_load.CheckpointReader.__init__ = recording
        try:
            model, opt = hf_elixir.prepare(model, opt, cfg, checkpoint=folder if streamed else None)
        finally:
            _stream_load.CheckpointReader.__init__ = original
        losses = []
        for step in range(2):
            loss = model(**_batch(step, dist.get_rank())).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, gather_full_state_dict(model, rank0_only=False)))
    (plain_losses, plain_sd), (streamed_losses, streamed_sd) = runs
    expert_bytes = sum(v.numel() * v.element_size() for k, v in plain_sd.items() if ".mlp.experts." in k)
    return {
        "same_losses": plain_losses == streamed_losses,
        "bitwise": plain_sd.keys() == streamed_sd.keys() and all(torch.equal(plain_sd[k], streamed_sd[k]) for k in plain_sd),
        "read_bytes": sum(r.bytes_read for r in readers),
        "model_bytes": sum(v.numel() * v.element_size() for v in plain_sd.values()),
        "expert_bytes": expert_bytes,
    }


def kernels_case(family: str) -> dict:
    """One forward and backward of the ep=2 model twice, same weights and batch: the token permutation through
    the PyTorch references, then through the Triton kernels (``FusedExpertDispatch.force_triton``; the
    interpreter on CPU, ``TRITON_INTERPRET=1``), counting the kernels' launches."""
    import hf_elixir
    import triton_kernels.moe_permutation as moe
    from hf_elixir.parallel import build_mesh, parallelize
    from hf_elixir.parallel._fused_experts import FusedExpertDispatch

    model = make_moe_model(family)
    cfg = hf_elixir.ElixirConfig(placements={"*.mlp.experts": "expert"}, expert_parallel_size=2)
    parallelize(model, cfg, build_mesh(cfg))
    launches = {"n": 0}
    original = moe._gather_rows_kernel

    class _Counting:
        def __getitem__(self, grid):
            launches["n"] += 1
            return original[grid]

    runs = []
    for force in (False, True):
        FusedExpertDispatch.force_triton = force
        moe._gather_rows_kernel = _Counting() if force else original
        try:
            model.zero_grad(set_to_none=True)
            out = model(**_batch(0, dist.get_rank()))
            out.loss.backward()
        finally:
            FusedExpertDispatch.force_triton = False
            moe._gather_rows_kernel = original
        runs.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits_ref, grads_ref), (logits_k, grads_k) = runs
    return {"logits_rel": rel(logits_k, logits_ref), "grad_rel": max(rel(grads_k[n], grads_ref[n]) for n in grads_ref),
            "launches": launches["n"]}


def run_cases(rank: int, world_size: int, cases: list[tuple[str, dict]]) -> dict:
    """``run_distributed`` target: every case in order; ``{name: metrics}`` (``kind``: ``"train"``, the
    default, is :func:`ep_case`; ``"stream"`` :func:`stream_case`; ``"kernels"`` :func:`kernels_case`)."""
    torch.use_deterministic_algorithms(False)
    run = {"stream": stream_case, "kernels": kernels_case, "train": ep_case}
    return {name: run[kwargs.pop("kind", "train")](**kwargs) for name, kwargs in cases}
