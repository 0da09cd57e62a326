"""This rank's own tensors of a tensor/expert-parallel model prepared by ``hf_elixir.prepare``, read and written
without any gather over the model-parallel group: what a training checkpoint of such a model stores per rank.

[Note: local tensors] A rank of a ``(dp, tp)`` or ``(dp, ep)`` mesh holds its tensor-parallel slices and its
experts (the parameters :func:`~hf_elixir.parallel.parallelize` left it, under their unmodified names, shapes
shrunk) plus the tensors replicated over the model-parallel group. ZeRO chunks shard those again over the
data-parallel group. :func:`read_local_tensors` consolidates the chunks over the data-parallel group only
(module by module, in module order, as ``model.state_dict()`` of a ZeRO model does, so the collectives line up on
every rank; under bf16/fp16 the values are the optimizer's fp32 masters, [Note: fp32 exports] in
``hf_elixir/runtime/_exports.py``) and never over tp/ep: the result is this rank's shard of the model, whatever
``model.state_dict()`` returns. :func:`write_local_tensors` is its inverse (the chunks are unsharded, written
through the parameters, marked dirty and written back into each rank's shard, as ``load_state_dict`` does).
:func:`tensor_roles` says, per tensor, how its local value maps to the unmodified model's tensor, so a checkpoint
records the layout it was saved in and refuses another one by name. A tensor tied under several names is read
and written once, under its first name (``named_parameters`` order), as transformers saves tied weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from hf_elixir.chunk.strict import host_copies, to_host
from hf_elixir.parallel._expert_units import fused_names
from hf_elixir.parallel._state import get_parallel_state
from hf_elixir.parallel._tensor_parallel import TPShardLayout, merge_shards
from hf_elixir.runtime._exports import MasterExport, load_fp32_masters
from hf_elixir.runtime._state import get_state
from hf_elixir.runtime.state_dict import _ensure_all_full, write_back_dirty

__all__ = ["check_layout_recorded", "check_same_layout", "consolidate_shards", "describe", "is_model_parallel",
           "mesh_record", "model_shard_payload", "mp_coordinates", "read_local_tensors", "same_layout",
           "shard_file_name", "shard_files_to_read", "tensor_roles", "write_local_tensors", "writes_model_shard"]


def mesh_record(model: nn.Module) -> dict[str, Any]:
    """The layout a checkpoint of ``model`` is bound to: mesh axis sizes and whether fused experts are split.

    Returns:
        ``{"tp": int, "ep": int, "dp": int, "world_size": int, "split_fused_experts": bool}``; a model
        not rewritten by ``parallelize`` is ``tp = ep = 1`` and ``dp`` = the world size.
    """
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    pstate = get_parallel_state(model)
    if pstate is None:
        tp = ep = 1
        dp = world_size
    else:
        mesh = pstate.mesh
        tp, ep, dp = mesh.tp_size, mesh.ep_size, mesh.dp_size
    return {"tp": tp, "ep": ep, "dp": dp, "world_size": world_size, "split_fused_experts": bool(fused_names(model))}


def is_model_parallel(record: dict[str, Any]) -> bool:
    """Does a :func:`mesh_record` describe a tensor- or expert-parallel mesh (tensors sharded per rank)?"""
    return record.get("tp", 1) > 1 or record.get("ep", 1) > 1


def describe(record: dict[str, Any]) -> str:
    """``tp=2 ep=1 dp=1 (world size 2, fused experts kept fused)``: a layout in an error message."""
    split = "split per expert" if record.get("split_fused_experts") else "kept fused"
    return (f"tp={record.get('tp', 1)} ep={record.get('ep', 1)} dp={record.get('dp', '?')} "
            f"(world size {record.get('world_size', '?')}, fused experts {split})")


def mp_coordinates(model: nn.Module) -> tuple[int, int]:
    """``(mp_rank, dp_index)`` of this rank: its place on the tp/ep axis and on the dp axis (``(0, rank)`` without
    a mesh)."""
    pstate = get_parallel_state(model)
    if pstate is None:
        return 0, dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    mesh = pstate.mesh
    if mesh.mp_axis == "tp_ep":  # the expert view's first row writes: [Note: tp x ep checkpoints]
        return mesh.ep_rank, mesh.expert_mesh.get_local_rank("edp")
    mp_rank = mesh.tp_rank if mesh.mp_axis == "tp" else mesh.ep_rank
    return mp_rank, mesh.device_mesh.get_local_rank("dp")


def writes_model_shard(model: nn.Module) -> bool:
    """Ranks of the first dp row write the model's shards (the other rows hold the same values)."""
    return mp_coordinates(model)[1] == 0


