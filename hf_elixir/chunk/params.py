"""The classes a managed ``nn.Parameter`` takes: current (a view into its chunk) or stale (a placeholder).

[Note: stale placeholder] Between uses, a parameter whose chunk holds no current unsharded copy
(resharded, offloaded, or older than the last optimizer step) must never read as a number: freed
storage can crash the process or return garbage, and a placeholder value (the NaN this replaced) flows
silently into user code (an EMA of the weights, ``ema_p.lerp_(p, 0.1)``, turned all-NaN under a budget or
at two ranks, and was exact at one rank without one). So the chunk points such a parameter's ``.data`` at a
zero-memory placeholder with the right shape, dtype and device (one element of the chunk's
``stale_values`` expanded) *and* swaps the Python object's class for a subclass of its own class
(:func:`stale_class`) whose ``__torch_function__`` raises :class:`StaleParameterError` on every tensor
operation that reads or writes data: arithmetic, in-place ops, ``clone``, indexing, ``copy_``, ``torch.*``
functions, ``.data`` (get and set), ``.tolist()``, ``.numpy()``, ``.item()``. Writes are caught at the
write, whatever the value. Metadata stays readable (:data:`_METADATA`: shape, dtype, device,
``requires_grad``, ``numel``, ``grad``, hooks), because optimizers, Accelerate and the Trainer read it.
Identity is kept (``isinstance(p, nn.Parameter)``, optimizer param groups, tied weights, dict keys).

The class swap is what a ``.data`` swap cannot do: ``param.data = t`` copies ``t``'s storage and sizes
into the parameter's ``TensorImpl`` but not its Python dispatch key or class, so a subclass placeholder
would not make ops on ``param`` itself raise. A current parameter has the plain managed class
(:func:`managed_class`), whose ``__torch_function__`` is PyTorch's disabled one: forward and backward
pay nothing. Every unshard points the parameters back at the chunk (``Chunk.show_params``) before use;
autograd's saved copies of a leaf parameter see the data again, as with the freed storage before
([Note: parameters as views] in chunk.py). Library code that must handle a stale parameter as a tensor
(``Module._apply`` for a no-op ``model.to``) does so under :func:`plain_classes`.

[Note: gradients in chunks] Backward adds each parameter's gradient into its chunk's buffer and sets
``p.grad`` back to ``None`` (``ChunkManager.on_grad``); the reduced shards belong to the ElixirOptimizer.
Code written for ``p.grad`` would otherwise see "no gradient" and do nothing, silently, so the managed
class makes the usual ways of touching gradients either work or raise :class:`UnconsumedGradientError`:
``p.grad = None`` (and ``del p.grad``) clears that parameter's chunk gradient, as in PyTorch (the
manager's ``clear_param_grad``); assigning a tensor raises; ``torch.nn.utils.clip_grad_norm_`` /
``clip_grad_value_`` reading ``p.grad`` while the chunks hold gradients not yet stepped or cleared raises
and so does a read of a trainable parameter's ``p.grad`` by user code (a file outside installed libraries and
hf_elixir: a ``p.grad`` norm or logging loop) in that window, naming ``hf_elixir.full_gradients`` /
``get_full_grad`` (optim/gradients.py), which give the gradient. After ``optimizer.step()`` and until ``zero_grad``
plain PyTorch's ``p.grad`` still holds the gradient (a Trainer callback's ``on_optimizer_step`` reads it there);
here the step consumed the shards, so a user's read raises too (``grads_stepped``, ``STEPPED_FIX``: read them
before the step, in ``on_pre_optimizer_step``) instead of seeing ``None`` for every parameter; library readers
(the Trainer's DTensor check, ``Module.zero_grad``, accelerate's test scripts) get ``None`` as before; and a global
optimizer step pre-hook refuses any optimizer other than hf_elixir's that holds managed parameters (it would
update nothing). ``model.zero_grad()`` is routed by runtime/guards.py.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten

__all__ = ["StaleParameterError", "UnconsumedGradientError", "managed_class", "stale_class", "is_stale",
           "mark_managed", "hide", "show", "plain_classes", "raw_grad", "set_raw_grad"]

_T = torch._C.TensorBase


def _getset(*names: str) -> list:
    out = []
    for name in names:
        descriptor = getattr(_T, name, None)
        if descriptor is not None:
            out.append(descriptor.__get__)
    return out


#: operations on a stale parameter that read metadata only (no element of its data).
_METADATA = frozenset([
    *_getset("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "is_cuda",
             "is_cpu", "is_meta", "is_mps", "is_xpu", "is_sparse", "is_quantized", "is_mkldnn", "is_nested",
             "names", "retains_grad", "itemsize", "nbytes", "output_nr", "_version", "_backward_hooks",
             "_post_accumulate_grad_hooks", "grad"),
    _T.grad.__set__, _T.requires_grad.__set__,
    _T.size, _T.dim, _T.numel, _T.nelement, _T.element_size, _T.is_floating_point, _T.is_complex,
    _T.get_device, _T.requires_grad_, torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
])

FIX = ("read or write parameters between steps inside `with hf_elixir.full_parameters(model):` "
       "(`writeback=True` keeps edits), or through `model.state_dict()` / `model.load_state_dict(...)`")


class StaleParameterError(RuntimeError):
    """A tensor operation touched a managed parameter whose data is not current (see the module Note)."""


class UnconsumedGradientError(RuntimeError):
    """Code that cannot see hf_elixir's chunk gradients tried to use them ([Note: gradients in chunks])."""


