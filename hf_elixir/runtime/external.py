"""``hf_elixir.external_reads(model)``: serve reads of a prepared model's parameters outside its forward, within a
training step (DeepSpeed ZeRO-3's ``GatheredParameters`` for a fused loss computed after the forward).

Inside the model's own forward and backward such reads are served without it ([Note: external reads] in
``hf_elixir/chunk/_external.py``).
"""

from __future__ import annotations

import contextlib

import torch

from hf_elixir.runtime._state import get_state

__all__ = ["external_reads"]


@contextlib.contextmanager
def external_reads(model: torch.nn.Module):
    """Serve reads of ``model``'s parameters from code outside their modules inside the context.

    A parameter read here whose chunk is not on the device is gathered on the spot and stays there until the
    context exits; one that autograd saves for backward is gathered again in backward and held until its gradient
    has arrived, so its gradient reaches its chunk exactly as in plain PyTorch. What autograd saves inside is
    charged to the device budget, as in the model's forward. Under ``torch.distributed`` every rank runs the same
    reads (a gather is a collective). Between steps, to look at or edit weights, use
    :func:`hf_elixir.full_parameters` instead.

    Example::

        hidden = model.model(input_ids).last_hidden_state  # the backbone only
        with hf_elixir.external_reads(model):
            logits = hidden @ model.lm_head.weight.t()  # a loss of one's own that reads the head directly
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()

    Args:
        model: a model prepared by :func:`hf_elixir.prepare`.

    Raises:
        ValueError: ``model`` was not prepared, or (inside) a read of a parameter split over tensor-parallel ranks.

    Source: DeepSpeed ZeRO-3 ``deepspeed.zero.GatheredParameters`` / ``register_external_parameter``; FSDP2's root
    unit and ``register_fsdp_forward_method``.
    """
    manager = get_state(model).manager
    accounting = manager.saved_tensors_accounting() if torch.is_grad_enabled() else contextlib.nullcontext()
    manager.open_reads_window()
    try:
        with accounting:
            yield model
    finally:
        manager.close_reads_window()
