"""The inner optimizer: the user's ``torch.optim`` class run on the shard views (``ElixirOptimizer``'s part).

Every shard view that the fused device step does not take ([Note: fused device step] in ``_fused_device.py``) is
a parameter of one *inner* instance of the user's optimizer class, built with the user's hyperparameters and one
param group per user group ([Note: shard views] in ``_shard_views.py``). The step runs it on the views with a
gradient; the host lane runs it on one chunk's views during backward (:meth:`InnerStepMixin._step_views`, [Note:
host lane] in ``_overlap.py``). Host chunks with a staging buffer whose groups run the fused Adam/AdamW kernel
are stepped block by block together with their refresh cast instead ([Note: same-pass host step] in
``_same_pass.py``); the states of host chunks live in the host blocks ([Note: host optimizer state] in
``_host_state.py``).
"""

from __future__ import annotations

import inspect

import torch

from hf_elixir.optim._same_pass import SamePassTable, ViewTensors, group_runs_fused, step_and_cast
from hf_elixir.optim._step_hooks import unhooked_step
from hf_elixir.optim._support import optimizer_state_numel_factor

__all__ = ["InnerStepMixin"]


class InnerStepMixin:
    """``ElixirOptimizer``'s inner optimizer: built over the views, stepped by the step and the host lane."""

    def _build_inner(self, cls: type) -> torch.optim.Optimizer | None:
        """The inner instance of ``cls`` over the views the fused device step does not take, one param group per
        user group (empty ones too, so indices line up), the user's defaults; ``None`` when no view is left."""
        groups = []
        for index, group in enumerate(self.param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": [v.tensor for v in self.views if v.group_index == index
                                               and v.chunk.chunk_id not in self.fused_chunks]})
        self._full_group_params = [list(g["params"]) for g in groups]
        if not any(self._full_group_params):
            return None
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in self.user_optimizer.defaults.items() if k in accepted and k != "params"}
        # [Note: fused shard update] the shard views are many small tensors; when the user left the
        # implementation to PyTorch (fused/foreach None), Adam/AdamW use PyTorch's fused kernel (CPU and
        # CUDA), one multi-tensor pass instead of ~10 ops per view
        self._inner_overrides = {}
        if cls in (torch.optim.Adam, torch.optim.AdamW) and kwargs.get("fused") is None \
                and kwargs.get("foreach") is None and not kwargs.get("differentiable"):
            self._inner_overrides = {"fused": True}
        kwargs.update(self._inner_overrides)
        inner = cls([g for g in groups if g["params"]] or groups, **kwargs)
        # keep one inner group per user group, even empty ones, so indices line up
        for group in groups:
            group.update(self._inner_overrides)
        inner.param_groups = groups
        self._host_states.take_over(inner)  # Adagrad's state, made in its constructor
        self._charge_inner_state_estimate()
        return inner

    def _charge_inner_state_estimate(self) -> None:
        """Charge the device optimizer chunks' states to the pool (host chunks' states are in the host
        blocks, which ``host_bytes`` counts as allocated: [Note: host optimizer state])."""
        factor = optimizer_state_numel_factor(self.user_optimizer)
        for chunk in self.manager.chunks:
            if chunk.trainable and chunk.optim_on_device:
                self.manager.pool.charge(factor * chunk.shard_numel * 4, f"optimizer states of chunk {chunk.chunk_id}")

    def _init_same_pass(self) -> None:
        """The same-pass tables ([Note: same-pass host step] in ``_same_pass.py``): chunk id -> (its blocks, its
        views by shard offset), for every chunk with a host staging buffer."""
        self._same_pass: dict[int, tuple[SamePassTable, list]] = {}
        for cid, staging in self._refresh_staging.items():
            views = sorted((v for v in self.views if v.chunk.chunk_id == cid), key=lambda v: v.lo)
            self._same_pass[cid] = (SamePassTable.build([(v.lo, v.hi) for v in views], staging.numel()), views)
        self.num_same_pass_steps = 0  # chunks stepped and cast in one pass (tests and benchmarks count them)

    def _inner_step(self, flags: list[float], done: set[int] = frozenset()) -> None:
        """Step every view with a gradient (``flags``) except those of the chunks in ``done`` (stepped
        during backward by the host lane, [Note: host lane]): first the chunks whose gradient collective has
        finished, then, after waiting for the others, the rest ([Note: late reduce waits] in
        ``hf_elixir/chunk/manager.py``). Each view's update is independent, so the split changes no result."""
        manager = self.manager
        todo = [[t for t in full if flags[self._flag_of(t)] > 0 and self._view_by_tensor[id(t)].chunk.chunk_id
                 not in done] for full in self._full_group_params]
        late = manager.reduces_in_flight()
        if late:
            self._run_inner([[t for t in group if self._view_by_tensor[id(t)].chunk.chunk_id not in late]
                             for group in todo])
            manager.drain_reduces()
            todo = [[t for t in group if self._view_by_tensor[id(t)].chunk.chunk_id in late] for group in todo]
        self._run_inner(todo)
        if self._disk is not None:
            self._disk.write_back_others()  # [Note: disk states] in _disk_state.py

    def _step_views(self, views: list, hyper: list[dict]) -> None:
        """Step exactly ``views`` with the hyperparameters ``hyper`` (per param group, as the host lane recorded
        them for its speculative step of one chunk; same inner optimizer, so the same arithmetic as
        :meth:`_inner_step`). Not the param groups' live values: the lane runs on its own thread, and a step pre
        hook may set a new lr on the main thread meanwhile ([Note: step hooks] in ``_step_hooks.py``); the
        validation compares the recorded values with the ones the step uses, and the rollback undoes an update
        made with exactly the recorded ones."""
        chosen = {id(v.tensor) for v in views}
        self._run_inner([[t for t in full if id(t) in chosen] for full in self._full_group_params], hyper)

    def _run_inner(self, params_per_group: list[list[torch.Tensor]], hyper: list[dict] | None = None) -> None:
        """Step ``params_per_group`` (views, aligned with the param groups) with ``hyper`` (per group; default:
        the groups' current hyperparameters): the views of chunks :meth:`_same_pass_chunks` picks block by block
        with their staging cast ([Note: same-pass host step]), the others by the inner optimizer."""
        if not any(params_per_group):
            return
        if hyper is None:
            hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        for inner_group, values, params in zip(self.inner.param_groups, hyper, params_per_group):
            for key, value in values.items():
                if key != "params":
                    inner_group[key] = value
            inner_group.update(self._inner_overrides)
            inner_group["params"] = params
        fresh = self._host_states.prime(self.inner, params_per_group)
        same_pass = self._same_pass_chunks(params_per_group)
        try:
            rest = [[t for t in params if self._view_by_tensor[id(t)].chunk.chunk_id not in same_pass]
                    for params in params_per_group]
            if any(rest):
                self._staged.difference_update(self._view_by_tensor[id(t)].chunk.chunk_id for g in rest for t in g)
                if self._disk is None:
                    self._step_params(rest)
                else:  # chunk by chunk, disk chunks read ahead and written back ([Note: disk states])
                    cids = {self._view_by_tensor[id(t)].chunk.chunk_id for g in rest for t in g}
                    self._disk.run(sorted(cids), lambda cid: self._step_params(
                        [[t for t in g if self._view_by_tensor[id(t)].chunk.chunk_id == cid] for g in rest]))
            if self._disk is None:
                for cid, chosen in same_pass.items():
                    self._step_same_pass(cid, chosen)
            else:
                self._disk.run(sorted(same_pass), lambda cid: self._step_same_pass(cid, same_pass[cid]))
        finally:
            for inner_group, full in zip(self.inner.param_groups, self._full_group_params):
                inner_group["params"] = full
        if fresh:  # a state the step made itself (SGD's momentum buffer) moves into the blocks
            self._host_states.adopt(self.inner, fresh)

    def _step_params(self, params_per_group: list[list[torch.Tensor]]) -> None:
        """One ``inner.step()`` over ``params_per_group`` (aligned with the param groups)."""
        for inner_group, params in zip(self.inner.param_groups, params_per_group):
            inner_group["params"] = params
        unhooked_step(self.inner)  # no step hooks for the inner optimizer ([Note: step hooks])
        # a fused kernel (torch._fused_adamw_) leaves the masters' version counter as it was: bump it, so
        # a pending upload of a master sees the write ([Note: strict refresh source] in chunk/_chunk_refresh.py)
        torch.autograd.graph.increment_version([t for params in params_per_group for t in params])

    def _same_pass_chunks(self, params_per_group: list[list[torch.Tensor]]) -> dict[int, set[int]]:
        """Chunk id -> ids of its views in ``params_per_group``, for the chunks with a staging buffer whose
        views' groups all run the fused Adam/AdamW kernel ([Note: same-pass host step])."""
        runs_fused = [group_runs_fused(type(self.inner), g) for g in self.inner.param_groups]
        chosen: dict[int, set[int]] = {}
        refused: set[int] = set()
        for index, params in enumerate(params_per_group):
            for t in params:
                cid = self._view_by_tensor[id(t)].chunk.chunk_id
                if cid not in self._same_pass:
                    continue
                chosen.setdefault(cid, set()).add(id(t))
                if not runs_fused[index]:
                    refused.add(cid)
        return {cid: ids for cid, ids in chosen.items() if cid not in refused}

    def _step_same_pass(self, cid: int, chosen: set[int]) -> None:
        """Step chunk ``cid``'s views in ``chosen`` and cast its master into its staging buffer in one pass."""
        self._release_staging(self.manager.chunks[cid])
        table, views = self._same_pass[cid]
        state, groups = self.inner.state, self.inner.param_groups
        tensors = []
        for v in views:
            if id(v.tensor) not in chosen:
                tensors.append(None)
                continue
            entry = state[v.tensor]
            tensors.append(ViewTensors(v.tensor.detach(), v.tensor.grad, entry["exp_avg"], entry["exp_avg_sq"],
                                       entry.get("max_exp_avg_sq"), entry["step"], groups[v.group_index]))
        step_and_cast(table, tensors, self.masters[cid], self._refresh_staging[cid])
        self._staged.add(cid)
        self.num_same_pass_steps += 1

    def _flag_of(self, tensor: torch.Tensor) -> int:
        return self._view_by_tensor[id(tensor)].slot.flag_index

    def settle_host_steps(self) -> None:
        """Join the host lane and undo its speculative updates ([Note: host lane]): masters and optimizer
        states as the last ``step()`` left them. Called before they are read or written outside ``step``."""
        if not self.manager.backward_pending:
            self.manager.drain_reduces()
        if self._lane is not None and not self.manager.backward_pending:
            self._lane.settle(restore_grads=not self._unscaled)