GRAD_FIX = ("backward adds each gradient into its chunk's buffer and reduce-scatters it, so p.grad stays None and "
            "only the optimizer hf_elixir.prepare returned (`model, optimizer = hf_elixir.prepare(model, "
            "optimizer)`) steps, clips and clears these gradients.")


#: a user's read of p.grad after optimizer.step() and before zero_grad ([Note: gradients in chunks])
STEPPED_FIX = ("p.grad of {name!r} after optimizer.step() is None under hf_elixir, where plain PyTorch still holds the "
               "gradient until zero_grad (a Trainer callback's on_optimizer_step): the gradients live in sharded chunk "
               "buffers that the step consumed. Read them before the step with `with hf_elixir.full_gradients(model) "
               "as grads:` (grads[name]: the full fp32 gradient, clipped) or hf_elixir.get_full_grad(param, model), "
               "on every rank: in a Trainer callback, in on_pre_optimizer_step (after the Trainer's clipping, the "
               "values p.grad holds in on_optimizer_step)")


def _op_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    owner = getattr(func, "__self__", None)  # getset descriptors: ``Tensor.data.__set__``
    if name in ("__get__", "__set__") and owner is not None:
        return f"{'reading' if name == '__get__' else 'assigning'} .{getattr(owner, '__name__', owner)}"
    return name


class _StaleMixin:
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        stales = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, _StaleMixin)]
        if stales and all(_served(t, func) for t in stales):  # [Note: external reads] in _external.py
            return func(*args, **(kwargs or {}))
        stale = next((t for t in stales if isinstance(t, _StaleMixin)), None)
        name = getattr(stale, "_hf_elixir_name", "?")
        shape = tuple(torch._C.TensorBase.shape.__get__(stale)) if stale is not None else ()
        raise StaleParameterError(
            f"{_op_name(func)} on parameter {name!r} (shape {shape}): its data is not current between "
            "steps (hf_elixir keeps it in a resharded, offloaded or not yet refreshed chunk), so it has no values "
            f"to read or write here; {FIX}. (Inside the model's forward and backward such reads are served; for a "
            "read elsewhere in a training step, e.g. a loss computed after the forward, wrap it in `with "
            "hf_elixir.external_reads(model):`)")

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            return (f"<hf_elixir parameter {getattr(self, '_hf_elixir_name', '?')!r} shape={tuple(self.shape)} "
                    f"dtype={self.dtype} device={self.device}: not current between steps; {FIX}>")

    def __format__(self, spec: str) -> str:
        return repr(self)


