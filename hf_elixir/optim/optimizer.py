"""``ElixirOptimizer``: runs the user's element-wise ``torch.optim`` optimizer on chunk shards.

The optimizer is a coordinator of its parts, one concept per file (as FSDP2's ``_fully_shard`` package):

* ``_shard_views.py``: the masters, gradient shards and per-parameter views of this rank's shards
  ([Note: shard views]);
* ``_inner.py``: the inner ``torch.optim`` optimizer over the views, stepped by the step and the host lane;
* ``_fused_device.py``: the fused Adam/AdamW step of device chunks ([Note: fused device step]);
* ``_overlap.py`` / ``_host_state.py`` / ``_same_pass.py``: the host lane, the host optimizer states and the
  same-pass host step ([Note: host lane], [Note: host optimizer state], [Note: same-pass host step]);
* ``_refresh.py``: the compute copies refreshed from the masters ([Note: overlapped refresh], [Note: refresh
  cast], [Note: early refresh]);
* ``_clip.py``: unscale, global norm and clipping ([Note: owed clip factor]);
* ``_step_read.py``: the step's one host read and the cross-rank checks it carries ([Note: one host read]);
* ``_state_dict.py``: the consolidated state dict; ``_param_writes.py``: parameter writes taken into the masters;
* ``_support.py``: the supported optimizers and their state costs; ``_step_hooks.py``: torch's step hooks;
  ``loss_scaler.py``: the fp16 loss scale.

This file holds the construction, the step's order of work and the ``torch.optim.Optimizer`` surface.

Source: ZeRO (arXiv 1910.02054) stage 3 sharded optimizer states; Gemini's hybrid Adam (host shards
updated on the host, device shards on the device).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hf_elixir.chunk._listener import ChunkStepListener
from hf_elixir.chunk.manager import ChunkManager
from hf_elixir.config import ElixirConfig
from hf_elixir.optim._clip import ClipMixin
from hf_elixir.optim._fused_device import FusedDeviceAdam
from hf_elixir.optim._inner import InnerStepMixin
from hf_elixir.optim._overlap import HostLane, speculates
from hf_elixir.optim._param_writes import ParamWritesMixin
from hf_elixir.optim._refresh import RefreshMixin
from hf_elixir.optim._shard_views import ShardStateMixin
from hf_elixir.optim._state_dict import CONSOLIDATED_FORMAT, SHARDED_FORMAT, StateDictMixin
from hf_elixir.optim._step_hooks import hooked_step
from hf_elixir.optim._step_read import StepReadMixin
from hf_elixir.optim._support import SUPPORTED_OPTIMIZERS, optimizer_cost_terms, optimizer_state_numel_factor
from hf_elixir.optim.loss_scaler import DynamicLossScaler
from hf_elixir.plan import REFRESH_CASTS

__all__ = ["CONSOLIDATED_FORMAT", "SHARDED_FORMAT", "SUPPORTED_OPTIMIZERS", "ElixirOptimizer",
           "optimizer_cost_terms", "optimizer_state_numel_factor"]

logger = logging.getLogger(__name__)


class ElixirOptimizer(ShardStateMixin, InnerStepMixin, RefreshMixin, ClipMixin, StepReadMixin, StateDictMixin,
                      ParamWritesMixin, ChunkStepListener, torch.optim.Optimizer):
    """Wraps the user's optimizer; steps the shards of every chunk where their optimizer state lives.

    Args:
        optimizer: a ``torch.optim`` optimizer built on the (prepared) model's parameters; one of
            :data:`SUPPORTED_OPTIMIZERS`.
        manager: the model's :class:`~hf_elixir.chunk.manager.ChunkManager`.
        config: the :class:`~hf_elixir.config.ElixirConfig` given to ``prepare``.
        refresh_cast: ``ElixirPlan.refresh_cast``: where uploaded chunks' masters are cast to the compute dtype,
            ``"host"`` (default) or ``"device"`` ([Note: refresh cast] in ``_refresh.py``).

    Raises:
        TypeError: an optimizer that is not element-wise (lists the supported ones).
        ValueError: the optimizer holds parameters that are not in the prepared model; ``refresh_cast`` is not
            ``"host"`` or ``"device"``.
    """

    #: run the fused kernels also for CPU tensors, through the Triton interpreter (tests only)
    _force_fused = False

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
        self.views: list = []  # _ShardView, [Note: shard views]
        self._full_group_params_user = [list(g["params"]) for g in self.param_groups]
        self._build_shard_state()
        # [Note: fused device step] in _fused_device.py: the device Adam/AdamW chunks' moments and step counts
        self._fused = FusedDeviceAdam(manager, type(optimizer), self.param_groups, self.masters, self.views,
                                      force=self._force_fused)
        self.fused_chunks = self._fused.chunks  # chunk id -> flat Adam moments (state dicts, checkpoints)
        self.fused_steps = self._fused.steps  # id(view.tensor) -> steps taken (fused chunks)
        self.inner = self._build_inner(type(optimizer))
        self._view_by_tensor = {id(v.tensor): v for v in self.views}
        self._init_same_pass()
        # [Note: host lane] in _overlap.py: offloaded gradients taken over, host step overlapped with backward
        self._lane: HostLane | None = None
        if any(c.trainable and not c.optim_on_device for c in manager.chunks):
            # not with gradient shards on disk ([Note: disk states] in _disk_state.py)
            speculate = speculates(config.overlap_host_optimizer, manager.compute_device) and not (
                self._disk is not None and self._disk.pages.grads)
            self._lane = HostLane(self, speculate=speculate, state_numel_factor=optimizer_state_numel_factor(optimizer))
            manager.reduces.host_steps_in_backward = self._lane.speculate  # [Note: reduce window] in chunk/_reduce.py
        manager.set_listener(self)  # the manager tells this optimizer the step's events (chunk/_listener.py)

    # -- ChunkStepListener: the events the chunk manager reports (chunk/_listener.py) --------------------------
    @property
    def takes_offloaded_grads(self) -> bool:
        """The host lane takes over offloaded gradients ([Note: host lane] in _overlap.py)."""
        return self._lane is not None

    def on_grad_offloaded(self, chunk, staging: torch.Tensor | None, event):
        return self._lane.on_grad_offloaded(chunk, staging, event)

    def host_fence(self, chunk) -> None:
        if self._lane is not None:
            self._lane.fence(chunk)

    def on_grad_progress(self) -> None:
        if self._lane is not None and self._lane.speculate:  # [Note: early refresh] in _refresh.py
            self._lane.issue_ready()

    def early_refresh_fence(self, chunk) -> None:
        if self._lane is not None and self._lane.speculate:
            self._lane.early_fence(chunk)

    def before_backward(self) -> None:
        self._settle_clip()  # [Note: owed clip factor] in _clip.py

    def on_zero_grad(self) -> None:
        self._forget_clip()

    def on_param_writes(self, chunks: list) -> None:
        self.merge_param_writes(chunks)  # [Note: parameter writes] in chunk/_chunk_params.py

    def hyper_code(self) -> int:
        return self._hyper_code()  # [Note: hyperparameter check] in chunk/_rank_checks.py

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

    # -- step ----------------------------------------------------------------------------------
    @hooked_step  # [Note: step hooks] in _step_hooks.py: torch's step hooks once per call
    @torch.no_grad()
    def step(self, closure=None):
        """Update every shard where its optimizer state lives, then refresh the compute copies.

        The step reads the device once, for the overflow flag, the clip factor owed to host gradients and the
        has-gradient flags ([Note: one host read] in ``_step_read.py``); everything else is issued without a wait.

        Host optimizer states: the host lane ([Note: host lane] in ``_overlap.py``) has usually stepped
        their chunks during backward already; the step joins it (a wait on the host thread, not on the
        device), keeps the updates the read validates and rolls back and redoes the others.

        Step hooks (``register_step_pre_hook`` / ``register_step_post_hook`` on this optimizer or on the user's,
        and torch's global ones) run once per call, around all of it ([Note: step hooks] in ``_step_hooks.py``);
        an lr a pre hook sets is the lr of this step.

        Raises:
            ValueError: a closure was given (not supported: forward/backward run outside the step).
            RuntimeError: the ranks reduced their gradients in different orders since the last step (their
                forwards differed; [Note: reduce order check] in ``hf_elixir/chunk/_rank_checks.py``); nothing updated.
        """
        if closure is not None:
            raise ValueError("ElixirOptimizer.step(closure) is not supported; call forward/backward before step()")
        assert not self.manager.backward_pending, "optimizer.step() called while a backward is still running"
        self._check_groups_unchanged()
        self.manager.take_param_writes()  # before anything reads the masters ([Note: parameter writes] in chunk/_chunk_params.py)
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
                for _, g in self._grad_items():  # a disk shard read in for its turn
                    if self._is_host(g):
                        g.mul_(host_coef)
            if self.inner is not None:
                self._inner_step(flags, done)
            self.manager.drain_reduces()
            self._fused.step(flags, force_triton=self._force_fused)  # [Note: fused device step]
            self.scaler.update(False)
            self._refresh_compute_copies()
        self._unscaled = False
        self._found_inf = self._host_clip_coef = None
        if self._lane is not None:
            self._lane.end_step()
        self.manager.end_step()
        return None

    def zero_grad(self, set_to_none: bool | None = True) -> None:
        """Zero the reduced gradient shards; ``p.grad`` stays ``None`` (gradients live in chunks).

        ``torch.optim.Optimizer.zero_grad`` semantics: with ``set_to_none=True`` (the default; ``None``
        counts as ``True``) a parameter with no gradient in the next backward is skipped by the next
        step; with ``set_to_none=False`` every parameter that had a gradient keeps a zero one, so the
        step still updates it (momentum, weight decay) — e.g. MoE experts that got no tokens.
        """
        self.manager.zero_grad(keep_has_grad=set_to_none is False)
