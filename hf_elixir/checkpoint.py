"""Atomic, verifiable training checkpoints of a prepared model and its :class:`ElixirOptimizer`.

Layout of a checkpoint directory ``DIR`` (all tensors in safetensors files, metadata in JSON)::

    DIR/model.safetensors            full (consolidated) model state_dict, written by rank 0, a tied
                                     weight once (under its first name, as transformers saves it)
    DIR/model.tp{r}.safetensors      a tensor/expert-parallel model instead: model-parallel rank r's shards
    DIR/model.ep{r}.safetensors      (see [Note: tensor/expert-parallel checkpoints])
    DIR/optimizer.safetensors        consolidated optimizer tensors (``optimizer_layout="consolidated"``)
    DIR/optimizer.json               param groups, scalar states (``step``), loss scaler
    DIR/optimizer.rank{R}.safetensors  this rank's optimizer shards (``optimizer_layout="sharded"``)
    DIR/manifest.json                written last: step, world size, plan summary, format version,
                                     per-file SHA-256 and byte size, chunk layout, ``extra``, the mesh
                                     (``{"tp", "ep", "dp", "world_size", "split_fused_experts"}``)

[Note: atomic save] Everything is written into the sibling ``.DIR.saving`` and fsynced; the manifest
is written last. Only then is the old ``DIR`` renamed to ``.DIR.previous``, ``.DIR.saving`` renamed to
``DIR`` and ``.DIR.previous`` deleted. A directory cannot be renamed over a non-empty one on POSIX, so
there is an instant with no ``DIR``; at every instant, though, ``DIR`` or ``.DIR.previous`` holds a
complete checkpoint, and :func:`load_checkpoint` (and the next save) falls back to / restores
``.DIR.previous`` when ``DIR`` is missing. A process killed at any point of a save therefore leaves the
previous checkpoint loadable.

[Note: sharded optimizer state] With ``optimizer_layout="sharded"`` each rank writes the fp32 shards
of its chunks' optimizer states (no all-gather, no rank-0 memory peak). Loading into the same
configuration (same world size and chunk layout) reads each rank's own file. Loading into another
world size or chunk layout reassembles full per-parameter states from every rank file (the directory
must be visible to every rank, as for any shared checkpoint) and goes through the consolidated path;
chunks sharded over a sub-group (tensor/expert parallel meshes) cannot be reassembled that way and
raise ``ValueError``.

[Note: tensor/expert-parallel checkpoints] A model rewritten by ``hf_elixir.parallel.parallelize`` holds a
different part of the model on each tp/ep rank. Each rank of the first dp row writes its own part, read from the
chunks without a gather over tp/ep ([Note: local tensors] in ``hf_elixir/parallel/_shard_io.py``): model-parallel
rank ``r`` writes ``model.{tp|ep}{r}.safetensors`` with its tensor-parallel slices and experts, rank 0 adds the
tensors replicated over the model-parallel group, so each tensor is on disk once and no rank holds more than its
own part. The optimizer state is per rank (``optimizer_layout="sharded"``, each rank's chunk layout and param
groups in its ``optimizer_shards`` record). The manifest records the mesh and, per model file, each tensor's role
(``tp`` with its split ``dim``, ``parts`` and ``full_size``, ``experts``, ``replicated``), local and global shape.
Such a checkpoint resumes exactly (weights, fp32 masters, moments, step counts) on the same mesh and the same split
of fused experts; resuming on any other layout (another tp/ep/dp size, a dense model, a dense checkpoint into a
parallel model) is refused with a ``ValueError`` naming both layouts, before anything is loaded. The weights alone
(``optimizer=None``) are resharded: the full tensors are reassembled from every rank's file (``consolidate_shards``,
by the ``tp_slice`` rule the slices were cut with, uneven ones too) and this model takes its part
(``load_full_state_dict``, the same rule, or ``load_state_dict``). A checkpoint without the mesh record whose model
file holds one rank's shards (a tensor/expert-parallel save from before the record) is refused naming the fixes
(``check_layout_recorded``). All ranks write into the same ``.DIR.saving``, gather their file records, and rank 0
writes the manifest and renames last, so [Note: atomic save] holds across ranks: a rank killed at any point leaves
``DIR`` (or ``.DIR.previous``) complete.

Source: the write-temp-then-rename discipline of POSIX ``rename(2)``; safetensors (Hugging Face) for
tensors; PyTorch distributed checkpoint's "each rank writes its shard" layout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hf_elixir.chunk._nf4_state_dict import packed_nf4_state
from hf_elixir.parallel._expert_units import fused_names
from hf_elixir.parallel._load import load_full_state_dict
from hf_elixir.parallel._shard_io import (check_layout_recorded, check_same_layout, consolidate_shards, describe,
                                          is_model_parallel, mesh_record, model_shard_payload, mp_coordinates,
                                          same_layout, shard_file_name, shard_files_to_read, write_local_tensors)
from hf_elixir.runtime._state import get_state
from hf_elixir.optim.optimizer import CONSOLIDATED_FORMAT, ElixirOptimizer
from hf_elixir.optim._shard_payload import (apply_own_shards, chunk_layout, decode, encode, param_groups_meta,
                                            sharded_payload)
from hf_elixir.optim._state_dict import expert_layout_hint

__all__ = ["CHECKPOINT_FORMAT_VERSION", "save_checkpoint", "load_checkpoint", "read_manifest"]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "hf_elixir.checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
_MODEL_FILE = "model.safetensors"
_OPTIM_FILE = "optimizer.safetensors"
_OPTIM_META = "optimizer.json"
_LAYOUTS = ("consolidated", "sharded")
_HASH_BLOCK = 1 << 20


# -- small helpers ---------------------------------------------------------------------------------
def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world_size() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _siblings(directory: Path) -> tuple[Path, Path]:
    """``(.DIR.saving, .DIR.previous)`` next to ``directory``."""
    return (directory.parent / f".{directory.name}.saving", directory.parent / f".{directory.name}.previous")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """safetensors file, fsynced; returns its manifest record (sha256, bytes)."""
    save_file(tensors, str(path))
    _fsync_file(path)
    return {"sha256": _sha256(path), "bytes": path.stat().st_size}


def _record(path: Path) -> dict[str, Any]:
    return {"sha256": _sha256(path), "bytes": path.stat().st_size}


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, cloning any that share storage with an earlier one (safetensors refuses
    shared storage; tied weights are separate clones already)."""
    seen: set[int] = set()
    out = {}
    for key, value in tensors.items():
        value = value.detach().cpu().contiguous()
        ptr = value.untyped_storage().data_ptr() if value.numel() else -1
        if ptr in seen:
            value = value.clone()
        elif ptr != -1:
            seen.add(ptr)
        out[key] = value
    return out