def _served(param, func) -> bool:
    """Did ``param``'s chunk manager serve this read (unshard the chunk: the parameter is current again)?"""
    if not isinstance(param, _StaleMixin):
        return True  # served with an earlier argument of the same chunk
    owner = param.__dict__.get("_hf_elixir_owner")
    serve = getattr(owner, "serve_read", None)
    return serve is not None and serve(param, _op_name(func)) and not isinstance(param, _StaleMixin)


_MANAGED: dict[type, type] = {}
_STALE: dict[type, type] = {}


_LIBRARY_DIRS = ("site-packages", "dist-packages")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hf_elixir/


def _read_by_user_code() -> bool:
    """Is the code reading ``p.grad`` (two frames up) a user's own, not an installed library's or hf_elixir's?"""
    path = sys._getframe(2).f_code.co_filename
    return not (any(part in path for part in _LIBRARY_DIRS) or path.startswith(_PACKAGE_DIR)
                or path.startswith("<frozen"))


def _read_by_clipping() -> bool:
    """Is the code reading ``p.grad`` (two frames up) PyTorch's gradient clipping?"""
    frame = sys._getframe(2)
    return frame.f_globals.get("__name__") == "torch.nn.utils.clip_grad"


class _ManagedMixin:
    """Marks a parameter whose data lives in a chunk (the current class: no ``__torch_function__``, so
    forward and backward pay nothing). ``grad`` is a property ([Note: gradients in chunks])."""

    @property
    def grad(self):
        value = _T.grad.__get__(self)
        if value is None:
            owner = self.__dict__.get("_hf_elixir_owner")
            if owner is not None and owner.grads_pending and _read_by_clipping():
                raise UnconsumedGradientError(
                    f"torch.nn.utils clipping reads p.grad of {self._hf_elixir_name!r}, which is None under "
                    f"hf_elixir: {GRAD_FIX} To clip, call optimizer.clip_grad_norm(max_norm) on the optimizer "
                    "hf_elixir.prepare returned (or accelerator.clip_grad_norm_ with ElixirPlugin / ElixirCallback)")
            if owner is not None and owner.grads_pending and self.requires_grad and _read_by_user_code():
                # [Note: gradients in chunks] a user's p.grad loop (norms, logging) would see no gradient: say where
                raise UnconsumedGradientError(
                    f"p.grad of {self._hf_elixir_name!r} is None under hf_elixir although backward computed its "
                    f"gradient: {GRAD_FIX} To read gradients between backward and optimizer.step(), use `with "
                    "hf_elixir.full_gradients(model) as grads:` (grads[name]: the full fp32 gradient) or "
                    "hf_elixir.get_full_grad(param, model) on every rank; the norm is what optimizer.clip_grad_norm "
                    "(accelerator.clip_grad_norm_) returns")
            if owner is not None and owner.grads_stepped and self.requires_grad and _read_by_user_code():
                raise UnconsumedGradientError(STEPPED_FIX.format(name=self._hf_elixir_name))
        return value

    @grad.setter
    def grad(self, value) -> None:
        owner = self.__dict__.get("_hf_elixir_owner")
        if value is not None:
            raise RuntimeError(
                f"assigning a tensor to p.grad of {self.__dict__.get('_hf_elixir_name', '?')!r} is not supported "
                f"under hf_elixir: {GRAD_FIX} Clear gradients with p.grad = None, model.zero_grad() or "
                "optimizer.zero_grad(set_to_none=...)")
        if owner is not None:
            owner.clear_param_grad(self)
        _T.grad.__set__(self, None)

    @grad.deleter
    def grad(self) -> None:
        self.grad = None

    @property
    def data(self):
        """``param.data`` as in PyTorch (same storage, no autograd history), except that it shares the
        parameter's version counter, as ``param.detach()`` does: a write through it (``p.data.mul_(0.99)``, a hand
        written weight decay) bumps ``param._version``, so the chunk sees it and carries it into the shard and
        the fp32 master ([Note: parameter writes] in _chunk_params.py); with a fresh counter it was lost silently
        wherever the chunk is not the master. The one difference a user can see: writing a parameter through ``.data``
        between a forward that saved it and its backward now raises autograd's in-place error instead of
        computing gradients from the new values. A stale parameter raises as before."""
        if isinstance(self, _StaleMixin):
            return _T.data.__get__(self)  # raises StaleParameterError (see the module Note)
        return _T.detach(self)

    @data.setter
    def data(self, value) -> None:
        _T.data.__set__(self, value)


