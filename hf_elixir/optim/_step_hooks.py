"""``torch.optim`` step hooks around ``ElixirOptimizer.step``: each hook once per ``step()``, never for the inner
optimizer.

[Note: step hooks] ``torch.optim.Optimizer`` wraps every subclass's ``step`` (``Optimizer.profile_hook_step``,
installed by ``_patch_step_function`` in ``Optimizer.__init__``): the global pre hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook``), then the optimizer's own
(``register_step_pre_hook``), the step, ``_optimizer_step_code`` (the profiler's entry point), the optimizer's
own post hooks, then the global post hooks; each is called as ``hook(optimizer, args, kwargs)`` and a pre hook
may return new ``(args, kwargs)``. Two things break that contract under ``ElixirOptimizer``:

* the *inner* optimizer (``ElixirOptimizer.inner``, the user's class over the shard views) is a ``torch.optim``
  optimizer too, so its ``step`` ran the global hooks again, with the inner optimizer as ``optimizer``: once per
  inner step, i.e. several times per ``step()`` (late reduces split the step) and on the host lane's worker
  thread during backward ([Note: host lane] in ``_overlap.py``). A global hook that sets the learning rate
  (``for g in optimizer.param_groups: g["lr"] = ...``) then wrote the inner groups after ``_run_inner`` copied
  the user's values into them: the views stepped with another lr than plain PyTorch (tiny GPT-2, 5 steps, a
  hook scaling lr by 0.9: 2.4e-2 relative off with the lane on, 1e-2 without; ``tests/test_step_hooks.py``).
  :func:`unhooked_step` steps the inner optimizer without any hook.
* the host lane steps chunks on its worker thread while ``step()`` begins: a pre hook (or the training loop)
  that set a new lr on the main thread meanwhile was read by the lane's later chunks, while their speculation
  recorded the old one, so validation rolled them back by the inverse of an update they had not made
  (3.3e-2 relative off after one step). The lane now steps with the hyperparameters it recorded
  (``ElixirOptimizer._step_views``); validation sees the new lr and steps those chunks again with it.
* hooks the user registered on *their* optimizer (the one given to ``hf_elixir.prepare``, whose ``param_groups``
  the ``ElixirOptimizer`` shares) never ran: that optimizer's ``step`` is never called.

:func:`hooked_step` replaces torch's wrapper on ``ElixirOptimizer.step`` (it carries ``hooked = True``, so
``_patch_step_function`` leaves it alone) and runs, once per call and in torch's order: global pre hooks, the
``ElixirOptimizer``'s pre hooks, the user optimizer's pre hooks (called with the user optimizer), the step, then
the post hooks in the reverse order of owners (user optimizer, ``ElixirOptimizer``, global). Pre hooks run before
anything in the step reads the hyperparameters, so an lr a hook sets is the lr of this step on every path (device
chunks, host chunks, the host lane's speculation: a changed lr makes it roll back and step again, [Note: host
lane]).

Source: ``torch.optim.optimizer.Optimizer.profile_hook_step`` (PyTorch 2.x).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer

__all__ = ["hooked_step", "unhooked_step"]


def _pre_hooks(owners: list[torch.optim.Optimizer]) -> list[tuple[Callable, torch.optim.Optimizer]]:
    """``(hook, optimizer argument)`` in calling order: global hooks (with ``owners[0]``), then each owner's."""
    out = [(hook, owners[0]) for hook in _torch_optimizer._global_optimizer_pre_hooks.values()]
    for owner in owners:
        out += [(hook, owner) for hook in getattr(owner, "_optimizer_step_pre_hooks", {}).values()]
    return out


def _post_hooks(owners: list[torch.optim.Optimizer]) -> list[tuple[Callable, torch.optim.Optimizer]]:
    out = []
    for owner in reversed(owners):
        out += [(hook, owner) for hook in getattr(owner, "_optimizer_step_post_hooks", {}).values()]
    return out + [(hook, owners[0]) for hook in _torch_optimizer._global_optimizer_post_hooks.values()]


def hooked_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``ElixirOptimizer.step`` so the step hooks run once per call ([Note: step hooks]).

    The wrapped method's ``self`` must have ``user_optimizer`` (the user's ``torch.optim`` optimizer, whose own
    hooks run too, called with it as ``optimizer``).

    Raises:
        RuntimeError: a pre hook returned something other than ``None`` or ``(args, kwargs)`` (torch's message).
    """

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        self = args[0]  # as torch's wrapper: the hooks' ``args`` include the optimizer
        owners = [self] + [o for o in (getattr(self, "user_optimizer", None),) if o is not None and o is not self]
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            for hook, optimizer in _pre_hooks(owners):
                result = hook(optimizer, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(
                            f"{step} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
                    args, kwargs = result
            out = step(*args, **kwargs)
            self._optimizer_step_code()
            for hook, optimizer in _post_hooks(owners):
                hook(optimizer, args, kwargs)
        return out

    wrapper.hooked = True  # torch.optim.Optimizer._patch_step_function: already wrapped, leave it
    return wrapper


def unhooked_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without torch's step hooks (the inner optimizer's step, [Note: step hooks]).

    ``Optimizer._patch_step_function`` replaced ``type(optimizer).step`` by a ``functools.wraps`` wrapper marked
    ``hooked``; its ``__wrapped__`` is the class's own ``step`` (with its ``no_grad`` / differentiable wrapper).
    A class whose ``step`` is not so wrapped is stepped as it is.
    """
    step = type(optimizer).step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    step(optimizer)
