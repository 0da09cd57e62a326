"""A prepared model's :class:`ElixirOptimizer` state as this rank's shards: what ``hf_elixir.save_checkpoint`` writes
with ``optimizer_layout="sharded"`` (and for every tensor/expert-parallel model) and reads back at the same layout
(see [Note: sharded optimizer state] in ``hf_elixir/checkpoint.py``), plus the JSON encoding of hyperparameters."""

from __future__ import annotations

from typing import Any

import torch

from hf_elixir.chunk import strict
from hf_elixir.optim.optimizer import ElixirOptimizer

__all__ = ["apply_own_shards", "chunk_layout", "decode", "encode", "param_groups_meta", "sharded_payload"]


def encode(value: Any) -> Any:
    """JSON-encode optimizer hyperparameters (tuples and 0-d tensors tagged so they round-trip)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"cannot store a {tuple(value.shape)} tensor in checkpoint metadata")
        return {"__tensor__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def chunk_layout(optimizer: ElixirOptimizer) -> list[dict[str, Any]]:
    """Per trainable chunk: numels, group size and its trainable slots (name, offset, numel, shape)."""
    layout = []
    for chunk in optimizer.manager.chunks:
        if not chunk.trainable:
            continue
        layout.append({
            "chunk_id": chunk.chunk_id, "chunk_numel": chunk.chunk_numel, "shard_numel": chunk.shard_numel,
            "group_size": chunk.world_size,
            "slots": [[s.name, s.offset, s.numel, list(s.shape)] for s in chunk.slots if s.trainable],
        })
    return layout


def view_state(optimizer: ElixirOptimizer, view) -> dict[str, Any]:
    """One shard view's optimizer state, whether the inner torch optimizer or the fused chunk update
    (Adam/AdamW on device chunks, ``ElixirOptimizer.fused_chunks``) holds it."""
    fused = optimizer.fused_chunks.get(view.chunk.chunk_id)
    if fused is None:
        return optimizer.inner.state.get(view.tensor, {}) if optimizer.inner is not None else {}
    steps = optimizer.fused_steps.get(id(view.tensor), 0)
    if not steps:
        return {}
    return {**{k: v[view.lo:view.hi] for k, v in fused.items()}, "step": torch.tensor(float(steps))}


def set_view_state(optimizer: ElixirOptimizer, view, target: dict[str, Any]) -> None:
    fused = optimizer.fused_chunks.get(view.chunk.chunk_id)
    if fused is None:
        if optimizer.inner is not None:
            optimizer.set_view_state(view, target)
        return
    for key, value in target.items():
        if key == "step":
            optimizer.fused_steps[id(view.tensor)] = int(float(value))
        else:
            with strict.host_copies():  # loaded from a file: host memory
                fused[key][view.lo:view.hi].copy_(value)


def sharded_payload(optimizer: ElixirOptimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's shards: tensors ``chunk{id}.{key}`` (fp32 ``[shard_numel]``) and per-slot metadata
    (which keys a parameter's state has; its scalar states such as ``step``)."""
    tensors: dict[str, torch.Tensor] = {}
    slots: dict[str, Any] = {}
    keys_of_chunk: dict[int, set[str]] = {}
    for view in optimizer.views:
        state = view_state(optimizer, view)
        per_element = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0
                       and v.numel() == view.tensor.numel()]
        scalars = {k: encode(v) for k, v in state.items() if k not in per_element}
        slots[view.slot.name] = {"keys": sorted(per_element), "scalars": scalars, "chunk_id": view.chunk.chunk_id}
        keys_of_chunk.setdefault(view.chunk.chunk_id, set()).update(per_element)
    chunks = {c.chunk_id: c for c in optimizer.manager.chunks}
    for cid, keys in keys_of_chunk.items():
        for key in sorted(keys):
            tensors[f"chunk{cid}.{key}"] = optimizer._shard_flat(chunks[cid], key)
        if optimizer._disk is not None:  # the chunk's disk pages read above leave host memory ([Note: disk states])
            optimizer._disk.pages_out(cid)
    if optimizer.config.precision != "fp32":
        for cid, master in optimizer.masters.items():
            tensors[f"chunk{cid}.master"] = master.detach().float().cpu().clone()
            if optimizer._disk is not None:
                optimizer._disk.pages_out(cid)
    optimizer.release_disk_pages()  # what read faults mapped around a region during its write-back
    group_ranks = {str(c.chunk_id): c.rank for c in optimizer.manager.chunks if c.trainable}
    return tensors, {"slots": slots, "group_ranks": group_ranks}


def param_groups_meta(optimizer: ElixirOptimizer) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        entry = {k: encode(v) for k, v in group.items() if k != "params"}
        entry["params"] = [optimizer.manager.slot_of[p].name for p in group["params"]]
        groups.append(entry)
    return groups


def apply_own_shards(optimizer: ElixirOptimizer, tensors: dict, meta: dict, groups: dict) -> None:
    """Copy this rank's shards straight into the optimizer's shard views and masters."""
    for group, saved in zip(optimizer.param_groups, groups["param_groups"]):
        for key, value in saved.items():
            if key != "params":
                group[key] = decode(value)
    for view in optimizer.views:
        entry = meta["slots"].get(view.slot.name)
        if entry is None:
            continue
        cid = view.chunk.chunk_id
        target = {k: tensors[f"chunk{cid}.{k}"][view.lo:view.hi].to(view.tensor.device).clone()
                  for k in entry["keys"]}
        for key, value in entry["scalars"].items():
            target[key] = decode(value)
        if torch.is_tensor(target.get("step")):
            target["step"] = target["step"].to(torch.float32)
        set_view_state(optimizer, view, target)
    masters = {cid: tensors.get(f"chunk{cid}.master") for cid in optimizer.masters}
    if masters and all(v is not None for v in masters.values()):
        for cid, value in masters.items():
            with strict.host_copies():  # loaded from a file: host memory
                optimizer.masters[cid].copy_(value)
        optimizer._refresh_compute_copies()
    optimizer.scaler.load_state_dict(groups["loss_scaler"])
