"""``model.state_dict()`` of a tensor/expert-parallel model: the unmodified model's full tensors, as on every placement.

[Note: one state_dict contract] Under ZeRO (``hf_elixir.prepare``) ``model.state_dict()`` returns full tensors under
the model's own names. After :func:`~hf_elixir.parallel.parallelize` it used to return this rank's parts under the
same names: ``q_proj.weight`` as this rank's ``(out / tp, in)`` rows, a Mixtral ``experts.gate_up_proj`` with this
rank's experts only, a Switch model without the other ranks' ``expert_{i}``. Nothing in such a dict says it is a
part, so ``torch.save(model.state_dict())``, ``accelerator.get_state_dict(model)`` or an EMA copy silently kept a
partial model. Now the root's ``state_dict`` (an instance attribute over the class method, as the save guard is)
returns :func:`~hf_elixir.parallel._gather.assemble_full` of this rank's parts: the unmodified model's keys, full
shapes and order, on every rank (a collective over the tp/ep group, and, on a model also prepared, over the
data-parallel groups; every rank calls it, checked by [Note: collective entry check] in
``hf_elixir/runtime/_entry_check.py``). Names that share one parameter share one full tensor, as in PyTorch
(tied embeddings: Hugging Face's ``save_pretrained`` then writes them once). ``model.load_state_dict`` takes that
dict back (each rank cuts its part out of the full tensors: :func:`~hf_elixir.parallel.load_full_state_dict`), and
still takes this rank's parts. :func:`local_state_dict` gives this rank's parts, as ``state_dict()`` did, for what
is kept per rank (a sharded checkpoint). The same split as FSDP's ``FULL_STATE_DICT`` / ``SHARDED_STATE_DICT``
and transformers' TP models (whose DTensor parameters carry their layout; plain tensors here, so the full dict is
the default and the parts are asked for by name). A submodule's own ``state_dict()`` stays this rank's parts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from hf_elixir.parallel._gather import assemble_full
from hf_elixir.parallel._load import LOCAL_LOAD_ATTR, load_full_state_dict
from hf_elixir.parallel._state import ParallelState, get_parallel_state
from hf_elixir.runtime._entry_check import checked_call

__all__ = ["install_full_state_dict", "local_state_dict"]

_LOCAL_ATTR = "_hf_elixir_local_state_dict"  # the wrapped state_dict: this rank's parts


def local_state_dict(model: nn.Module, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """This rank's parts of a tensor/expert-parallel model's state dict ([Note: one state_dict contract]).

    The names of the parallelized model with this rank's shapes: its tensor-parallel slices
    (``hf_elixir.parallel.get_parallel_state(model).tp_layouts[name]`` says how each was cut; ``full_shapes[name]``
    the whole shape), its experts (fused 3-D experts: its rows; Switch-style ``expert_{i}``: its own ``i`` only),
    everything else whole. On a model also prepared by ``hf_elixir.prepare`` each part is whole over the
    data-parallel ranks (a collective over them: every rank calls it). ``model.load_state_dict`` takes it back on
    the same layout. A model not rewritten by ``parallelize`` has no parts: its ``model.state_dict()``.

    Args:
        model: a model rewritten by :func:`hf_elixir.parallel.parallelize` (prepared or not), or any other.
        keep_vars: as ``torch.nn.Module.state_dict``.

    Returns:
        ``{name: tensor}`` of this rank (an ``OrderedDict``, as ``state_dict()``).
    """
    local = getattr(model, _LOCAL_ATTR, None)
    return local(keep_vars=keep_vars) if local is not None else model.state_dict(keep_vars=keep_vars)


def _storage_key(tensor: torch.Tensor) -> tuple | None:
    """Where ``tensor``'s data lives (names of one tied parameter share it), or ``None`` when it has no storage."""
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (ptr, tensor.storage_offset(), tuple(tensor.shape), tensor.stride()) if ptr else None


def _tie(parts: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """Point every name of one tied parameter at one full tensor (the first name's), as ``state_dict`` does."""
    first: dict[tuple, str] = {}
    for key, value in parts.items():
        if key not in full or not torch.is_tensor(value):
            continue
        where = _storage_key(value)
        if where is None:
            continue
        owner = first.setdefault(where, key)
        if owner != key and full[owner].shape == full[key].shape:
            full[key] = full[owner]


def _put(destination, prefix: str, full: dict[str, torch.Tensor], metadata) -> OrderedDict:
    """Write ``full`` into the caller's ``destination`` under ``prefix``, as ``Module.state_dict`` does."""
    if destination is None:
        destination = OrderedDict()
        destination._metadata = OrderedDict()
    for key, value in full.items():
        destination[prefix + key] = value
    target = getattr(destination, "_metadata", None)
    if target is not None and metadata is not None:
        for key, value in metadata.items():
            target[(prefix + key) if key else prefix[:-1]] = value
    return destination


def _kind(state: ParallelState, source: dict[str, Any]) -> str:
    """``"full"`` when every tensor of ``source`` has the unmodified model's shape (``model.state_dict()``, a stock
    model's), else ``"local"`` (this rank's parts: some tensor-parallel slice or expert rows are smaller). A Switch
    expert is whole either way; the full path loads this rank's own experts from either."""
    shapes = state.full_shapes
    smaller = [k for k, v in source.items() if torch.is_tensor(v) and k in shapes and tuple(v.shape) != shapes[k]]
    return "local" if smaller else "full"


def install_full_state_dict(model: nn.Module) -> None:
    """Make ``model.state_dict()`` / ``model.load_state_dict`` of a parallelized model speak full tensors ([Note:
    one state_dict contract]); :func:`local_state_dict` keeps this rank's parts."""
    original_save, original_load = model.state_dict, model.load_state_dict
    state = get_parallel_state(model)

    def local(*, keep_vars: bool = False):
        return original_save(keep_vars=keep_vars)

    def state_dict(*args, destination=None, prefix: str = "", keep_vars: bool = False):
        if args:  # torch's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (*args, *(destination, prefix, keep_vars)[len(args):])[:3]
        with checked_call("model.state_dict()"):  # every rank: tp/ep all-gathers follow
            parts = original_save(keep_vars=keep_vars)
            full = assemble_full(parts, model)
        _tie(parts, full)
        return _put(destination, prefix, full, getattr(parts, "_metadata", None))

    def load_state_dict(state_dict, strict: bool = True, assign: bool = False):
        if _kind(state, state_dict) == "local":
            return original_load(state_dict, strict=strict, assign=assign)
        with checked_call("model.load_state_dict(...)"):
            return load_full_state_dict(model, state_dict, strict=strict)

    state_dict.__doc__ = ("The unmodified model's full state dict (collective: every rank calls it); this rank's "
                          "parts: hf_elixir.parallel.local_state_dict(model).")
    load_state_dict.__doc__ = ("Load a full state dict (model.state_dict()) or this rank's parts "
                               "(hf_elixir.parallel.local_state_dict(model)).")
    setattr(model, _LOCAL_ATTR, local)
    setattr(model, LOCAL_LOAD_ATTR, original_load)
    model.state_dict = state_dict
    model.load_state_dict = load_state_dict
