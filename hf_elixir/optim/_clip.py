"""Gradient unscale, global norm and clipping of the chunk gradients (``ElixirOptimizer``'s part).

The reduced gradient shards live in the chunks (``ChunkManager.grad_shards``), on the device for device
optimizer states and on the host for host ones. fp16 gradients are unscaled once per step (:meth:`_unscale`),
the global norm is summed over every chunk and rank without a host sync, and the clip factor is multiplied into
the device gradients at once and owed to the host gradients until the step's one host read ([Note: one host
read] in ``_step_read.py``).

[Note: owed clip factor] Until the step pays it, the factor owed to host gradients is part of their value: a
second clip before the step (measure, then clip; two callers) counts the host gradients with it (the norm
PyTorch would see after the first clip) and multiplies the factors; a backward after a clip pays it into the
host gradients first (:meth:`ClipMixin._settle_clip`, with the fp16 loss scale restored), and ``zero_grad``
forgets it (:meth:`ClipMixin._forget_clip`: the gradients it was owed to are gone). Without this, a second clip
would count the host gradients unclipped, a later backward's gradients would be scaled by the earlier factor
too, and a clip followed by ``zero_grad`` without a step (skipping a batch whose norm was too large) would scale
the next step's host gradients (fp16: leave them unscaled), all silently.

Source: ``torch.nn.utils.clip_grad_norm_`` for the norm rule; ``torch.amp.GradScaler`` for the unscale and its
overflow flag.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_elixir.chunk import strict
from hf_elixir.optim._norms import max_abs, pow_sum

__all__ = ["ClipMixin"]


class ClipMixin:
    """``ElixirOptimizer``'s gradient unscale, norm and clipping; the state is the optimizer's ``_unscaled``,
    ``_found_inf``, ``_host_clip_coef`` and ``_kernel_sq_norms`` (set in its constructor)."""

    def _grad_shards(self) -> list[torch.Tensor]:
        return list(self.manager.grad_shards.values())

    def _grad_items(self, write: bool = True):
        """``(chunk id, gradient shard)`` for a pass that reads or writes (``write``) every gradient: a shard in the
        disk tier's file is read in for its turn and written back after it ([Note: disk parameters] in
        ``hf_elixir/chunk/_disk_pages.py``; a pass that only reads leaves its pages clean)."""
        pages = self.manager.disk_pages
        items = self.manager.grad_shards.items()
        return items if pages is None else pages.each_grad(list(items), write)

    def _unscale(self) -> None:
        """Divide gradients by the loss scale and find non-finite values on any rank (fp16).

        The overflow flag stays on the compute device (``_found_inf``, fp32 ``[1]``, max-reduced over
        the job's group); :meth:`step` reads it in its one host read ([Note: one host read] in ``_step_read.py``)."""
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
        for cid, grad in self._grad_items():
            if cid in prepared:  # unscaled and checked by the host lane during backward
                if prepared[cid].found_inf:
                    found.fill_(1.0)
                continue
            if self._use_kernels(grad):
                # one fused pass: unscale, overflow flag and squared norm (triton_kernels.unscale_norm_);
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
        for cid, g in self._grad_items(write=False):
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
            for _, g in self._grad_items():
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
        optimizer states are scaled in :meth:`step` after its one host read ([Note: one host read]); until then the
        factor is owed to them ([Note: owed clip factor]).

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