def _plan_summary(model: torch.nn.Module) -> dict[str, Any]:
    state = get_state(model)
    plan = state.plan
    return {"model_type": plan.model_type, "num_params": plan.num_params, "world_size": plan.world_size,
            "precision": plan.precision, "chunk_size_numel": plan.chunk_size_numel,
            "num_chunks": len(state.manager.chunks)}


# -- model tensors -----------------------------------------------------------------------------------
def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Every later name of a parameter held under several names -> its first name (``named_parameters`` order),
    the one a checkpoint stores: transformers' ``save_pretrained`` also writes a tied weight once."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _layout_for(mesh: dict[str, Any], optimizer_layout: str | None) -> str:
    """The optimizer layout to write: a tensor/expert-parallel model's optimizer state is always per rank."""
    if optimizer_layout is None:
        return "sharded" if is_model_parallel(mesh) else "consolidated"
    if optimizer_layout == "consolidated" and is_model_parallel(mesh):
        logger.warning("save_checkpoint(optimizer_layout='consolidated') of a tensor/expert-parallel model (%s): the "
                       "optimizer state is saved per rank ('sharded'), which resumes on the same layout; pass "
                       "optimizer_layout=None to silence this", describe(mesh))
        return "sharded"
    return optimizer_layout


def _model_payload(model: torch.nn.Module, mesh: dict[str, Any], rank: int):
    """``(file this rank writes or None, its tensors, their roles)``; collective. A tensor/expert-parallel model:
    each rank's own shards ([Note: tensor/expert-parallel checkpoints]); else the consolidated state dict (rank 0
    writes it), each tied weight once."""
    if is_model_parallel(mesh):
        tensors, roles = model_shard_payload(model)
        return (shard_file_name(model) if tensors else None), tensors, roles
    state = packed_nf4_state(model, model.state_dict())  # safetensors holds no NF4Tensor: its packed bytes
    aliases = _tied_aliases(model)
    tensors = {k: v for k, v in state.items() if k not in aliases or aliases[k] not in state}
    return (_MODEL_FILE if rank == 0 else None), tensors, {}


