"""The optimizer's state dict: consolidated by parameter name, at any world size (``ElixirOptimizer``'s part).

The optimizer states live in this rank's shard of each chunk: flat fp32 moments of the fused device chunks
(``FusedDeviceAdam``), the inner ``torch.optim`` optimizer's per-view states, the host blocks of host optimizer
chunks ([Note: host optimizer state] in ``_host_state.py``). :meth:`StateDictMixin.state_dict` all-gathers each
chunk's shards per state key and cuts the full chunk into the parameters' shapes, so every rank holds the same
dict keyed by the original parameter names (``CONSOLIDATED_FORMAT``); :meth:`StateDictMixin.load_state_dict`
takes each rank's part of every parameter back, whatever world size wrote it. A plain ``torch.optim`` state
dict (integer ids in param-group order, a stock ``Trainer`` checkpoint) is matched by position. Below
``fp32`` the fp32 masters are part of the state (key ``"master"``): the compute copies alone would round them.

Source: ``torch.optim.Optimizer.state_dict`` (the layout of ``state`` and ``param_groups``); FSDP's
``FULL_STATE_DICT`` optimizer state (``torch.distributed.fsdp.FullyShardedDataParallel.optim_state_dict``).
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.distributed as dist

from hf_elixir._compat import all_gather_single
from hf_elixir.chunk import strict
from hf_elixir.chunk.chunk import Chunk

__all__ = ["CONSOLIDATED_FORMAT", "SHARDED_FORMAT", "StateDictMixin", "expert_layout_hint"]

CONSOLIDATED_FORMAT = "hf_elixir.optimizer.consolidated.v1"
SHARDED_FORMAT = "hf_elixir.optimizer.sharded.v1"


#: a piece of fused MoE experts split per expert ([Note: split fused experts] in parallel/_expert_units.py)
_EXPERT_PIECE = re.compile(r"\.experts\.\d+\.")


def expert_layout_hint(saved_names, names) -> str:
    """The fix when a checkpoint and this model lay out fused MoE experts differently (one side split per expert,
    the other fused: ``ElixirConfig.split_fused_experts="auto"`` decides by the budget), else ``""``."""
    saved_split = any(_EXPERT_PIECE.search(n) for n in saved_names)
    if saved_split == any(_EXPERT_PIECE.search(n) for n in names):
        return ""
    return (f"; the checkpoint was saved with the fused MoE experts {'split per expert' if saved_split else 'fused'} "
            f"and this model has them {'fused' if saved_split else 'split per expert'} (ElixirConfig.split_fused_"
            f"experts='auto' decides by the device budget): prepare with ElixirConfig(split_fused_experts={saved_split})"
            " to resume it")


def _is_plain_torch_state(state_dict: dict) -> bool:
    groups = state_dict.get("param_groups")
    return isinstance(groups, list) and isinstance(state_dict.get("state"), dict) and all(
        isinstance(i, int) for g in groups for i in g.get("params", ()))


class StateDictMixin:
    """``ElixirOptimizer``'s ``state_dict`` / ``load_state_dict`` over the views, the fused chunks and the inner
    optimizer."""

    def _per_element_keys(self) -> list[str]:
        keys: set[str] = set()
        if any(self.fused_steps.values()):
            keys.update(("exp_avg", "exp_avg_sq"))
        for view in self.views:
            for key, value in self.inner.state.get(view.tensor, {}).items() if self.inner else ():
                if torch.is_tensor(value) and value.numel() == view.tensor.numel() and value.dim() > 0:
                    keys.add(key)
        gathered = [keys]
        if self._job_world_size() > 1:
            gathered = [None] * self._job_world_size()
            dist.all_gather_object(gathered, keys, group=self.manager.job_group)
        union = set().union(*gathered)
        if self.config.precision != "fp32":
            union.add("master")
        return sorted(union)

    def _shard_flat(self, chunk: Chunk, key: str) -> torch.Tensor:
        self.settle_host_steps()
        if key == "master":
            return self.masters[chunk.chunk_id].detach().float().cpu().clone()
        if chunk.chunk_id in self.fused_chunks:
            return self.fused_chunks[chunk.chunk_id][key].detach().float().cpu().clone()
        flat = torch.zeros(chunk.shard_numel, dtype=torch.float32)
        for view in self.views:
            if view.chunk is chunk:
                value = self.inner.state.get(view.tensor, {}).get(key)
                if value is not None:
                    flat[view.lo:view.hi] = value.detach().float().cpu()
        return flat

    def _scalars_by_slot(self) -> dict[str, dict[str, float]]:
        """Per-parameter scalar state (``step``; NAdam's ``mu_product``, ...): ``{name: {key: value}}``.
        Every view of one parameter holds the same values (they are updated in lockstep)."""
        scalars: dict[str, dict[str, float]] = {}
        for view in self.views:
            if id(view.tensor) in self.fused_steps:
                if self.fused_steps[id(view.tensor)]:
                    scalars.setdefault(view.slot.name, {})["step"] = float(self.fused_steps[id(view.tensor)])
                continue
            for key, value in (self.inner.state.get(view.tensor, {}) if self.inner else {}).items():
                if isinstance(value, (int, float)) or (torch.is_tensor(value) and value.dim() == 0):
                    scalars.setdefault(view.slot.name, {})[key] = float(value)
        return scalars

    def state_dict(self) -> dict:
        """Consolidated optimizer state keyed by original parameter names (collective on all ranks).

        Returns a dict ``{"format", "state": {name: {key: fp32 tensor of the param's shape, "step": ...}},
        "param_groups": [{hyperparameters..., "params": [names]}], "loss_scaler": {...}}`` that every
        rank holds (CPU tensors).
        """
        self.settle_host_steps()
        keys = self._per_element_keys()
        state: dict[str, dict] = defaultdict(dict)
        for chunk in self.manager.chunks:
            if not chunk.trainable:
                continue
            for key in keys:
                flat = self._shard_flat(chunk, key)
                if chunk.world_size > 1:
                    full = torch.empty(chunk.chunk_numel, dtype=torch.float32, device=self.manager.compute_device)
                    all_gather_single(full, flat.to(full.device), group=chunk.group)
                    full = full.cpu()
                else:
                    full = flat
                for slot in chunk.slots:
                    if slot.trainable and slot.param in self._param_group_of:
                        state[slot.name][key] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            if self._disk is not None:  # the chunk's disk pages read above leave host memory ([Note: disk states])
                self._disk.pages_out(chunk.chunk_id)
        # and the pages a later chunk's read faults mapped around them while their write-back ran (fault-around)
        self.release_disk_pages()
        scalars = self._scalars_by_slot()
        if self._job_world_size() > 1:
            gathered = [None] * self._job_world_size()
            dist.all_gather_object(gathered, scalars, group=self.manager.job_group)
            for part in gathered:
                for name, values in part.items():
                    scalars.setdefault(name, {}).update(values)
        for name, values in scalars.items():
            for key, value in values.items():
                state[name][key] = torch.tensor(value)
        groups = []
        for group in self.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = [self.manager.slot_of[p].name for p in group["params"]]
            groups.append(entry)
        return {"format": CONSOLIDATED_FORMAT, "state": dict(state), "param_groups": groups,
                "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a dict written by :meth:`state_dict` (any world size).

        A plain ``torch.optim`` state dict of the same optimizer class (parameters numbered in
        param-group order, e.g. a stock ``Trainer`` checkpoint's ``optimizer.pt``) is accepted too: its
        parameters are matched by position to this optimizer's param groups.

        Raises:
            ValueError: not an optimizer state this class can read, or its param groups do not match
                this optimizer's (names the group, the expected and the found parameter names).
        """
        self.settle_host_steps()
        self._release_master_reads()  # pending uploads may read the masters written below
        self.manager.drain_refreshes()
        self._staged.clear()
        if "format" not in state_dict and _is_plain_torch_state(state_dict):
            state_dict = self._from_plain_torch_state(state_dict)
        if state_dict.get("format") != CONSOLIDATED_FORMAT:
            raise ValueError(
                f"optimizer state_dict format {state_dict.get('format')!r} is not {CONSOLIDATED_FORMAT!r}; "
                "load a state written by ElixirOptimizer.state_dict()"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(saved_groups)} param groups but this optimizer has "
                f"{len(self.param_groups)}; build the optimizer with the same param groups as the saved run"
            )
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            names = [self.manager.slot_of[p].name for p in group["params"]]
            if list(saved["params"]) != names:
                raise ValueError(
                    f"optimizer param_groups[{index}] holds {len(names)} parameters {names[:3]}... but the "
                    f"checkpoint's group holds {len(saved['params'])} {list(saved['params'])[:3]}...; build "
                    f"the optimizer with the same param groups as the saved run{expert_layout_hint(saved['params'], names)}"
                )
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        with strict.host_copies():  # the loaded state is host memory
            self._load_view_states(state_dict["state"])
        self.scaler.load_state_dict(state_dict.get("loss_scaler", self.scaler.state_dict()))
        if self._disk is not None:  # the loaded disk states go to the file ([Note: disk states] in _disk_state.py)
            self._disk.file.evict_all()

    def _load_view_states(self, saved_state: dict) -> None:
        for i, view in enumerate(self.views):
            if self._disk is not None and i and self.views[i - 1].chunk is not view.chunk:
                self._disk.pages_out(self.views[i - 1].chunk.chunk_id)  # its regions written: out of host memory
            entry = saved_state.get(view.slot.name)
            fused = self.fused_chunks.get(view.chunk.chunk_id)
            if not entry:  # no state saved (e.g. before the first step): start afresh, as torch.optim does
                self._clear_view_state(view, fused)
                continue
            target: dict = {}
            for key, value in entry.items():
                if key == "step":
                    target["step"] = torch.tensor(float(value), dtype=torch.float32)
                    if fused is not None:
                        self.fused_steps[id(view.tensor)] = int(float(value))
                    continue
                if not torch.is_tensor(value) or value.dim() == 0:  # other scalar state (NAdam mu_product)
                    target[key] = torch.tensor(float(value), dtype=torch.float32)
                    continue
                part = value.reshape(-1)[view.start:view.stop].to(view.tensor.device, torch.float32)
                if key == "master":
                    view.tensor.detach().copy_(part)  # not .data: bumps the master's version counter too
                elif fused is not None:
                    fused[key][view.lo:view.hi].copy_(part)
                else:
                    target[key] = part if self._host_states.owns(view.tensor) else part.clone()
            if self.inner is not None and fused is None:
                self.set_view_state(view, target)
        if "master" in self._per_element_keys_local(saved_state):
            self._refresh_compute_copies()

    def set_view_state(self, view, target: dict) -> None:
        """Give one view of the inner optimizer the state ``target`` (a load); the per-element tensors of a
        host view are copied into its chunk's state buffers ([Note: host optimizer state])."""
        self.inner.state[view.tensor] = target
        self._host_states.adopt(self.inner, [view.tensor])

    def _clear_view_state(self, view, fused: dict[str, torch.Tensor] | None) -> None:
        """Forget one parameter's optimizer state (moments and step count), as ``torch.optim`` does when
        the loaded state has no entry for it."""
        if fused is not None:
            for moment in fused.values():
                moment[view.lo:view.hi].zero_()
            self.fused_steps[id(view.tensor)] = 0
        elif self.inner is not None:
            self.inner.state.pop(view.tensor, None)

    def _from_plain_torch_state(self, state_dict: dict) -> dict:
        """``torch.optim.Optimizer.state_dict()`` (integer ids) -> the consolidated form (names)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(group["params"]) for saved, group in zip(saved_groups, self.param_groups)):
            raise ValueError(
                "a plain torch optimizer state_dict is matched to this optimizer by position: it has param groups of "
                f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}; build the optimizer with the same param groups "
                "as the run that saved it")
        name_of = {}
        groups = []
        for saved, group in zip(saved_groups, self.param_groups):
            names = [self.manager.slot_of[p].name for p in group["params"]]
            name_of.update(zip(saved["params"], names))
            groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": names})
        state = {name_of[i]: entry for i, entry in state_dict["state"].items() if i in name_of}
        return {"format": CONSOLIDATED_FORMAT, "state": state, "param_groups": groups}

    @staticmethod
    def _per_element_keys_local(saved_state: dict) -> set[str]:
        return {k for entry in saved_state.values() for k in entry}
