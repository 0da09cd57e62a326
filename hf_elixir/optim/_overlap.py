"""The host lane: host-side work on offloaded gradient shards, overlapped with backward, and the
speculative host optimizer step (SuperOffload, arXiv 2509.21271, section 4: speculation-then-validation).

[Note: host lane] Chunks whose optimizer state lives on the host receive their reduced gradient shard by
a non-blocking device->host copy ([Note: gradient offload] in ``hf_elixir/chunk/_grad_shards.py``). The host
lane takes each one over on ONE worker thread (``concurrent.futures``; PyTorch's CPU ops release the
GIL, so it runs beside the backward the main thread drives): it waits for the copy's event (CUDA),
adds the staging buffer into the gradient shard (gradient accumulation), and, on the backward that
precedes ``step()``, steps the chunk at once:

* **speculate.** Where the update has no inverse (AMSGrad, other optimizer classes, fp16 with a loss scale
  that is not a power of two: [Note: inverse rollback] in ``_inverse_adam.py``), the lane first copies the
  chunk's fp32 master shard, its optimizer state (and, under fp16, its still scaled gradient) into a per-chunk
  snapshot; Adam/AdamW keep none. Under fp16 it unscales the
  gradient and checks it for inf/NaN (host memory: free to read); it computes the chunk's squared
  L2 norm, then runs the inner optimizer on the chunk's views, as if no clipping and no overflow
  happened, with this rank's has-gradient flags as known so far and the param groups' current
  hyperparameters; a chunk whose shard is on the device then has its master cast into the staging buffer
  its upload reads ([Note: overlapped refresh] in ``_refresh.py``), in the same pass as the update for
  Adam/AdamW ([Note: same-pass host step] in ``_same_pass.py``).
* **validate.** ``step()`` joins the lane and reads the global overflow flag, clip factor and merged
  has-gradient flags in its one host read. A speculative update stands when nothing overflowed, the
  clip factor is 1, and the chunk's flags and hyperparameters are those it used.
* **roll back.** Otherwise the update is undone, by the inverse Adam/AdamW update with the same gradient and
  the hyperparameters the speculation used (about one ulp, not bitwise; fp16: the gradient is scaled back by
  the power-of-two scale, exactly) or by copying the snapshot back (exact), and the chunk is stepped again the
  ordinary way: with the clip factor applied, or not at all on overflow. Rollbacks are rare in long
  runs (clipping triggers and fp16 overflows are); they cost one pass over the chunk's state.

Gradient accumulation: the lane speculates only on the backward expected to be followed by
``step()``: the ``n``-th backward after a step, ``n`` the backwards the previous step had (1 at
first). A chunk stepped on a misprediction (another backward arrives) is rolled back before its next
gradient is added, or before anything reads its shard (``host_fence``).

The lane is joined (and exceptions raised in it re-raised on the main thread) before anything reads
or writes master shards, optimizer states or gradient shards: ``clip_grad_norm``, ``step``,
``zero_grad`` (also ``model.zero_grad()``), the state dicts, a shard being unsharded. ``zero_grad``
and the state dicts before ``step()`` roll every speculative update back.

[Note: lane off the CPU device] The lane gains only where its thread runs beside compute that is not on the
host's cores: with a CUDA compute device the CPU is idle during backward. Where the compute device is the CPU
(the simulated device), the lane's thread shares the cores with the ranks' own compute, so the host update
costs the same CPU time as in ``step()`` plus what speculation adds (before the inverse rollback, the
snapshot copies: ``(1 + k) * 4`` bytes per shard element copied every step, and as many bytes of host RAM
held, on GPT-2 124M at 2 ranks 1.3 GiB of RAM per rank and ~0.3 s of copies per step; now only for the
optimizers without an inverse). So ``overlap_host_optimizer=None`` speculates on
CUDA only; ``True`` forces it (tests of the lane run it on CPU), and the cost model prices exactly that
(``hf_elixir.search._cost``, [Note: overlap]).

Memory: Adam/AdamW chunks (``HostLane.inverse_chunks``) keep nothing. A speculatively stepped chunk of another
optimizer keeps a host snapshot of ``(1 + k) * 4 * shard_numel`` bytes (``k`` optimizer states per element,
AMSGrad 3; fp16: ``(2 + k) * 4``), allocated once and counted in ``host_bytes``. Snapshots are taken only while
they fit what ``ElixirConfig.host_memory_budget_bytes`` leaves after the host shards and optimizer states: the
first chunks in reduce order (the ones whose overlap gains most) speculate, the others are stepped in ``step()``
as without overlap.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import weakref
from dataclasses import dataclass, field

import torch

from hf_elixir.chunk import strict
from hf_elixir.chunk.memory import default_host_budget_bytes
from hf_elixir.optim._inverse_adam import group_invertible, power_of_two, undo_adam_step
from hf_elixir.optim._norms import pow_sum

__all__ = ["HostLane", "scale_invertible", "snapshot_rollback", "speculates"]


def speculates(overlap_host_optimizer: bool | None, compute_device: torch.device) -> bool:
    """Whether the host lane steps host chunks during backward (``ElixirConfig.overlap_host_optimizer``).

    ``None`` (the default) resolves by the compute device ([Note: lane off the CPU device]): on where
    the compute runs on an accelerator (CUDA), off where the compute device is the host's own CPU.
    """
    if overlap_host_optimizer is None:
        return compute_device.type == "cuda"
    return bool(overlap_host_optimizer)


def scale_invertible(scale: float, policy) -> bool:
    """fp16: whether the loss scale ``scale`` and the factors of its ``LossScalePolicy`` are powers of two, so the
    lane's in-place unscale is undone exactly ([Note: inverse rollback] in ``_inverse_adam.py``)."""
    factors = (scale, policy.growth_factor, policy.backoff_factor, policy.min_scale)
    return all(power_of_two(float(f)) for f in factors)


