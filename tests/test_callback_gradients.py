"""Gradients in Trainer callbacks under ElixirCallback, at 1 and 2 ranks.

The plain Trainer's ``p.grad`` in ``on_optimizer_step`` holds each parameter's (clipped) gradient. Under hf_elixir it
used to be ``None`` for every parameter, silently. Now reading it there raises, naming ``hf_elixir.full_gradients``
and ``on_pre_optimizer_step``; ``full_gradients`` in ``on_pre_optimizer_step`` gives what the plain Trainer's
``p.grad`` holds in ``on_optimizer_step``, checked against a one-process plain Trainer on the global batch (the exact
data-parallel reference); ``full_gradients`` after the step refuses too (fp16 would read the step's unscaled shards).
"""

from __future__ import annotations

import os

import pytest
import torch

import hf_elixir
from hf_elixir.chunk.params import UnconsumedGradientError
from tests._dist import run_distributed
from tests._models import tiny_model

STEPS = 2
ROWS = 2  # per rank and step


def _trainer_grads(rank, world_size, out, elixir, rows):
    """Train ``STEPS`` steps; per step: the gradients a callback saw, and the errors its reads raised."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_elixir.integrations import ElixirCallback

    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 128, (16, 12), generator=g)]
    args = TrainingArguments(os.path.join(out, f"elixir{elixir}-{rank}"), max_steps=STEPS, learning_rate=1e-2,
                             per_device_train_batch_size=rows, max_grad_norm=0.05, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)
    seen: dict[str, list] = {"pre": [], "after": [], "errors": []}

    class Reader(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if elixir:
                with hf_elixir.full_gradients(model) as grads:
                    seen["pre"].append(grads)

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            try:
                grads = {name: p.grad for name, p in model.named_parameters()}
                seen["after"].append({n: g.detach().clone() for n, g in grads.items() if g is not None})
            except UnconsumedGradientError as err:
                seen["errors"].append(str(err))
            if elixir:
                try:
                    with hf_elixir.full_gradients(model):
                        pass
                except ValueError as err:
                    seen["errors"].append(str(err))

    callbacks = [ElixirCallback(hf_elixir.ElixirConfig(default_placement="sharded"))] if elixir else []
    trainer = Trainer(tiny_model("gpt2"), args, train_dataset=data, callbacks=[*callbacks, Reader()])
    trainer.train()
    return seen


def _check(seen, reference):
    assert len(seen["pre"]) == STEPS and len(seen["errors"]) == 2 * STEPS
    assert seen["after"] == []  # never a dict of Nones
    for message in seen["errors"][0::2]:
        assert "full_gradients" in message and "on_pre_optimizer_step" in message, message
    assert "on_pre_optimizer_step" in seen["errors"][1]
    for got, want in zip(seen["pre"], reference["after"]):
        assert got.keys() == want.keys()
        for name, grad in want.items():
            assert float((got[name] - grad).norm()) <= 1e-5 * float(grad.norm()) + 1e-9, name


def test_gradients_in_callbacks_one_rank(tmp_path):
    reference = _trainer_grads(0, 1, str(tmp_path), False, ROWS)
    assert len(reference["after"]) == STEPS and reference["errors"] == []
    _check(_trainer_grads(0, 1, str(tmp_path), True, ROWS), reference)


def test_gradients_in_callbacks_two_ranks(tmp_path):
    reference = _trainer_grads(0, 1, str(tmp_path), False, 2 * ROWS)  # one process, the global batch
    for seen in run_distributed(_trainer_grads, 2, str(tmp_path), True, ROWS, timeout_s=180):
        _check(seen, reference)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_full_gradients_after_the_step_refuses_in_a_plain_loop(precision):
    """fp16: after the step the shards are unscaled and the scale moved; reading them used to be 1e-2 off."""
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()),
                                   hf_elixir.ElixirConfig(precision=precision))
    ids = torch.randint(0, 128, (2, 12))
    opt.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    with pytest.raises(ValueError, match="on_pre_optimizer_step"):
        with hf_elixir.full_gradients(model):
            pass
    with pytest.raises(UnconsumedGradientError, match="full_gradients"):
        _ = model.transformer.wte.weight.grad
    opt.zero_grad()
    assert model.transformer.wte.weight.grad is None  # cleared: None, as in PyTorch
    with hf_elixir.full_gradients(model) as grads:
        assert grads == {}
