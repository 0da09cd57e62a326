"""Multi-process harness for the tensor/expert-parallel tests (gloo, spawned ranks, free port).

Every case trains a tiny model for ``STEPS`` AdamW steps twice on every rank: once rewritten by
:func:`hf_elixir.parallel.parallelize` (each rank on its own data-parallel batch, gradients synced
with :func:`hf_elixir.parallel.reduce_gradients`) and once as the single-process reference (the
unmodified model, loss = mean of the per-batch losses over every distinct batch of the step, plain
``torch.optim.AdamW``: a parameter whose ``.grad`` is ``None``, such as an expert no token of the step
was routed to, is skipped, no moment update and no weight decay). Each case returns metrics; the
test asserts on them. Rank 0 writes ``results.json`` (worst value over ranks).

``*_idle`` cases mask router logits (:class:`RouterMask`, the same hook on both models) so that
chosen experts get no token in chosen steps: globally idle (PyTorch leaves their ``.grad`` ``None``)
or idle in only some batches (PyTorch gives them a gradient; under ep x dp one replica is idle).

``elixir_*`` cases additionally run ``hf_elixir.prepare`` on the parallelized model (chunks of
``CHUNK_NUMEL`` sharded over the data-parallel groups, no budget or a tight one that forces
evictions) and train through ``optimizer.backward / clip_grad_norm(MAX_NORM) / step / zero_grad``;
the reference clips with ``torch.nn.utils.clip_grad_norm_`` at the same norm, so the global norm
(tp-replicated parameters counted once) is compared every step.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 5
LR = 3e-3
WEIGHT_DECAY = 0.1
MAX_NORM = 0.05  # below every step's gradient norm, so clipping (and the replica-weighted norm) is exercised
CHUNK_NUMEL = 4096  # several chunks per tiny model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- tiny models ------------------------------------------------------------------------------------
def make_model(kind: str, *, router_bias: bool = False):
    import transformers as T

    torch.manual_seed(0)
    if kind in ("gpt2", "gpt2" + ODD):  # _odd: an MLP width of 63 (the spec's c_fc/c_proj block splits 32 + 31)
        cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                           n_inner=63 if kind.endswith(ODD) else None)
        return T.GPT2LMHeadModel(cfg)
    if kind == "opt":
        cfg = T.OPTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, vocab_size=128,
                          max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                          activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=0)
        return T.OPTForCausalLM(cfg)
    if kind == "switch":
        cfg = T.SwitchTransformersConfig(
            vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            num_experts=4, expert_capacity=3, num_sparse_encoder_layers=2, num_sparse_decoder_layers=2,
            router_jitter_noise=0.0, dropout_rate=0.0, router_z_loss_coef=0.01, router_aux_loss_coef=0.1,
            dense_act_fn="gelu_new", router_bias=router_bias, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )
        return T.SwitchTransformersForConditionalGeneration(cfg)
    if kind == "deepseek_v3":  # MLA attention (mla_kv_a_proj), shared experts, one MoE layer (experts ZeRO-sharded)
        return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, n_routed_experts=4, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1,
            num_experts_per_tok=2, max_position_embeddings=64, attention_dropout=0.0))
    if kind == "phi3_packed":  # Phi-3's fused gate_up_proj placed packed_colwise (its config's plan gathers it)
        cfg = T.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        cfg.base_model_tp_plan = {**T.Phi3Config.base_model_tp_plan, "layers.*.mlp.gate_up_proj": "packed_colwise",
                                  "layers.*.mlp.down_proj": "rowwise"}
        return T.Phi3ForCausalLM(cfg)
    if kind in ("llama4", "llama4" + ODD):  # tensor-parallel experts (moe_tp_experts; packed_rowwise gate_up_proj), a
        odd = kind.endswith(ODD)  # shared expert; _odd: expert width 15 (8 + 7 per packed part), MLP 63, vocabulary 255
        return T.Llama4ForCausalLM(T.Llama4TextConfig(
            hidden_size=32, intermediate_size=15 if odd else 16, intermediate_size_mlp=63 if odd else 64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=ODD_VOCAB if odd else 128, num_local_experts=2, max_position_embeddings=64,
            attention_dropout=0.0))
    family = kind.removesuffix(ODD)
    if family in PLAN_FAMILIES:  # tensor-parallel placements from the config's own base_model_tp_plan
        config_cls, model_cls, extra = PLAN_FAMILIES[family]
        sizes = {"vocab_size": ODD_VOCAB, "intermediate_size": 63} if kind.endswith(ODD) else \
            {"vocab_size": 128, "intermediate_size": 64}
        cfg = getattr(T, config_cls)(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=64, attention_dropout=0.0, **sizes, **extra)
        return getattr(T, model_cls)(cfg)
    raise ValueError(kind)


#: kind -> (config class, model class, config fields): tiny configs of today's dense families, built offline;
#: GQA (2 key/value heads for 4 query heads) on Llama, Qwen3 and Mistral; Qwen3 and Gemma3 add q_norm/k_norm
#: (``replicated_with_grad_allreduce``); Gemma3 ties lm_head to the (scaled) input embedding
PLAN_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": None}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 8,
                                                         "tie_word_embeddings": True}),
}


#: ``f"{family}{ODD}"``: the family with sizes tp 2 splits unevenly (a vocabulary of ``ODD_VOCAB``: 128 + 127 rows;
#: an MLP width of 63: 32 + 31), and batches drawn from the whole vocabulary (both ranks' rows are looked up)
ODD = "_odd"
ODD_VOCAB = 255


def make_batch(kind: str, step: int, index: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + index)
    if kind == "switch":
        ids = torch.randint(2, 128, (2, 8), generator=g)
        labels = torch.randint(2, 128, (2, 6), generator=g)
        return {"input_ids": ids, "labels": labels, "output_router_logits": True}
    ids = torch.randint(2, ODD_VOCAB if kind.endswith(ODD) and kind != "gpt2" + ODD else 128, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


class RouterMask:
    """Forward hook on every Switch ``router.classifier``: adds -1e4 to the logits of the experts that
    :attr:`SCHEDULE` masks for the current ``(step, batch)``, so they win no token (the same hook on
    the parallel model and the reference; the z-loss sees exp(-1e4) = 0 for them)."""

    #: step -> (expert, batches it is masked in: "all", or "first half" of the step's batches)
    SCHEDULE = {2: ((3, "all"),), 3: ((2, "first half"), (1, "all"))}

    def __init__(self, model, num_batches: int) -> None:
        self.step, self.batch, self.num_batches = 0, 0, num_batches
        for name, module in model.named_modules():
            if name.endswith("router.classifier"):
                module.register_forward_hook(self._hook)

    def masked(self) -> list[int]:
        half = max(1, self.num_batches // 2)
        return [e for e, where in self.SCHEDULE.get(self.step, ()) if where == "all" or self.batch < half]

    def _hook(self, module, args, logits):
        masked = self.masked()
        if not masked:
            return logits
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype)
        bias[masked] = -1e4
        return logits + bias


def _none_grad_layers(ref) -> dict[str, int]:
    """Expert index -> number of sparse layers where PyTorch left that expert's gradient ``None``."""
    out: dict[str, int] = {}
    for name, p in ref.named_parameters():
        if ".experts.expert_" in name and name.endswith("wi.weight"):
            e = name.split(".experts.expert_")[1].split(".")[0]
            out[e] = out.get(e, 0) + int(p.grad is None)
    return out