def snapshot_rollback(optimizer: torch.optim.Optimizer, precision: str, loss_scale) -> bool:
    """Whether the host lane keeps snapshots for some chunk of ``optimizer`` (the search's ``snapshot_rollback``,
    [Note: overlap] in ``hf_elixir/search/_cost.py``): a param group whose update has no inverse (AMSGrad, an
    optimizer class other than Adam/AdamW, tensor hyperparameters), or ``precision="fp16"`` with a
    ``loss_scale`` policy (``ElixirConfig.loss_scale``) that is not all powers of two. ``False``: every
    speculative update is undone by the inverse Adam/AdamW update, no snapshot held."""
    if precision == "fp16" and not scale_invertible(loss_scale.init_scale, loss_scale):
        return True
    return not all(group_invertible(type(optimizer), group) for group in optimizer.param_groups)


@dataclass
class _Prepared:
    """A host chunk's gradient as the lane left it: unscaled (fp16), its overflow, its squared L2 norm."""

    found_inf: bool
    sq_norm: float


@dataclass
class _Snapshot:
    """A chunk's state before its speculative step (buffers reused step after step)."""

    master: torch.Tensor
    states: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> fp32 [shard_numel]
    grad: torch.Tensor | None = None
    # per view: None (no state before: first step) or {key: scalar tensor / value} of non-per-element state
    view_scalars: list = field(default_factory=list)
    view_keys: list = field(default_factory=list)


@dataclass
class _Speculation:
    flags: frozenset[int]
    hyper: list[dict]
    stepped: bool
    grad_saved: bool
    inverse: bool = False  # rolled back by the inverse update ([Note: inverse rollback]), no snapshot
    scale: float = 1.0  # fp16: the loss scale the lane unscaled the gradient by (a power of two if inverse)
    backward: int = 0  # the manager's backward_count of the backward it was made in


def _hyper_of(groups: list[dict]) -> list[dict] | None:
    """The param groups' hyperparameters, or None when one is a tensor (not compared: no speculation)."""
    out = []
    for group in groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        if any(torch.is_tensor(v) for v in entry.values()):
            return None
        out.append(entry)
    return out


