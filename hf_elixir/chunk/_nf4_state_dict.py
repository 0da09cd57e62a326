"""A prepared QLoRA model's ``state_dict`` speaks the plain model's names and values for its NF4 weights.

[Note: NF4 state_dict names] ``prepare`` stores each torchao NF4 weight as a frozen carrier parameter under a
``torch.nn.utils.parametrize`` parametrization ([Note: NF4 in chunks] in ``_nf4.py``), so PyTorch's own
``state_dict()`` names it ``<module>.parametrizations.weight.original`` and writes the packed bytes. Plain PyTorch
(the same peft + ``to_nf4`` model, not prepared) writes ``<module>.weight`` holding torchao's ``NF4Tensor``. Users
compare keys with the plain model, load a plain state dict into the prepared one and back, and peft's
``get_peft_model_state_dict`` filters ``model.state_dict()`` by name; so the parametrized module's hooks translate:

* save (a state-dict post-hook of the module that holds the weight, run after its children wrote theirs): the
  carrier's exported bytes (``runtime/_exports.py``: never upcast) become the ``NF4Tensor`` they pack (a host copy,
  :class:`~hf_elixir.chunk._nf4.NF4Weight` reading them as the forward does) under ``<module>.weight``, and the
  module's keys are put back in plain PyTorch's order (its parameters in their order, then buffers and children);
* load (a load pre-hook of the same module, run before its children load): an ``NF4Tensor`` under
  ``<module>.weight`` with the weight's layout is packed into the carrier's bytes (exact); another NF4 layout or a
  dense tensor of the weight's shape is quantized with the weight's block sizes first, as torchao's ``copy_`` into
  an ``NF4Tensor`` does; anything else is refused with a ``ValueError`` naming the key. The carrier's own key
  (``...parametrizations.weight.original``, what earlier releases wrote) still loads as bytes.

``hf_elixir.save_checkpoint`` writes safetensors, which hold plain tensors only: it stores each NF4 weight as its
carrier's bytes under the carrier's key (:func:`packed_nf4_state`), which ``load_state_dict`` takes back as bytes.

``named_parameters()`` keeps the carrier's name and value: the optimizer, the chunks and the hooks hold that
parameter, and there is no NF4 value to hand out without gathering its chunk.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from hf_elixir.chunk._nf4 import NF4Weight, _NF4Layout, _nf4_module, is_nf4

__all__ = ["install_nf4_state_dict_names", "packed_nf4_state"]


def _nf4_attrs(module: torch.nn.Module) -> dict[str, NF4Weight]:
    """``attr -> NF4Weight`` of each NF4 parametrization on ``module``."""
    if not parametrize.is_parametrized(module):
        return {}
    return {attr: plist[0] for attr, plist in module.parametrizations.items()
            if len(plist) == 1 and isinstance(plist[0], NF4Weight)}


def _original_key(prefix: str, attr: str) -> str:
    return f"{prefix}parametrizations.{attr}.original"


def _plain_order(destination: dict, prefix: str, names: tuple) -> None:
    """Move ``destination``'s keys under ``prefix`` (the module's, written last) into plain PyTorch's order: the
    module's parameters in ``names`` order, then the rest as they were."""
    keys = [k for k in destination if k.startswith(prefix)]
    entries = {k: destination.pop(k) for k in keys}
    first = [prefix + n for n in names if prefix + n in entries]
    for key in [*first, *(k for k in keys if k not in first)]:
        destination[key] = entries[key]


def _save_hook(weights: dict[str, NF4Weight]):
    def hook(module, destination, prefix, local_metadata) -> None:
        found = False
        for attr, weight in weights.items():
            carrier = destination.pop(_original_key(prefix, attr), None)
            if carrier is not None:
                destination[prefix + attr] = weight.forward(carrier.detach())  # a host NF4Tensor over a copy
                found = True
        if found:
            _plain_order(destination, prefix, next(iter(weights.values())).state_names)
    return hook


def _as_carrier(key: str, value, weight: NF4Weight) -> torch.Tensor:
    """The carrier bytes that ``value`` (given under ``key`` for the NF4 weight ``weight``) loads as."""
    layout = weight.layout
    if not torch.is_tensor(value) or tuple(value.shape) != tuple(layout.shape):
        got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"load_state_dict: {key!r} is an NF4 weight of shape {tuple(layout.shape)} and got {got}; "
                         "give torchao's NF4Tensor (what state_dict() writes) or a floating tensor of that shape")
    if is_nf4(value) and _NF4Layout.of(value) == layout:
        return layout.carrier(value, weight.carrier_dtype)
    dense = value.get_original_weight() if is_nf4(value) else value
    if not dense.is_floating_point():
        raise ValueError(f"load_state_dict: {key!r} is an NF4 weight and got a {dense.dtype} tensor; give torchao's "
                         "NF4Tensor (what state_dict() writes) or a floating tensor of its shape")
    # as torchao's copy_ into an NF4Tensor: quantized with the weight's block sizes
    nf4 = _nf4_module().to_nf4(dense.detach().to(layout.dtype), layout.block_size, layout.scaler_block_size)
    return layout.carrier(nf4, weight.carrier_dtype)


def _load_pre_hook(weights: dict[str, NF4Weight]):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        for attr, weight in weights.items():
            key = prefix + attr
            if key in state_dict:  # the module's children (the carrier's list) load after this hook
                state_dict[_original_key(prefix, attr)] = _as_carrier(key, state_dict.pop(key), weight)
    return hook


def install_nf4_state_dict_names(model: torch.nn.Module) -> list:
    """Give every module of ``model`` with NF4 parametrizations the hooks of [Note: NF4 state_dict names].

    Returns:
        the hooks' removable handles.
    """
    handles = []
    for module in model.modules():
        weights = _nf4_attrs(module)
        if weights:
            handles.append(module.register_state_dict_post_hook(_save_hook(weights)))
            handles.append(module.register_load_state_dict_pre_hook(_load_pre_hook(weights)))
    return handles


def packed_nf4_state(model: torch.nn.Module, state: dict) -> dict:
    """``state`` (``model.state_dict()``) with each NF4 weight as its carrier's packed bytes under the carrier's key,
    for a file of plain tensors ([Note: NF4 state_dict names]); other entries as they are."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for attr, weight in _nf4_attrs(module).items():
            value = state.pop(prefix + attr, None)
            if value is not None:
                state[_original_key(prefix, attr)] = weight.layout.carrier(value, weight.carrier_dtype)
    return state