# [Note: tp x ep checkpoints] Under tp x ep ([Note: tp x ep mesh] in ``_mesh.py``) a tp slice is the same on every
# rank of its tp index, an expert slice on every rank of its ep index. The expert view's first row (ranks
# ``0 .. ep - 1``, whose ep index is their rank) writes: each rank its experts, ranks ``0 .. tp - 1`` (the dense
# view's first row, tp index = rank) also their tp slices, rank 0 the replicated tensors; the file of ep index
# ``e`` is ``model.ep{e}.safetensors`` with ``mp_rank = e``. So tp slices sit in files ``0 .. tp - 1`` in tp order
# and experts in files ``0 .. ep - 1`` in ep order, each tensor once; a rank reads the tp slices of the file of its
# tp index, the experts of the file of its ep index and the replicated tensors of file 0.


def _file_index(model: nn.Module, role: str) -> int:
    """The ``mp_rank`` of the file holding this rank's tensors of ``role`` (see [Note: tp x ep checkpoints])."""
    if role == "replicated":
        return 0
    mesh = get_parallel_state(model).mesh
    return mesh.tp_rank if role == "tp" else mesh.ep_rank


def _owned(model: nn.Module):
    """``(module, [(name, parameter)], [(name, buffer)])`` per module, each parameter once (under its first name in
    ``named_parameters`` order), persistent buffers only; names relative to ``model``."""
    seen: set[int] = set()
    for fqn, module in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        params = []
        for name, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                params.append((prefix + name, param))
        buffers = [(prefix + name, buf) for name, buf in module._buffers.items()
                   if buf is not None and name not in module._non_persistent_buffers_set]
        if params or buffers:
            yield module, params, buffers


def tensor_roles(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Name -> how this rank's tensor maps to the unmodified model's (see [Note: local tensors]).

    ``{"role": "tp", "dim": d, "parts": p, "full_size": n, "local_shape": [...], "global_shape": [...]}`` for a
    tensor-parallel slice (``n`` features along ``d``, cut by ``tp_slice``: [Note: uneven tensor-parallel slices] in
    ``hf_elixir/chunk/_tp_slices.py``), ``{"role": "experts", ...}`` for an expert-parallel tensor (a fused slice,
    one piece of split experts, or a Switch-style expert), ``{"role": "replicated", ...}`` for the rest (the same on
    every model-parallel rank). ``global_shape`` is the unmodified model's shape where that tensor has this name,
    else ``None``.
    """
    pstate = get_parallel_state(model)
    full_shapes = pstate.full_shapes if pstate is not None else {}
    aliases: dict[int, list[str]] = {}  # a tied parameter is split if any of its names is
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    roles: dict[str, dict[str, Any]] = {}
    for _, params, buffers in _owned(model):
        for name, tensor in params + buffers:
            names = aliases.get(id(tensor), [name])
            entry: dict[str, Any] = {"role": "replicated", "local_shape": list(tensor.shape)}
            layout = next((pstate.tp_layouts[n] for n in names if n in pstate.tp_layouts), None) if pstate else None
            if layout is not None:
                entry.update(role="tp", dim=layout.dim, parts=layout.parts, full_size=layout.full_size)
            elif pstate is not None and any(pstate.is_expert_param(n) for n in names):
                entry["role"] = "experts"
            shape = full_shapes.get(name)
            entry["global_shape"] = list(shape) if shape is not None else None
            roles[name] = entry
    return roles


@torch.no_grad()
def read_local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's tensors of a prepared model (host copies; see [Note: local tensors]). Collective over the
    chunks' data-parallel groups: every rank calls it.

    Returns:
        ``{name: tensor}`` for every parameter (once, under its first name) and persistent buffer, in module
        order; local (sharded) shapes under a tensor/expert-parallel mesh.
    """
    manager = get_state(model).manager
    export = MasterExport(model, manager)
    export.begin()
    out: dict[str, torch.Tensor] = {}
    try:
        for _, params, buffers in _owned(model):
            chunks = sorted({manager.chunk_of[p] for _, p in params if p in manager.slot_of}, key=lambda c: c.chunk_id)
            _ensure_all_full(manager, chunks)
            for name, param in params:
                out[name] = export.value(param) if param in manager.slot_of else to_host(param.detach()).clone()
            for name, buf in buffers:
                out[name] = to_host(buf.detach()).clone()
    finally:
        export.end()
    return out


@torch.no_grad()
def write_local_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Write :func:`read_local_tensors`' output back into a prepared model of the same layout (collective, as the
    read). Every name must be present with its local shape; then the optimizer's fp32 masters are refreshed from
    the parameters and take the fp32 values given exactly ([Note: fp32 loads] in ``hf_elixir/runtime/_exports.py``).

    Raises:
        ValueError: a tensor is missing or of another shape (names it and both shapes).
    """
    state = get_state(model)
    manager = state.manager
    manager.take_param_writes()
    owned = {name for _, params, buffers in _owned(model) for name, _ in params + buffers}
    unexpected = sorted(set(tensors) - owned)
    if unexpected:
        raise ValueError(f"checkpoint tensors {unexpected[:5]} are not in this rank's model: load the checkpoint into "
                         "the kind of model it was saved from")
    for _, params, buffers in _owned(model):
        for name, tensor in params + buffers:
            value = tensors.get(name)
            if value is None or tuple(value.shape) != tuple(tensor.shape):
                got = "missing" if value is None else f"of shape {tuple(value.shape)}"
                raise ValueError(f"checkpoint tensor {name!r} is {got}; this rank's model has {tuple(tensor.shape)}: "
                                 "load the checkpoint into a model prepared with the layout it was saved in")
    for _, params, buffers in _owned(model):
        chunks = sorted({manager.chunk_of[p] for _, p in params if p in manager.slot_of}, key=lambda c: c.chunk_id)
        _ensure_all_full(manager, chunks)
        with host_copies():  # from a file: host memory into the gathered chunk (a manager copy path)
            for name, tensor in params + buffers:
                tensor.copy_(tensors[name])
        for chunk in chunks:
            chunk.dirty = True
    write_back_dirty(manager)
    if state.optimizer is not None:  # as load_state_dict: masters from the parameters, then the fp32 values exactly
        state.optimizer.sync_masters_from_params()
        loaded = {p: tensors[name] for _, params, _ in _owned(model) for name, p in params
                  if p in manager.slot_of and tensors[name].dtype == torch.float32}
        load_fp32_masters(manager, state.optimizer, loaded)  # [Note: fp32 loads]
        state.optimizer.release_disk_pages()  # the masters written in the disk tier's file: out of host memory


# -- what a checkpoint of a tensor/expert-parallel model writes and reads per rank ---------------------------------
def shard_file_name(model: nn.Module) -> str:
    """``model.tp{r}.safetensors`` / ``model.ep{r}.safetensors``: the file of this rank's model-parallel index."""
    pstate = get_parallel_state(model)
    axis = "ep" if pstate.mesh.mp_axis == "tp_ep" else pstate.mesh.mp_axis
    return f"model.{axis}{mp_coordinates(model)[0]}.safetensors"


