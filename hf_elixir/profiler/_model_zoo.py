"""Offline model configs and meta-device construction for planning (nothing big is materialised).

Built-in sizes follow the published model cards' configurations (GPT-2: Radford et al. 2019; OPT: Zhang
et al. 2022, table 1; Switch Transformers base-N: Fedus et al. 2021, T5-base backbone; today's models from the ``config.json`` their
publishers ship on the hub: meta-llama/Llama-3.1-8B, Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1,
deepseek-ai/DeepSeek-V3, openai/gpt-oss-20b, meta-llama/Llama-3.1-405B; ``kimi-k2-like``: moonshotai/Kimi-K2's
numbers on the DeepSeek-V3 architecture). Any other model
is read from a local directory or a ``config.json`` file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["BUILTIN_MODELS", "load_config", "meta_model_and_batch"]

_GPT2 = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}
_OPT = {  # layers, hidden, heads, ffn
    "125m": (12, 768, 12, 3072), "350m": (24, 1024, 16, 4096), "1.3b": (24, 2048, 32, 8192),
    "2.7b": (32, 2560, 32, 10240), "6.7b": (32, 4096, 32, 16384), "13b": (40, 5120, 40, 20480),
    "30b": (48, 7168, 56, 28672), "66b": (64, 9216, 72, 36864),
}
_SWITCH = (8, 16, 32, 64, 128)
# today's models: the published configs' dimensions (hidden, layers, heads, kv heads, intermediate, experts,
# top-k, vocab); names with and without the hub organisation
_TODAY: dict[tuple[str, str], dict[str, Any]] = {
    ("meta-llama", "Llama-3.1-8B"): {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False},
    ("meta-llama", "Llama-3.1-70B"): {
        "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False},
    ("Qwen", "Qwen3-30B-A3B"): {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False},
    ("mistralai", "Mixtral-8x7B-v0.1"): {
        "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1e6, "tie_word_embeddings": False},
    ("deepseek-ai", "DeepSeek-V3"): {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "n_group": 8, "topk_group": 4, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
        "tie_word_embeddings": False},
    ("meta-llama", "Llama-3.1-405B"): {
        "model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126, "num_attention_heads": 128,
        "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False},
    ("openai", "gpt-oss-20b"): {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 201088, "max_position_embeddings": 131072, "sliding_window": 128,
        "tie_word_embeddings": False},
}


# a 1T-parameter MoE from moonshotai/Kimi-K2-Instruct's published config.json numbers, built as the DeepSeek-V3
# architecture it uses (MLA attention, one shared expert, the first layer dense): not the hub model itself
# (its tokenizer, weights and remote code are not used), hence the name
_KIMI_K2_LIKE: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 163840, "max_position_embeddings": 131072, "tie_word_embeddings": False}


def _builtin() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, (layers, hidden, heads) in _GPT2.items():
        cfg = {"model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": heads}
        out[name] = cfg
        out[f"openai-community/{name}"] = cfg
    for size, (layers, hidden, heads, ffn) in _OPT.items():
        cfg = {"model_type": "opt", "num_hidden_layers": layers, "hidden_size": hidden,
               "num_attention_heads": heads, "ffn_dim": ffn, "word_embed_proj_dim": hidden,
               "max_position_embeddings": 2048, "vocab_size": 50272}
        if size == "350m":
            cfg.update(word_embed_proj_dim=512, do_layer_norm_before=False)
        out[f"opt-{size}"] = cfg
        out[f"facebook/opt-{size}"] = cfg
    for experts in _SWITCH:
        cfg = {"model_type": "switch_transformers", "num_experts": experts, "d_model": 768, "d_ff": 2048,
               "num_heads": 12, "d_kv": 64, "num_layers": 12, "num_decoder_layers": 12,
               "num_sparse_encoder_layers": 6, "num_sparse_decoder_layers": 6, "vocab_size": 32128,
               "decoder_start_token_id": 0}
        out[f"switch-base-{experts}"] = cfg
        out[f"google/switch-base-{experts}"] = cfg
    for (org, name), cfg in _TODAY.items():
        out[name] = out[name.lower()] = out[f"{org}/{name}"] = cfg
    out["mixtral-8x7b"] = _TODAY[("mistralai", "Mixtral-8x7B-v0.1")]
    out["kimi-k2-like"] = _KIMI_K2_LIKE
    # special token ids inside the 128-token vocabulary (GPT2Config's defaults, 50256, are not: a warning)
    out["tiny-gpt2"] = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128,
                        "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0}
    return out


BUILTIN_MODELS = _builtin()


def load_config(model: str):
    """A ``transformers`` config for a built-in name, a local model directory or a ``config.json`` file.

    Raises:
        ValueError: the name is neither built in nor a readable local path (lists the built-ins).
    """
    from transformers import AutoConfig

    if model in BUILTIN_MODELS:
        values = dict(BUILTIN_MODELS[model])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    path = Path(model)
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.is_file():
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{str(path)!r} is not valid JSON ({err}); pass a transformers config.json") from None
        if "model_type" not in values:
            raise ValueError(f"{str(path)!r} has no 'model_type'; it is not a transformers config.json")
        return AutoConfig.for_model(values.pop("model_type"), **values)
    names = ", ".join(sorted(n for n in BUILTIN_MODELS if "/" not in n))
    raise ValueError(f"--model {model!r} is not a built-in config ({names}) nor a local directory/config.json "
                     "(no hub access is assumed: download the config.json and pass its path)")


def _model_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if getattr(config, "is_encoder_decoder", False):
        return AutoModelForSeq2SeqLM
    return AutoModelForCausalLM


def meta_model_and_batch(config, *, batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32,
                         device: str = "meta"):
    """Build the model for ``config`` (on meta unless ``device="cpu"``) and a sample batch of token ids.

    Returns:
        ``(model, batch)`` where ``batch`` holds ``input_ids`` and ``labels`` of shape
        ``(batch_size, seq_len)`` (int64), on the same device.
    """
    from accelerate import init_empty_weights

    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = 0
    cls = _model_class(config)
    if device == "meta":
        # the default device too: fused expert tensors (``nn.Parameter(torch.empty(E, 2I, H))``, 30 GB a layer for
        # DeepSeek-V3) would otherwise be allocated on the host before init_empty_weights moves them to meta
        with init_empty_weights(), torch.device("meta"):
            model = cls.from_config(config, dtype=dtype)
    else:
        model = cls.from_config(config, dtype=dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # init_empty_weights leaves lm_head untied in transformers 5.x
    if not getattr(config, "is_encoder_decoder", False) and getattr(model, "loss_type", "") is None:
        # transformers names the loss from the class name; GPT2LMHeadModel matches none and warns
        # "loss_type=None ... unrecognized" on the first loss before using this same causal-LM loss
        model.loss_type = "ForCausalLM"
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    if device == "meta":
        ids = torch.empty(batch_size, seq_len, dtype=torch.long, device="meta")
    else:
        ids = torch.randint(0, vocab, (batch_size, seq_len))
    return model, {"input_ids": ids, "labels": ids}
