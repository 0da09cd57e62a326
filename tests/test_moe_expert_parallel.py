"""Expert parallel over today's fused 3-D MoE experts (Mixtral, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3).

Parity with plain PyTorch at 2 ranks under ``expert_parallel_size=2`` (placed by the glob
``{"*.mlp.experts": "expert"}``), through ``hf_elixir.prepare`` with no budget and with a model-data budget
of half the 16 B/param state, AdamW with weight decay on matrices only, clipping, 5 steps, fp32; plus a
budget that forces evictions, an ep rank whose experts never get a token, HF activation checkpointing (the
dispatch re-runs in backward), bf16, the Triton permute kernels, ``save_pretrained`` -> plain
``from_pretrained``, and streamed load under ep. See ``tests/_moe_ep_cases.py`` for what each case runs.
"""

from __future__ import annotations

import pytest
import torch

import hf_elixir
from hf_elixir.placement import resolve_placements
from tests._dist import run_distributed
from tests._moe_ep_cases import run_cases
from tests._moe_models import MOE_FAMILIES, make_moe_model

TOL = 2e-5

CASES = [(f"{family}_{budget}", {"family": family, "budget": budget}) for family in MOE_FAMILIES
         for budget in ("none", "half")]
CASES += [("mixtral_tight", {"family": "mixtral", "budget": "tight"}),
          ("gpt_oss_idle_tight", {"family": "gpt_oss", "budget": "tight", "idle": True}),
          ("qwen3_moe_checkpointing_half", {"family": "qwen3_moe", "budget": "half", "checkpointing": True})]
STREAM_CASES = [("stream_mixtral", "mixtral"), ("stream_qwen3_moe", "qwen3_moe")]
BF16_CASES = [(f"{family}_bf16", {"family": family, "budget": "half", "precision": "bf16"})
              for family in ("mixtral", "deepseek_v3")]
_RESULTS: dict = {}


def _results(tmp_path_factory) -> dict:
    """Every case in one 2-rank run per session (starting the ranks costs more than the cases)."""
    if not _RESULTS:
        save_root = str(tmp_path_factory.mktemp("moe_ep"))
        cases = [(name, {**kw, "save_dir": f"{save_root}/{name}"} if name in ("mixtral_none", "gpt_oss_none") else kw)
                 for name, kw in CASES]
        cases += [(name, {"kind": "stream", "family": family, "folder": f"{save_root}/{name}"})
                  for name, family in STREAM_CASES]
        cases += [("kernels_qwen3_moe", {"kind": "kernels", "family": "qwen3_moe"})] + BF16_CASES
        per_rank = run_distributed(run_cases, 2, cases, timeout_s=600)
        _RESULTS.update({name: [r[name] for r in per_rank] for name, _ in cases})
    return _RESULTS


@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_fused_experts_ep2_match_plain_pytorch(name, tmp_path_factory):
    ranks = _results(tmp_path_factory)[name]
    for m in ranks:
        assert m["loss_rel"] < TOL and m["norm_rel"] < TOL and m["param_rel"] < TOL, m
        assert m["same_keys"] and m["params_moved"] > 1e-3, m
        # [Note: idle case] the plain ZeRO path (no ep) on this gpt-oss set-up reaches 2.9e-5 on the
        # embedding too: Adam scales float noise in its near-zero gradients; the ep run matches that
        assert m["param_rel_worst_tensor"] < (1e-4 if "idle" in name else TOL), m
        assert set(m["expert_containers"].values()) == {4}, m
        assert m["split_pieces"] == [2], m  # split_fused_experts=True: each rank's 2 experts, a unit each
        for fqn, shape in m["local_expert_shapes"].items():  # each rank holds 2 of the 4 experts, biases included
            assert shape[0] == 2, (fqn, shape)
    family = dict(CASES)[name]["family"]
    expected_layers = 1 if family == "deepseek_v3" else 2  # DeepSeek-V3's first layer is dense
    assert len(ranks[0]["expert_containers"]) == expected_layers
    if dict(CASES)[name]["budget"] == "half":
        assert ranks[0]["budget_bytes"] == 8 * sum(p.numel() for p in make_moe_model(family).parameters())
    if dict(CASES)[name]["budget"] == "tight":
        assert min(m["num_evictions"] for m in ranks) > 0


