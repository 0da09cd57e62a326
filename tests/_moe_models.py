"""Tiny configs (built offline) of today's fused-expert MoE families, for the expert-parallel tests.

Each: 2 layers, hidden 32, 4 experts, top-2, router losses returned (``output_router_logits``), no dropout,
so an expert slice of a ``(4, 64, 32)`` fused ``gate_up_proj`` under ``expert_parallel_size=2`` is 4096
elements. DeepSeek-V3 keeps its first layer dense (``first_k_dense_replace=1``), routes by sigmoid scores
over 2 groups (group-limited top-k) and adds a shared expert.
"""

from __future__ import annotations

import torch

__all__ = ["MOE_FAMILIES", "make_moe_model"]

MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3")

_COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
               output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False,
               bos_token_id=0, eos_token_id=1, pad_token_id=None)


def moe_config(family: str):
    """The tiny config of ``family`` (one of :data:`MOE_FAMILIES`)."""
    import transformers as T

    if family == "mixtral":
        return T.MixtralConfig(**_COMMON, intermediate_size=32, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, router_jitter_noise=0.0)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=32, num_key_value_heads=2,
                                head_dim=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[])
    if family == "olmoe":
        return T.OlmoeConfig(**_COMMON, intermediate_size=32, num_key_value_heads=4, num_experts=4,
                             num_experts_per_tok=2)
    if family == "gpt_oss":
        return T.GptOssConfig(**_COMMON, intermediate_size=32, num_key_value_heads=2, head_dim=8,
                              num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "deepseek_v3":
        return T.DeepseekV3Config(**_COMMON, intermediate_size=64, moe_intermediate_size=32, num_key_value_heads=4,
                                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                  topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                  qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, rope_interleave=False)
    raise ValueError(f"family={family!r}; use one of {MOE_FAMILIES}")


def make_moe_model(family: str, seed: int = 0):
    """A fresh fp32 ``AutoModelForCausalLM`` of ``family``'s tiny config (eager attention), seeded."""
    import transformers as T

    torch.manual_seed(seed)
    return T.AutoModelForCausalLM.from_config(moe_config(family), attn_implementation="eager")