class HostLane:
    """Host gradient intake and the speculative host step for one :class:`ElixirOptimizer` ([Note: host lane]).

    Args:
        optimizer: the ``ElixirOptimizer``; the lane steps its host chunks through ``_step_views``.
        speculate: run the host optimizer step during backward (``ElixirConfig.overlap_host_optimizer``).
        state_numel_factor: fp32 optimizer-state elements per parameter element (Adam: 2), for the
            snapshot sizes.
    """

    def __init__(self, optimizer, speculate: bool, state_numel_factor: int) -> None:
        self._opt = optimizer  # a cycle (optimizer -> lane -> optimizer) the garbage collector takes
        self.manager = optimizer.manager
        self.speculate = speculate
        self.host_chunks = {c.chunk_id for c in self.manager.chunks if c.trainable and not c.optim_on_device}
        self._views = {cid: [v for v in optimizer.views if v.chunk.chunk_id == cid] for cid in self.host_chunks}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._futures: list[concurrent.futures.Future] = []
        self._pending: set[int] = set()  # chunk ids with a task submitted and not joined yet (main thread)
        self.prepared: dict[int, _Prepared] = {}
        self.speculations: dict[int, _Speculation] = {}
        self._snapshots: dict[int, _Snapshot] = {}
        self.expected_backwards = 1
        self._count_at_step = self.manager.backward_count
        self.local_inf = False
        self.num_speculated = 0  # chunks stepped during backward (counters for tests and benchmarks)
        self.num_early_refreshes = 0  # uploads issued during backward ([Note: early refresh])
        self.num_rolled_back = 0
        self._new_snapshot_bytes = 0
        budget = optimizer.config.host_memory_budget_bytes or default_host_budget_bytes()
        self._snapshot_room = max(0, budget - self.manager.counters.host_bytes)
        self._snapshot_numel = 1 + state_numel_factor + int(optimizer.scaler.enabled)  # fp32 per element
        self._may_speculate: dict[int, bool] = {}
        # chunks rolled back by the inverse Adam/AdamW update: no snapshot held ([Note: inverse rollback])
        hyper = _hyper_of(optimizer.param_groups)
        self.inverse_chunks = {cid for cid in self.host_chunks if self._invertible(cid, hyper)}
        # [Note: early refresh] in _refresh.py: chunks the worker stepped speculatively whose refresh is an
        # upload (appended by the worker), those waiting for backward to be done with them, those issued
        self.ready: collections.deque[int] = collections.deque()
        self._waiting: list[int] = []
        self.early: set[int] = set()

    # -- intake ------------------------------------------------------------------------------------
    def _submit(self, fn, *args) -> concurrent.futures.Future:
        if self._executor is None:
            threads = torch.get_num_threads()
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="hf_elixir-host-lane",
                initializer=torch.set_num_threads, initargs=(threads,))
            weakref.finalize(self, self._executor.shutdown, wait=False)  # idle: tasks are joined first
        future = self._executor.submit(fn, *args)
        self._futures.append(future)
        return future

    def on_grad_offloaded(self, chunk, staging: torch.Tensor | None, event):
        """The manager's ``on_grad_offloaded``: take over a host gradient (main thread, in backward)."""
        cid = chunk.chunk_id
        speculate = (self.speculate and cid in self.host_chunks
                     and self.manager.backward_count - self._count_at_step >= self.expected_backwards)
        flags = self.manager.flags.spec(chunk) if speculate else frozenset()
        hyper = _hyper_of(self._opt.param_groups) if speculate else None
        speculate = speculate and hyper is not None and self._snapshot_fits(chunk)
        if speculate and cid in self.inverse_chunks and not self._invertible(cid, hyper):
            speculate = False  # no snapshot room reserved: stepped in step() (the hyperparameters changed)
        if not speculate and event is None:  # nothing to wait for or overlap: add here
            self._intake(cid, staging, None, None)
            return None
        self._pending.add(cid)
        future = self._submit(self._intake, cid, staging, event,
                              (flags, hyper, self.manager.backward_count) if speculate else None)
        return lambda: concurrent.futures.wait([future])  # its error, if any, is raised by join()

    def _invertible(self, cid: int, hyper: list[dict] | None) -> bool:
        """Whether chunk ``cid``'s speculative step under ``hyper`` (the param groups' hyperparameters) can be
        undone by the inverse update ([Note: inverse rollback]); fp16: the loss scale and its policy's factors
        are powers of two (the gradient is unscaled in place and scaled back exactly)."""
        opt = self._opt
        if opt.inner is None or hyper is None:
            return False
        if opt.scaler.enabled and not scale_invertible(opt.scaler.scale, opt.scaler.policy):
            return False
        cls = type(opt.inner)
        return all(group_invertible(cls, hyper[g]) for g in {v.group_index for v in self._views[cid]})

    def _snapshot_fits(self, chunk) -> bool:
        """Reserve room for ``chunk``'s snapshot the first time (first come in reduce order); then fixed. A chunk
        rolled back by the inverse update needs none ([Note: inverse rollback])."""
        allowed = self._may_speculate.get(chunk.chunk_id)
        if allowed is None:
            numel = 0 if chunk.chunk_id in self.inverse_chunks else self._snapshot_numel
            need = chunk.shard_numel * 4 * numel
            allowed = self._may_speculate[chunk.chunk_id] = need <= self._snapshot_room
            if allowed:
                self._snapshot_room -= need
        return allowed

    def _intake(self, cid: int, staging, event, speculation) -> None:
        """(worker, or inline) wait for the copy, roll back a stale speculation, add, maybe speculate."""
        with torch.no_grad():
            if event is not None:
                event.synchronize()
            grad = self.manager.grad_shards[cid]
            if cid in self.early:  # its upload may be on the bus: the worker cannot take it back
                raise RuntimeError(
                    f"chunk {cid} got a gradient after backward had used it for the last time in the previous "
                    "step's order and its refresh was issued early ([Note: early refresh]); the step's module "
                    "order changed within a backward. Set ElixirConfig(overlap_host_optimizer=False) for this model")
            if cid in self.speculations:  # a later gradient for a chunk already stepped: undo it first
                self._rollback(cid, restore_grad=True)
            self.prepared.pop(cid, None)
            if staging is not None:
                grad.add_(staging)
            if speculation is not None:
                self._speculate(cid, grad, *speculation)

    def _speculate(self, cid: int, grad: torch.Tensor, flags: frozenset[int], hyper: list[dict],
                   backward: int) -> None:
        opt = self._opt
        if self.local_inf:
            return  # an earlier chunk overflowed: the step is skipped, nothing to speculate on
        fp16 = opt.scaler.enabled
        inverse = cid in self.inverse_chunks
        snap = None if inverse else self._snapshot(cid, grad if fp16 else None)
        scale = opt.scaler.scale if fp16 else 1.0
        if fp16:
            grad.mul_(1.0 / scale)
        found_inf = fp16 and not bool(torch.isfinite(grad).all())
        self.prepared[cid] = _Prepared(found_inf, 0.0 if found_inf else float(pow_sum(grad, 2.0)))  # [Note: blockwise norms]
        views = [v for v in self._views[cid] if v.slot.flag_index in flags]
        stepped = not found_inf and bool(views)
        if found_inf:
            self.local_inf = True
        elif views:
            opt._step_views(views, hyper)  # the values validate() compares, not the live ones
            if cid not in opt._staged:  # cast in the same pass already ([Note: same-pass host step])
                opt.stage_refresh(cid)  # the upload's host cast, overlapped too ([Note: overlapped refresh])
        self.speculations[cid] = _Speculation(flags, hyper, stepped, snap is not None and snap.grad is not None,
                                              inverse, scale, backward)
        self.num_speculated += int(stepped)
        if stepped and cid in opt.early_refresh_chunks:
            self.ready.append(cid)  # the main thread issues its upload ([Note: early refresh])

    def issue_ready(self) -> None:
        """The manager's ``on_grad_progress`` (main thread, after each gradient lands): issue the upload of
        every chunk the worker has stepped speculatively and backward uses no more ([Note: early refresh])."""
        while self.ready:
            self._waiting.append(self.ready.popleft())
        if not self._waiting:
            return
        waiting = []
        for cid in self._waiting:
            spec = self.speculations.get(cid)
            if spec is None or spec.backward != self.manager.backward_count:
                continue  # rolled back meanwhile, or another backward came: a misprediction, never uploaded
            chunk = self.manager.chunks[cid]
            if self.manager.used_no_more(chunk):
                self.early.add(cid)
                self._opt.issue_upload(chunk, speculative=True)
                self.num_early_refreshes += 1
            else:
                waiting.append(cid)
        self._waiting = waiting

    def early_fence(self, chunk) -> None:
        """The manager's ``early_refresh_fence``: something waits for ``chunk``'s early refresh before ``step()``
        validated it (another micro-batch's forward: the lane mispredicted the step; a state dict, ...). Undo
        the speculative step and upload the values from before it ([Note: early refresh])."""
        self.join()
        if chunk.chunk_id in self.speculations:
            with torch.no_grad():
                self._rollback(chunk.chunk_id, restore_grad=True)

    # -- snapshots ---------------------------------------------------------------------------------
    def _buffer(self, numel: int) -> torch.Tensor:
        self._new_snapshot_bytes += numel * 4  # added to the counters on the main thread (join)
        return strict.register_host(torch.empty(numel, dtype=torch.float32))

    def _snapshot(self, cid: int, grad: torch.Tensor | None) -> _Snapshot:
        opt = self._opt
        master = opt.masters[cid]
        snap = self._snapshots.get(cid)
        if snap is None:
            snap = self._snapshots[cid] = _Snapshot(master=self._buffer(master.numel()))
        snap.master.copy_(master)
        snap.view_scalars, snap.view_keys = [], []
        state = opt.inner.state if opt.inner is not None else {}
        for view in self._views[cid]:
            entry = state.get(view.tensor)
            if not entry:
                snap.view_scalars.append(None)
                snap.view_keys.append(())
                continue
            keys, scalars = [], {}
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == view.tensor.numel():
                    if key not in snap.states:
                        snap.states[key] = self._buffer(master.numel())
                    snap.states[key][view.lo:view.hi].copy_(value)
                    keys.append(key)
                else:
                    scalars[key] = value.clone() if torch.is_tensor(value) else value
            snap.view_scalars.append(scalars)
            snap.view_keys.append(tuple(keys))
        snap.grad = None
        if grad is not None:
            if "_grad" not in snap.states:
                snap.states["_grad"] = self._buffer(grad.numel())
            snap.grad = snap.states["_grad"]
            snap.grad.copy_(grad)
        return snap

    def _rollback(self, cid: int, restore_grad: bool, reupload: bool = True) -> None:
        """Undo chunk ``cid``'s speculation: master and optimizer state as before it (snapshot: exact copies;
        else the inverse update, [Note: inverse rollback]), and with ``restore_grad`` the gradient too (fp16:
        scaled again, so later micro-batches add to it). An upload issued early from it ([Note: early refresh])
        is waited for first (the undo writes what it reads), and with ``reupload`` the values from before are
        uploaded again (``False``: the step redoes the chunk and uploads the result)."""
        spec = self.speculations.pop(cid)
        self.prepared.pop(cid, None)
        early = cid in self.early
        if early:
            self.early.discard(cid)
            self._opt.release_upload(self.manager.chunks[cid])
        if spec.stepped:
            self.num_rolled_back += 1
            self._opt._staged.discard(cid)  # the staging holds the undone values: cast again after the real step
            if spec.inverse:
                self._undo_by_inverse(cid, spec)
            else:
                self._restore_snapshot(cid)
        if early and reupload:
            self._opt.issue_upload(self.manager.chunks[cid])
        grad = self.manager.grad_shards[cid]
        if restore_grad and spec.grad_saved:
            grad.copy_(self._snapshots[cid].grad)
        elif restore_grad and spec.inverse and spec.scale != 1.0:
            grad.mul_(spec.scale)  # a power of two: exact

    def _undo_by_inverse(self, cid: int, spec: _Speculation) -> None:
        """The inverse Adam/AdamW update of the views the speculation stepped, per param group and step count
        (one multi-tensor pass each), with the hyperparameters it used ([Note: inverse rollback])."""
        opt = self._opt
        state = opt.inner.state
        batches: dict[tuple[int, int], list] = {}
        for view in self._views[cid]:
            if view.slot.flag_index in spec.flags:
                entry = state[view.tensor]
                batches.setdefault((view.group_index, int(entry["step"])), []).append((view, entry))
        cls = type(opt.inner)
        for (group_index, step), items in batches.items():
            undo_adam_step(cls, spec.hyper[group_index], step, [v.tensor.detach() for v, _ in items],
                           [v.tensor.grad for v, _ in items], [e["exp_avg"] for _, e in items],
                           [e["exp_avg_sq"] for _, e in items])
            for view, entry in items:
                if step == 1:
                    state.pop(view.tensor)  # no state before its first step (primed again, zero)
                else:
                    entry["step"].sub_(1)

    def _restore_snapshot(self, cid: int) -> None:
        """Copy chunk ``cid``'s snapshot back: master and optimizer state exactly as before the speculation."""
        snap = self._snapshots[cid]
        opt = self._opt
        opt.masters[cid].copy_(snap.master)
        state = opt.inner.state
        for view, scalars, keys in zip(self._views[cid], snap.view_scalars, snap.view_keys):
            if scalars is None:
                state.pop(view.tensor, None)
                continue
            entry = state[view.tensor]
            for key in keys:
                entry[key].copy_(snap.states[key][view.lo:view.hi])
            for key, value in scalars.items():
                if torch.is_tensor(entry.get(key)) and torch.is_tensor(value):
                    entry[key].copy_(value)
                else:
                    entry[key] = value

    # -- main-thread side --------------------------------------------------------------------------
    def join(self) -> None:
        """Wait for every submitted task; re-raise the first exception one of them raised."""
        futures, self._futures = self._futures, []
        self._pending.clear()
        error = None
        for future in futures:
            try:
                future.result()
            except BaseException as err:  # noqa: BLE001 - re-raised below, after every task ended
                error = error or err
        self.manager.counters.host_bytes += self._new_snapshot_bytes
        self._new_snapshot_bytes = 0
        if error is not None:
            raise RuntimeError(f"the host optimizer lane failed: {error!r}") from error

    def settle(self, restore_grads: bool = True) -> None:
        """Join, then undo every speculative update; ``restore_grads``: gradients as backward left them
        (fp16: scaled), else as the lane left them (unscaled: the step already read their norm and overflow)."""
        self.join()
        with torch.no_grad():
            for cid in list(self.speculations):
                self._rollback(cid, restore_grad=restore_grads)
        self.prepared.clear()
        self.local_inf = False
        self.ready.clear()
        self._waiting.clear()

    def fence(self, chunk) -> None:
        """The manager's ``host_fence``: ``chunk`` (``None``: every gradient shard) is about to be read or
        reset. A speculative update of a shard that is its own master (fp32, host shard) is undone first."""
        if chunk is None:
            if self._futures or self.speculations:
                self.settle()
            return
        cid = chunk.chunk_id
        if cid not in self._pending and cid not in self.speculations:
            return
        if self._opt.masters.get(cid) is not chunk.shard:
            return  # the speculation writes a separate master: the shard is untouched
        self.join()
        if cid in self.speculations:
            with torch.no_grad():
                self._rollback(cid, restore_grad=True)

    def validate(self, found_inf: bool, host_coef: float, flags: list[float]) -> set[int]:
        """After the step's host read: roll back what does not stand; the chunk ids stepped already."""
        redo_all = found_inf or host_coef < 1.0
        hyper = _hyper_of(self._opt.param_groups)
        kept = set()
        with torch.no_grad():
            for cid, spec in list(self.speculations.items()):
                actual = frozenset(v.slot.flag_index for v in self._views[cid] if flags[v.slot.flag_index] > 0)
                if redo_all or actual != spec.flags or hyper != spec.hyper:
                    # an overflow skips the step: nothing redoes and uploads the chunk ([Note: early refresh])
                    self._rollback(cid, restore_grad=False, reupload=found_inf)
                else:
                    kept.add(cid)
                    del self.speculations[cid]
                    pending = self.manager.chunks[cid].pending_refresh
                    if cid in self.early and pending is not None:
                        pending.speculative = False  # validated: its early upload stands
        return kept

    def end_step(self) -> None:
        """After ``step()``: learn the backwards per step, forget this step's records."""
        count = self.manager.backward_count
        self.expected_backwards = max(1, count - self._count_at_step)
        self._count_at_step = count
        self.speculations.clear()
        self.prepared.clear()
        self.local_inf = False
        self.ready.clear()
        self._waiting.clear()
        self.early.clear()

    def host_sq_norm(self, cid: int) -> float | None:
        """The squared L2 norm the lane computed for chunk ``cid``'s final gradient, if it did."""
        prepared = self.prepared.get(cid)
        if prepared is None or prepared.found_inf or not math.isfinite(prepared.sq_norm):
            return None
        return prepared.sq_norm