def model_shard_payload(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """This rank's part of a tensor/expert-parallel checkpoint's model files (collective: every rank calls it).

    The first dp row writes; model-parallel rank 0 writes the replicated tensors, every model-parallel rank its
    own slices and experts, so each tensor is on disk once. Returns ``(tensors, roles)`` (empty on the other dp
    rows), ``roles`` as :func:`tensor_roles` for the tensors written.
    """
    local = read_local_tensors(model)
    if not writes_model_shard(model):
        return {}, {}
    mp_rank = mp_coordinates(model)[0]
    roles = {k: v for k, v in tensor_roles(model).items() if _file_index(model, v["role"]) == mp_rank}
    return {k: local[k] for k in roles}, roles


def shard_files_to_read(model: nn.Module, shards: list[dict[str, Any]]) -> dict[str, set[str]]:
    """The model files (of a checkpoint's ``model_shards`` records) holding this rank's tensors -> the names to take
    from each: the tp slices of its tp index's file, the experts of its ep index's file, the replicated tensors of
    model-parallel rank 0's file ([Note: tp x ep checkpoints]; under dp x tp or dp x ep two files at most)."""
    out: dict[str, set[str]] = {}
    for shard in shards:
        names = {name for name, role in shard["tensors"].items()
                 if _file_index(model, role["role"]) == shard["mp_rank"]}
        if names:
            out[shard["file"]] = names
    return out


def same_layout(saved: dict[str, Any], model: nn.Module) -> bool:
    """Does ``model`` have the layout of a checkpoint's :func:`mesh_record` (always, when neither is tp/ep parallel:
    a ZeRO checkpoint is consolidated)?"""
    current = mesh_record(model)
    if not (is_model_parallel(saved) or is_model_parallel(current)):
        return True
    return all(saved.get(k) == current[k] for k in ("tp", "ep", "dp", "world_size", "split_fused_experts"))


def check_same_layout(where: str, saved: dict[str, Any], model: nn.Module) -> None:
    """Refuse to resume training from a checkpoint saved on another tensor/expert-parallel layout (both named).

    Raises:
        ValueError: either layout is tensor/expert parallel and the mesh or the split of fused experts differ.
    """
    if same_layout(saved, model):
        return
    raise ValueError(
        f"checkpoint {where} was saved with layout {describe(saved)}; this run has {describe(mesh_record(model))}. "
        "The optimizer state of a tensor/expert-parallel run is per rank and resumes only on the layout it was saved "
        f"in: resume with tensor_parallel_size={saved.get('tp', 1)}, expert_parallel_size={saved.get('ep', 1)}, "
        f"world size {saved.get('world_size')} and split_fused_experts={bool(saved.get('split_fused_experts'))}, or "
        "load the weights alone (optimizer=None: resharded to this layout) and start the optimizer afresh")


def _saved_tp_layout(where: str, name: str, role: dict[str, Any], values: list[torch.Tensor]) -> TPShardLayout:
    """The split a tensor-parallel tensor was saved with; its tp-rank-ordered slices must have the lengths
    ``tp_slice`` gives ([Note: uneven tensor-parallel slices] in ``hf_elixir/chunk/_tp_slices.py``: ceil-sized, the
    last shorter), or they are not one save's (a record without ``full_size`` predates uneven splits: its slices
    are equal and sum to it)."""
    dim, parts = role["dim"], role["parts"]
    full_size = role.get("full_size") or sum(v.shape[dim] for v in values)
    layout = TPShardLayout(dim, parts, full_size)
    lengths, expected = [v.shape[dim] for v in values], layout.sizes(len(values))
    if lengths != expected:
        raise ValueError(f"checkpoint {where}: the {len(values)} tensor-parallel slices of {name!r} have lengths "
                         f"{lengths} along dim {dim}, but {full_size} features split over {len(values)} ranks are "
                         f"{expected}; the files are not from one save")
    return layout


def consolidate_shards(where: str, shards: list[dict[str, Any]],
                       files: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The unmodified model's full tensors from a tensor/expert-parallel checkpoint's per-rank model files.

    Tensor-parallel slices are merged in tp-rank order (:func:`merge_shards` with the recorded ``dim``, ``parts`` and
    ``full_size``; each slice of the length ``tp_slice`` gives its rank, the last one shorter where the ranks do not
    divide the dim), fused expert slices concatenated on dim 0 in ep-rank order, Switch-style experts (one file
    each) and replicated tensors taken as they are.

    Args:
        where: the checkpoint, for messages.
        shards: the manifest's ``model_shards`` records.
        files: file name -> its tensors.

    Raises:
        ValueError: a merged tensor does not have its recorded global shape, or its slices not the lengths of
            their ranks.
    """
    parts: dict[str, list[tuple[dict[str, Any], torch.Tensor]]] = {}
    for shard in sorted(shards, key=lambda s: s["mp_rank"]):
        for name, role in shard["tensors"].items():
            parts.setdefault(name, []).append((role, files[shard["file"]][name]))
    full: dict[str, torch.Tensor] = {}
    for name, pieces in parts.items():
        role, values = pieces[0][0], [value for _, value in pieces]
        if role["role"] == "tp":
            full[name] = merge_shards(values, _saved_tp_layout(where, name, role, values))
        elif role["role"] == "experts" and len(values) > 1:
            full[name] = torch.cat(values)
        else:
            full[name] = values[0]
        shape = role.get("global_shape")
        if shape is not None and list(full[name].shape) != shape:
            raise ValueError(f"checkpoint {where}: {name!r} reassembles to {tuple(full[name].shape)}, but its manifest "
                             f"records the global shape {tuple(shape)}; the files are not from one save")
    return full


def check_layout_recorded(where: str, model_file: str | os.PathLike, model: nn.Module) -> None:
    """Refuse a checkpoint without a layout record (no ``mesh`` in its manifest) whose model file a
    tensor/expert-parallel run wrote: before checkpoints recorded the mesh, such a run saved rank 0's
    ``model.state_dict()``, one rank's slices and experts under the unmodified names, which no layout can load.
    Checked on a tensor/expert-parallel ``model`` by the file's shapes against the unmodified model's (a dense
    checkpoint of full tensors passes and is resharded).

    Raises:
        ValueError: a tensor's shape is not the unmodified model's (names it, both shapes and the fixes).
    """
    pstate = get_parallel_state(model)
    if pstate is None or not is_model_parallel(mesh_record(model)):
        return
    with safe_open(str(model_file), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    local = [(n, s) for n, s in shapes.items() if n in pstate.full_shapes and s != tuple(pstate.full_shapes[n])]
    if local:
        name, shape = local[0]
        raise ValueError(
            f"checkpoint {where} has no layout record (no 'mesh' in its manifest.json: it predates them) and its model "
            f"file holds one rank's shards of a tensor/expert-parallel run ({name!r} has shape {shape}, the full model "
            f"{tuple(pstate.full_shapes[name])}; {len(local)} tensors so), which cannot be loaded into any layout. "
            "Re-save the checkpoint with this hf_elixir from a run of its own layout (save_checkpoint now writes every "
            "rank's shards and the mesh), or load the consolidated folder model.save_pretrained(dir) wrote "
            "(hf_elixir.parallel.load_full_state_dict(model, dir))")
