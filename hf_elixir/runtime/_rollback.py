"""What ``prepare`` may change on a model, recorded before it changes anything, so that a failure
part-way leaves the model exactly as it was (``prepare`` is all or nothing).

[Note: all-or-nothing prepare] ``prepare`` first checks everything it can without touching the model
(arguments, plan, meta parameters, shared modules, the optimizer, the budget: chunks are built and
placed as sizes only). Only then does it change the model: hooks and guards (module hook dicts,
instance attributes such as ``_apply`` and ``resize_token_embeddings``), parameter storage (each
parameter's ``.data`` becomes a view into its chunk, or a placeholder once resharded, and its class a
managed or stale one with attributes naming its owner: [Note: stale placeholder]), gradient hooks,
state-dict hooks, activation checkpointing and the attached state. A :class:`ModelSnapshot` taken
just before restores every one of those on failure: the original ``.data`` tensors (the model's own
storage, kept alive by the snapshot), class, attributes, ``requires_grad``, gradients and gradient
hooks of every parameter, and every module's instance attributes and hook dicts. The chunk manager, its device
pool and host buffers are dropped with it; nothing else refers to them.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

__all__ = ["ModelSnapshot", "buffers_restored"]


def _is_hook_dict(name: str, value) -> bool:
    return "hooks" in name and isinstance(value, dict)


class ModelSnapshot:
    """Every module's instance attributes and hook dicts, and every parameter's storage, flags,
    gradient and gradient hooks, as they are now (see [Note: all-or-nothing prepare])."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._modules = []
        for module in model.modules():
            attrs = dict(vars(module))
            hooks = {k: OrderedDict(v) for k, v in attrs.items() if _is_hook_dict(k, v)}
            self._modules.append((module, attrs, hooks))
        self._params = []
        for param in {id(p): p for p in model.parameters()}.values():
            grad_hooks = getattr(param, "_post_accumulate_grad_hooks", None)
            self._params.append((param, type(param), dict(vars(param)), param.data, param.requires_grad, param.grad,
                                 grad_hooks, None if grad_hooks is None else OrderedDict(grad_hooks)))

    def restore(self) -> None:
        """Put everything recorded back (parameters first: their class and attributes, their original
        storage, then flags)."""
        with torch.no_grad():
            for param, cls, attrs, data, requires_grad, grad, grad_hooks, grad_hook_items in self._params:
                if data.is_meta != param.is_meta:  # streamed init swapped a meta parameter for a placeholder
                    torch.utils.swap_tensors(param, torch.nn.Parameter(data, requires_grad=requires_grad))
                param.__class__ = cls  # first: a managed or stale class ([Note: stale placeholder]) guards .data
                vars(param).clear()
                vars(param).update(attrs)
                param.data = data
                param.grad = grad
                param.requires_grad_(requires_grad)
                if grad_hooks is None:
                    if getattr(param, "_post_accumulate_grad_hooks", None) is not None:
                        param._post_accumulate_grad_hooks = None
                else:
                    grad_hooks.clear()
                    grad_hooks.update(grad_hook_items)
                    param._post_accumulate_grad_hooks = grad_hooks
        for module, attrs, hooks in self._modules:
            current = vars(module)
            for name in [k for k in current if k not in attrs]:
                del current[name]
            for name, value in attrs.items():
                if current.get(name) is not value:
                    current[name] = value
            for name, items in hooks.items():
                current[name].clear()
                current[name].update(items)


@contextlib.contextmanager
def buffers_restored(model: torch.nn.Module):
    """Put every buffer of ``model`` back to its values on entry when the block exits (a copy of each, same
    device and dtype: the buffers' bytes once more while the block runs).

    ``search="auto"`` profiles real training steps on the unprepared model (a warm-up, the traced step, repeats):
    a ``BatchNorm`` in train mode updates ``running_mean``/``running_var`` and ``num_batches_tracked`` on each,
    so without this the model ``prepare`` returned had statistics of batches it never trained on, and differed
    from a ``search="off"`` run (a tiny ResNet: 3 extra ``num_batches_tracked``, every running statistic moved,
    the evaluation loss after two steps 0.7785 against 0.8348). A buffer on the meta device has no values to
    keep and is left alone."""
    values: dict[int, torch.Tensor] = {}
    saved = []  # (module, name, buffer object, its values on entry): a forward may also replace a buffer object
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                if id(buffer) not in values:
                    values[id(buffer)] = buffer.detach().clone()
                saved.append((module, name, buffer, values[id(buffer)]))
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, value in saved:
                buffer.copy_(value)
                module._buffers[name] = buffer
