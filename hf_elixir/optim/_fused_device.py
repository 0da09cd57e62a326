"""The fused device step: Adam/AdamW over whole device chunk shards in one kernel pass.

[Note: fused device step] The shards of chunks whose optimizer state lives on the device are updated by
``triton_kernels.fused_adamw_`` rather than by the inner ``torch.optim`` optimizer: one pass over the chunk's
whole fp32 master shard, with flat moments of the shard's size (``FusedDeviceAdam.chunks``) and a segment table
that gives every parameter's elements its param group's lr and weight decay (padding, frozen and other ranks'
elements get lr 0 and stay as they are; [Note: segment lookup] in ``triton_kernels/fused_adam.py``), launched
without a host sync. ``triton_kernels.fused_adamw_reference`` is the kernel's PyTorch reference. Where one
chunk's parameters cannot share one launch (some have no gradient this step, their step counts differ, or their
groups' betas, eps or weight-decay rule differ), each parameter is updated on its own by the reference. Only
Adam/AdamW without AMSGrad, ``maximize`` or ``differentiable``, with Triton present and the shards on CUDA (or
forced for tests: the Triton interpreter on CPU tensors).

Source: ``torch.optim.AdamW`` (the update rule); the kernel, its reference and their notes in
``triton_kernels/fused_adam.py``.
"""

from __future__ import annotations

import torch

from hf_elixir.chunk import strict
from hf_elixir.chunk.chunk import Chunk

__all__ = ["FusedDeviceAdam"]


