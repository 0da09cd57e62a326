"""[Note: blockwise norms] in ``hf_elixir/optim/_norms.py``: the gradient norm is accumulated in fp64 one block
at a time (no fp64 copy of a whole chunk), equal to the whole-tensor fp64 norm up to fp64 rounding, and
``clip_grad_norm`` still matches ``torch.nn.utils.clip_grad_norm_`` on a plain model with blocks much smaller
than a chunk, for the device and the host optimizer paths and the inf norm."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import hf_elixir
from hf_elixir.optim import _norms
from tests._models import batch, float_state, rel_l2, tiny_model, two_groups


class _LargestFp64(TorchFunctionMode):
    """Records the most elements of any fp64 tensor made inside."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            self.largest = max(self.largest, out.numel())
        return out


@pytest.mark.parametrize("numel", [0, 1, 999, 1000, 1001, 12_345])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0])
def test_blockwise_pow_sum_equals_the_whole_fp64_norm(numel, norm_type):
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e3
    got = _norms.pow_sum(grad, norm_type, block_numel=1000)
    want = grad.double().norm(norm_type) ** norm_type
    assert got.dtype == torch.float64 and got.shape == ()
    assert abs(float(got) - float(want)) <= 1e-13 * max(float(want), 1e-300), (float(got), float(want))
    want_max = grad.abs().max().double() if numel else torch.zeros((), dtype=torch.float64)
    assert float(_norms.max_abs(grad, block_numel=1000)) == float(want_max)  # exact


def test_max_abs_keeps_nan_and_refuses_empty_blocks():
    grad = torch.ones(3000)
    grad[2500] = float("nan")
    assert torch.isnan(_norms.max_abs(grad, block_numel=1000))
    with pytest.raises(ValueError, match="block_numel=0"):
        _norms.pow_sum(grad, 2.0, block_numel=0)


def test_extra_memory_is_one_block():
    """No fp64 tensor larger than a block is made, for a shard of 3.5 blocks of the default size."""
    grad = torch.randn(_norms.NORM_BLOCK_NUMEL * 7 // 2)
    with _LargestFp64() as mode:
        got = _norms.pow_sum(grad, 2.0)
        _norms.max_abs(grad)
    assert 0 < mode.largest <= _norms.NORM_BLOCK_NUMEL, mode.largest
    want = grad.double().norm() ** 2
    assert abs(float(got) - float(want)) <= 1e-12 * float(want)  # fp64 rounding over 3.7 M elements


def _plain(norm_type: float, max_norm: float, steps: int):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    norms = []
    for step in range(steps):
        model(**batch("gpt2", step, 2)).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)))
        opt.step()
        opt.zero_grad()
    return norms, float_state(model)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_matches_plain_pytorch_with_small_blocks(monkeypatch, offload, norm_type):
    """Blocks of 100 elements (every 4096-element chunk spans many): the same norms and parameters as
    ``torch.nn.utils.clip_grad_norm_``."""
    monkeypatch.setattr(_norms, "NORM_BLOCK_NUMEL", 100)
    calls = []
    pow_sum, max_abs = _norms.pow_sum, _norms.max_abs
    monkeypatch.setattr("hf_elixir.optim._clip.pow_sum", lambda *a, **k: calls.append(1) or pow_sum(*a, **k))
    monkeypatch.setattr("hf_elixir.optim._clip.max_abs", lambda *a, **k: calls.append(1) or max_abs(*a, **k))
    steps, max_norm = 3, 0.5
    want_norms, want_state = _plain(norm_type, max_norm, steps)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=4096,
                                                                      offload_optimizer=offload))
    norms = []
    for step in range(steps):
        opt.backward(model(**batch("gpt2", step, 2)).loss)
        norms.append(float(opt.clip_grad_norm(max_norm, norm_type=norm_type)))
        opt.step()
        opt.zero_grad()
    assert calls, "the norm did not go through the blockwise helpers"
    for got, want in zip(norms, want_norms):
        assert abs(got - want) <= 1e-5 * want, (norms, want_norms)
    assert rel_l2(float_state(model), want_state) < 1e-5