NULL_GRAD = 1e-6  # |grad| below this in every step: see [Note: null-gradient elements]


def _is_idle_expert(key: str, empty_experts: bool) -> bool:
    return empty_experts and (".experts.expert_2." in key or ".experts.expert_3." in key)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _grad_parity(local_grads: dict, ref_params: dict, state) -> tuple[float, float]:
    """Relative L2 between this rank's reduced gradients and the matching slice of the reference's."""
    from hf_elixir.parallel._tensor_parallel import _split

    mesh = state.mesh
    pairs = []
    for name, grad in local_grads.items():
        ref_grad = ref_params[name].grad
        if grad is None or ref_grad is None:  # has-gradient agreement is counted per step in train_case
            continue
        if name in state.tp_layouts:
            lay = state.tp_layouts[name]
            ref_grad = _split(ref_grad, lay.dim, lay.parts, mesh.tp_rank, mesh.tp_size)
        quiet = ref_grad.abs() < NULL_GRAD  # see [Note: null-gradient elements]
        pairs.append((grad.masked_fill(quiet, 0), ref_grad.masked_fill(quiet, 0)))
    total = rel(torch.cat([g.flatten() for g, _ in pairs]), torch.cat([r.flatten() for _, r in pairs]))
    return total, max(rel(g, r) for g, r in pairs if r.norm() > 0)


class _AutocastReference:
    """Plain PyTorch's own low-precision run of the reference: the same model, optimizer, batches and clipping, the
    forward under ``torch.autocast("cpu", dtype)`` (fp32 weights and optimizer). A low-precision hf_elixir run is
    compared with it, at a tolerance taken from its distance to the fp32 reference on the same machine (the CPU's
    bf16 kernels set both), never from a constant."""

    def __init__(self, ref, matrix_decay: bool, dtype: torch.dtype):
        self.model, self.dtype = copy.deepcopy(ref), dtype
        self.opt = torch.optim.AdamW(_param_groups(self.model, matrix_decay), lr=LR)
        self.losses, self.norms = [], []

    def step(self, kind: str, step: int, num_batches: int, my_batch: int, masks) -> None:
        self.opt.zero_grad()
        losses = []
        with torch.autocast("cpu", dtype=self.dtype):
            for b in range(num_batches):
                if masks:
                    masks[1].batch = b
                losses.append(self.model(**make_batch(kind, step, b)).loss.float())
        torch.stack(losses).mean().backward()
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)))
        self.opt.step()
        self.losses.append(losses[my_batch].item())