class FusedDeviceAdam:
    """The fused Adam/AdamW state and step of the device optimizer chunks ([Note: fused device step]).

    Args:
        manager: the model's ``ChunkManager``.
        optimizer_cls: the user's optimizer class (``torch.optim.Adam`` or ``torch.optim.AdamW`` to fuse).
        param_groups: the user's param groups (shared dicts: their current lr and weight decay are used).
        masters: chunk id -> fp32 master shard.
        views: every shard view (``_ShardView``) of this rank.
        force: run the fused path on CPU shards too, through the Triton interpreter (tests only).

    Attributes:
        chunks: chunk id -> ``{"exp_avg", "exp_avg_sq"}`` flat fp32 moments of the shard's size (empty when
            the path is not eligible).
        steps: ``id(view.tensor)`` -> steps taken, for every view of a fused chunk.
    """

    def __init__(self, manager, optimizer_cls: type, param_groups: list[dict], masters: dict[int, torch.Tensor],
                 views: list, force: bool) -> None:
        self.manager = manager
        self.param_groups = param_groups
        self.masters = masters
        self._adamw = optimizer_cls is torch.optim.AdamW
        self.chunks: dict[int, dict[str, torch.Tensor]] = {}  # chunk id -> flat Adam moments
        self.steps: dict[int, int] = {}  # id(view.tensor) -> steps taken (fused chunks)
        self._views: dict[int, list] = {}  # chunk id -> its views by shard offset
        self._tables: dict[int, dict] = {}  # chunk id -> segment tables (see _segment_table)
        if self.eligible(optimizer_cls, param_groups, manager.compute_device, force):
            self._setup(views)

    @staticmethod
    def eligible(optimizer_cls: type, param_groups: list[dict], compute_device: torch.device, force: bool) -> bool:
        """Adam/AdamW without AMSGrad/maximize, Triton present, shards on CUDA (or forced for tests)."""
        import triton_kernels  # noqa: PLC0415

        if optimizer_cls not in (torch.optim.Adam, torch.optim.AdamW) or not triton_kernels.HAS_TRITON:
            return False
        if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in param_groups):
            return False
        return compute_device.type == "cuda" or force

    def _setup(self, views: list) -> None:
        """Allocate the moments of every device optimizer chunk with a view on this rank."""
        for chunk in self.manager.chunks:
            if chunk.trainable and chunk.optim_on_device and any(v.chunk is chunk for v in views):
                device = self.masters[chunk.chunk_id].device
                self.chunks[chunk.chunk_id] = {
                    key: strict.register_device(torch.zeros(chunk.shard_numel, dtype=torch.float32, device=device))
                    for key in ("exp_avg", "exp_avg_sq")}
        for view in views:
            if view.chunk.chunk_id in self.chunks:
                self.steps[id(view.tensor)] = 0
        self._views = {cid: sorted((v for v in views if v.chunk.chunk_id == cid), key=lambda v: v.lo)
                       for cid in self.chunks}

    def _decoupled(self, group: dict) -> bool:
        return self._adamw or bool(group.get("decoupled_weight_decay"))

    def _segment_table(self, chunk: Chunk, views: list) -> dict:
        """The chunk's segment tables for ``fused_adamw_`` ([Note: segment lookup] in
        ``triton_kernels/fused_adam.py``), built once on the device: boundaries never change; the
        lr / weight-decay values are re-uploaded (one small host->device copy, no sync) only when a
        scheduler or the user changed them."""
        table = self._tables.get(chunk.chunk_id)
        if table is None:
            bounds, members, cursor = [0], [], 0
            for v in views:
                if v.lo > cursor:  # padding / frozen / foreign elements: lr 0 leaves them unchanged
                    bounds.append(v.lo)
                    members.append(None)
                bounds.append(v.hi)
                members.append(v.group_index)
                cursor = v.hi
            if cursor < chunk.shard_numel:
                bounds.append(chunk.shard_numel)
                members.append(None)
            assert bounds == sorted(bounds) and bounds[-1] == chunk.shard_numel, f"chunk {chunk.chunk_id}: {bounds}"
            device = self.masters[chunk.chunk_id].device
            table = {"members": members, "values": None,
                     "bounds": torch.tensor(bounds, dtype=torch.int64, device=device),
                     "lr": torch.zeros(len(members), dtype=torch.float32, device=device),
                     "wd": torch.zeros(len(members), dtype=torch.float32, device=device)}
            self._tables[chunk.chunk_id] = table
        values = [(0.0, 0.0) if i is None else (float(self.param_groups[i]["lr"]),
                                                  float(self.param_groups[i]["weight_decay"]))
                  for i in table["members"]]
        if values != table["values"]:
            table["lr"].copy_(torch.tensor([lr for lr, _ in values]), non_blocking=True)
            table["wd"].copy_(torch.tensor([wd for _, wd in values]), non_blocking=True)
            table["values"] = values
        return table

    def step(self, flags: list[float], force_triton: bool) -> None:
        """Step every fused chunk's views that have a gradient (``flags``, by ``slot.flag_index``): the whole
        shard in one ``fused_adamw_`` launch where they can share one, else view by view by the reference."""
        import triton_kernels  # noqa: PLC0415

        for cid, moments in self.chunks.items():
            chunk = self.manager.chunks[cid]
            views = self._views[cid]
            flagged = [v for v in views if flags[v.slot.flag_index] > 0]
            if not flagged:
                continue
            groups = [self.param_groups[v.group_index] for v in flagged]
            steps = {self.steps[id(v.tensor)] for v in flagged}
            same_hyper = len({(tuple(g["betas"]), g["eps"], self._decoupled(g)) for g in groups}) == 1
            master, grad = self.masters[cid], self.manager.grad_shards[cid]
            if len(flagged) == len(views) and len(steps) == 1 and same_hyper:
                table = self._segment_table(chunk, views)
                beta1, beta2 = groups[0]["betas"]
                triton_kernels.fused_adamw_(
                    master, grad, moments["exp_avg"], moments["exp_avg_sq"], seg_bounds=table["bounds"],
                    seg_lr=table["lr"], seg_weight_decay=table["wd"], beta1=beta1, beta2=beta2,
                    eps=groups[0]["eps"], step=steps.pop() + 1, decoupled_weight_decay=self._decoupled(groups[0]),
                    force_triton=force_triton, validate_bounds=False)
            else:  # some parameters skip this step or differ in step count: per-parameter update
                for v, g in zip(flagged, groups):
                    beta1, beta2 = g["betas"]
                    triton_kernels.fused_adamw_reference(
                        master[v.lo:v.hi], grad[v.lo:v.hi], moments["exp_avg"][v.lo:v.hi],
                        moments["exp_avg_sq"][v.lo:v.hi], torch.tensor([0, v.hi - v.lo]),
                        torch.tensor([float(g["lr"])]), torch.tensor([float(g["weight_decay"])]), beta1=beta1,
                        beta2=beta2, eps=g["eps"], step=self.steps[id(v.tensor)] + 1, grad_scale=1.0,
                        found_inf=None, out_lowp=None, decoupled=self._decoupled(g))
            for v in flagged:
                self.steps[id(v.tensor)] += 1
