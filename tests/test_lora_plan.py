"""LoRA-aware planning: ``hf-elixir plan --quantize nf4`` prices the frozen base as torchao's NF4, and
``min_device_budget_bytes`` of a peft model counts optimizer state only where the run keeps it."""

import json

import pytest
import torch

from hf_elixir import ElixirConfig, min_device_budget_bytes
from hf_elixir.cli import main
from hf_elixir.plan import ElixirPlan


@pytest.fixture(autouse=True)
def _hardware_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path / "cache"))


def _plan(capsys, argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_nf4_prices_the_frozen_base_at_torchao_bytes(capsys):
    """The frozen base's bytes shrink by NF4's bytes per element over bf16's (0.515747 / 2), the adapters' and
    their gradients and AdamW state do not change, and the plan needs less device and host memory."""
    from hf_elixir.cli._plan import nf4_bytes_per_element

    argv = ["plan", "--model", "tiny-gpt2", "--gpu", "h100", "--gpu-memory", "1GiB", "--host-memory", "2GiB",
            "--seq-len", "32", "--lora-rank", "4", "--lora-targets", "c_attn"]
    bf16, nf4 = _plan(capsys, argv), _plan(capsys, [*argv, "--quantize", "nf4"])
    a, b = bf16["zero3_model_data_per_gpu_bytes"], nf4["zero3_model_data_per_gpu_bytes"]
    assert (a["grads"], a["optimizer"]) == (b["grads"], b["optimizer"]) and bf16["parameters"] == nf4["parameters"]
    adapters = a["grads"] // 4  # fp32 gradients of the trained elements
    ratio = (b["params"] - 2 * adapters) / (a["params"] - 2 * adapters)
    assert ratio == pytest.approx(nf4_bytes_per_element("bf16") / 2, rel=5e-3)  # each tiny tensor rounds up
    assert nf4["device_peak_bytes"] < bf16["device_peak_bytes"]
    assert nf4["host_bytes_per_gpu"] <= bf16["host_bytes_per_gpu"]
    assert any("NF4" in reason for reason in nf4["reasons"])


def test_nf4_bytes_per_element_is_torchao_layout():
    """64-element blocks (0.5 B of codes + an int8 scale) and a bf16 scale per 256 scales, as ``to_nf4`` stores."""
    from hf_elixir.cli._plan import nf4_bytes_per_element

    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor as nf4
    t = nf4.to_nf4(torch.randn(256, 256, dtype=torch.bfloat16))
    stored = sum(x.numel() * x.element_size()
                 for x in (t.quantized_data, t.quantized_scalers, t.quantization_factor))
    assert stored / t.numel() == pytest.approx(nf4_bytes_per_element("bf16"), rel=1e-12)


def test_quantize_needs_lora_rank(capsys):
    assert main(["plan", "--model", "gpt2", "--quantize", "nf4"]) == 2
    err = capsys.readouterr().err
    assert "--quantize nf4" in err and "--lora-rank" in err


def test_min_device_budget_of_a_peft_llama_counts_only_the_adapters_state():
    """The device optimizer state at the floor is the adapters' (16 B per element in fp32: gradient, two moments,
    master), with the adapters after the frozen base or in module order: the frozen base is packed in chunks of its
    own either way, so no chunk carries that state for frozen weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    full = LlamaForCausalLM(cfg)
    lora = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules="all-linear"))
    trained = [n for n, p in lora.named_parameters() if p.requires_grad]
    order = [n for n, p in lora.named_parameters() if not p.requires_grad] + trained
    plan = ElixirPlan(param_order=order, chunk_size_numel=16384)

    def optimizer_state(model, plan=None):  # the floor with the optimizer on the device less the offloaded one
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        floor = [min_device_budget_bytes(model, opt, ElixirConfig(precision="fp32", offload_optimizer=off,
                                                                  chunk_size_numel=16384, search="off", plan=plan))
                 for off in (False, True)]
        return floor[0] - floor[1]

    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert optimizer_state(lora, plan) == 16 * adapters
    assert optimizer_state(full) >= 16 * sum(p.numel() for p in full.parameters())
    assert optimizer_state(lora) == 16 * adapters  # module order: the same split