def test_idle_expert_slices_get_what_plain_pytorch_gives(tmp_path_factory):
    """Experts 2 and 3 (all of ep rank 1's) never get a token: plain PyTorch gives their fused slices a zero
    gradient and AdamW decays them; the ep run moved them by exactly that decay."""
    for m in _results(tmp_path_factory)["gpt_oss_idle_tight"]:
        assert m["idle_decay_rel"] < 1e-6 and m["idle_moved"] > 1e-3, m


@pytest.mark.parametrize("name", ["mixtral_none", "gpt_oss_none"])
def test_save_pretrained_of_ep_model_writes_plain_layout(name, tmp_path_factory):
    """``save_pretrained`` of the ep model writes the tensors plain transformers writes for the family (names
    and layout on disk), and plain ``from_pretrained`` loads them bit for bit."""
    for m in _results(tmp_path_factory)[name]:
        assert m["disk_keys_as_plain"] and m["loaded_keys_match"] and m["loaded_bitwise"], m


def test_experts_not_divisible_by_ep_raise_naming_both_numbers():
    cfg = hf_elixir.ElixirConfig(placements={"*.mlp.experts": "expert"}, expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"num_experts=4 experts are not divisible by expert_parallel_size=3"):
        resolve_placements(make_moe_model("mixtral"), cfg)


def test_glob_places_the_fused_experts_module_only():
    cfg = hf_elixir.ElixirConfig(placements={"*.mlp.experts": "expert"}, expert_parallel_size=2)
    placements = resolve_placements(make_moe_model("deepseek_v3"), cfg)
    assert {k for k, v in placements.items() if v == "expert"} == {"model.layers.1.mlp.experts"}
    assert placements["model.layers.1.mlp.shared_experts.gate_proj"] == "sharded"


def test_ep_on_dense_model_raises():
    import transformers as T

    torch.manual_seed(0)
    dense = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 but model_type 'llama' has no experts placed"):
        resolve_placements(dense, hf_elixir.ElixirConfig(expert_parallel_size=2))
    with pytest.raises(ValueError, match=r"matches no module"):
        resolve_placements(dense, hf_elixir.ElixirConfig(placements={"*.mlp.experts": "expert"}, expert_parallel_size=2))


@pytest.mark.parametrize("name", [name for name, _ in STREAM_CASES])
def test_streamed_load_under_ep_matches_from_pretrained(name, tmp_path_factory):
    """``prepare(model_on_meta, checkpoint=folder)`` after ``parallelize`` at ep=2 on a plain ``save_pretrained``
    folder (experts per expert on disk): the same training as from ``from_pretrained``, bit for bit; each rank
    reads its own experts (half of them) and its shards of the rest, never the whole model."""
    for m in _results(tmp_path_factory)[name]:
        assert m["same_losses"] and m["bitwise"], m
        assert 0 < m["read_bytes"] <= m["model_bytes"] - m["expert_bytes"] / 2 + 1, m


def test_triton_permute_kernels_match_the_pytorch_reference(tmp_path_factory):
    """The fused-expert dispatch through the package's Triton permute kernels (the interpreter on CPU) gives
    the logits and gradients of its PyTorch reference path."""
    for m in _results(tmp_path_factory)["kernels_qwen3_moe"]:
        assert m["launches"] > 0 and m["logits_rel"] < 1e-6 and m["grad_rel"] < 1e-5, m


@pytest.mark.parametrize("name", [name for name, _ in BF16_CASES])
def test_bf16_ep2_tracks_fp32_reference(name, tmp_path_factory):
    """bf16 compute with fp32 master weights under ep=2 stays within the package's documented bf16 tolerance
    (2% of the fp32 loss, as ``tests/test_core_features.py``); DeepSeek-V3's router runs in fp32 on bf16
    hidden states, so the combine takes fp32 routing weights."""
    for m in _results(tmp_path_factory)[name]:
        assert m["loss_rel"] < 2e-2 and m["same_keys"] and m["params_moved"] > 1e-3, m
