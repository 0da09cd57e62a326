"""Tiny GPT-2 / OPT / Switch-Transformers models and batches for tests (dropout off, fixed seeds)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 128


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    transformers.logging.set_verbosity_error()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "opt":
        cfg = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64,
                                     vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32,
                                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                     layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)
        return transformers.OPTForCausalLM(cfg)
    if kind == "switch":
        cfg = transformers.SwitchTransformersConfig(
            vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
            num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
            dropout_rate=0.0, router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1, output_router_logits=True)
        return transformers.SwitchTransformersForConditionalGeneration(cfg)
    raise ValueError(kind)


def batch(kind: str, step: int, rows: int, seq: int = 12, seed: int = 1234) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + step)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    if kind == "switch":
        labels = torch.randint(3, VOCAB, (rows, 6), generator=g)
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids.clone()}


def rank_batch(kind: str, step: int, rank: int, world_size: int, rows: int) -> dict[str, torch.Tensor]:
    """This rank's ``rows`` of the global batch ``batch(kind, step, rows * world_size)`` (the reference
    trains on the whole global batch)."""
    full = batch(kind, step, rows * world_size)
    return {k: v[rank * rows:(rank + 1) * rows] for k, v in full.items()}


def two_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def plain_step(ref: torch.nn.Module, ref_opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """One plain-PyTorch causal-LM step of the reference run on ``ids``; its loss."""
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return float(loss.detach())


def rank_mean(values: list[float], world_size: int) -> list[float]:
    """``values`` averaged over the ranks (all-reduce), as every rank's loss of a data-parallel step averages."""
    if world_size == 1:
        return values
    total = torch.tensor(values)
    torch.distributed.all_reduce(total)
    return (total / world_size).tolist()


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    keys = sorted(set(a) & set(b))
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in keys)
    den = sum(float(b[k].double().norm() ** 2) for k in keys)
    return (num / den) ** 0.5


def float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 copy of ``model.state_dict()`` (parity references and snapshots between steps)."""
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


#: seconds every access event costs in a :func:`fixed_times` profile beyond its parameters' elements
FIXED_EVENT_S = 30e-6
#: seconds per parameter element an access event uses in a :func:`fixed_times` profile (backward: twice that)
FIXED_NUMEL_S = 2e-8


def fixed_times(profile, event_s: float = FIXED_EVENT_S, numel_s: float = FIXED_NUMEL_S):
    """A copy of ``profile`` (a measured :class:`~hf_elixir.profiler.StepProfile`) whose measured seconds are
    replaced by ones derived from the trace alone: each event takes ``event_s + numel_s * n`` seconds forward
    and ``event_s + 2 * numel_s * n`` backward, ``n`` the elements of the parameters it uses; ``forward_s`` /
    ``backward_s`` and the plain (untraced) times are the sums, so the cost model rescales nothing. The
    defaults are the order of what a tiny GPT-2 step measures on one CPU thread (30-250 us per event).

    Tests that check the search's decisions price with these (and a fixed ``HardwareProfile``, see
    :func:`fixed_cpu_hardware`): a measured profile on a loaded machine changes which configuration wins.
    Tests of the measurement itself keep measuring."""
    import dataclasses

    events = []
    for e in profile.events:
        numel = sum(profile.param_numels[i] for i in e.params)
        events.append(dataclasses.replace(e, compute_s=event_s + numel_s * numel * (2 if e.phase == "bwd" else 1)))
    fwd = sum(e.compute_s for e in events if e.phase == "fwd")
    bwd = sum(e.compute_s for e in events if e.phase == "bwd")
    return dataclasses.replace(profile, events=events, forward_s=fwd, backward_s=bwd, plain_forward_s=fwd,
                               plain_backward_s=bwd)


def fixed_cpu_hardware(budget_bytes: int = 2**30, **changes):
    """A CPU :class:`~hf_elixir.profiler.HardwareProfile` with fixed rates (what ``probe_hardware`` measured on a
    2-core test VM, rounded) and ``budget_bytes`` of device memory; ``changes`` override any field. For tests
    that check the search's decisions instead of ``probe_hardware``, whose timings vary with the machine's load."""
    import dataclasses

    from hf_elixir.profiler import HardwareProfile

    hw = HardwareProfile(hostname="test", device_name="cpu", device_kind="cpu", device_total_bytes=budget_bytes,
                         device_free_bytes=budget_bytes, host_total_bytes=64 * 2**30,
                         host_available_bytes=64 * 2**30, h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9,
                         host_adam_numel_per_s=5e8, device_adam_numel_per_s=5e8, device_flops_per_s=2e9,
                         device_fp32_flops_per_s=2e9, hook_event_s=40e-6, onload_fixed_s=60e-6,
                         optim_tensor_s=6e-6, world_size=1, can_overlap=False)
    return dataclasses.replace(hw, **changes)


def low_precision_reference(steps: int, rows: int, dtype: torch.dtype, lr: float = 5e-3,
                            schedule=None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Plain PyTorch mixed precision on tiny GPT-2: fp32 masters stepped by AdamW (``two_groups``; ``schedule``: a
    ``LambdaLR`` factor, stepped after each step) from the gradients of a ``dtype`` copy cast from the masters
    before every step, which is cast once more at the end. Returns ``(masters, model)``."""
    masters = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(masters), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule is not None else None
    model = tiny_model("gpt2").to(dtype)
    for step in range(steps):
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters.parameters()):
                p.copy_(m)
        model.zero_grad()
        model(**batch("gpt2", step, rows)).loss.backward()
        for p, m in zip(model.parameters(), masters.parameters()):
            m.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters.parameters()):
            p.copy_(m)
    return masters, model


def priced_plan(profile, resident: list[int], prediction, chunk_size_numel: int = 4096):
    """An fp32 one-rank ``ElixirPlan`` for ``profile`` holding ``resident`` chunks resident (and as device shards),
    no prefetch, carrying ``prediction``'s step time and device peak: a priced plan, whose lists ``prepare``
    follows even when empty (else the budget decides)."""
    from hf_elixir.plan import ElixirPlan

    return ElixirPlan(model_type=profile.model_type, num_params=profile.num_params, world_size=1, precision="fp32",
                      chunk_size_numel=chunk_size_numel, param_order=list(profile.param_names),
                      resident_chunks=resident, device_shard_chunks=resident, prefetch_depth=0,
                      predicted_step_s=prediction.step_s, predicted_peak_device_bytes=prediction.device_peak_bytes)
