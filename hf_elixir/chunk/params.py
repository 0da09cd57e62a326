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
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["StaleParameterError", "managed_class", "stale_class", "is_stale", "hide", "show", "plain_classes"]

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
        stale = next((t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, _StaleMixin)), None)
        name = getattr(stale, "_hf_elixir_name", "?")
        shape = tuple(torch._C.TensorBase.shape.__get__(stale)) if stale is not None else ()
        raise StaleParameterError(
            f"{_op_name(func)} on parameter {name!r} (shape {shape}): its data is not current between "
            "steps (hf_elixir keeps it in a resharded, offloaded or not yet refreshed chunk), so it has no values "
            f"to read or write here; {FIX}")

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            return (f"<hf_elixir parameter {getattr(self, '_hf_elixir_name', '?')!r} shape={tuple(self.shape)} "
                    f"dtype={self.dtype} device={self.device}: not current between steps; {FIX}>")

    def __format__(self, spec: str) -> str:
        return repr(self)


_MANAGED: dict[type, type] = {}
_STALE: dict[type, type] = {}


class _ManagedMixin:
    """Marks a parameter whose data lives in a chunk (the current, zero-overhead class)."""


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


def mark_managed(param: torch.nn.Parameter, name: str) -> None:
    """Give ``param`` its managed class and remember its name for error messages (``prepare``)."""
    param._hf_elixir_name = name
    param.__class__ = managed_class(type(param))


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
