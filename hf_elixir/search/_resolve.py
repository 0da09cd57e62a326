"""Plan resolution, a phase of ``hf_elixir.prepare``: the plan ``ElixirConfig(plan=...)`` names, or with
``search="auto"`` the one the search finds from a profiled step of the unprepared model (which leaves the
caller's RNG streams, the model's buffers and its Hugging Face checkpointing switches as they were).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hf_elixir.config import ElixirConfig
from hf_elixir.placement._plan_check import load_plan
from hf_elixir.plan import ElixirPlan
from hf_elixir.runtime._rollback import buffers_restored
from hf_elixir.runtime.activations import hf_checkpointing_off
from hf_elixir.search._plan_search import auto_plan

__all__ = ["check_decoder_inputs", "resolve_plan"]


def resolve_plan(model, config: ElixirConfig, sample_batch, optimizer=None, *,
                 runtime_probe=None) -> ElixirPlan | None:
    """The plan ``prepare`` follows: ``config.plan`` loaded, else (``search="auto"``) searched from one
    profiled step of ``sample_batch`` (a forward only when ``optimizer`` is ``None``), else ``None``.
    ``runtime_probe`` goes to the hardware probe (:func:`auto_plan`).

    Raises:
        ValueError: ``search="auto"`` without ``sample_batch``, or with an encoder-decoder model's batch that
            has no decoder inputs; a plan file that does not load.
    """
    plan = load_plan(config)
    if plan is None and config.search == "auto":
        if sample_batch is None:
            raise ValueError(
                "ElixirConfig.search='auto' profiles one training step: pass hf_elixir.prepare(model, optimizer, "
                "config, sample_batch=batch)" if optimizer is not None else
                "ElixirConfig.search='auto' without an optimizer (inference) profiles one forward under "
                "torch.no_grad(): pass hf_elixir.prepare(model, None, config, sample_batch=batch), a batch "
                "model(**batch) accepts (labels not needed)")
        check_decoder_inputs(model, sample_batch, optimizer)
        # priced with the optimizer's state bytes; without one, a forward-only (inference) step. The profiled
        # step (dropout) and the hardware probe draw random numbers: the caller's RNG streams are restored, so
        # training after a search draws what it would without one (data order, dropout masks); and its training
        # forwards update buffers (BatchNorm running statistics, num_batches_tracked): those are restored too
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices), buffers_restored(model), hf_checkpointing_off(model):
            plan = auto_plan(model, sample_batch, config, optimizer=optimizer, inference=optimizer is None,
                             runtime_probe=runtime_probe)
    return plan


def check_decoder_inputs(model, sample_batch, optimizer) -> None:
    """An encoder-decoder model (Switch-Transformers, T5, BART) cannot run ``model(**sample_batch)`` without
    decoder inputs: ``generate`` makes them itself, the profiled forward does not. Raise before profiling, naming the
    keys to add, instead of the model's own error from deep inside the profiler ("You must specify exactly one of
    input_ids or inputs_embeds")."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or not isinstance(sample_batch, Mapping):
        return
    if any(sample_batch.get(k) is not None for k in ("decoder_input_ids", "decoder_inputs_embeds", "labels")):
        return
    start = getattr(config, "decoder_start_token_id", None)
    fix = ("labels (the training step computes the loss from them)" if optimizer is not None else
           f"decoder_input_ids, e.g. torch.full((batch_size, 1), {start}) (model.config.decoder_start_token_id: "
           "the first decoder step of generate), or labels")
    raise ValueError(
        f"sample_batch={sorted(sample_batch)} for {type(model).__name__}, an encoder-decoder model, has no "
        "decoder_input_ids, decoder_inputs_embeds or labels, so model(**sample_batch) cannot run its decoder; "
        f"add {fix}")
