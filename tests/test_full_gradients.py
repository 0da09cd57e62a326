"""hf_elixir.full_gradients / get_full_grad equal plain PyTorch's p.grad (hf_elixir/optim/gradients.py,
[Note: readable gradients]); a user's p.grad read between backward and step raises naming them."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_elixir
from hf_elixir.chunk.params import StaleParameterError, UnconsumedGradientError
from tests._dist import run_distributed
from tests._models import rank_batch, tiny_model, two_groups

CHUNK = 8192
LAYOUTS = {
    "sharded": dict(chunk_size_numel=CHUNK, default_placement="sharded"),
    # chunks offloaded, gradients and optimizer states on the host (the host lane takes them during backward)
    "offloaded": dict(chunk_size_numel=CHUNK, default_placement="sharded", device_memory_budget_bytes=200_000,
                      budget_covers_activations=False, offload_optimizer=True),
}
SCALE = 2.0**10
MAX_NORM = 0.05  # below the gradient norm: clipping scales every gradient


def _reference_grads(ref, precision, world_size, step=0):
    """Plain PyTorch: each rank's batch backward on a copy in the compute dtype (fp16: the loss scaled by SCALE),
    gradients in fp32
    unscaled and averaged over the ranks (what the data-parallel mean loss gives)."""
    model = ref.to({"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision])
    total: dict[str, torch.Tensor] = {}
    for r in range(world_size):
        model.zero_grad()
        loss = model(**rank_batch("gpt2", step, r, world_size, 2)).loss
        (loss * SCALE if precision == "fp16" else loss).backward()
        for name, p in model.named_parameters():
            g = p.grad.float() / (SCALE if precision == "fp16" else 1.0)
            total[name] = total.get(name, 0) + g / world_size
    return total


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in b)
    return (num / sum(float(b[k].double().norm() ** 2) for k in b)) ** 0.5


def _worker(rank, world_size, precision, layout):
    model = tiny_model("gpt2")
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        precision=precision, loss_scale=hf_elixir.LossScalePolicy(init_scale=SCALE), **LAYOUTS[layout]))
    opt.backward(model(**rank_batch("gpt2", 0, rank, world_size, 2)).loss)
    with hf_elixir.full_gradients(model) as grads:
        shapes_ok = all(grads[n].shape == p.shape and grads[n].dtype == torch.float32
                        for n, p in model.named_parameters())
    one = hf_elixir.get_full_grad(model.transformer.h[1].mlp.c_fc.weight, model)
    expected = _reference_grads(ref, precision, world_size)
    result = {"names": list(grads) == [n for n, _ in model.named_parameters()], "shapes": shapes_ok,
              "rel": _rel(grads, expected), "one": _rel({"w": one}, {"w": expected["transformer.h.1.mlp.c_fc.weight"]})}
    norm = opt.clip_grad_norm(MAX_NORM)  # unscales; on the host the clip factor is owed until the step
    with hf_elixir.full_gradients(model) as clipped:
        pass
    coef = MAX_NORM / (float(norm) + 1e-6)
    result["clipped_rel"] = _rel(clipped, {n: g * coef for n, g in expected.items()})
    opt.step()
    opt.zero_grad()
    with hf_elixir.full_gradients(model) as after_zero:
        result["after_zero"] = len(after_zero)
    return result


CASES = [("fp32", "sharded"), ("fp32", "offloaded"), ("fp16", "sharded"), ("fp16", "offloaded"),
         ("bf16", "offloaded")]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("precision,layout", CASES)
def test_full_gradients_equal_plain_pytorch(precision, layout, world_size):
    if world_size == 1:
        results = [_worker(0, 1, precision, layout)]
    else:
        results = run_distributed(_worker, 2, precision, layout, timeout_s=240)
    tol = 1e-6
    for result in results:
        assert result["names"] and result["shapes"]
        assert result["rel"] < tol and result["one"] < tol, result
        assert result["clipped_rel"] < max(tol, 1e-6), result
        assert result["after_zero"] == 0  # zero_grad(set_to_none=True): no parameter has a gradient


def test_p_grad_read_by_user_code_raises_naming_full_gradients_and_library_paths_still_work():
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=5e-3),
                                   hf_elixir.ElixirConfig(**LAYOUTS["offloaded"]))
    assert all(p.grad is None for p in model.parameters())  # before backward: no gradient, as in PyTorch
    opt.backward(model(**rank_batch("gpt2", 0, 0, 1, 2)).loss)
    with pytest.raises(UnconsumedGradientError, match="hf_elixir.full_gradients"):
        sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=False)  # Module.zero_grad reads p.grad (library code): routed, no error
    opt.backward(model(**rank_batch("gpt2", 0, 0, 1, 2)).loss)
    norm = opt.clip_grad_norm(1.0)
    assert torch.isfinite(norm)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # nothing pending: None, no error
    # the stale-read guard stays loud outside full_parameters (an offloaded chunk between steps)
    with pytest.raises(StaleParameterError):
        float(model.transformer.h[0].mlp.c_fc.weight.sum())


def test_full_gradients_needs_an_optimizer():
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(**LAYOUTS["sharded"]))
    with pytest.raises(ValueError, match="prepared without an optimizer"):
        with hf_elixir.full_gradients(model):
            pass
