"""resolve_placements: registry specs, glob overrides, and the user errors (single process)."""


import pytest
import torch
import transformers as T

import hf_elixir
from hf_elixir.placement import (
    ModelPlacementSpec,
    get_model_spec,
    register_model_spec,
    resolve_placements,
)


def gpt2(n_head=4):
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=n_head, vocab_size=128, n_positions=32,
                                          bos_token_id=0, eos_token_id=0))


def opt():
    return T.OPTForCausalLM(T.OPTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64,
                                        vocab_size=128, max_position_embeddings=32, word_embed_proj_dim=32,
                                        pad_token_id=1, bos_token_id=0, eos_token_id=0))


def switch(num_experts=4):
    return T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=num_experts, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1))


def cfg(**kw):
    return hf_elixir.ElixirConfig(**kw)


def test_every_param_module_gets_a_placement_and_defaults_are_sharded():
    model = gpt2()
    placements = resolve_placements(model, cfg())
    owners = {n for n, m in model.named_modules() if list(m.parameters(recurse=False))}
    assert set(placements) == owners
    assert set(placements.values()) == {"sharded"}


def test_gpt2_spec_with_tp2():
    p = resolve_placements(gpt2(), cfg(tensor_parallel_size=2))
    assert p["transformer.h.1.attn.c_attn"] == "column" and p["transformer.h.1.attn.c_proj"] == "row"
    assert p["transformer.h.0.mlp.c_fc"] == "column" and p["transformer.h.0.mlp.c_proj"] == "row"
    assert p["transformer.wte"] == p["lm_head"] == p["transformer.h.0.ln_1"] == "sharded"


def test_opt_spec_with_tp2():
    p = resolve_placements(opt(), cfg(tensor_parallel_size=2))
    layer = "model.decoder.layers.0"
    assert [p[f"{layer}.self_attn.{n}"] for n in ("q_proj", "k_proj", "v_proj", "out_proj")] == ["column"] * 3 + ["row"]
    assert (p[f"{layer}.fc1"], p[f"{layer}.fc2"], p[f"{layer}.final_layer_norm"]) == ("column", "row", "sharded")


def test_switch_spec_with_ep2_places_only_experts():
    p = resolve_placements(switch(), cfg(expert_parallel_size=2))
    experts = {k for k, v in p.items() if v == "expert"}
    assert experts and all(".mlp.experts.expert_" in k for k in experts)
    assert len(experts) == 2 * 4 * 2  # 2 sparse layers x 4 experts x (wi, wo)
    assert all(v == "sharded" for k, v in p.items() if k not in experts)


def test_generic_fallback_is_all_sharded():
    model = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                     vocab_size=128, max_position_embeddings=32))
    assert get_model_spec("bert").model_type == "*"
    assert set(resolve_placements(model, cfg()).values()) == {"sharded"}
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but model_type 'bert' has no tensor-parallel plan"):
        resolve_placements(model, cfg(tensor_parallel_size=2))


def test_user_glob_override_covers_subtree_and_wins():
    p = resolve_placements(gpt2(), cfg(tensor_parallel_size=2, placements={"*.mlp": "replicated", "*.ln_f": "replicated"}))
    assert p["transformer.h.0.mlp.c_fc"] == p["transformer.h.1.mlp.c_proj"] == "replicated"
    assert p["transformer.h.0.attn.c_attn"] == "column" and p["transformer.ln_f"] == "replicated"


def test_user_can_turn_tp_on_by_glob():
    p = resolve_placements(gpt2(), cfg(placements={"*.attn.c_attn": "column", "*.attn.c_proj": "row"}))
    assert p["transformer.h.0.attn.c_attn"] == "column" and p["transformer.h.0.mlp.c_fc"] == "sharded"


