"""One-step profiler (real and meta) and the cached hardware probe."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig

from hf_elixir.profiler import profile_step
from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch


def _tiny_gpt2():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                       eos_token_id=0, bos_token_id=0))
    ids = torch.randint(0, 128, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def test_real_profile_records_order_tied_once_backward_and_activations():
    model, batch = _tiny_gpt2()
    profile = profile_step(model, batch, device="cpu")
    names = profile.param_names
    assert names[0] == "transformer.wte.weight" and "lm_head.weight" not in names
    assert len(names) == len({id(p) for p in model.parameters()})
    fwd = [e for e in profile.events if e.phase == "fwd"]
    bwd = [e for e in profile.events if e.phase == "bwd"]
    assert [e.module for e in profile.events[:len(fwd)]] == [e.module for e in fwd]
    # backward visits the same modules in reverse order; the tied weight is accessed twice each way
    assert [e.module for e in bwd] == [e.module for e in reversed(fwd)]
    assert sum(1 for e in fwd if 0 in e.params) == 2 and fwd[-1].module == "lm_head"
    assert all(e.compute_s is not None and e.compute_s >= 0 for e in profile.events)
    assert profile.forward_s > 0 and profile.backward_s > 0
    # the tied embedding's gradient is complete only at the very end (embedding backward)
    assert profile.grad_ready_event[0] == len(profile.events) - 1
    assert all(r >= len(fwd) for r in profile.grad_ready_event)
    assert profile.activation_peak_bytes > 0 and set(profile.block_activation_bytes) == {"transformer.h.0", "transformer.h.1"}
    assert all(p.grad is None for p in model.parameters())
    sizes = profile.model_data_bytes("bf16", world_size=2)
    assert sizes["params"] == profile.num_params * 2 // 2 and sizes["optimizer"] == profile.num_params * 12 // 2


class _RealTensors(TorchDispatchMode):
    """Records every operator run under it and each tensor it returns that is not on meta (real memory)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.real: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.real.append((str(func), t.device.type, t.numel() * t.element_size()))
        return out


def test_meta_profile_of_a_large_config_materialises_nothing():
    config = OPTConfig(num_hidden_layers=4, hidden_size=2048, ffn_dim=8192, num_attention_heads=32)
    model, batch = meta_model_and_batch(config, batch_size=2, seq_len=128, dtype=torch.bfloat16)
    with _RealTensors() as seen:
        profile = profile_step(model, batch, device="meta")
    # every operator of forward and backward ran, and none returned a tensor with real storage
    assert any("mm" in op for op in seen.ops) and any("backward" in op for op in seen.ops), seen.ops[:20]
    assert seen.real == [], seen.real[:10]
    assert not profile.static and profile.forward_s is None
    assert all(p.device.type == "meta" for p in model.parameters())
    assert profile.forward_flops > 0 and profile.backward_flops > profile.forward_flops
    assert profile.activation_dtype_bytes == 2 and profile.activation_peak_bytes > 0
    assert profile.num_params == sum(p.numel() for p in model.parameters())


def test_meta_profile_falls_back_to_static_trace_for_data_dependent_models():
    model, batch = meta_model_and_batch(load_config("switch-base-8"), batch_size=1, seq_len=8)
    profile = profile_step(model, batch, device="meta")
    assert profile.num_params == sum(p.numel() for p in model.parameters())
    assert profile.events and {e.phase for e in profile.events} == {"fwd", "bwd"}


def test_profile_rejects_unknown_device():
    model, batch = _tiny_gpt2()
    with pytest.raises(ValueError, match="device='tpu'"):
        profile_step(model, batch, device="tpu")


def test_meta_profile_counts_the_routed_flops_of_fused_experts():
    # top-2 of 8 experts of width I cost per token what one dense MLP of width 2I costs ([Note: meta expert FLOPs]);
    # on meta no expert is hit, so without the routing arithmetic the experts count nothing
    import torch
    from transformers import AutoConfig

    from hf_elixir.profiler import profile_step
    from hf_elixir.profiler._model_zoo import meta_model_and_batch

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=64, tie_word_embeddings=False)
    moe = AutoConfig.for_model("mixtral", intermediate_size=96, num_local_experts=8, num_experts_per_tok=2, **common)
    dense = AutoConfig.for_model("llama", intermediate_size=192, **common)
    flops = []
    for cfg in (moe, dense):
        model, batch = meta_model_and_batch(cfg, batch_size=2, seq_len=16, dtype=torch.bfloat16)
        profile = profile_step(model, batch, device="meta")
        assert not profile.static
        flops.append((profile.forward_flops, profile.backward_flops))
    router = 2 * 2 * 16 * 64 * 8 * 2  # two layers of a [tokens, H] x [H, E] gate
    assert flops[0][0] == pytest.approx(flops[1][0] + router, rel=1e-6)
    assert flops[0][1] == pytest.approx(2 * flops[0][0], rel=1e-6)