# -- save --------------------------------------------------------------------------------------------
def _recover(directory: Path) -> None:
    """A save killed between its two renames leaves only ``.DIR.previous``: move it back."""
    _, previous = _siblings(directory)
    if not directory.exists() and (previous / _MANIFEST).is_file():
        os.rename(previous, directory)
        _fsync_dir(directory.parent)
        logger.warning("restored checkpoint %s from %s (a previous save was interrupted)", directory, previous)


def _check_extra(extra: Any) -> dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint(extra={extra!r}) must be a dict of JSON-serialisable values or None")
    try:
        json.dumps(extra)
    except TypeError as err:
        raise TypeError(f"save_checkpoint(extra=...) must be JSON-serialisable ({err}); store tensors in "
                        "the model or convert them to lists") from None
    return extra


def _write_consolidated_optimizer(saving: Path, optim_state: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: ``optimizer.safetensors`` (per-parameter tensors) and ``optimizer.json``; returns their records."""
    tensors, scalars = {}, {}
    for name, entry in optim_state["state"].items():
        for key, value in entry.items():
            if value.dim() == 0:
                scalars.setdefault(name, {})[key] = encode(value)
            else:
                tensors[f"{name}/{key}"] = value
    files = {_OPTIM_FILE: _save_tensors(saving / _OPTIM_FILE, _unshared(tensors))}
    _write_json(saving / _OPTIM_META, {
        "format": optim_state["format"], "scalars": scalars,
        "param_groups": [{**{k: encode(v) for k, v in g.items() if k != "params"}, "params": g["params"]}
                         for g in optim_state["param_groups"]],
        "loss_scaler": optim_state["loss_scaler"]})
    files[_OPTIM_META] = _record(saving / _OPTIM_META)
    return files


def _write_sharded_optimizer(saving: Path, optimizer: ElixirOptimizer, rank: int) -> tuple[dict, dict]:
    """This rank's ``optimizer.rank{R}.safetensors`` (and rank 0's ``optimizer.json``): ``(file records, this
    rank's shard record)``; the record holds its chunk layout and param groups (they differ per ep rank)."""
    tensors, shard_meta = sharded_payload(optimizer)
    shard_meta["chunk_layout"] = chunk_layout(optimizer)
    shard_meta["param_groups"] = [g["params"] for g in param_groups_meta(optimizer)]
    name = f"optimizer.rank{rank}.safetensors"
    files = {name: _save_tensors(saving / name, tensors)}
    shard_meta["file"] = name
    if rank == 0:
        _write_json(saving / _OPTIM_META, {"format": "hf_elixir.optimizer.sharded.v1",
                                           "param_groups": param_groups_meta(optimizer),
                                           "loss_scaler": optimizer.scaler.state_dict()})
        files[_OPTIM_META] = _record(saving / _OPTIM_META)
    return files, shard_meta


def _commit(directory: Path, manifest: dict[str, Any]) -> None:
    """Rank 0, once every rank's files are in ``.DIR.saving``: the manifest last, then the swap."""
    saving, previous = _siblings(directory)
    _write_json(saving / _MANIFEST, manifest)
    _fsync_dir(saving)
    # [Note: atomic save] swap: DIR -> .DIR.previous, .DIR.saving -> DIR, drop .DIR.previous
    if previous.exists():
        shutil.rmtree(previous)
    if directory.exists():
        os.rename(directory, previous)
    os.rename(saving, directory)
    _fsync_dir(directory.parent)
    if previous.exists():
        shutil.rmtree(previous)


def save_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, optimizer: ElixirOptimizer | None,
                    *, step: int, extra: dict[str, Any] | None = None,
                    optimizer_layout: str | None = None) -> Path:
    """Save model and optimizer state atomically into ``directory`` (collective: call on every rank).

    Args:
        directory: the checkpoint directory; replaced only once the new checkpoint is complete
            (see [Note: atomic save]). Its parent must be on a filesystem every rank sees.
        model: a model prepared by :func:`hf_elixir.prepare`.
        optimizer: its :class:`ElixirOptimizer`, or ``None`` to save only the model.
        step: the training step (int >= 0), returned by :func:`load_checkpoint`.
        extra: JSON-serialisable user data (LR scheduler ``state_dict()``, data-loader position, ...).
        optimizer_layout: ``"consolidated"`` (rank 0 writes full per-parameter states, loadable at any
            world size) or ``"sharded"`` (each rank writes its own shards, see [Note: sharded optimizer
            state]). Default ``None``: consolidated, or sharded for a tensor/expert-parallel model (whose
            checkpoints are per rank: [Note: tensor/expert-parallel checkpoints]).

    Returns:
        the checkpoint directory.

    Raises:
        TypeError: ``step`` is not an int, ``extra`` not JSON-serialisable, ``optimizer`` not an
            ElixirOptimizer.
        ValueError: unknown ``optimizer_layout``; ``model`` not prepared; ``directory`` exists and is
            not a checkpoint (it is never replaced).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"save_checkpoint(step={step!r}) must be an int >= 0")
    if optimizer_layout is not None and optimizer_layout not in _LAYOUTS:
        raise ValueError(f"save_checkpoint(optimizer_layout={optimizer_layout!r}) must be one of {_LAYOUTS} or None")
    if optimizer is not None and not isinstance(optimizer, ElixirOptimizer):
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if not isinstance(optimizer, ElixirOptimizer):
            raise TypeError(f"save_checkpoint(optimizer=<{type(optimizer).__name__}>) must be the "
                            "ElixirOptimizer returned by hf_elixir.prepare (or None)")
    extra = _check_extra(extra)
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or (any(directory.iterdir())
                                                          and not (directory / _MANIFEST).is_file())):
        raise ValueError(f"save_checkpoint({str(directory)!r}): the path exists and is not an hf_elixir "
                         "checkpoint; refusing to replace it. Choose a new or empty directory")
    saving, _ = _siblings(directory)
    rank, world_size = _rank(), _world_size()
    plan = _plan_summary(model)
    mesh = mesh_record(model)
    optimizer_layout = _layout_for(mesh, optimizer_layout)

    # collectives first, in the same order on every rank
    model_file, model_state, roles = _model_payload(model, mesh, rank)
    optim_state = optimizer.state_dict() if optimizer is not None and optimizer_layout == "consolidated" else None

    if rank == 0:
        directory.parent.mkdir(parents=True, exist_ok=True)
        _recover(directory)
        if saving.exists():
            shutil.rmtree(saving)
        saving.mkdir()
    _barrier()
    files: dict[str, Any] = {}
    if model_file is not None:
        files[model_file] = _save_tensors(saving / model_file, _unshared(model_state))
    del model_state
    if optim_state is not None and rank == 0:
        files.update(_write_consolidated_optimizer(saving, optim_state))
    shard_meta = None
    if optimizer is not None and optimizer_layout == "sharded":
        shard_files, shard_meta = _write_sharded_optimizer(saving, optimizer, rank)
        files.update(shard_files)
    model_shard = None if model_file is None or not is_model_parallel(mesh) else {
        "file": model_file, "mp_rank": mp_coordinates(model)[0], "tensors": roles}
    gathered = [(files, shard_meta, model_shard)]
    if _dist_on():
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (files, shard_meta, model_shard))
    if rank == 0:
        all_files: dict[str, Any] = {}
        for part, _, _ in gathered:
            all_files.update(part)
        manifest = {
            "format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_FORMAT_VERSION, "step": step,
            "world_size": world_size, "plan": plan, "files": all_files, "extra": extra,
            "optimizer_layout": None if optimizer is None else optimizer_layout,
            "precision": plan["precision"], "mesh": mesh, "tied": _tied_aliases(model),
        }
        if is_model_parallel(mesh):
            manifest["model_shards"] = [shard for _, _, shard in gathered if shard is not None]
        if optimizer is not None and optimizer_layout == "sharded":
            manifest["chunk_layout"] = chunk_layout(optimizer)
            manifest["optimizer_shards"] = [meta for _, meta, _ in gathered]
        _commit(directory, manifest)
    _barrier()
    return directory


# -- load --------------------------------------------------------------------------------------------
def _resolve(directory: Path) -> Path:
    if (directory / _MANIFEST).is_file():
        return directory
    _, previous = _siblings(directory)
    if (previous / _MANIFEST).is_file():
        logger.warning("checkpoint %s is missing (a save was interrupted); loading %s", directory, previous)
        return previous
    raise FileNotFoundError(f"no hf_elixir checkpoint at {str(directory)!r} (no {_MANIFEST}); "
                            "save one with hf_elixir.checkpoint.save_checkpoint")


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint at ``directory`` (or of its interrupted-save fallback).

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: the manifest is unreadable, of another format or of a newer format version.
    """
    path = _resolve(Path(directory)) / _MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint manifest {str(path)!r} is corrupted ({err}); use an older checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{str(path)!r} is not an hf_elixir checkpoint manifest")
    if manifest.get("format_version", 0) > CHECKPOINT_FORMAT_VERSION:
        raise ValueError(f"checkpoint {str(path.parent)!r} has format_version {manifest['format_version']}, newer "
                         f"than this hf_elixir reads ({CHECKPOINT_FORMAT_VERSION}); upgrade hf_elixir")
    manifest["_directory"] = str(path.parent)
    return manifest


