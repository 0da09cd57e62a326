"""Loads that write part of a model ([Note: a load that raises] in hf_elixir/runtime/state_dict.py): a partial
``load_state_dict`` or a ``full_parameters(writeback=True)`` edit leaves the other fp32 masters bit for bit, and a
load that raises part-way leaves what plain PyTorch leaves and ends its copy sanction."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import hf_elixir
from hf_elixir.chunk import strict


def _gpt2():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32))


def _trained(precision: str):
    """A prepared tiny GPT-2 after two AdamW steps (so its bf16 masters hold more than their bf16 copies)."""
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=4096, precision=precision))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt, ids


def _unrounded(state: dict) -> list[str]:
    """Keys whose fp32 export is not already a bf16 value (the masters a rounding would change)."""
    return [k for k, v in state.items() if not torch.equal(v, v.bfloat16().float())]


def test_partial_load_keeps_the_other_masters_bit_for_bit(single_rank_group):
    model, opt, ids = _trained("bf16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(_unrounded(before)) > 20  # the masters hold fp32 values a rounding would lose
    key = "transformer.h.1.mlp.c_fc.bias"
    value = torch.randn_like(before[key])
    missing, unexpected = model.load_state_dict({key: value}, strict=False)
    assert key not in missing and unexpected == []
    after = model.state_dict()
    assert torch.equal(after[key], value)  # an fp32 value is kept as the master ([Note: fp32 loads])
    assert [k for k in before if k != key and not torch.equal(before[k], after[k])] == []
    model(input_ids=ids, labels=ids).loss.backward()  # and training goes on from them
    opt.step()


def test_full_parameters_writeback_keeps_the_masters_of_what_was_not_edited(single_rank_group):
    model, _, _ = _trained("bf16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with hf_elixir.full_parameters(model, writeback=True):
        with torch.no_grad():
            model.transformer.h[0].ln_1.weight[:3] = 5.0
    after = model.state_dict()
    edited = "transformer.h.0.ln_1.weight"
    assert torch.equal(after[edited][:3], torch.full((3,), 5.0))
    assert torch.equal(after[edited][3:], before[edited][3:])
    assert [k for k in before if k != edited and not torch.equal(before[k], after[k])] == []


def _raise_on_load(module, *args):
    raise ValueError("refused by a user's load pre-hook")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_load_that_raises_part_way_leaves_what_plain_pytorch_leaves(single_rank_group, precision):
    """A pre-hook of ``transformer.h.1.attn.c_attn`` raises: the modules before it are loaded, it and the ones after
    are not (plain PyTorch's result, checked against a plain model), and strict mode holds again after the error."""
    plain = _gpt2()
    model, opt, ids = _trained(precision)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    plain.load_state_dict(start)
    new = {k: v + 1 for k, v in start.items()}
    for m in (plain, model):
        m.transformer.h[1].attn.c_attn.register_load_state_dict_pre_hook(_raise_on_load)
        with pytest.raises(ValueError, match="refused by a user's load pre-hook"):
            m.load_state_dict(new)
    expected, after = plain.state_dict(), model.state_dict()
    assert torch.equal(after["transformer.h.1.ln_1.weight"], new["transformer.h.1.ln_1.weight"])  # before it: loaded
    assert torch.equal(after["transformer.h.1.attn.c_attn.weight"], start["transformer.h.1.attn.c_attn.weight"])
    assert [k for k in expected if not torch.equal(expected[k], after[k])] == []
    # the copy sanction of the failed load ended with it: an uncounted host->device copy raises again
    host, device = strict.host_empty(2, torch.float32, pin=False), strict.register_device(torch.zeros(2))
    with pytest.raises(strict.HostMemoryError):
        device.copy_(host)
    model(input_ids=ids, labels=ids).loss.backward()  # the model trains on
    opt.step()