def _low_precision_metrics(auto: _AutocastReference, ref_losses, ref_norms, losses, norms, full, ref_sd, null,
                           param_keys) -> dict:
    """Distances of the autocast run to fp32 (``auto_*``) and of the hf_elixir run to the autocast run (``*_vs_auto``)."""
    def step_rel(a, b):
        return max(abs(x - y) / abs(y) for x, y in zip(a, b))

    def vec(sd):
        return torch.cat([sd[k].float().masked_fill(null[k], 0).flatten() for k in param_keys])

    auto_sd = auto.model.state_dict()
    return {"auto_loss_rel": step_rel(auto.losses, ref_losses), "auto_norm_rel": step_rel(auto.norms, ref_norms),
            "auto_param_rel": rel(vec(auto_sd), vec(ref_sd)), "loss_rel_vs_auto": step_rel(losses, auto.losses),
            "norm_rel_vs_auto": step_rel(norms, auto.norms), "param_rel_vs_auto": rel(vec(full), vec(auto_sd))}


# -- one case ---------------------------------------------------------------------------------------
def _tight_budget(model, optimizer, cfg, mesh) -> int:
    """A device budget a little above the smallest one ``prepare`` accepts, so chunks get evicted."""
    import hf_elixir

    import dataclasses

    cfg = dataclasses.replace(cfg, chunk_size_numel=CHUNK_NUMEL)  # the chunk size prepare will use
    base = hf_elixir.min_device_budget_bytes(model, optimizer, cfg, world_size=mesh.dp_size)
    # 5% above it: the floor counts tensor-parallel chunks as prepare packs them (it used to count them
    # merged, a few % low), and 25% above it leaves room to cache every chunk of the tiny OPT (no eviction)
    return int(base * 1.05) + 1024


def _half_state_budget(model, mesh) -> int:
    """A model-data budget of half the 16 B/param state this rank holds (fp32 weight, gradient, two Adam moments
    of its tensor-parallel shards, ZeRO-sharded over the data-parallel axis): offload is forced."""
    local_numel = sum(p.numel() for p in model.parameters())
    return 16 * local_numel // mesh.dp_size // 2