def _base_of(cls: type) -> type:
    while issubclass(cls, (_ManagedMixin, _StaleMixin)):
        cls = cls.__bases__[-1]
    return cls


def managed_class(cls: type) -> type:
    """The current class of a managed parameter whose original class is ``cls`` (cached)."""
    base = _base_of(cls)
    out = _MANAGED.get(base)
    if out is None:
        out = _MANAGED[base] = type(base)(f"Managed{base.__name__}", (_ManagedMixin, base), {})
    return out


def stale_class(cls: type) -> type:
    """The stale (placeholder) class for parameters of original class ``cls`` (cached)."""
    base = _base_of(cls)
    out = _STALE.get(base)
    if out is None:
        out = _STALE[base] = type(base)(f"Stale{base.__name__}", (_StaleMixin, managed_class(base)), {})
    return out


def is_stale(param: torch.Tensor) -> bool:
    return isinstance(param, _StaleMixin)


def mark_managed(param: torch.nn.Parameter, name: str, owner) -> None:
    """Give ``param`` its managed class; remember its name (for messages) and ``owner``, the chunk
    manager that keeps its gradient (``grads_pending``, ``clear_param_grad(param)``)."""
    param._hf_elixir_name = name
    param._hf_elixir_owner = owner
    param.__class__ = managed_class(type(param))
    _install_step_guard()


def raw_grad(param: torch.Tensor):
    """``param.grad`` as autograd left it (bypasses the managed property)."""
    return _T.grad.__get__(param)


def set_raw_grad(param: torch.Tensor, value) -> None:
    _T.grad.__set__(param, value)


def _foreign_step_guard(optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook: an optimizer other than hf_elixir's over managed parameters
    would update nothing (their p.grad is None), silently."""
    if getattr(optimizer, "manager", None) is not None and hasattr(optimizer, "masters"):
        return  # hf_elixir's ElixirOptimizer (its inner optimizers hold shard views, never parameters)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, _ManagedMixin):
                raise UnconsumedGradientError(
                    f"{type(optimizer).__name__}.step() over parameters managed by hf_elixir (e.g. "
                    f"{p._hf_elixir_name!r}) would update nothing: {GRAD_FIX} Step that optimizer; keep "
                    "managed parameters out of any other optimizer")


_STEP_GUARD = []


def _install_step_guard() -> None:
    if not _STEP_GUARD:
        _STEP_GUARD.append(register_optimizer_step_pre_hook(_foreign_step_guard))


def hide(param: torch.nn.Parameter, placeholder: torch.Tensor) -> None:
    """Point ``param`` at ``placeholder`` (same shape/dtype/device, no memory) and make it raise."""
    if not is_stale(param):
        param.data = placeholder
        param.__class__ = stale_class(type(param))


def show(param: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Point ``param`` at ``view`` (its slice of the chunk) with its current class."""
    if is_stale(param):
        param.__class__ = managed_class(type(param))
    param.data = view


@contextlib.contextmanager
def plain_classes(params):
    """Let library code handle stale ``params`` as ordinary tensors (their data stays the placeholder)."""
    swapped = [p for p in params if is_stale(p)]
    for p in swapped:
        p.__class__ = managed_class(type(p))
    try:
        yield
    finally:
        for p in swapped:
            p.__class__ = stale_class(type(p))
