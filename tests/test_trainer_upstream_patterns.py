"""ElixirCallback under Trainer usage patterns taken from transformers' own Trainer tests (one process).

Patterns: a model of two 0-d parameters (``y = x * a + b``), ``model_init`` (a new model and optimizer
at every ``train()``, as hyperparameter search does), ``train()`` called again on the same Trainer.
The reference is the same Trainer without the callback.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

import hf_elixir
from hf_elixir.integrations import ElixirCallback
from hf_elixir.integrations._binding import binding_of


class _Line(nn.Module):
    """``y = x * a + b`` with 0-d parameters; returns ``(mse_loss, y)`` when labels are given."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.0))
        self.b = nn.Parameter(torch.tensor(0.0))

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        return (nn.functional.mse_loss(y, labels), y) if labels is not None else (y,)


def _data(n: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    y = 2.0 * x + 3.0 + 0.1 * torch.randn(n, generator=g)
    return [{"input_x": xi, "labels": yi} for xi, yi in zip(x, y)]


def _args(tmp_path, name: str) -> TrainingArguments:
    return TrainingArguments(str(tmp_path / name), max_steps=3, per_device_train_batch_size=8, learning_rate=0.1,
                             report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0)


def _line_values(model: nn.Module) -> tuple[float, float]:
    sd = model.state_dict()
    return float(sd["a"]), float(sd["b"])


def test_model_init_trains_under_elixir_at_every_train_call(tmp_path):
    """``train()`` with ``model_init`` builds a new model and optimizer each call. The callback prepared
    only the first one: the second ``train()`` silently ran a plain model and a plain optimizer."""
    reference = Trainer(args=_args(tmp_path, "ref"), train_dataset=_data(), model_init=_Line)
    reference.train()
    expected = _line_values(reference.model)

    callback = ElixirCallback()
    trainer = Trainer(args=_args(tmp_path, "elixir"), train_dataset=_data(), model_init=_Line, callbacks=[callback])
    models = []
    for _ in range(2):
        trainer.train()
        models.append(trainer.model)
        assert type(trainer.optimizer.optimizer).__name__ == "ElixirOptimizer"
        assert callback.model is trainer.model and callback.optimizer is trainer.optimizer.optimizer
        hf_elixir.memory_stats(trainer.model)  # raises for a model hf_elixir does not manage
        # only the current model stays bound (accelerator.backward picks the one Elixir model)
        assert [m for m, _ in binding_of(trainer.accelerator).entries] == [trainer.model]
        for got, want in zip(_line_values(trainer.model), expected):
            assert abs(got - want) < 1e-6
    assert models[0] is not models[1]


def test_second_train_call_on_the_same_trainer_keeps_the_elixir_model(tmp_path):
    reference = Trainer(_Line(), _args(tmp_path, "ref"), train_dataset=_data())
    reference.train()
    reference.train()
    callback = ElixirCallback()
    trainer = Trainer(_Line(), _args(tmp_path, "elixir"), train_dataset=_data(), callbacks=[callback])
    trainer.train()
    first_optimizer = callback.optimizer
    trainer.train()
    assert callback.optimizer is first_optimizer and trainer.optimizer.optimizer is first_optimizer
    for got, want in zip(_line_values(trainer.model), _line_values(reference.model)):
        assert abs(got - want) < 1e-6


def _two_trainers(tmp_path, name: str, callbacks, second_optim: str = "adamw_torch") -> nn.Module:
    """transformers' test_trainer_resume pattern: the model object one Trainer trained goes to the next."""
    torch.manual_seed(0)
    model = _Line()
    Trainer(model, _args(tmp_path, name + "1"), train_dataset=_data(), callbacks=callbacks()).train()
    args = _args(tmp_path, name + "2")
    args.optim = second_optim
    Trainer(model, args, train_dataset=_data(), callbacks=callbacks()).train()
    return model


def test_a_model_trained_by_one_trainer_trains_again_in_the_next(tmp_path):
    """The second Trainer builds a fresh optimizer over the same (already managed) parameters; prepare
    refused the model ("already prepared"). Now the model's ElixirOptimizer takes the fresh optimizer's
    hyperparameters and empty state, so the run equals the stock Trainer's."""
    reference = _two_trainers(tmp_path, "ref", lambda: None)
    model = _two_trainers(tmp_path, "elixir", lambda: [ElixirCallback()])
    for got, want in zip(_line_values(model), _line_values(reference)):
        assert abs(got - want) < 1e-6


def test_a_trained_model_in_a_trainer_with_another_optimizer_class_is_refused(tmp_path):
    with pytest.raises(ValueError, match="already under hf_elixir with a AdamW; a new SGD"):
        _two_trainers(tmp_path, "elixir", lambda: [ElixirCallback()], second_optim="sgd")
