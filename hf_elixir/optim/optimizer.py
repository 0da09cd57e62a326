"""``ElixirOptimizer``: runs the user's element-wise ``torch.optim`` optimizer on chunk shards.

[Note: shard views] For every trainable parameter, the part of it that falls into this rank's shard of
its chunk is a 1-D view of the chunk's fp32 master shard, and its gradient is the same view of the
chunk's reduced fp32 gradient shard. An *inner* instance of the user's optimizer class runs on these
views with the user's hyperparameters, so the update is the same code as plain PyTorch's (AdamW, Adam,
SGD, ...) and param groups apply per parameter even when one chunk mixes groups. Only element-wise
optimizers are equivalent under this slicing, hence the allow-list. The user's ``param_groups`` dicts
are shared, so LR schedulers built on the user's optimizer keep driving the learning rate. The inner
optimizer's states of host optimizer chunks are views into the manager's host blocks ([Note: host
optimizer state] in ``_host_state.py``), not tensors ``torch.optim`` allocates lazily.

Source: ZeRO (arXiv 1910.02054) stage 3 sharded optimizer states; Gemini's hybrid Adam (host shards
updated on the host, device shards on the device); ``torch.nn.utils.clip_grad_norm_`` for the norm rule.
"""

from __future__ import annotations

import inspect
import logging
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

from hf_elixir._compat import all_gather_single
from hf_elixir.chunk import strict
from hf_elixir.chunk.chunk import Chunk, ParamSlot, refresh_staging_numel
from hf_elixir.chunk.manager import ChunkManager
from hf_elixir.config import ElixirConfig
from hf_elixir.optim._host_state import HostStates
from hf_elixir.optim._norms import max_abs, pow_sum
from hf_elixir.optim._overlap import HostLane, snapshot_rollback, speculates
from hf_elixir.optim._same_pass import SamePassTable, ViewTensors, group_runs_fused, step_and_cast
from hf_elixir.optim._step_hooks import hooked_step, unhooked_step
from hf_elixir.optim.loss_scaler import DynamicLossScaler
from hf_elixir.plan import REFRESH_CASTS

__all__ = ["ElixirOptimizer", "SUPPORTED_OPTIMIZERS", "optimizer_cost_terms", "optimizer_state_numel_factor"]

logger = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
)

CONSOLIDATED_FORMAT = "hf_elixir.optimizer.consolidated.v1"
SHARDED_FORMAT = "hf_elixir.optimizer.sharded.v1"


def _is_plain_torch_state(state_dict: dict) -> bool:
    groups = state_dict.get("param_groups")
    return isinstance(groups, list) and isinstance(state_dict.get("state"), dict) and all(
        isinstance(i, int) for g in groups for i in g.get("params", ()))


def optimizer_state_numel_factor(optimizer: torch.optim.Optimizer) -> int:
    """fp32 state elements per parameter element (Adam: exp_avg + exp_avg_sq = 2)."""
    group = optimizer.defaults
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(optimizer, (torch.optim.Adagrad,)):
        return 1
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + int(bool(group.get("momentum", 0))) + int(bool(group.get("centered")))
    return 2


def optimizer_cost_terms(optimizer: torch.optim.Optimizer | None, config: ElixirConfig) -> dict:
    """What the plan search needs to know of the user's optimizer (``hf_elixir.search.search`` keywords).

    Returns:
        ``{"optim_states": fp32 state elements per parameter element (:func:`optimizer_state_numel_factor`:
        Adam/AdamW 2, i.e. 8 bytes; SGD with momentum 1, 4 bytes; plain SGD 0), "snapshot_rollback": whether the
        host lane keeps snapshots ([Note: inverse rollback]; Adam/AdamW without AMSGrad: ``False``)}``. With
        ``optimizer=None`` the search's defaults (AdamW: 2, ``False``).
    """
    if optimizer is None:
        return {"optim_states": 2, "snapshot_rollback": False}
    return {"optim_states": optimizer_state_numel_factor(optimizer),
            "snapshot_rollback": snapshot_rollback(optimizer, config.precision, config.loss_scale)}


class _ShardView:
    """One parameter's part of this rank's shard: ``param_flat[start:stop]`` = shard ``[lo:hi]``."""

    __slots__ = ("slot", "chunk", "group_index", "start", "stop", "lo", "hi", "tensor")

    def __init__(self, slot: ParamSlot, chunk: Chunk, group_index: int, start: int, stop: int,
                 lo: int, hi: int, tensor: torch.nn.Parameter) -> None:
        self.slot, self.chunk, self.group_index = slot, chunk, group_index
        self.start, self.stop, self.lo, self.hi, self.tensor = start, stop, lo, hi, tensor


def _uploads(chunk: Chunk) -> bool:
    """The chunk's refresh is an upload: fp32 master on the host, compute copy (shard) on the device."""
    return chunk.trainable and chunk.shard_on_device and not chunk.optim_on_device


def _uploads_cast(chunk: Chunk) -> bool:
    """An upload whose compute dtype is not the master's: it reads a host staging buffer cast from the master."""
    return _uploads(chunk) and chunk.dtype != torch.float32


