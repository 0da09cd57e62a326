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


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    keys = sorted(set(a) & set(b))
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in keys)
    den = sum(float(b[k].double().norm() ** 2) for k in keys)
    return (num / den) ** 0.5


def float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 copy of ``model.state_dict()`` (parity references and snapshots between steps)."""
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}