def _param_groups(model, matrix_decay: bool) -> list[dict]:
    params = list(model.parameters())
    if not matrix_decay:
        return [{"params": params, "weight_decay": WEIGHT_DECAY}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def train_case(kind: str, *, tp: int = 1, ep: int = 1, empty_experts: bool = False, save_dir: str | None = None,
               elixir: str | None = None, idle: bool = False, precision: str = "fp32", matrix_decay: bool = False):
    """One parity case; ``elixir`` = ``None`` (plain parallel layers + :func:`reduce_gradients` + AdamW),
    ``"unbudgeted"`` or ``"tight"`` (``hf_elixir.prepare`` on the parallelized model, chunks sharded
    over the data-parallel groups, no device budget or one that forces evictions; steps go through
    ``optimizer.backward / clip_grad_norm / step / zero_grad`` and both runs clip at ``MAX_NORM``).
    ``matrix_decay``: weight decay on matrices only (1-D norms and biases in a group without it)."""
    import hf_elixir
    from hf_elixir.parallel import build_mesh, gather_full_state_dict, parallelize, reduce_gradients

    model = make_model(kind, router_bias=empty_experts)
    if empty_experts:  # experts 2 and 3 (all of ep rank 1's) never win the argmax
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("router.classifier.bias"):
                    p[2:] = -1e4
    ref = copy.deepcopy(model)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    cfg = hf_elixir.ElixirConfig(tensor_parallel_size=tp, expert_parallel_size=ep)
    mesh = build_mesh(cfg)
    state = parallelize(model, cfg, mesh)
    my_batch = mesh.device_mesh.get_local_rank("dp") if mesh.mp_axis == "tp" else dist.get_rank()
    num_batches = mesh.num_batches
    masks = (RouterMask(model, num_batches), RouterMask(ref, num_batches)) if idle else ()
    none_grad_layers = []
    has_grad_mismatch = 0

    opt, opt_ref = (torch.optim.AdamW(_param_groups(m, matrix_decay), lr=LR) for m in (model, ref))
    extra: dict = {}
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    auto = _AutocastReference(ref, matrix_decay, low) if low is not None else None
    trace = {"ref_losses": [], "ref_norms": [], "losses": [], "norms": []}
    if elixir is not None:
        budget = {"tight": lambda: _tight_budget(model, opt, cfg, mesh),
                  "half": lambda: _half_state_budget(model, mesh)}.get(elixir, lambda: None)()
        # "tight" is a model-data budget (a little above the model-data floor): activations outside it
        ecfg = hf_elixir.ElixirConfig(tensor_parallel_size=tp, expert_parallel_size=ep, chunk_size_numel=CHUNK_NUMEL,
                                      device_memory_budget_bytes=budget, budget_covers_activations=False,
                                      precision=precision)
        model, opt = hf_elixir.prepare(model, opt, ecfg)
        extra["plan_placements"] = dict(hf_elixir.get_state(model).plan.placements)
    loss_rel = 0.0
    step_rels = []
    norm_rels = []
    grad_rel = grad_rel_worst = 0.0
    grad_max = {k: torch.zeros_like(p) for k, p in ref.named_parameters()}
    for step in range(STEPS):
        for mask in masks:
            mask.step = step
        if masks:
            masks[0].batch = my_batch
        opt.zero_grad()
        loss = model(**make_batch(kind, step, my_batch)).loss
        if elixir is not None:
            opt.backward(loss)
            norm = opt.clip_grad_norm(MAX_NORM)
        else:
            loss.backward()
            reduce_gradients(model)
            local_grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        opt.step()

        opt_ref.zero_grad()
        ref_losses = []
        for b in range(num_batches):
            if masks:
                masks[1].batch = b
            ref_losses.append(ref(**make_batch(kind, step, b)).loss)
        torch.stack(ref_losses).mean().backward()  # plain PyTorch: unused parameters keep .grad None
        ref_params = dict(ref.named_parameters())
        if elixir is None:  # the same parameters have a gradient as in PyTorch, every step
            has_grad_mismatch += sum((g is None) != (ref_params[n].grad is None) for n, g in local_grads.items())
        if kind == "switch":
            none_grad_layers.append(_none_grad_layers(ref))
        for k, p in ref.named_parameters():
            if p.grad is not None:
                torch.maximum(grad_max[k], p.grad.abs(), out=grad_max[k])
        if elixir is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            norm_rels.append(abs(float(norm) - float(ref_norm)) / float(ref_norm))
            trace["ref_norms"].append(float(ref_norm))
            trace["norms"].append(float(norm))
            extra["clipped_steps"] = extra.get("clipped_steps", 0) + int(float(ref_norm) > MAX_NORM)
        elif step == 0:
            grad_rel, grad_rel_worst = _grad_parity(local_grads, ref_params, state)
        opt_ref.step()
        if auto is not None:
            auto.step(kind, step, num_batches, my_batch, masks)
        trace["losses"].append(loss.item())
        trace["ref_losses"].append(ref_losses[my_batch].item())
        step_rel = abs(loss.item() - ref_losses[my_batch].item()) / abs(ref_losses[my_batch].item())
        loss_rel = max(loss_rel, step_rel)
        step_rels.append(step_rel)

    full = gather_full_state_dict(model, rank0_only=False)
    ref_sd = ref.state_dict()
    # [Note: null-gradient elements] GPT-2/OPT key-projection biases have an analytically zero
    # gradient (softmax is invariant to a per-query constant); both runs hold float noise there that
    # Adam scales up, so they are compared in absolute terms, everything else relatively.
    null = {k: (grad_max[k] > 0) & (grad_max[k] < NULL_GRAD) for k in grad_max}
    param_keys = [k for k in ref_sd if k in null]
    metrics = {
        "loss_rel": loss_rel,
        "grad_rel": grad_rel,  # step 0, after the reduction, before any optimizer step
        "grad_rel_worst_tensor": grad_rel_worst,
        "loss_rel_per_step": step_rels,
        # relative L2 over the whole parameter vector (what DDP parity is quoted in), and the worst
        # single tensor (catches a misplaced shard of a small tensor that the global norm would hide)
        "param_rel": rel(torch.cat([full[k].masked_fill(null[k], 0).flatten() for k in param_keys]),
                         torch.cat([ref_sd[k].masked_fill(null[k], 0).flatten() for k in param_keys])),
        "param_rel_worst_tensor": max(rel(full[k].masked_fill(null[k], 0), ref_sd[k].masked_fill(null[k], 0))
                                      for k in param_keys),
        "buffer_rel": max([rel(full[k], ref_sd[k]) for k in ref_sd if k not in null and ref_sd[k].is_floating_point()] or [0.0]),
        "null_grad_abs": max(float((full[k] - ref_sd[k])[null[k]].abs().max()) if null[k].any() else 0.0 for k in param_keys),
        "worst": sorted((rel(full[k].masked_fill(null[k], 0), ref_sd[k].masked_fill(null[k], 0)), k) for k in param_keys)[-3:],
        "null_grad_numel": sum(int(null[k].sum()) for k in param_keys if not _is_idle_expert(k, empty_experts)),
        "same_keys": list(full) == list(ref_sd),
        # every weight the reference trained moved (never-routed experts stay put: PyTorch skips them)
        "params_moved": min(rel(ref_sd[k], init[k]) for k in ref_sd
                            if k.endswith("weight") and not _is_idle_expert(k, empty_experts)),
        # the whole parameter vector's movement over the steps: a parity tolerance must sit well below it
        "params_moved_total": rel(torch.cat([ref_sd[k].flatten() for k in param_keys]),
                                  torch.cat([init[k].flatten() for k in param_keys])),
        "placements": {k: v for k, v in state.placements.items() if v != "sharded"},
        "has_grad_mismatch": has_grad_mismatch,  # plain path: parameters whose .grad is None only on one side
        "none_grad_layers": none_grad_layers,  # per step: expert -> sparse layers where PyTorch gave no gradient
        **extra,
    }
    if auto is not None:
        metrics.update(_low_precision_metrics(auto, trace["ref_losses"], trace["ref_norms"], trace["losses"],
                                              trace["norms"], full, ref_sd, null, param_keys))
    if elixir is not None:
        stats = hf_elixir.memory_stats(model)
        metrics["norm_rel"] = max(norm_rels)
        metrics["num_evictions"] = stats["num_evictions"]
        metrics["num_chunks"] = stats["num_chunks"]
        metrics["reduce_scatter_bytes"] = stats["reduce_scatter_bytes"]
    if empty_experts:
        decay = (1 - LR * WEIGHT_DECAY) ** STEPS
        idle = [k for k in full if ".experts.expert_2." in k or ".experts.expert_3." in k]
        busy = [k for k in full if ".experts.expert_0." in k or ".experts.expert_1." in k]
        metrics["idle_moved_rel"] = max(rel(full[k], init[k]) for k in idle)  # PyTorch skips them: unchanged
        metrics["busy_moved_rel"] = min(rel(full[k], init[k] * decay) for k in busy)
        metrics["num_idle_tensors"] = len(idle)
    if save_dir is not None:
        metrics.update(_save_and_reload(kind, model, full, save_dir))
    return metrics


class _CountLaunches:
    """Stands in for a ``@triton.jit`` kernel and counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def kernels_case() -> dict:
    """One forward and backward of the ep-2 Switch model twice, same weights and batch: the MoE
    permutation through the PyTorch references, then through the Triton kernels
    (``ExpertParallelExperts.force_triton``, the interpreter on CPU; needs ``TRITON_INTERPRET=1``)."""
    import hf_elixir
    import triton_kernels.moe_permutation as moe
    from hf_elixir.parallel import ExpertParallelExperts, build_mesh, parallelize

    model = make_model("switch")
    cfg = hf_elixir.ElixirConfig(expert_parallel_size=2)
    parallelize(model, cfg, build_mesh(cfg))
    batch = make_batch("switch", 0, dist.get_rank())
    kernels = {"_gather_rows_kernel": _CountLaunches(moe._gather_rows_kernel),
               "_combine_rows_kernel": _CountLaunches(moe._combine_rows_kernel)}
    runs = []
    for force in (False, True):
        ExpertParallelExperts.force_triton = force
        for name, counter in kernels.items():
            setattr(moe, name, counter if force else counter.kernel)
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        runs.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    for name, counter in kernels.items():
        setattr(moe, name, counter.kernel)
    ExpertParallelExperts.force_triton = False
    (logits_ref, grads_ref), (logits_kernel, grads_kernel) = runs
    last_experts = [n for n in grads_ref if n.startswith("decoder.block.1.") and ".experts." in n]
    return {
        "logits_bitwise": torch.equal(logits_kernel, logits_ref),
        "grad_keys_equal": set(grads_kernel) == set(grads_ref),
        "grad_rel": max(rel(grads_kernel[n], grads_ref[n]) for n in grads_ref),
        "num_last_experts": len(last_experts),
        "last_experts_bitwise": all(torch.equal(grads_kernel[n], grads_ref[n]) for n in last_experts),
        "launches": min(c.launches for c in kernels.values()),
    }


@contextlib.contextmanager
def _slow_config_writes(delay_s: float = 0.3):
    """Every ``PretrainedConfig.save_pretrained`` on this rank sleeps ``delay_s`` seconds first."""
    import transformers as T

    original = T.PretrainedConfig.save_pretrained

    def slow(self, *args, **kwargs):
        time.sleep(delay_s)
        return original(self, *args, **kwargs)

    T.PretrainedConfig.save_pretrained = slow
    try:
        yield
    finally:
        T.PretrainedConfig.save_pretrained = original


def _save_and_reload(kind: str, model, full: dict, save_dir: str) -> dict:
    import transformers as T

    from hf_elixir.parallel import local_state_dict

    # the plain HF call gathers the unmodified model's folder (collective); rank 0 writes config.json slowly, so a
    # rank that returns before the folder is final (reads it while rank 0 still writes) is seen below
    with _slow_config_writes() if dist.get_rank() == 0 else contextlib.nullcontext():
        model.save_pretrained(save_dir)
    config_mtime = os.stat(os.path.join(save_dir, "config.json")).st_mtime_ns
    dist.barrier()
    folder_final = os.stat(os.path.join(save_dir, "config.json")).st_mtime_ns == config_mtime
    try:  # this rank's parts as state_dict= (what a Trainer would pass): refused, nothing written
        model.save_pretrained(save_dir + "-partial", state_dict=local_state_dict(model))
        partial_refused = False
    except ValueError as err:
        partial_refused = "save_pretrained_full" in str(err) and not os.path.exists(save_dir + "-partial")
    cls = {"gpt2": T.GPT2LMHeadModel, "opt": T.OPTForCausalLM,
           "switch": T.SwitchTransformersForConditionalGeneration, "deepseek_v3": T.DeepseekV3ForCausalLM,
           "phi3_packed": T.Phi3ForCausalLM, "llama4": T.Llama4ForCausalLM,
           **{k: getattr(T, v[1]) for k, v in PLAN_FAMILIES.items()}}[kind.removesuffix(ODD)]
    loaded = cls.from_pretrained(save_dir)
    loaded_sd = loaded.state_dict()
    batch = make_batch(kind, 99, 0)
    model.eval(), loaded.eval()
    with torch.no_grad():
        out_parallel = model(**batch).logits  # collective: every rank runs it
        out_loaded = loaded(**batch).logits
    dist.barrier()
    return {
        "loaded_class": type(loaded).__name__,
        "folder_final": folder_final,  # nothing rewrote config.json after save_pretrained returned on this rank
        "loaded_bitwise": all(torch.equal(loaded_sd[k], full[k]) for k in full),
        "partial_refused": partial_refused,
        "loaded_keys_match": set(loaded_sd) == set(full),
        "logits_rel": rel(out_loaded, out_parallel),
    }


def stream_case(kind: str, out_dir: str) -> dict:
    """``prepare(model_on_meta, checkpoint=folder)`` under TP=2 on a folder plain transformers wrote (rank 0's
    ``save_pretrained`` of the seeded model): the meta model is parallelized from its config's plan, each rank
    reads its slices of the full tensors. Compared bitwise with the saved weights, then one training step
    against the same model loaded whole (``from_pretrained``) and parallelized."""
    import hf_elixir
    from hf_elixir.chunk import _stream_load
    from hf_elixir.parallel import gather_full_state_dict, parallelize

    ref = make_model(kind)
    folder = os.path.join(out_dir, f"plain_{kind}")
    if dist.get_rank() == 0:
        ref.save_pretrained(folder)
    dist.barrier()
    cfg = hf_elixir.ElixirConfig(tensor_parallel_size=2, chunk_size_numel=CHUNK_NUMEL)
    runs, read = [], []
    original_close = _stream_load.StreamedInit.close
    for streamed in (True, False):
        if streamed:
            with torch.device("meta"):
                model = type(ref)(ref.config)
        else:
            model = type(ref).from_pretrained(folder)
        was_meta = all(p.is_meta for p in model.parameters())
        parallelize(model, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        _stream_load.StreamedInit.close = lambda self: (read.append(self.reader.bytes_read), original_close(self))[1]
        try:
            model, opt = hf_elixir.prepare(model, opt, cfg, checkpoint=folder if streamed else None)
        finally:
            _stream_load.StreamedInit.close = original_close
        loaded = gather_full_state_dict(model, rank0_only=False)
        loss = model(**make_batch(kind, 0, 0)).loss
        opt.backward(loss)
        opt.step()
        runs.append((was_meta, loaded, loss.item(), gather_full_state_dict(model, rank0_only=False)))
    ref_sd = ref.state_dict()
    (meta, streamed_sd, streamed_loss, streamed_after), (_, _, loaded_loss, loaded_after) = runs
    folder_bytes = sum(t.numel() * t.element_size() for t in ref_sd.values())
    return {
        "was_meta": meta,
        "stream_bitwise": all(torch.equal(streamed_sd[k], ref_sd[k]) for k in ref_sd),
        "same_keys": list(streamed_sd) == list(ref_sd),
        "step_bitwise": streamed_loss == loaded_loss and all(torch.equal(streamed_after[k], loaded_after[k])
                                                             for k in loaded_after),
        "read_fraction": max(read) / folder_bytes,  # this rank's bytes read / the model's bytes
        "step_loss_rel": abs(streamed_loss - loaded_loss) / abs(loaded_loss),
        "step_param_rel": max(rel(streamed_after[k], loaded_after[k]) for k in loaded_after),
        "step_worst": max((rel(streamed_after[k], loaded_after[k]), k) for k in loaded_after),
    }


def expert_with_tp_case() -> dict:
    """Mixtral with tensor_parallel_size=2 and its experts placed 'expert' (no expert-parallel axis): refused by
    parallelize, where the experts' all-to-all used to run on WORLD and fail in the first forward."""
    import hf_elixir
    from hf_elixir.parallel import parallelize
    from tests._moe_models import make_moe_model

    try:
        parallelize(make_moe_model("mixtral"), hf_elixir.ElixirConfig(tensor_parallel_size=2,
                                                                     placements={"*.mlp.experts": "expert"}))
    except ValueError as err:
        return {"refused": str(err)}
    return {"refused": ""}


CASES = {
    "expert_with_tp2": lambda d: expert_with_tp_case(),
    "gpt2_tp2": lambda d: train_case("gpt2", tp=2, save_dir=os.path.join(d, "gpt2_tp2")),
    "opt_tp2": lambda d: train_case("opt", tp=2, save_dir=os.path.join(d, "opt_tp2")),
    "gpt2_tp2_dp2": lambda d: train_case("gpt2", tp=2),
    "opt_tp2_dp2": lambda d: train_case("opt", tp=2),
    "switch_ep2": lambda d: train_case("switch", ep=2, save_dir=os.path.join(d, "switch_ep2")),
    "switch_ep4": lambda d: train_case("switch", ep=4),
    "switch_ep2_dp2": lambda d: train_case("switch", ep=2),
    "switch_ep2_empty": lambda d: train_case("switch", ep=2, empty_experts=True),
    "switch_ep2_idle": lambda d: train_case("switch", ep=2, idle=True),
    "switch_ep2_kernels": lambda d: kernels_case(),
    "switch_ep4_idle": lambda d: train_case("switch", ep=4, idle=True),
    "switch_ep2_dp2_idle": lambda d: train_case("switch", ep=2, idle=True),
    # the same on prepared (chunked) models: hf_elixir.prepare after parallelize
    "elixir_gpt2_tp2": lambda d: train_case("gpt2", tp=2, elixir="unbudgeted", save_dir=os.path.join(d, "e_gpt2")),
    "elixir_gpt2_tp2_tight": lambda d: train_case("gpt2", tp=2, elixir="tight"),
    "elixir_opt_tp2_tight": lambda d: train_case("opt", tp=2, elixir="tight", save_dir=os.path.join(d, "e_opt")),
    "elixir_gpt2_tp2_dp2_tight": lambda d: train_case("gpt2", tp=2, elixir="tight"),
    "elixir_switch_ep2": lambda d: train_case("switch", ep=2, elixir="unbudgeted", save_dir=os.path.join(d, "e_sw")),
    "elixir_switch_ep2_tight": lambda d: train_case("switch", ep=2, elixir="tight"),
    "elixir_switch_ep2_empty_tight": lambda d: train_case("switch", ep=2, empty_experts=True, elixir="tight"),
    "elixir_switch_ep2_dp2_tight": lambda d: train_case("switch", ep=2, elixir="tight"),
    "elixir_switch_ep2_idle": lambda d: train_case("switch", ep=2, elixir="unbudgeted", idle=True),
    "elixir_switch_ep4_idle_tight": lambda d: train_case("switch", ep=4, elixir="tight", idle=True),
    "elixir_switch_ep2_dp2_idle_tight": lambda d: train_case("switch", ep=2, elixir="tight", idle=True),
}
# today's dense families, tensor parallel read from their config's plan: plain, prepared with no budget, and
# prepared with a model-data budget of half the 16 B/param state (offload forced)
for _kind in PLAN_FAMILIES:
    CASES[f"{_kind}_tp2"] = lambda d, k=_kind: train_case(k, tp=2, save_dir=os.path.join(d, f"{k}_tp2"))
    CASES[f"elixir_{_kind}_tp2"] = lambda d, k=_kind: train_case(k, tp=2, elixir="unbudgeted")
    CASES[f"elixir_{_kind}_tp2_half"] = lambda d, k=_kind: train_case(k, tp=2, elixir="half",
                                                                    save_dir=os.path.join(d, f"e_{k}"))
    CASES[f"elixir_{_kind}_tp2_half_bf16"] = lambda d, k=_kind: train_case(k, tp=2, elixir="half", precision="bf16")
PLAN_CASES = [c for k in PLAN_FAMILIES for c in (f"{k}_tp2", f"elixir_{k}_tp2", f"elixir_{k}_tp2_half")]
PLAN_CASES += ["elixir_llama_tp2_half_bf16", "elixir_gemma3_tp2_half_bf16"]
#: plan styles beyond column/row: DeepSeek-V3's mla_kv_a_proj, Phi-3's gate_up_proj as packed_colwise, Llama-4's
#: moe_tp_experts (packed_rowwise gate_up_proj)
STYLE_FAMILIES = ("deepseek_v3", "phi3_packed", "llama4")
for _kind in STYLE_FAMILIES:
    CASES[f"{_kind}_tp2"] = lambda d, k=_kind: train_case(k, tp=2, save_dir=os.path.join(d, f"{k}_tp2"))
    CASES[f"elixir_{_kind}_tp2_half"] = lambda d, k=_kind: train_case(k, tp=2, elixir="half")
    PLAN_CASES += [f"{_kind}_tp2", f"elixir_{_kind}_tp2_half"]
PLAN_CASES.append("expert_with_tp2")
for _kind in ("llama", "gemma3"):
    CASES[f"stream_{_kind}_tp2"] = lambda d, k=_kind: stream_case(k, d)
    PLAN_CASES.append(f"stream_{_kind}_tp2")
# uneven tensor-parallel slices (vocabulary 255, MLP width 63 at tp 2): plain, and prepared with half the state
# offloaded (clipping every step), each saved with save_pretrained and reloaded; Llama also streamed from a folder
UNEVEN_CASES = []
for _kind in PLAN_FAMILIES:
    _odd = _kind + ODD
    CASES[f"{_odd}_tp2"] = lambda d, k=_odd: train_case(k, tp=2, save_dir=os.path.join(d, f"{k}_tp2"))
    CASES[f"elixir_{_odd}_tp2_half"] = lambda d, k=_odd: train_case(k, tp=2, elixir="half",
                                                                   save_dir=os.path.join(d, f"e_{k}"))
    UNEVEN_CASES += [f"{_odd}_tp2", f"elixir_{_odd}_tp2_half"]
CASES[f"stream_llama{ODD}_tp2"] = lambda d: stream_case("llama" + ODD, d)
CASES[f"gpt2{ODD}_tp2"] = lambda d: train_case("gpt2" + ODD, tp=2, save_dir=os.path.join(d, f"gpt2{ODD}_tp2"))
CASES[f"llama4{ODD}_tp2"] = lambda d: train_case("llama4" + ODD, tp=2, save_dir=os.path.join(d, f"llama4{ODD}_tp2"))
UNEVEN_CASES += [f"stream_llama{ODD}_tp2", f"gpt2{ODD}_tp2", f"llama4{ODD}_tp2"]


def _merge(values: list) -> object:
    """Worst value over ranks: max for errors/relative diffs, min for booleans and 'moved' checks."""
    first = values[0]
    if isinstance(first, bool):
        return all(values)
    if isinstance(first, (int, float)):
        return max(values)
    return first


def _worker(rank: int, world_size: int, port: int, cases: list[str], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    log = Path(out_dir, f"rank{rank}.log")  # what run_cases prints if the ranks hang
    for case in cases:
        with log.open("a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} start {case}\n")
        try:
            metrics = CASES[case](out_dir)
        except Exception:  # report, keep going: the other ranks raise too or time out
            metrics = {"error": f"rank {rank}: {traceback.format_exc()}"}
            with log.open("a") as f:
                f.write(metrics["error"])
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, metrics)
        keys = {k for m in gathered for k in m}
        merged = {k: _merge([m[k] for m in gathered if k in m]) for k in keys}
        for k in ("busy_moved_rel", "params_moved", "num_evictions"):
            if k in merged:
                merged[k] = min(m[k] for m in gathered if k in m)
        results[case] = merged
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _tail(path: Path, lines: int = 40) -> list[str]:
    return path.read_text().splitlines()[-lines:] if path.exists() else ["(no log)"]


def run_cases(world_size: int, cases: list[str], out_dir: str, timeout_s: float = 240.0) -> dict:
    """Spawn ``world_size`` gloo ranks running ``cases``; kill them after ``timeout_s`` (a hang).

    Returns ``{case: metrics}``; raises ``TimeoutError`` on a hang, with the case each rank was in and the
    errors it met (a rank that raised while the others wait in a collective is the usual cause). Keep
    ``timeout_s`` under pytest's own ``timeout`` (pyproject) so that this message is what a hang prints.
    """
    ctx = mp.start_processes(_worker, args=(world_size, free_port(), cases, out_dir), nprocs=world_size,
                             join=False, start_method="spawn")
    start = time.monotonic()
    while not ctx.join(timeout=1.0):
        if time.monotonic() - start > timeout_s:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            logs = "".join(f"\n--- rank {r} ---\n" + "\n".join(_tail(Path(out_dir, f"rank{r}.log")))
                           for r in range(world_size))
            raise TimeoutError(f"{world_size} ranks running {cases} did not finish in {timeout_s:.0f} s (hang?)"
                               + logs)
    return json.loads(Path(out_dir, "results.json").read_text())


#: every case, by the number of ranks it runs on (one spawn per world size for the whole session)
SUITES = {
    2: ["gpt2_tp2", "opt_tp2", "switch_ep2", "switch_ep2_empty", "elixir_gpt2_tp2", "elixir_gpt2_tp2_tight",
        "elixir_opt_tp2_tight", "elixir_switch_ep2", "elixir_switch_ep2_tight", "elixir_switch_ep2_empty_tight",
        "switch_ep2_idle", "elixir_switch_ep2_idle", "switch_ep2_kernels"],
    4: ["gpt2_tp2_dp2", "switch_ep4", "switch_ep2_dp2", "elixir_gpt2_tp2_dp2_tight", "elixir_switch_ep2_dp2_tight",
        "switch_ep4_idle", "switch_ep2_dp2_idle", "elixir_switch_ep4_idle_tight", "elixir_switch_ep2_dp2_idle_tight"],
}
_SUITE_RESULTS: dict[int, object] = {}


def run_suite(world_size: int, out_dir: str, timeout_s: float = 420.0) -> dict:
    """All of ``SUITES[world_size]`` in one spawn, run once per test session (starting 2 or 4 ranks that
    import transformers costs more than the cases): the tensor- and expert-parallel test files share
    the result. A failure (hang) is remembered and re-raised for every caller."""
    if world_size not in _SUITE_RESULTS:
        try:
            _SUITE_RESULTS[world_size] = run_cases(world_size, SUITES[world_size], out_dir, timeout_s)
        except Exception as err:  # noqa: BLE001 - re-raised below, here and for later callers
            _SUITE_RESULTS[world_size] = err
    result = _SUITE_RESULTS[world_size]
    if isinstance(result, Exception):
        raise result
    return result


if __name__ == "__main__":  # manual run: python tests/parallel_harness.py 2 gpt2_tp2
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(run_cases(int(sys.argv[1]), sys.argv[2:], d), indent=1))
