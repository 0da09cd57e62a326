"""Liger-Kernel's fused linear cross-entropy as a reader of ``lm_head.weight`` outside ``lm_head``'s forward ([Note:
external reads] in hf_elixir/chunk/_external.py).

Liger's Llama forward (``liger_kernel.transformers.model.llama.lce_forward``, what ``apply_liger_kernel_to_llama``
installs) never calls ``lm_head``: in training it hands ``lm_head.weight`` and the hidden states to
``LigerFusedLinearCrossEntropyFunction``, Triton kernels that compute the loss and both gradients chunk by chunk
(here under ``TRITON_INTERPRET=1``, set by conftest.py, on CPU tensors). Liger special-cases FSDP for this read (it
must run inside the FSDP unit's forward); under hf_elixir it needs nothing. A tiny Llama trains for a few AdamW
steps under a budget that evicts chunks and offloads the optimizer (sharded over the ranks at 2), against plain
PyTorch running the same Liger forward on the whole batch, and Liger's loss is checked against HF's own.

The forward is bound to the instance (``apply_liger_kernel_to_llama`` patches the class for the whole process).
"""

from __future__ import annotations

import types

import pytest
import torch

from tests._dist import run_distributed
from tests._models import plain_step, rank_mean

STEPS = 3
ROWS = 2
SEQ = 10
VOCAB = 128
#: device bytes for model data (activations not counted), under the model's ~110 KB of fp32 weights plus their
#: gradients: chunks are evicted and re-gathered
BUDGET_BYTES = 80_000


def _liger_llama():
    import transformers
    from liger_kernel.transformers.model.llama import lce_forward

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    hf_forward = model.forward
    model.forward = types.MethodType(lce_forward, model)
    return model, hf_forward


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _train(rank: int, world_size: int) -> dict:
    import hf_elixir

    ref, hf_forward = _liger_llama()
    model, _ = _liger_llama()
    first = _batch(0, ROWS * world_size)
    with torch.no_grad():  # Liger's fused loss is HF's loss
        hf_loss = float(hf_forward(input_ids=first, labels=first).loss)
        liger_loss = float(ref(first, labels=first).loss)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    config = hf_elixir.ElixirConfig(device_memory_budget_bytes=BUDGET_BYTES, chunk_size_numel=4096,
                                    offload_optimizer=True, budget_covers_activations=False)
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), config)
    losses, ref_losses = [], []
    for step in range(STEPS):
        ids = _batch(step, ROWS * world_size)
        mine = ids[rank * ROWS:(rank + 1) * ROWS]
        out = model(input_ids=mine, labels=mine)
        assert out.logits is None  # Liger's fused path: lm_head's forward never ran
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
        ref_losses.append(plain_step(ref, ref_opt, ids))
    losses = rank_mean(losses, world_size)
    got, want = model.state_dict(), ref.state_dict()
    num = sum(float((got[k] - want[k]).double().norm() ** 2) for k in want)
    den = sum(float(want[k].double().norm() ** 2) for k in want)
    head = float((got["lm_head.weight"] - want["lm_head.weight"]).norm() / want["lm_head.weight"].norm())
    return dict(losses=losses, ref_losses=ref_losses, rel_l2=(num / den) ** 0.5, head_rel=head, hf_loss=hf_loss,
                liger_loss=liger_loss, evictions=hf_elixir.memory_stats(model)["num_evictions"],
                world=hf_elixir.get_state(model).manager.chunks[0].world_size)


def _check(result: dict, world_size: int) -> None:
    assert result["liger_loss"] == pytest.approx(result["hf_loss"], rel=1e-5)
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    assert result["rel_l2"] < 1e-5 and result["head_rel"] < 1e-5
    assert result["evictions"] > 0  # the budget really evicted chunks
    assert result["world"] == world_size  # sharded over the ranks


def test_liger_fused_linear_cross_entropy_one_rank():
    _check(_train(0, 1), 1)


def test_liger_fused_linear_cross_entropy_two_ranks():
    for result in run_distributed(_train, 2, timeout_s=300):
        _check(result, 2)
