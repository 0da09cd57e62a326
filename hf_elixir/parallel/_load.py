"""Load the unmodified model's full tensors into a tensor/expert-parallel model: the reverse of ``_gather.py``.

[Note: loading full tensors] A checkpoint of a parallelized model holds the unmodified model's full tensors
(:func:`~hf_elixir.parallel._gather.gather_full_state_dict` wrote them, or plain transformers did), while this
rank's parameters hold its tensor-parallel slices (``ParallelState.tp_layouts``) and its experts (fused 3-D
experts: rows ``[first, first + L)``, ``EXPERT_ROWS_ATTR``; Switch-style ``expert_{i}`` modules: only this rank's
``i``, under their global names). :func:`load_full_state_dict` cuts each parameter's part out of the full tensor
with the same rule the rewrite used (``TensorShard.cut`` = ``_tensor_parallel._split``) and hands the local
tensors to the model's own ``load_state_dict`` (on a model prepared by ``hf_elixir.prepare`` that unshards the
chunks and writes every rank's shard back; collective there). From a folder it reads through the streamed-init
reader ([Note: streamed tensor-parallel shards] in ``hf_elixir/chunk/_stream_load.py``): only this rank's rows
and columns of each tensor, tied weights under any of their names, per-expert files through transformers'
converters. Buffers are whole on every rank (no placement splits them).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from hf_elixir.chunk._stream_load import (EXPERT_ROWS_ATTR, CheckpointReader, TensorShard, read_local,
                                          resolve_sources)
from hf_elixir.parallel._expert_units import fused_names
from hf_elixir.parallel._state import ParallelState, get_parallel_state
from hf_elixir.runtime.state_dict import finishing_load

__all__ = ["LOCAL_LOAD_ATTR", "load_full_state_dict"]

LOCAL_LOAD_ATTR = "_hf_elixir_local_load_state_dict"  # a parallelized model's load_state_dict of this rank's parts


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> buffer for every buffer ``model.state_dict()`` holds (persistent ones, under every name)."""
    out = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def _param_names(model: nn.Module) -> dict[nn.Parameter, list[str]]:
    names: dict[nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return names


def _shards(state: ParallelState, names: dict[nn.Parameter, list[str]]) -> dict[nn.Parameter, TensorShard]:
    by_name = state.stream_shards()
    return {p: by_name[n] for p, fqns in names.items() for n in fqns if n in by_name}


def _cut(full: torch.Tensor, param: nn.Parameter, shard: TensorShard | None, name: str) -> torch.Tensor:
    """This rank's part of ``full`` for ``param`` (see [Note: loading full tensors])."""
    rows = getattr(param, EXPERT_ROWS_ATTR, None)
    expected = shard.full_shape(param.shape) if shard is not None else \
        torch.Size((rows[1], *param.shape[1:])) if rows is not None else param.shape
    if full.shape != expected:
        raise ValueError(f"load_full_state_dict: {name!r} has shape {tuple(full.shape)} in the given state dict, "
                         f"but the unmodified model's tensor is {tuple(expected)}; pass the full state dict of this "
                         "model (gather_full_state_dict, or a from_pretrained model's state_dict())")
    if shard is not None:
        return shard.cut(full)
    if rows is not None:
        return full[rows[0]:rows[0] + param.shape[0]]
    return full


def _source_names(model: nn.Module, names: dict[nn.Parameter, list[str]]) -> dict[nn.Parameter, list[str]]:
    """Each parameter's names in the unmodified model: a piece of split fused experts
    (``hf_elixir/parallel/_expert_units.py``) reads its row of the fused tensor, under the fused name."""
    fused = fused_names(model)
    return {p: [fused[n][0] if n in fused else n for n in fqns] for p, fqns in names.items()}


def _from_dict(model: nn.Module, full: dict[str, torch.Tensor], names: dict, shards: dict) -> dict[str, torch.Tensor]:
    local: dict[str, torch.Tensor] = {}
    sources = _source_names(model, names)
    for param, fqns in names.items():
        name = next((n for n in sources[param] if n in full), None)
        if name is not None:
            part = _cut(full[name], param, shards.get(param), name)
            local.update({n: part for n in fqns})
    local.update({k: full[k] for k in _persistent_buffers(model) if k in full})
    return local


def _from_folder(model: nn.Module, folder: str | os.PathLike, names: dict, shards: dict,
                 expected=(), missing_fix: str | None = None) -> dict[str, torch.Tensor]:
    """This rank's parts of the folder's tensors under the model's names ([Note: strict loads] in
    ``hf_elixir/chunk/_load_report.py``: unused tensors warn; missing ones raise unless ``missing_fix`` is ``None``,
    then they are left out)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    local: dict[str, torch.Tensor] = {}
    with CheckpointReader(folder) as reader:
        strict = {} if missing_fix is None else {"missing_fix": missing_fix}
        keys, bases = resolve_sources(reader, model, _source_names(model, names), shards, expected=expected,
                                      missing_ok=missing_fix is None, **strict)
        for param, fqns in names.items():
            if param not in keys:
                continue
            part = read_local(reader, keys[param], param.shape, shards.get(param), bases[param])
            local.update({n: part for n in fqns})
        for name in _persistent_buffers(model):
            key = reader.resolve([name], prefix)
            if key is not None:
                local[name] = reader.read(key)
    return local


@torch.no_grad()
def load_full_state_dict(model: nn.Module, source: dict[str, torch.Tensor] | str | os.PathLike, *,
                         strict: bool = True) -> Any:
    """Load the unmodified model's full tensors into a tensor/expert-parallel model (see [Note: loading full
    tensors]).

    Each rank keeps its own part: tensor-parallel slices by the model's layouts, its experts' rows; everything
    else whole. On a model also prepared by ``hf_elixir.prepare`` this is collective (its ``load_state_dict``
    unshards chunks): call it on every rank.

    Args:
        model: a model rewritten by :func:`hf_elixir.parallel.parallelize` (prepared or not).
        source: the full state dict (``{name: tensor}`` with the unmodified model's names and full shapes, e.g.
            :func:`~hf_elixir.parallel.gather_full_state_dict` or a stock model's ``state_dict()``; any dtype,
            cast to each parameter's as ``load_state_dict`` does), or a Hugging Face folder with safetensors
            weights (``save_pretrained`` / the Trainer's checkpoints), of which only this rank's bytes are read.
        strict: raise when a parameter gets no value (a buffer the source lacks keeps its value).

    Returns:
        the ``load_state_dict`` result (``missing_keys`` / ``unexpected_keys`` of the local names).

    Raises:
        ValueError: ``model`` was not parallelized; a tensor of the wrong full shape; with ``strict``, parameters
            without a value in ``source`` (names them). From a folder also as ``hf_elixir.prepare(checkpoint=)``
            (the folder's tensors the unmodified model does not use are logged as a warning).
        FileNotFoundError: ``source`` is not a folder with safetensors weights.
    """
    state = get_parallel_state(model)
    if state is None:
        raise ValueError("load_full_state_dict needs a model rewritten by hf_elixir.parallel.parallelize; use "
                         "model.load_state_dict for others")
    names = _param_names(model)
    shards = _shards(state, names)
    if isinstance(source, (str, os.PathLike)):
        fix = ("pass the folder this model was saved to, or strict=False to keep their values" if strict else None)
        local = _from_folder(model, source, names, shards, expected=state.full_shapes, missing_fix=fix)
    elif isinstance(source, dict):
        local = _from_dict(model, source, names, shards)
    else:
        raise TypeError(f"load_full_state_dict(source=...) got {type(source).__name__}; pass a state dict or the "
                        "path of a Hugging Face folder")
    missing = [fqns[0] for fqns in names.values() if fqns[0] not in local]
    if strict and missing:
        raise ValueError(f"load_full_state_dict: no value for parameters {missing[:5]}"
                         f"{' and more' if len(missing) > 5 else ''} in the given state dict; pass the full state "
                         "dict of this model (strict=False keeps their values)")
    # this rank's parts: the model's own load_state_dict, not the full-tensor one over it ([Note: one state_dict
    # contract] in _state_dict.py), ended on a prepared model if it raises part-way ([Note: a load that raises])
    return finishing_load(model, getattr(model, LOCAL_LOAD_ATTR, model.load_state_dict))(local, strict=False)


@torch.no_grad()
def load_folder_state_dict(model: nn.Module, folder: str | os.PathLike) -> Any:
    """Load a ``save_pretrained`` folder into a model not rewritten by ``parallelize``, plain or prepared by
    ``hf_elixir.prepare`` (then collective: its ``load_state_dict`` unshards chunks; call it on every rank).

    The folder's on-disk names and layout (transformers' conversion mapping: Mixtral's per-expert
    ``block_sparse_moe.experts.{e}.w1``...) are read as ``prepare(checkpoint=)`` reads them, so fused experts, kept
    fused or split per expert, get their values; the Trainer's plain ``load_state_dict`` of the file misses them.

    Returns:
        the ``load_state_dict`` result (``missing_keys`` / ``unexpected_keys``).

    Raises:
        FileNotFoundError: ``folder`` holds no safetensors weights; ValueError as ``prepare(checkpoint=)``.
    """
    names = _param_names(model)
    local = _from_folder(model, folder, names, {}, missing_fix="resume from a checkpoint of this model")
    return model.load_state_dict(local, strict=False)

