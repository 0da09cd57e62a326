"""A prepared QLoRA model's ``state_dict`` and ``load_state_dict`` speak the plain peft + torchao NF4 model's names and
values ([Note: NF4 state_dict names] in hf_elixir/chunk/_nf4_state_dict.py): the same keys in the same order, torchao
``NF4Tensor`` values that dequantize to the same weights, plain state dicts (NF4 or dense) loading as they load into
the plain model (also at 2 ranks), a tensor of the wrong shape refused naming the key, peft's adapter state dict
unchanged, and a save_checkpoint round trip.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_qlora import BUDGET_BYTES, ROWS, _adamw, _batch, _qlora_model


def _prepared(model=None, frozen_placement: str = "auto"):
    import hf_elixir

    model = model if model is not None else _qlora_model()
    config = hf_elixir.ElixirConfig(device_memory_budget_bytes=BUDGET_BYTES, chunk_size_numel=16_384,
                                    budget_covers_activations=False, frozen_placement=frozen_placement)
    return hf_elixir.prepare(model, _adamw(model), config)


def _assert_same_state(got: dict, want: dict) -> None:
    from hf_elixir.chunk._nf4 import is_nf4

    assert list(got) == list(want)
    for key, value in want.items():
        assert is_nf4(got[key]) == is_nf4(value), key
        if is_nf4(value):
            assert torch.equal(got[key].get_original_weight(), value.get_original_weight()), key
            assert torch.equal(got[key].quantized_data, value.quantized_data), key
        else:
            assert torch.equal(got[key], value), key


def test_state_dict_has_the_plain_models_keys_and_nf4_values():
    plain = _qlora_model()
    model, _ = _prepared()
    got, want = model.state_dict(), plain.state_dict()
    assert sum(k.endswith("base_layer.weight") for k in want) == 2 * 3  # q, v, up: the adapted NF4 linears
    _assert_same_state(got, want)
    keep = model.state_dict(keep_vars=True)  # as plain PyTorch: the same names
    assert list(keep) == list(plain.state_dict(keep_vars=True))
    layer = model.base_model.model.model.layers[0]  # a submodule's state_dict, with its prefix
    _assert_same_state(layer.state_dict(prefix="x."), plain.base_model.model.model.layers[0].state_dict(prefix="x."))


def test_peft_adapter_state_dict_and_files_are_unchanged(tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    plain = _qlora_model()
    model, _ = _prepared()
    got, want = get_peft_model_state_dict(model), get_peft_model_state_dict(plain)
    assert list(got) == list(want) and len(want) == 2 * 3 * 2
    assert all(torch.equal(got[k], want[k]) for k in want)
    model.save_pretrained(tmp_path / "elixir")  # peft's adapter files
    plain.save_pretrained(tmp_path / "plain")
    got, want = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("elixir", "plain"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def _trained_plain():
    """A plain QLoRA model one AdamW step on, its base quantized from other weights (seed 1)."""
    from peft import get_peft_model

    from tests.test_qlora import _lora, _nf4_llama

    torch.manual_seed(1)
    plain = _qlora_model()
    other = get_peft_model(_nf4_llama(), _lora())
    with torch.no_grad():  # another base: every NF4 weight from a perturbed dense weight
        for name, module in other.named_modules():
            if name.endswith("base_layer"):
                dense = module.weight.get_original_weight()
                plain.get_submodule(name).weight.copy_(dense + 0.01 * torch.randn_like(dense))
    opt = _adamw(plain)
    ids = _batch(0, ROWS)
    plain(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return plain


def test_load_a_plain_state_dict_then_train_as_plain_pytorch():
    """A plain model's state dict (other NF4 codes, trained adapters) loads into the prepared model: its state dict
    and its next steps are the plain model's."""
    plain = _trained_plain()
    model, opt = _prepared()
    missing, unexpected = model.load_state_dict(plain.state_dict())
    assert missing == [] and unexpected == []
    _assert_same_state(model.state_dict(), plain.state_dict())
    plain_opt = _adamw(plain)
    for step in range(1, 3):
        ids = _batch(step, ROWS)
        losses = []
        for m, o in ((model, opt), (plain, plain_opt)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(float(loss.detach()))
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_dense_weights_load_as_torchao_quantizes_them():
    """A dense tensor under an NF4 weight's key is quantized with the weight's block sizes, as plain PyTorch's
    ``load_state_dict`` into an ``NF4Tensor`` parameter does (torchao's ``copy_``)."""
    plain = _qlora_model()
    model, _ = _prepared()
    key = "base_model.model.model.layers.1.mlp.up_proj.base_layer.weight"
    dense = torch.randn(256, 128, generator=torch.Generator().manual_seed(3))
    plain.load_state_dict({key: dense}, strict=False)
    missing, unexpected = model.load_state_dict({key: dense}, strict=False)
    assert key not in missing and unexpected == []
    _assert_same_state(model.state_dict(), plain.state_dict())


def test_a_wrong_shape_is_refused_naming_the_key():
    model, _ = _prepared()
    key = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    with pytest.raises(ValueError, match=r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.base_layer\."
                                         r"weight' is an NF4 weight of shape \(128, 128\) and got \(128, 64\)"):
        model.load_state_dict({key: torch.zeros(128, 64)}, strict=False)
    with pytest.raises(ValueError, match=r"q_proj\.base_layer\.weight' is an NF4 weight and got a torch\.int64"):
        model.load_state_dict({key: torch.zeros(128, 128, dtype=torch.int64)}, strict=False)


def test_save_checkpoint_round_trip(tmp_path):
    """``hf_elixir.save_checkpoint`` (safetensors: plain tensors) stores the NF4 weights as their packed bytes, and
    ``load_checkpoint`` gives a fresh prepared model the same state (other NF4 codes and trained adapters)."""
    import hf_elixir

    plain = _trained_plain()
    model, opt = _prepared()
    model.load_state_dict(plain.state_dict())
    hf_elixir.save_checkpoint(tmp_path / "ckpt", model, opt, step=1)
    fresh, fresh_opt = _prepared()
    hf_elixir.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    _assert_same_state(fresh.state_dict(), plain.state_dict())


def _load_at(rank: int, world_size: int, frozen_placement: str) -> dict:
    from tests.test_qlora import _batch

    plain = _trained_plain()
    model, opt = _prepared(frozen_placement=frozen_placement)
    model.load_state_dict(plain.state_dict())  # sharded: each rank writes its slice of the packed bytes to its shard
    _assert_same_state(model.state_dict(), plain.state_dict())
    ids = _batch(5, ROWS)
    import hf_elixir

    sharded = {c.world_size for c in hf_elixir.get_state(model).manager.chunks}
    return dict(loss=float(model(input_ids=ids, labels=ids).loss.detach()), sharded=sharded,
                plain=float(plain(input_ids=ids, labels=ids).loss.detach()))


@pytest.mark.parametrize("frozen_placement, world_sizes", [("sharded", {2}), ("whole", {1, 2})])
def test_load_a_plain_state_dict_at_two_ranks(frozen_placement, world_sizes):
    from tests._dist import run_distributed

    for r in run_distributed(_load_at, 2, frozen_placement, timeout_s=180):
        assert r["sharded"] == world_sizes and r["loss"] == pytest.approx(r["plain"], rel=1e-6)