def _scalar(value):
    """A param group's value as :meth:`ElixirOptimizer._hyperparameters` compares it: numbers, flags, strings and
    tuples of them as they are, anything else (a tensor) ``None``. Module level: a recursive closure would be a
    reference cycle, cyclic garbage at every backward."""
    if isinstance(value, (tuple, list)):
        return tuple(_scalar(v) for v in value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else None


class ElixirOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer; steps the shards of every chunk where their optimizer state lives.

    Args:
        optimizer: a ``torch.optim`` optimizer built on the (prepared) model's parameters; one of
            :data:`SUPPORTED_OPTIMIZERS`.
        manager: the model's :class:`~hf_elixir.chunk.manager.ChunkManager`.
        config: the :class:`~hf_elixir.config.ElixirConfig` given to ``prepare``.
        refresh_cast: ``ElixirPlan.refresh_cast``: where uploaded chunks' masters are cast to the compute dtype,
            ``"host"`` (default) or ``"device"`` ([Note: refresh cast]).

    Raises:
        TypeError: an optimizer that is not element-wise (lists the supported ones).
        ValueError: the optimizer holds parameters that are not in the prepared model; ``refresh_cast`` is not
            ``"host"`` or ``"device"``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, manager: ChunkManager, config: ElixirConfig,
                 refresh_cast: str = "host", fp32_masters: dict | None = None) -> None:
        if refresh_cast not in REFRESH_CASTS:
            raise ValueError(f"ElixirPlan.refresh_cast={refresh_cast!r} must be one of {REFRESH_CASTS}")
        self.refresh_cast = refresh_cast
        if type(optimizer) not in SUPPORTED_OPTIMIZERS:
            names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED_OPTIMIZERS)
            raise TypeError(
                f"hf_elixir.prepare(optimizer=<{type(optimizer).__name__}>) is not supported: the chunk "
                f"optimizer slices parameters into shards, which is exact only for element-wise optimizers. "
                f"Use one of: {names}"
            )
        # state from steps taken (Adagrad creates step=0 state in __init__: nothing is lost there)
        if any(float(s.get("step", 1)) > 0 for s in optimizer.state.values() if len(s)):
            logger.warning("the optimizer given to hf_elixir.prepare already has state; it is not carried over")
        self.manager = manager
        self.config = config
        self.user_optimizer = optimizer
        self.scaler = DynamicLossScaler(config.loss_scale, enabled=config.precision == "fp16")
        self._unscaled = False
        self._found_inf: torch.Tensor | None = None  # fp32 [1] on the device (fp16), see _unscale
        self._host_clip_coef: torch.Tensor | None = None  # clip factor still owed to host gradients
        self._kernel_sq_norms: dict[int, torch.Tensor] = {}
        self._scaled_backward = False
        self._warned_unscaled = False
        self._param_group_of: dict[torch.nn.Parameter, int] = {}
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p not in manager.slot_of:
                    raise ValueError(
                        f"optimizer param_groups[{index}] holds a parameter of shape {tuple(p.shape)} that is not "
                        "in the prepared model; build the optimizer on model.parameters() before hf_elixir.prepare"
                    )
                self._param_group_of[p] = index
        self._groups_frozen = False
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # shared dicts: schedulers on either object work
        self._groups_frozen = True
        self.masters: dict[int, torch.Tensor] = {}
        self._fp32_init = fp32_masters or {}  # [Note: fp32 masters at prepare] in chunk/_build.py
        self.views: list[_ShardView] = []
        self._full_group_params_user = [list(g["params"]) for g in self.param_groups]
        self._build_shard_state()
        self.fused_chunks: dict[int, dict[str, torch.Tensor]] = {}  # chunk id -> flat Adam moments
        self.fused_steps: dict[int, int] = {}  # id(view.tensor) -> steps taken (fused chunks)
        self._fused_views: dict[int, list[_ShardView]] = {}  # chunk id -> its views by shard offset
        self._fused_tables: dict[int, dict] = {}  # chunk id -> segment tables (see _segment_table)
        self._setup_fused()
        self.inner = self._build_inner(type(optimizer))
        self._view_by_tensor = {id(v.tensor): v for v in self.views}
        # [Note: same-pass host step] in _same_pass.py: chunk id -> (its blocks, its views by shard offset)
        self._same_pass: dict[int, tuple[SamePassTable, list[_ShardView]]] = {}
        for cid, staging in self._refresh_staging.items():
            views = sorted((v for v in self.views if v.chunk.chunk_id == cid), key=lambda v: v.lo)
            self._same_pass[cid] = (SamePassTable.build([(v.lo, v.hi) for v in views], staging.numel()), views)
        self.num_same_pass_steps = 0  # chunks stepped and cast in one pass (tests and benchmarks count them)
        # [Note: host lane] in _overlap.py: offloaded gradients taken over, host step overlapped with backward
        self._lane: HostLane | None = None
        if any(c.trainable and not c.optim_on_device for c in manager.chunks):
            self._lane = HostLane(self, speculate=speculates(config.overlap_host_optimizer, manager.compute_device),
                                  state_numel_factor=optimizer_state_numel_factor(optimizer))
            manager.host_steps_in_backward = self._lane.speculate  # [Note: reduce window] in chunk/manager.py
        manager.on_param_writes = self.merge_param_writes  # [Note: parameter writes] in chunk/chunk.py
        manager.before_backward = self._settle_clip  # [Note: owed clip factor]
        manager.on_zero_grad = self._forget_clip
        manager.hyper_code = self._hyper_code  # [Note: hyperparameter check] in chunk/manager.py

    def add_param_group(self, param_group: dict) -> None:
        """Only used while constructing; afterwards adding parameters is refused.

        Raises:
            ValueError: called after ``hf_elixir.prepare`` (new parameters are not in any chunk, so they
                would be neither reduced across ranks nor stepped).
        """
        if getattr(self, "_groups_frozen", False):
            raise ValueError(
                "optimizer.add_param_group(...) after hf_elixir.prepare is not supported: the new parameters "
                "are not packed into chunks, so they would be neither reduced across ranks nor stepped. Put "
                "every parameter group (and every parameter) in the optimizer before hf_elixir.prepare")
        super().add_param_group(param_group)

    def _check_groups_unchanged(self) -> None:
        sizes = [len(g["params"]) for g in self.param_groups]
        expected = [len(g) for g in self._full_group_params_user]
        if sizes != expected:
            raise ValueError(
                f"the optimizer's param groups changed after hf_elixir.prepare (parameter counts {expected} -> "
                f"{sizes}); parameters cannot be added or removed after prepare. Build the optimizer with its "
                "final param groups before hf_elixir.prepare")

    # -- construction --------------------------------------------------------------------------
    def _build_shard_state(self) -> None:
        manager = self.manager
        host = [c for c in manager.chunks if c.trainable and not c.optim_on_device]
        state_keys = HostStates.requests(type(self.user_optimizer), self.param_groups, self._groups_of_shards(host),
                                         {c.chunk_id: c.shard_numel for c in host})
        manager.host.reserve_for([(c.shard_numel, torch.float32) for c in host]  # gradient shards, masters
                                 + [(c.shard_numel, torch.float32) for c in host if c.dtype != torch.float32
                                    or c.shard_on_device]
                                 + [(c.shard_numel, torch.float32) for c in host for _ in state_keys.get(c.chunk_id, ())]
                                 + [(c.shard_numel, c.dtype) for c in host if _uploads_cast(c)
                                    and self.refresh_cast == "host"])  # staging
        # [Note: overlapped refresh] the compute-dtype host copy each upload reads
        self._refresh_staging: dict[int, torch.Tensor] = {
            c.chunk_id: manager.host_empty(c.shard_numel, c.dtype) for c in host
            if _uploads_cast(c) and self.refresh_cast == "host"}
        # [Note: refresh cast] or one fp32 device buffer the uploads go through, cast on the device
        self._device_cast: list[Chunk] = [c for c in host if _uploads_cast(c) and self.refresh_cast == "device"]
        self._device_cast_ids = frozenset(c.chunk_id for c in self._device_cast)
        self._device_staging: torch.Tensor | None = None
        staging_numel = refresh_staging_numel([c.shard_numel for c in self._device_cast])
        if staging_numel:
            manager.pool.charge(staging_numel * 4, "the refresh cast's fp32 device staging buffer")
            self._device_staging = strict.register_device(
                torch.empty(staging_numel, dtype=torch.float32, device=manager.compute_device))
        self._staged: set[int] = set()  # chunks whose staging holds the master's current values
        # [Note: early refresh] chunks whose refresh is an upload the host lane may issue during backward (not
        # under fp16 loss scaling: a skipped step must leave the compute copies as they were, bit for bit)
        self.early_refresh_chunks = frozenset(c.chunk_id for c in host if _uploads(c) and not self.scaler.enabled)
        for chunk in manager.chunks:
            if not chunk.trainable:
                continue
            location = manager.compute_device if chunk.optim_on_device else torch.device("cpu")
            nbytes = chunk.shard_numel * 4
            if chunk.optim_on_device:
                manager.pool.charge(nbytes, f"gradient shard of chunk {chunk.chunk_id}")
                grad_shard = strict.register_device(torch.zeros(chunk.shard_numel, dtype=torch.float32,
                                                                device=location))
            else:
                grad_shard = manager.host_zeros(chunk.shard_numel, torch.float32)
            manager.grad_shards[chunk.chunk_id] = grad_shard
            shard_view = chunk.shard if not chunk.full_alias else chunk.full
            source = self._fp32_init.pop(chunk.chunk_id, shard_view)  # fp32 values from before the cast
            if chunk.dtype == torch.float32 and chunk.optim_on_device == chunk.shard_on_device:
                master = shard_view  # fp32 compute copy is the master (no duplicate)
            else:
                if chunk.optim_on_device:
                    manager.pool.charge(nbytes, f"fp32 master shard of chunk {chunk.chunk_id}")
                    master = strict.register_device(strict.to_device(source.detach().float(), location).clone())
                else:
                    master = manager.host_empty(chunk.shard_numel, torch.float32)
                    with strict.host_copies():
                        master.copy_(source)
                    if chunk.shard_on_device:
                        manager.counters.d2h_bytes += chunk.shard_bytes
            self.masters[chunk.chunk_id] = master
            begin, end = chunk.shard_begin, chunk.shard_begin + chunk.shard_numel
            for slot in chunk.slots:
                if not slot.trainable or slot.param not in self._param_group_of:
                    continue
                lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, end)
                if hi <= lo:
                    continue
                tensor = torch.nn.Parameter(master[lo - begin:hi - begin], requires_grad=True)
                tensor.grad = grad_shard[lo - begin:hi - begin]
                self.views.append(_ShardView(slot, chunk, self._param_group_of[slot.param],
                                             lo - slot.offset, hi - slot.offset, lo - begin, hi - begin, tensor))
        # [Note: host optimizer state] in _host_state.py: the host chunks' optimizer states, in the blocks
        self._host_states = HostStates(manager, type(self.user_optimizer),
                                       [v for v in self.views if not v.chunk.optim_on_device], state_keys)

    def _groups_of_shards(self, chunks: list[Chunk]) -> dict[int, set[int]]:
        """Chunk id -> the param groups of the trainable parameters in this rank's shard of it."""
        groups: dict[int, set[int]] = {}
        for chunk in chunks:
            begin, end = chunk.shard_begin, chunk.shard_begin + chunk.shard_numel
            groups[chunk.chunk_id] = {self._param_group_of[s.param] for s in chunk.slots
                                      if s.trainable and s.param in self._param_group_of
                                      and max(s.offset, begin) < min(s.offset + s.numel, end)}
        return groups

    # -- fused device path ---------------------------------------------------------------------
    #: run the fused path also for CPU shards, through the Triton interpreter (tests only)
    _force_fused = False

    def _fused_eligible(self) -> bool:
        """Adam/AdamW without AMSGrad/maximize, Triton present, shards on CUDA (or forced for tests)."""
        import triton_kernels  # noqa: PLC0415

        opt = self.user_optimizer
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or not triton_kernels.HAS_TRITON:
            return False
        if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in self.param_groups):
            return False
        return self.manager.compute_device.type == "cuda" or self._force_fused

    def _setup_fused(self) -> None:
        """Device optimizer-state chunks of Adam/AdamW are updated by ``triton_kernels.fused_adamw_``:
        one pass over the whole shard with a per-segment lr/weight-decay table (Triton issue #3)."""
        if not self._fused_eligible():
            return
        for chunk in self.manager.chunks:
            if chunk.trainable and chunk.optim_on_device and any(v.chunk is chunk for v in self.views):
                device = self.masters[chunk.chunk_id].device
                self.fused_chunks[chunk.chunk_id] = {
                    key: strict.register_device(torch.zeros(chunk.shard_numel, dtype=torch.float32, device=device))
                    for key in ("exp_avg", "exp_avg_sq")}
        for view in self.views:
            if view.chunk.chunk_id in self.fused_chunks:
                self.fused_steps[id(view.tensor)] = 0
        self._fused_views = {cid: sorted((v for v in self.views if v.chunk.chunk_id == cid), key=lambda v: v.lo)
                             for cid in self.fused_chunks}

    def _decoupled(self, group: dict) -> bool:
        return isinstance(self.user_optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))

    def _segment_table(self, chunk: Chunk, views: list[_ShardView]) -> dict:
        """The chunk's segment tables for ``fused_adamw_`` ([Note: segment lookup] in
        ``triton_kernels/fused_adam.py``), built once on the device: boundaries never change; the
        lr / weight-decay values are re-uploaded (one small host->device copy, no sync) only when a
        scheduler or the user changed them."""
        table = self._fused_tables.get(chunk.chunk_id)
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
            self._fused_tables[chunk.chunk_id] = table
        values = [(0.0, 0.0) if i is None else (float(self.param_groups[i]["lr"]),
                                                  float(self.param_groups[i]["weight_decay"]))
                  for i in table["members"]]
        if values != table["values"]:
            table["lr"].copy_(torch.tensor([lr for lr, _ in values]), non_blocking=True)
            table["wd"].copy_(torch.tensor([wd for _, wd in values]), non_blocking=True)
            table["values"] = values
        return table

    def _fused_step(self, flags: list[float]) -> None:
        import triton_kernels  # noqa: PLC0415

        for cid, moments in self.fused_chunks.items():
            chunk = self.manager.chunks[cid]
            views = self._fused_views[cid]
            flagged = [v for v in views if flags[v.slot.flag_index] > 0]
            if not flagged:
                continue
            groups = [self.param_groups[v.group_index] for v in flagged]
            steps = {self.fused_steps[id(v.tensor)] for v in flagged}
            same_hyper = len({(tuple(g["betas"]), g["eps"], self._decoupled(g)) for g in groups}) == 1
            master, grad = self.masters[cid], self.manager.grad_shards[cid]
            if len(flagged) == len(views) and len(steps) == 1 and same_hyper:
                table = self._segment_table(chunk, views)
                beta1, beta2 = groups[0]["betas"]
                triton_kernels.fused_adamw_(
                    master, grad, moments["exp_avg"], moments["exp_avg_sq"], seg_bounds=table["bounds"],
                    seg_lr=table["lr"], seg_weight_decay=table["wd"], beta1=beta1, beta2=beta2,
                    eps=groups[0]["eps"], step=steps.pop() + 1, decoupled_weight_decay=self._decoupled(groups[0]),
                    force_triton=self._force_fused, validate_bounds=False)
            else:  # some parameters skip this step or differ in step count: per-parameter update
                for v, g in zip(flagged, groups):
                    beta1, beta2 = g["betas"]
                    triton_kernels.fused_adamw_reference(
                        master[v.lo:v.hi], grad[v.lo:v.hi], moments["exp_avg"][v.lo:v.hi],
                        moments["exp_avg_sq"][v.lo:v.hi], torch.tensor([0, v.hi - v.lo]),
                        torch.tensor([float(g["lr"])]), torch.tensor([float(g["weight_decay"])]), beta1=beta1,
                        beta2=beta2, eps=g["eps"], step=self.fused_steps[id(v.tensor)] + 1, grad_scale=1.0,
                        found_inf=None, out_lowp=None, decoupled=self._decoupled(g))
            for v in flagged:
                self.fused_steps[id(v.tensor)] += 1

    def _build_inner(self, cls: type) -> torch.optim.Optimizer | None:
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

    # -- backward helpers ----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` with the fp16 loss scale applied (identity for fp32/bf16)."""
        if self.scaler.enabled:
            loss = loss * self.scaler.scale
            self._scaled_backward = True
        loss.backward(**kwargs)

    def _grad_shards(self) -> list[torch.Tensor]:
        return list(self.manager.grad_shards.values())

    def _job_world_size(self) -> int:
        group = self.manager.job_group
        return dist.get_world_size(group) if group is not None else 1

    def _all_reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        """All-reduce over the ranks training this model (``manager.job_group``, never WORLD by default)."""
        if self._job_world_size() > 1:
            device = tensor.device
            moved = tensor.to(self.manager.compute_device)
            dist.all_reduce(moved, op=op, group=self.manager.job_group)
            tensor = moved.to(device)
        return tensor

    def _unscale(self) -> None:
        """Divide gradients by the loss scale and find non-finite values on any rank (fp16).

        The overflow flag stays on the compute device (``_found_inf``, fp32 ``[1]``, max-reduced over
        the job's group); :meth:`step` reads it in its one host read ([Note: one host read])."""
        if self._unscaled:
            return
        self._unscaled = True
        self._found_inf = None
        self._kernel_sq_norms = {}
        if self._lane is not None:
            self._lane.join()
        if not self.scaler.enabled:
            return
        self.manager.drain_reduces()  # every gradient is read here ([Note: late reduce waits])
        if self._lane is not None:
            self._lane.join()
        inv = 1.0 / self.scaler.scale
        device = self.manager.compute_device
        found = torch.zeros(1, dtype=torch.float32, device=device)
        prepared = self._lane.prepared if self._lane is not None else {}
        for cid, grad in self.manager.grad_shards.items():
            if cid in prepared:  # unscaled and checked by the host lane during backward
                if prepared[cid].found_inf:
                    found.fill_(1.0)
                continue
            if self._use_kernels(grad):
                # one fused pass: unscale, overflow flag and squared norm (Triton issue #3, kernel 2);
                # the norm is kept on the device for clip_grad_norm
                import triton_kernels  # noqa: PLC0415

                self._kernel_sq_norms[cid] = triton_kernels.unscale_norm_(
                    grad, inv_scale=inv, found_inf=found, force_triton=self._force_fused)
            else:
                grad.mul_(inv)
                bad = (~torch.isfinite(grad)).any().float().reshape(1)
                found = torch.maximum(found, bad.to(device, non_blocking=True))
        self._found_inf = self._all_reduce(found, dist.ReduceOp.MAX)

    def _is_host(self, tensor: torch.Tensor) -> bool:
        return strict.is_host(tensor) or tensor.device != self.manager.compute_device

    def _use_kernels(self, tensor: torch.Tensor) -> bool:
        import triton_kernels  # noqa: PLC0415

        return triton_kernels.HAS_TRITON and (tensor.device.type == "cuda" or self._force_fused)

    def _local_norm(self, norm_type: float) -> torch.Tensor:
        """This rank's share of the global gradient norm (fp64 ``[1]`` on the compute device): the max of
        |g| (``inf``), else the sum of |g|^p, tensor-parallel replicas counted once. Host gradients count
        with the clip factor an earlier :meth:`clip_grad_norm` of this step still owes them ([Note: owed clip
        factor])."""
        device = self.manager.compute_device
        chunks = {c.chunk_id: c for c in self.manager.chunks}
        local = torch.zeros(1, dtype=torch.float64, device=device)
        cached = self._kernel_sq_norms if norm_type == 2.0 else {}
        owed = self._host_clip_coef.double() if self._host_clip_coef is not None else None
        for cid, g in self.manager.grad_shards.items():
            factor = owed if owed is not None and self._is_host(g) else None
            if norm_type == float("inf"):
                if g.numel():  # blockwise ([Note: blockwise norms] in _norms.py)
                    part = max_abs(g).reshape(1).to(device, non_blocking=True)
                    local = torch.maximum(local, part if factor is None else part * factor)
                continue
            if factor is not None:
                factor = factor ** norm_type
            host_sq = self._lane.host_sq_norm(cid) if self._lane is not None and norm_type == 2.0 else None
            if host_sq is not None:  # computed by the host lane during backward
                local += (host_sq if factor is None else host_sq * factor) / chunks[cid].norm_replicas
                continue
            part = cached[cid].double() if cid in cached else pow_sum(g, norm_type)  # [Note: blockwise norms]
            part = part.reshape(1).to(device, non_blocking=True)
            local += (part if factor is None else part * factor) / chunks[cid].norm_replicas
        return local

    def _forget_clip(self) -> None:
        """The manager's ``on_zero_grad``: every gradient is zero again, so no clip factor is owed and nothing
        is unscaled ([Note: owed clip factor])."""
        self._unscaled = False
        self._found_inf = self._host_clip_coef = None
        self._kernel_sq_norms = {}

    def _settle_clip(self) -> None:
        """The manager's ``before_backward``: a backward after :meth:`clip_grad_norm` and before :meth:`step`
        (clipping every micro-batch, or clearing some gradients with ``p.grad = None`` after a clip) adds to
        gradients that are clipped and unscaled ([Note: owed clip factor]). Pays the owed factor into the host
        gradients (a host read of it) and, under fp16 loss scaling, scales every gradient back by the loss scale
        (a power of two: exact), so the new gradients add to them as in PyTorch and the next clip or step sees
        the sum. Speculative host steps are undone first (they stepped the unclipped gradients)."""
        if not self._unscaled:
            return
        self.settle_host_steps()
        owed = self._host_clip_coef
        value = float(strict.host_read(owed.reshape(1).float())[0]) if owed is not None else 1.0
        with torch.no_grad():
            for g in self._grad_shards():
                if value < 1.0 and self._is_host(g):
                    g.mul_(value)
                if self.scaler.enabled:
                    g.mul_(self.scaler.scale)
        self._forget_clip()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by one global norm over every rank and chunk, without a host sync.

        Same rule as ``torch.nn.utils.clip_grad_norm_``: ``coef = max_norm / (total_norm + 1e-6)``,
        clamped to 1 and multiplied into every gradient. Padding elements have zero gradient and do not
        contribute. Gradients on the device are scaled at once on the device; gradients of host
        optimizer states are scaled in :meth:`step` after its one host read ([Note: one host read]).

        [Note: owed clip factor] Until the step pays it, the factor owed to host gradients is part of their
        value: a second clip before the step (measure, then clip; two callers) counts the host gradients with it
        (the norm PyTorch would see after the first clip) and multiplies the factors; a backward after a clip
        pays it into the host gradients first (:meth:`_settle_clip`, with the fp16 loss scale restored), and
        ``zero_grad`` forgets it (:meth:`_forget_clip`: the gradients it was owed to are gone). Before, the second
        clip counted the host gradients unclipped, a later backward's gradients were scaled by the earlier factor
        too, and a clip followed by ``zero_grad`` without a step (skipping a batch whose norm was too large)
        scaled the next step's host gradients (fp16: left them unscaled) — all silently.

        Returns:
            the total norm before clipping (fp32 0-d tensor on the compute device; ``inf`` when fp16
            gradients overflowed, and then nothing is scaled). Reading it (``float(norm)``) is a
            host sync the caller chooses.
        """
        self.manager.drain_reduces()  # the norm reads every gradient ([Note: late reduce waits])
        self._unscale()
        norm_type = float(norm_type)
        local = self._local_norm(norm_type)
        if norm_type == float("inf"):
            total = self._all_reduce(local, dist.ReduceOp.MAX)[0]
        else:
            total = self._all_reduce(local, dist.ReduceOp.SUM)[0] ** (1.0 / norm_type)
        total = total.float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self._found_inf is not None:
            overflow = self._found_inf[0] > 0
            total = torch.where(overflow, torch.full_like(total, float("inf")), total)
            coef = torch.where(overflow, torch.ones_like(coef), coef)
        for g in self._grad_shards():
            if not self._is_host(g):
                g.mul_(coef)
        if any(self._is_host(g) for g in self._grad_shards()):
            self._host_clip_coef = coef if self._host_clip_coef is None else coef * self._host_clip_coef
        self._kernel_sq_norms = {}  # stale once clipped
        return total

    # -- step ----------------------------------------------------------------------------------
    @hooked_step  # [Note: step hooks] in _step_hooks.py: torch's step hooks once per call
    @torch.no_grad()
    def step(self, closure=None):
        """Update every shard where its optimizer state lives, then refresh the compute copies.

        [Note: one host read] The step reads the device once: the overflow flag, the clip factor owed
        to host gradients and the has-gradient flags, concatenated on the device and copied to the
        host in one transfer (:func:`hf_elixir.chunk.strict.host_read`). Everything else (unscale,
        norm, clipping, the fused update, the copies back) is issued without waiting; the loss scale
        is updated on the host from that read (``torch.amp.GradScaler`` reads its ``found_inf`` the
        same way, once per step).

        Host optimizer states: the host lane ([Note: host lane] in ``_overlap.py``) has usually stepped
        their chunks during backward already; the step joins it (a wait on the host thread, not on the
        device), keeps the updates the read validates and rolls back and redoes the others.

        Step hooks (``register_step_pre_hook`` / ``register_step_post_hook`` on this optimizer or on the user's,
        and torch's global ones) run once per call, around all of it ([Note: step hooks] in ``_step_hooks.py``);
        an lr a pre hook sets is the lr of this step.

        Raises:
            ValueError: a closure was given (not supported: forward/backward run outside the step).
            RuntimeError: the ranks reduced their gradients in different orders since the last step (their
                forwards differed; [Note: reduce order check] in ``hf_elixir/chunk/manager.py``); nothing updated.
        """
        if closure is not None:
            raise ValueError("ElixirOptimizer.step(closure) is not supported; call forward/backward before step()")
        assert not self.manager.backward_pending, "optimizer.step() called while a backward is still running"
        self._check_groups_unchanged()
        self.manager.take_param_writes()  # before anything reads the masters ([Note: parameter writes] in chunk.py)
        self.manager.settle_grad_zeros()  # a step with no backward since zero_grad reads zeros
        if self._lane is not None and self._lane.speculate:
            self.manager.drain_reduces()  # the lane takes every offloaded gradient before it is validated
        self.manager.join_side_streams()
        if self._lane is not None:
            self._lane.join()
        self._release_master_reads()  # a step with no backward since the last one: uploads may still read masters
        if self.scaler.enabled and not self._scaled_backward and not self._warned_unscaled:
            self._warned_unscaled = True
            logger.warning("precision='fp16' but the loss was not scaled: call optimizer.backward(loss) (or "
                           "accelerator.backward) instead of loss.backward(), or fp16 gradients may underflow")
        self._scaled_backward = False
        self._unscale()
        found_inf, host_coef, flags = self._read_step_state()
        self.user_optimizer._opt_called = True  # tells LR schedulers built on the user's optimizer
        done = self._lane.validate(found_inf, host_coef, flags) if self._lane is not None else set()
        if found_inf:
            logger.warning("fp16 gradient overflow: skipping this step, loss scale %.1f -> %.1f",
                           self.scaler.scale, self.scaler.scale * self.config.loss_scale.backoff_factor)
            self.scaler.update(True)
        else:
            if host_coef < 1.0:
                for g in self._grad_shards():
                    if self._is_host(g):
                        g.mul_(host_coef)
            if self.inner is not None:
                self._inner_step(flags, done)
            self.manager.drain_reduces()
            self._fused_step(flags)
            self.scaler.update(False)
            self._refresh_compute_copies()
        self._unscaled = False
        self._found_inf = self._host_clip_coef = None
        if self._lane is not None:
            self._lane.end_step()
        self.manager.end_step()
        return None

    def _hyperparameters(self) -> list[dict]:
        """Per param group, its scalar hyperparameters (numbers, flags, strings, tuples of them), as the ranks
        compare them ([Note: hyperparameter check] in ``chunk/manager.py``); a tensor value (a tensor lr) is
        left out (``None``): reading it could be a device sync."""
        return [{k: _scalar(v) for k, v in sorted(group.items()) if k != "params"} for group in self.param_groups]

    def _hyper_code(self) -> int:
        """The manager's ``hyper_code``: a 24-bit CRC of :meth:`_hyperparameters` (exact in float32)."""
        return zlib.crc32(repr(self._hyperparameters()).encode()) & 0xFFFFFF

    def _read_step_state(self) -> tuple[bool, float, list[float]]:
        """The step's one host read ([Note: one host read]): ``(overflow, clip factor owed to host
        gradients, has-gradient flags)``."""
        device = self.manager.compute_device
        found = self._found_inf if self._found_inf is not None else torch.zeros(1, device=device)
        coef = self._host_clip_coef if self._host_clip_coef is not None else torch.ones((), device=device)
        self.manager.wait_flags()  # the flags' all-reduce, issued at the end of backward ([Note: late reduce waits])
        packed = torch.cat([found.reshape(1).float(), coef.reshape(1).float(),
                            self.manager.reduce_order_mismatch.float(), self.manager.hyper_mismatch.float(),
                            self.manager.has_grad_flags.float(), self.manager.ahead_veto.float()])
        values = strict.host_read(packed).tolist()
        hyper_mismatch = values.pop(3)
        num_flags = self.manager.has_grad_flags.numel()
        if self.manager.ahead_veto.numel():  # [Note: agreed gathers ahead] in chunk/manager.py
            self.manager.agree_gathers_ahead(values[3 + num_flags:])
        if values[2] > 0 or hyper_mismatch > 0:  # [Note: reduce order check] in chunk/manager.py: nothing is updated
            self.settle_host_steps()  # the host lane's speculative updates of this backward are undone
            if self._lane is not None:
                self._lane.end_step()
            self._unscaled = False
            self._found_inf = self._host_clip_coef = None
            if values[2] <= 0:  # [Note: hyperparameter check] in chunk/manager.py
                raise RuntimeError(
                    "the ranks hold different optimizer hyperparameters (this rank's, per param group: "
                    f"{self._hyperparameters()}): a value set from rank-local data, such as "
                    "ReduceLROnPlateau.step(loss) with each rank's own loss, or an lr set on some ranks only. Under "
                    "DDP the ranks' models would drift apart silently. This step was not applied (parameters and "
                    "optimizer state are unchanged). Set the same values on every rank (average the metric over the "
                    "ranks first: accelerator.reduce(loss, 'mean') or torch.distributed.all_reduce), then call "
                    "zero_grad() and go on")
            raise RuntimeError(
                "the ranks reduced their gradient chunks in different orders in a backward since the last step: "
                "the forward ran different modules, or the same modules in another order, on different ranks "
                "(e.g. a submodule called only on some ranks under data-dependent control flow), so gradients "
                "were summed with another chunk's. This step was not applied (parameters and optimizer state "
                "are unchanged). Run the same modules in the same order on every rank (call the module "
                "everywhere and discard its output where it is not needed), then call zero_grad() and go on")
        return values[0] > 0, values[1], values[3:3 + num_flags]

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

    def _step_views(self, views: list[_ShardView], hyper: list[dict]) -> None:
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
                for inner_group, params in zip(self.inner.param_groups, rest):
                    inner_group["params"] = params
                self._staged.difference_update(self._view_by_tensor[id(t)].chunk.chunk_id for g in rest for t in g)
                unhooked_step(self.inner)  # no step hooks for the inner optimizer ([Note: step hooks])
                # a fused kernel (torch._fused_adamw_) leaves the masters' version counter as it was: bump it, so
                # a pending upload of a master sees the write ([Note: strict refresh source] in chunk.py)
                torch.autograd.graph.increment_version([t for params in rest for t in params])
            for cid, chosen in same_pass.items():
                self._step_same_pass(cid, chosen)
        finally:
            for inner_group, full in zip(self.inner.param_groups, self._full_group_params):
                inner_group["params"] = full
        if fresh:  # a state the step made itself (SGD's momentum buffer) moves into the blocks
            self._host_states.adopt(self.inner, fresh)

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

    def stage_refresh(self, cid: int) -> None:
        """Cast chunk ``cid``'s fp32 master into its host staging buffer (compute dtype), which its upload reads
        ([Note: overlapped refresh]); the host lane calls it right after the chunk's speculative step, so the
        cast overlaps backward. No-op for a chunk without staging."""
        staging = self._refresh_staging.get(cid)
        if staging is not None:
            with torch.no_grad():
                staging.copy_(self.masters[cid])
            self._staged.add(cid)

    def _release_staging(self, chunk: Chunk) -> None:
        """Before the chunk's staging buffer is written outside the host lane: an upload issued by the last step
        may still read it (a step with no backward since then: the backward's drain did not run)."""
        pending = chunk.pending_refresh
        if pending is not None and pending.event is not None:
            pending.event.synchronize()
        chunk.wait_refresh()

    def _release_master_reads(self) -> None:
        """Before masters are written on the host outside backward: wait (host sync on its event) for every
        pending upload that reads a master itself (fp32 compute copies, or the cast on the device, [Note: refresh
        cast]); backward's drain orders the host lane after them, a stream wait does not order the host."""
        for chunk in self.manager.chunks:
            pending = chunk.pending_refresh
            if pending is not None and pending.source is self.masters.get(chunk.chunk_id) and not pending.speculative:
                self._release_staging(chunk)  # (an early one is released by its rollback: [Note: early refresh])

    def _upload_source(self, chunk: Chunk) -> torch.Tensor:
        self._release_staging(chunk)
        cid = chunk.chunk_id
        if cid not in self._staged:
            self.stage_refresh(cid)
        self._staged.discard(cid)
        return self._refresh_staging.get(cid, self.masters[cid])

    def _refresh_compute_copies(self) -> None:
        """Make every trained chunk's compute copy hold its master's new values.

        [Note: overlapped refresh] A chunk whose master is on the host and whose shard is on the device
        (host optimizer state, resident or device-shard chunk) is *uploaded*: its master is cast on the host
        into a pinned staging buffer of the compute dtype (Adam/AdamW: in the same pass as its update, [Note:
        same-pass host step] in ``_same_pass.py``; else by the host lane right after its speculative step,
        [Note: host lane], or here), then :meth:`Chunk.issue_refresh` copies it into the device shard on the
        manager's copy stream with one event per chunk, in the order the next forward first uses the chunks
        (:meth:`ChunkManager.next_use_order`). Nothing waits here: the chunk's first access (or anything else
        that reads the shard: an unshard, ``write_back``, ``state_dict``, ``full_parameters``) makes the compute
        stream wait for its event, so the next forward starts once its first chunk is up, not after every
        upload. The start of backward drains what forward did not use, so the host lane may write the masters
        and staging buffers again; a staging buffer is written only after the step's host read or the lane's
        wait for a gradient copy, both ordered after that drain, so no upload still reads it. Casting on the
        host halves the bytes on the bus: ``copy_`` from an fp32 host tensor into a bf16 device one with
        ``non_blocking=True`` moves fp32 and casts on the device, in an uncharged fp32 device temporary.
        On the simulated device the copy is done at the wait and the parameters are stale placeholders until
        then, so a read that skips the wait raises (as the hardware would return the old values); a write to the
        upload's source (staging buffer or master) between the issue and the wait raises too, where the hardware
        would upload the values of the issue time ([Note: strict refresh source] in ``hf_elixir/chunk/chunk.py``).
        Source: ZeRO-Offload (arXiv 2101.06840) section 4.2, the fp16 parameter copy overlapped with the next
        step; FSDP2's per-parameter-group events on a side stream.

        [Note: refresh cast] Where the cast of such an upload happens is the plan's ``refresh_cast``. ``"host"``
        (above): the host lane pays the cast (about a fifth of the AdamW update, [Note: same-pass host step]),
        PCIe carries ``b`` bytes per element. ``"device"``: no host staging buffer; the fp32 master itself is
        uploaded, 4 bytes per element, on the same copy stream and event, through one fp32 device staging buffer
        of at most ``REFRESH_STAGING_NUMEL`` elements (``hf_elixir/chunk/chunk.py``) that every such chunk
        reuses block by block (upload a block, cast it into the shard on the device, next block: one stream, so
        the buffer is never overwritten before its cast ran), charged to the device pool for the whole run. The
        master is then what an upload reads, so it is written only after the upload finished: after backward's
        drain (as the staging buffers above), or, for a step with no backward since the last, after
        :meth:`step` waits for the pending upload. The search picks the side by cost
        (``hf_elixir/search/_cost.py``): the host lane's cast against the doubled PCIe bytes and the device
        staging bytes. Only for a compute dtype narrower than fp32: fp32 has nothing to cast.

        [Note: early refresh] With the host lane speculating ([Note: host lane] in ``_overlap.py``), a chunk's
        upload does not wait for the step: the main thread issues it during backward, at the first gradient
        hook after the lane has stepped (and cast) the chunk and backward uses the chunk no more in the previous
        step's order (``ChunkManager.used_no_more``: no later access, no parameter in COMPUTE, no gradient
        waiting for another reduce of the chunk), so nothing reads
        the compute copy the upload overwrites before the next forward. The host-to-device direction of the bus
        is idle in backward (gradients go the other way), so most uploads are done when backward ends and the
        next forward waits only for the last chunks the lane steps; with the cast on the device ([Note: refresh
        cast]) the lane is left with the AdamW update alone. The upload carries speculative values until
        ``step()`` validates them: a kept speculation keeps its upload (``step`` skips it); one rolled back
        waits for the upload first (``release_upload``: the undo writes what it reads) and the step uploads the
        redone values; a wait for it before the step (the next micro-batch's forward when the lane mispredicted
        the step, a state dict) goes through ``early_refresh_fence``, which undoes the speculative step and
        uploads the values from before it. A gradient for the chunk after its early upload (the module order
        changed within a backward) raises. Not under fp16 loss scaling: an overflow skips the step, and the
        compute copies must then stay bit for bit as they were, which re-uploading a master the inverse update
        restored to about one ulp ([Note: inverse rollback]) would not guarantee. Source: SuperOffload (arXiv 2509.21271) section 4, the parameter
        copy-back overlapped with the remaining backward; priced in ``hf_elixir/search/_cost.py``.
        """
        import triton_kernels  # noqa: PLC0415

        counters = self.manager.counters
        uploads = []
        for chunk in self.manager.chunks:
            if not chunk.trainable:
                continue
            master = self.masters[chunk.chunk_id]
            target = chunk.full if chunk.full_alias else chunk.shard
            if master is not target and _uploads(chunk):
                uploads.append(chunk)
            elif master is not target:
                same_side = master.device == target.device and strict.is_host(master) == strict.is_host(target)
                if same_side and master.dtype != target.dtype:
                    # fp32 master -> bf16/fp16 compute copy on one device: the cast kernel (Triton on CUDA)
                    triton_kernels.cast_(master, target, force_triton=self._force_fused)
                else:
                    with strict.host_copies():  # onload / offload of the refreshed shard, counted below
                        target.copy_(master, non_blocking=True)
                if chunk.optim_on_device != chunk.shard_on_device:
                    nbytes = chunk.shard_bytes
                    if chunk.shard_on_device:
                        counters.h2d_bytes += nbytes
                    else:
                        counters.d2h_bytes += nbytes
            chunk.version += 1
            if chunk.full_alias:
                chunk.full_version = chunk.version
        early = self._lane.early if self._lane is not None else ()
        for chunk in self.manager.next_use_order(uploads):
            if chunk.chunk_id not in early:  # uploaded during backward already ([Note: early refresh])
                self.issue_upload(chunk)

    def issue_upload(self, chunk: Chunk, speculative: bool = False) -> None:
        """Issue the upload refreshing ``chunk``'s device shard from its master ([Note: overlapped refresh]):
        the fp32 master cast on the device ([Note: refresh cast]), or its host staging buffer (cast now unless
        the step or the lane cast it already). ``speculative``: from a host-lane step ``step()`` has not
        validated yet ([Note: early refresh])."""
        if chunk.chunk_id in self._device_cast_ids:  # [Note: refresh cast] the fp32 master, cast on the device
            chunk.issue_refresh(self.masters[chunk.chunk_id], side_stream=self.manager.copy_stream,
                                staging=self._device_staging, speculative=speculative)
        else:
            chunk.issue_refresh(self._upload_source(chunk), side_stream=self.manager.copy_stream,
                                speculative=speculative)

    def release_upload(self, chunk: Chunk) -> None:
        """Wait (host sync on its event) until ``chunk``'s pending upload has read its source, and make it
        visible: before the source is written outside the step's order ([Note: early refresh])."""
        pending = chunk.pending_refresh
        if pending is not None:
            pending.speculative = False
        self._release_staging(chunk)

    def zero_grad(self, set_to_none: bool | None = True) -> None:
        """Zero the reduced gradient shards; ``p.grad`` stays ``None`` (gradients live in chunks).

        ``torch.optim.Optimizer.zero_grad`` semantics: with ``set_to_none=True`` (the default; ``None``
        counts as ``True``) a parameter with no gradient in the next backward is skipped by the next
        step; with ``set_to_none=False`` every parameter that had a gradient keeps a zero one, so the
        step still updates it (momentum, weight decay) — e.g. MoE experts that got no tokens.
        """
        self.manager.zero_grad(keep_has_grad=set_to_none is False)

    # -- state dicts ---------------------------------------------------------------------------
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
                    "the optimizer with the same param groups as the saved run"
                )
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        with strict.host_copies():  # the loaded state is host memory
            self._load_view_states(state_dict["state"])
        self.scaler.load_state_dict(state_dict.get("loss_scaler", self.scaler.state_dict()))

    def _load_view_states(self, saved_state: dict) -> None:
        for view in self.views:
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

    def merge_param_writes(self, chunks: list[Chunk]) -> None:
        """The manager's ``on_param_writes``: merge the compute shards of ``chunks`` (which hold parameter writes)
        into their fp32 masters element by element: an element whose compute value differs from its master cast
        to the compute dtype was written and takes that value; the others keep their master value, so a bf16
        chunk's masters are not rounded to bf16 by a write elsewhere in it. Speculative host steps are undone
        first (the step redoes them from the merged masters), as :meth:`sync_masters_from_params` does."""
        self.settle_host_steps()
        self._release_master_reads()  # pending uploads may read the masters written below
        self.manager.drain_refreshes()
        counters = self.manager.counters
        for chunk in chunks:
            chunk.params_written = False
            master = self.masters.get(chunk.chunk_id)
            source = chunk.full if chunk.full_alias else chunk.shard
            if master is None or master is source:
                continue  # no optimizer state, or the shard is the master: the write is in already
            self._staged.discard(chunk.chunk_id)
            moved = strict.is_host(source) != strict.is_host(master)
            with torch.no_grad(), strict.host_copies():
                values = source.to(master.device, copy=moved)
                written = values != master.to(values.dtype)
                master.copy_(torch.where(written, values.to(master.dtype), master))
            if moved:
                if strict.is_host(master):
                    counters.d2h_bytes += chunk.shard_bytes
                else:
                    counters.h2d_bytes += chunk.shard_bytes

    def sync_masters_from_params(self) -> None:
        """Refresh fp32 masters from the compute shards (after ``model.load_state_dict``)."""
        self.settle_host_steps()
        self.manager.drain_refreshes()
        self._staged.clear()
        for chunk in self.manager.chunks:
            if chunk.trainable:
                master = self.masters[chunk.chunk_id]
                source = chunk.full if chunk.full_alias else chunk.shard
                if master is not source:
                    with strict.host_copies():
                        master.copy_(source)