def _verify(root: Path, manifest: dict[str, Any], name: str) -> Path:
    """Check one file's size and SHA-256 against the manifest before it is read."""
    record = manifest["files"].get(name)
    path = root / name
    if record is None:
        raise ValueError(f"checkpoint {str(root)!r}: {name} is not listed in its manifest")
    if not path.is_file():
        raise ValueError(f"checkpoint {str(root)!r}: {name} is missing (the manifest lists it)")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise ValueError(f"checkpoint {str(root)!r}: {name} has {size} bytes but the manifest records "
                         f"{record['bytes']} (truncated or corrupted); use an older checkpoint")
    digest = _sha256(path)
    if digest != record["sha256"]:
        raise ValueError(f"checkpoint {str(root)!r}: {name} fails its SHA-256 check (manifest "
                         f"{record['sha256'][:16]}..., file {digest[:16]}...): the file is corrupted; "
                         "use an older checkpoint")
    return path


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except SafetensorError as err:  # unreachable after a checksum pass unless the writer was broken
        raise ValueError(f"{str(path)!r} is not a readable safetensors file ({err})") from None


def _load_json(root: Path, manifest: dict[str, Any], name: str) -> dict[str, Any]:
    return json.loads(_verify(root, manifest, name).read_text())


def _consolidated_from_files(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    meta = _load_json(root, manifest, _OPTIM_META)
    tensors = _load_tensors(_verify(root, manifest, _OPTIM_FILE))
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        state.setdefault(name, {})[field] = value
    for name, scalars in meta["scalars"].items():
        for key, value in scalars.items():
            state.setdefault(name, {})[key] = decode(value)
    return {"format": meta["format"], "state": state, "param_groups": [decode(g) for g in meta["param_groups"]],
            "loss_scaler": meta["loss_scaler"]}


def _consolidated_from_shards(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Reassemble full per-parameter states from every rank's shard file (any target world size)."""
    layout = manifest["chunk_layout"]
    saved_ws = manifest["world_size"]
    if any(c["group_size"] != saved_ws for c in layout):
        raise ValueError(
            f"checkpoint {str(root)!r} holds optimizer shards over sub-groups (tensor/expert parallel), which "
            f"cannot be resharded to this run; resume with world size {saved_ws} and the same mesh, or save "
            "with optimizer_layout='consolidated'")
    shards = manifest["optimizer_shards"]
    by_rank_tensors = [_load_tensors(_verify(root, manifest, meta["file"])) for meta in shards]
    state: dict[str, dict[str, Any]] = {}
    for chunk in layout:
        cid = chunk["chunk_id"]
        keys = sorted({k.split(".", 1)[1] for t in by_rank_tensors for k in t if k.startswith(f"chunk{cid}.")})
        for key in keys:
            parts = [None] * saved_ws
            for meta, tensors in zip(shards, by_rank_tensors):
                value = tensors.get(f"chunk{cid}.{key}")
                parts[meta["group_ranks"][str(cid)]] = (
                    value if value is not None else torch.zeros(chunk["shard_numel"]))
            full = torch.cat(parts)
            for name, offset, numel, shape in chunk["slots"]:
                state.setdefault(name, {})[key] = full[offset:offset + numel].view(shape).clone()
    for meta in shards:
        for name, entry in meta["slots"].items():
            for key, value in entry["scalars"].items():
                state.setdefault(name, {})[key] = decode(value)
    for name in list(state):  # drop keys a parameter never had (zeros from other parameters' chunks)
        had = set()
        for meta in shards:
            if name in meta["slots"]:
                had.update(meta["slots"][name]["keys"])
        had.add("master")
        state[name] = {k: v for k, v in state[name].items() if k in had or not torch.is_tensor(v) or v.dim() == 0}
    meta = _load_json(root, manifest, _OPTIM_META)
    return {"format": CONSOLIDATED_FORMAT, "state": state,
            "param_groups": [decode(g) for g in meta["param_groups"]], "loss_scaler": meta["loss_scaler"]}


def _read_own_shards(root: Path, manifest: dict[str, Any]) -> tuple[dict, dict, dict]:
    """Same world size and chunk layout: this rank's verified shard tensors, its metadata, the groups."""
    for meta in manifest["optimizer_shards"]:
        if meta["file"] not in manifest["files"]:
            raise ValueError(f"checkpoint {str(root)!r}: its manifest lacks {meta['file']}")
    meta = manifest["optimizer_shards"][_rank()]
    tensors = _load_tensors(_verify(root, manifest, meta["file"]))
    return tensors, meta, _load_json(root, manifest, _OPTIM_META)


def _check_groups(optimizer: ElixirOptimizer, saved: list[list[str]]) -> None:
    mine = [[optimizer.manager.slot_of[p].name for p in g["params"]] for g in optimizer.param_groups]
    if mine != saved:
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved)} param groups of sizes {[len(g) for g in saved]}, "
            f"this optimizer {len(mine)} of sizes {[len(g) for g in mine]}; build the optimizer with the same "
            "param groups (same parameters, same order) as the saved run"
            + expert_layout_hint([n for g in saved for n in g], [n for g in mine for n in g]))


