"""Loud failures for model changes a prepared model cannot follow.

``prepare`` packs the parameters that exist at that moment into chunks. A parameter added or replaced
afterwards (``resize_token_embeddings``, a new module, a new ``nn.Parameter`` assigned to a module)
would not be sharded, reduced across ranks or stepped by the optimizer: it would train wrong, or read
freed chunk storage. These guards turn that into a clear error before any work is done:

* ``model.resize_token_embeddings`` (Hugging Face models) raises at once: it copies the old
  embedding, whose storage is freed while its chunk is resharded.
* a forward pre-hook on the root module checks that every floating-point parameter is managed.
* ``model.to(dtype)`` / ``.half()`` / ``.bfloat16()`` / ``.to(other_device)``, of the model or of any
  submodule (everything through ``Module._apply``), raises before it changes anything when it would change a parameter's dtype or
  device: it would replace the chunk views by copies the optimizer never updates (training stops
  silently). Conversions that change nothing (``model.to(the compute device)``) pass.
* ``model.zero_grad()`` / ``submodule.zero_grad(set_to_none=...)`` clear the chunk gradients of the
  parameters they cover (``torch.nn.Module.zero_grad`` only sees ``p.grad``, which stays ``None`` under
  hf_elixir): gradients no longer accumulate silently across steps in loops that clear through the model
  (the Trainer, Accelerate's examples). ``p.grad = None`` is handled by the managed parameter class
  ([Note: gradients in chunks] in chunk/params.py).
"""

from __future__ import annotations

import torch

from hf_elixir.chunk.manager import ChunkManager
from hf_elixir.chunk.params import plain_classes

__all__ = ["install_guards", "UNMANAGED_FIX"]

UNMANAGED_FIX = ("make such changes (resize_token_embeddings, new modules or parameters, PEFT adapters) before "
                 "hf_elixir.prepare, then prepare the model and build the optimizer on its final parameters")


def _refuse_resize(*args, **kwargs):
    raise ValueError("model.resize_token_embeddings(...) after hf_elixir.prepare is not supported: the embedding "
                     f"lives in sharded chunks and the new one would not be managed; {UNMANAGED_FIX}")


def check_all_managed(model: torch.nn.Module, manager: ChunkManager) -> None:
    """Raise ``ValueError`` naming the first floating-point parameter ``prepare`` did not pack, or (in a
    forward that records gradients) that was frozen at ``prepare`` and is unfrozen now: chunks hold
    gradient buffers and optimizer states for the parameters trainable at ``prepare`` only, so it would
    never be stepped. Freezing a trainable parameter later is what PyTorch does: the hooks follow the
    current ``requires_grad`` (runtime/hooks.py)."""
    slot_of = manager.slot_of
    grad_enabled = torch.is_grad_enabled()
    with torch._C.DisableTorchFunctionSubclass():  # metadata of stale placeholders, without dispatch
        _check_params(model, slot_of, grad_enabled)


def _check_params(model: torch.nn.Module, slot_of: dict, grad_enabled: bool) -> None:
    for name, param in model.named_parameters():
        slot = slot_of.get(param)
        if slot is None:
            if param.is_floating_point():
                raise ValueError(
                    f"parameter {name!r} (shape {tuple(param.shape)}) is not managed by hf_elixir: it was added or "
                    f"replaced after hf_elixir.prepare, so it would not be sharded, reduced or stepped; {UNMANAGED_FIX}")
        elif grad_enabled and param.requires_grad and not slot.trainable:
            raise ValueError(
                f"parameter {name!r} was unfrozen (requires_grad=True) after hf_elixir.prepare, which laid out "
                "gradients and optimizer states only for the parameters trainable then. Set requires_grad before "
                "prepare; to unfreeze mid-training, save (hf_elixir.save_checkpoint or save_pretrained), rebuild the "
                "model with the new setting, prepare it and load. (Freezing a trainable parameter later works as in "
                "PyTorch: it gets no gradient, and the step skips it once its gradient is cleared.)")


def _guard_apply(model: torch.nn.Module, manager: ChunkManager):
    """A root ``_apply`` that runs the conversion on a probe tensor first (see the module docstring)."""
    original = model._apply
    dtype = manager.chunks[0].dtype if manager.chunks else torch.float32

    def _apply(fn, *args, **kwargs):
        probe = torch.empty(0, dtype=dtype, device=manager.compute_device)
        out = fn(probe)
        if isinstance(out, torch.Tensor) and (out.dtype != probe.dtype or out.device != probe.device):
            raise ValueError(
                f"converting a model prepared by hf_elixir (parameters {dtype} on {manager.compute_device}) to "
                f"{out.dtype} on {out.device} is not supported: the copies would not be the chunks the optimizer "
                "updates, so training would stop silently. Choose the compute dtype with "
                "ElixirConfig(precision='bf16' | 'fp16' | 'fp32') before prepare; hf_elixir places parameters on "
                "the device itself (ElixirConfig.device_memory_budget_bytes)")
        with plain_classes(manager.slot_of):  # a no-op conversion of a stale placeholder returns it unchanged
            return original(fn, *args, **kwargs)

    return _apply


def _routed_zero_grad(module: torch.nn.Module, manager: ChunkManager):
    """``module.zero_grad`` that clears the chunk gradients of the module's managed parameters (see the
    module docstring); ``torch.nn.Module.zero_grad`` only sees ``p.grad``, which is ``None`` here."""
    managed = [p for p in module.parameters() if p in manager.slot_of]
    whole = len(managed) == len(manager.slot_of)

    def zero_grad(set_to_none: bool = True) -> None:
        if whole:
            manager.zero_grad(keep_has_grad=not set_to_none)
        else:
            for param in managed:
                manager.clear_param_grad(param, keep_has_grad=not set_to_none)
        torch.nn.Module.zero_grad(module, set_to_none)  # parameters hf_elixir does not manage

    zero_grad.__doc__ = torch.nn.Module.zero_grad.__doc__
    return zero_grad


def install_guards(model: torch.nn.Module, manager: ChunkManager) -> list:
    """Install the guards; returns removable hook handles."""
    if callable(getattr(model, "resize_token_embeddings", None)):
        model.resize_token_embeddings = _refuse_resize  # instance attribute shadows the method
    for module in model.modules():  # instance attributes: .to / .half / .cuda of the root or any submodule
        module._apply = _guard_apply(module, manager)
        if any(p in manager.slot_of for p in module.parameters()):
            module.zero_grad = _routed_zero_grad(module, manager)
    return [model.register_forward_pre_hook(lambda module, args: check_all_managed(module, manager), prepend=True)]