@pytest.mark.parametrize("model_fn, config, match", [
    (lambda: gpt2(n_head=4), cfg(tensor_parallel_size=3), "heads are not divisible by tensor_parallel_size=3"),
    (lambda: switch(num_experts=4), cfg(expert_parallel_size=3), "experts are not divisible by expert_parallel_size=3"),
    (gpt2, cfg(placements={"*.ln_1": "column"}), "LayerNorm.*cannot take placement 'column'"),
    (gpt2, cfg(placements={"transformer.wte": "expert"}), "cannot take placement 'expert'"),
    (gpt2, cfg(tensor_parallel_size=2, placements={"*.attn.c_proj": "sharded"}), "must be placed together"),
    (gpt2, cfg(placements={"*.atn.c_attn": "column"}), "matches no module"),
    (gpt2, cfg(placements={"lm_head": "replicated"}), "share a tied parameter"),
    (switch, cfg(placements={"*.SelfAttention.q": "embedding_row"}), "cannot take placement 'embedding_row'"),
    (switch, cfg(expert_parallel_size=2, placements={"*.experts.expert_0": "sharded"}), "must share the placement"),
    (gpt2, cfg(tensor_parallel_size=2, expert_parallel_size=2), "gpt2. has no experts placed"),
    (opt, cfg(expert_parallel_size=2), "has no experts placed"),
])
def test_user_errors_name_the_problem(model_fn, config, match):
    with pytest.raises(ValueError, match=match):
        resolve_placements(model_fn(), config)


def test_register_spec_for_a_new_family():
    spec = ModelPlacementSpec(model_type="bert_test_only", tensor_parallel={})
    register_model_spec(spec)
    try:
        assert get_model_spec("bert_test_only") is spec
        with pytest.raises(ValueError, match="already registered"):
            register_model_spec(spec)
    finally:
        from hf_elixir.placement._registry import MODEL_TYPE_TO_SPEC

        MODEL_TYPE_TO_SPEC.pop("bert_test_only")


def test_plan_records_placements_roundtrip(tmp_path):
    placements = resolve_placements(gpt2(), cfg(tensor_parallel_size=2))
    plan = hf_elixir.ElixirPlan(model_type="gpt2", placements=placements)
    plan.save(tmp_path / "plan.yaml")
    assert hf_elixir.ElixirPlan.load(tmp_path / "plan.yaml").placements == placements


def test_fused_qkv_split_is_per_head_and_merges_back():
    from hf_elixir.parallel._tensor_parallel import TPShardLayout, _split, merge_shards

    embd, heads, tp = 8, 4, 2  # head_dim 2
    full = torch.arange(3 * embd).repeat(3, 1)  # Conv1D (in=3, out=q|k|v)
    shards = [_split(full, 1, 3, r, tp) for r in range(tp)]
    # rank 1 holds heads 2,3 of q, of k and of v: columns 4..7, 12..15, 20..23
    assert shards[1][0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    assert torch.equal(merge_shards(shards, TPShardLayout(1, 3, 3 * embd)), full)


def test_world_size_must_factor_into_the_mesh(single_rank_group):
    from hf_elixir.parallel import build_mesh

    with pytest.raises(ValueError, match="world size 1 does not factor"):
        build_mesh(cfg(tensor_parallel_size=2))


def test_gather_needs_a_parallelized_model(single_rank_group):
    from hf_elixir.parallel import gather_full_state_dict

    with pytest.raises(ValueError, match="needs a model rewritten"):
        gather_full_state_dict(gpt2())


def test_an_unrewritten_model_under_tensor_parallel_is_refused_with_each_entry_points_fix(single_rank_group):
    """A Trainer user who only set ``tensor_parallel_size`` is told where ``parallelize`` goes in their script, and
    that ElixirPlugin and routed launches parallelize by themselves, not only how a ``hf_elixir.prepare`` loop does."""
    from hf_elixir.parallel._apply import placements_for_plan

    with pytest.raises(ValueError, match=r"ElixirCallback: parallelize\(model, config\) before Trainer\(\.\.\.\)"
                                         r".*ElixirPlugin\(\)\.prepare\(\.\.\.\) and a script launched .* parallelize the model themselves"):
        placements_for_plan(gpt2(), cfg(tensor_parallel_size=2))


def test_parallelize_on_one_rank_keeps_outputs(single_rank_group):
    from hf_elixir.parallel import gather_full_state_dict, parallelize

    torch.manual_seed(0)
    model = gpt2()
    ref = T.GPT2LMHeadModel(model.config)
    ref.load_state_dict(model.state_dict())
    state = parallelize(model, cfg(placements={"*.attn.c_attn": "column", "*.attn.c_proj": "row"}))
    assert state.placements["transformer.h.0.attn.c_attn"] == "column"
    ids = torch.randint(0, 128, (2, 8))
    model.eval(), ref.eval()
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
    full = gather_full_state_dict(model)
    assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize(model, cfg())