def _check_model_keys(root: Path, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The keys ``model.state_dict()`` has (parameters and persistent buffers) against the file's; the pieces of
    split fused experts count under their fused name, as ``state_dict()`` writes them."""
    expected = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefix = prefix + "." if prefix else ""
        expected.update(prefix + n for n, p in module._parameters.items() if p is not None)
        expected.update(prefix + n for n, b in module._buffers.items()
                        if b is not None and n not in module._non_persistent_buffers_set)
    pieces = fused_names(model)
    expected = {pieces[k][0] if k in pieces else k for k in expected}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(root)!r} does not match this model: missing keys {missing[:5]}, "
                         f"unexpected keys {unexpected[:5]}; load it into the kind of model it was saved from")


def _same_layout(manifest: dict[str, Any], optimizer: ElixirOptimizer) -> bool:
    """Same world size and chunk layout as this rank's saved shards (every rank agrees on the answer)."""
    same = manifest["world_size"] == _world_size()
    if same:
        saved = manifest["optimizer_shards"][_rank()].get("chunk_layout", manifest["chunk_layout"])
        same = saved == chunk_layout(optimizer)
    if _dist_on():
        votes = [None] * _world_size()
        dist.all_gather_object(votes, same)
        same = all(votes)
    return same


def _saved_mesh(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's layout; a checkpoint from before layouts were recorded was saved without tp/ep."""
    ws = manifest["world_size"]
    return manifest.get("mesh") or {"tp": 1, "ep": 1, "dp": ws, "world_size": ws, "split_fused_experts": None}


def _read_model(root: Path, manifest: dict[str, Any], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The verified model tensors this rank loads: its shard files under a tensor/expert-parallel layout
    (same layout checked before), else the consolidated file with tied names filled in."""
    if is_model_parallel(_saved_mesh(manifest)):
        state: dict[str, torch.Tensor] = {}
        for name, keep in shard_files_to_read(model, manifest["model_shards"]).items():
            state.update({k: v for k, v in _load_tensors(_verify(root, manifest, name)).items() if k in keep})
        return state
    state = _with_tied(model, _load_tensors(_verify(root, manifest, _MODEL_FILE)))
    _check_model_keys(root, model, state)
    return state


def _with_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every later name of a tied weight (stored once) filled in from its first name."""
    for alias, first in _tied_aliases(model).items():
        if alias not in state and first in state:
            state[alias] = state[first]
    return state


def _load_resharded(root: Path, manifest: dict[str, Any], model: torch.nn.Module) -> None:
    """Weights only, into another layout: the full tensors (every rank reads every model file: the whole model in
    host memory on each rank, once), then this model's own part of them."""
    saved = _saved_mesh(manifest)
    if is_model_parallel(saved):
        if saved.get("split_fused_experts"):
            raise ValueError(f"checkpoint {str(root)!r} ({describe(saved)}) holds experts split per expert, which "
                             "are not resharded; load it on its own layout and export it with "
                             "model.save_pretrained(dir) (every rank)")
        shards = manifest["model_shards"]
        files = {s["file"]: _load_tensors(_verify(root, manifest, s["file"])) for s in shards}
        full = consolidate_shards(repr(str(root)), shards, files)
    else:
        full = _load_tensors(_verify(root, manifest, _MODEL_FILE))
    logger.info("checkpoint %s: weights saved with layout %s resharded for %s", root, describe(saved),
                describe(mesh_record(model)))
    if is_model_parallel(mesh_record(model)):
        load_full_state_dict(model, full)
        return
    _check_model_keys(root, model, _with_tied(model, full))
    model.load_state_dict(full)


def _read_optimizer(root: Path, manifest: dict[str, Any], optimizer: ElixirOptimizer):
    """``(consolidated state or None, own shards or None)``, verified; the param groups checked."""
    layout = manifest.get("optimizer_layout")
    if layout is None:
        raise ValueError(f"checkpoint {str(root)!r} has no optimizer state (saved with optimizer=None); "
                         "pass optimizer=None or resume from another checkpoint")
    optim_state = own = None
    if layout == "consolidated":
        optim_state = _consolidated_from_files(root, manifest)
    elif _same_layout(manifest, optimizer):
        own = _read_own_shards(root, manifest)
    elif is_model_parallel(_saved_mesh(manifest)):
        raise ValueError(f"checkpoint {str(root)!r}: this rank's optimizer chunks differ from the saved run's at the "
                         f"same layout ({describe(_saved_mesh(manifest))}); prepare with the same ElixirConfig "
                         "(chunk_size_numel, placements, param groups) as the saved run")
    else:
        logger.info("checkpoint %s: optimizer shards of world size %d are resharded for world size %d",
                    root, manifest["world_size"], _world_size())
        optim_state = _consolidated_from_shards(root, manifest)
    if optim_state is not None:
        groups = [list(g["params"]) for g in optim_state["param_groups"]]
    else:
        groups = own[1].get("param_groups") or [list(g["params"]) for g in own[2]["param_groups"]]
    _check_groups(optimizer, groups)
    return optim_state, own


def load_checkpoint(directory: str | os.PathLike, model: torch.nn.Module,
                    optimizer: ElixirOptimizer | None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (collective: call on every rank).

    Every file is checked against the manifest's byte size and SHA-256 before it is read. Model weights
    are consolidated and load at any world size; optimizer state loads at any world size when
    consolidated, and from shards either directly (same world size and chunk layout) or by
    reassembling every rank's shards (plain data parallel). A tensor/expert-parallel checkpoint loads each
    rank's own shards on the layout it was saved in; its weights alone (``optimizer=None``) load into any layout
    ([Note: tensor/expert-parallel checkpoints]).

    Args:
        directory: the checkpoint directory (if a save was interrupted between its renames, the
            previous checkpoint beside it is used, with a warning).
        model: the prepared model to load into.
        optimizer: its :class:`ElixirOptimizer`, or ``None`` to load only the model.

    Returns:
        ``{"step": int, "extra": dict, "world_size": int (of the saving run), "manifest": dict}``.

    Raises:
        FileNotFoundError: no checkpoint at ``directory``.
        ValueError: a file is missing, truncated or fails its checksum; the manifest is corrupted or
            newer; the checkpoint has no optimizer state but ``optimizer`` was given; param groups
            or parameters do not match; sharded state over sub-groups into another world size; with an
            optimizer, a tensor/expert-parallel checkpoint into another layout, or a dense one into a parallel
            model (names both layouts; ``optimizer=None`` reshards the weights instead); into a parallel model, a
            checkpoint without a mesh record holding one rank's shards.
    """
    manifest = read_manifest(directory)
    root = Path(manifest["_directory"])
    if optimizer is not None and not isinstance(optimizer, ElixirOptimizer):
        optimizer = getattr(optimizer, "optimizer", optimizer)
    info = {"step": int(manifest["step"]), "extra": manifest.get("extra", {}),
            "world_size": int(manifest["world_size"]), "manifest": manifest}
    # verify and read everything before touching the model: a bad file leaves the run as it was
    if "mesh" not in manifest and _MODEL_FILE in manifest["files"] and is_model_parallel(mesh_record(model)):
        check_layout_recorded(repr(str(root)), _verify(root, manifest, _MODEL_FILE), model)
    if optimizer is None and not same_layout(_saved_mesh(manifest), model):  # the same answer on every rank
        _load_resharded(root, manifest, model)
        return info
    check_same_layout(repr(str(root)), _saved_mesh(manifest), model)
    model_state = _read_model(root, manifest, model)
    optim_state = own = None
    if optimizer is not None:
        optim_state, own = _read_optimizer(root, manifest, optimizer)
    if is_model_parallel(_saved_mesh(manifest)):
        write_local_tensors(model, model_state)  # [Note: tensor/expert-parallel checkpoints]
    else:
        model.load_state_dict(model_state)
    del model_state
    if optim_state is not None:
        optimizer.load_state_dict(optim_state)
    elif own is not None:
        apply_own_shards(optimizer, *own)
    return info
