"""The step's one host read and the cross-rank checks it carries (``ElixirOptimizer``'s part).

[Note: one host read] The step reads the device once: the overflow flag, the clip factor owed
to host gradients and the has-gradient flags, concatenated on the device and copied to the
host in one transfer (:func:`hf_elixir.chunk.strict.host_read`). Everything else (unscale,
norm, clipping, the fused update, the copies back) is issued without waiting; the loss scale
is updated on the host from that read (``torch.amp.GradScaler`` reads its ``found_inf`` the
same way, once per step).

The same read carries the manager's cross-rank checks, so they cost no extra sync: the ranks' gradient reduce
orders ([Note: reduce order check] in ``hf_elixir/chunk/_rank_checks.py``), their hyperparameters ([Note:
hyperparameter check] there: :meth:`StepReadMixin._hyper_code` is what each rank contributes) and the vetoes of
gathers ahead ([Note: agreed gathers ahead] there). A failed check raises before anything is updated.
"""

from __future__ import annotations

import zlib

import torch

from hf_elixir.chunk import strict

__all__ = ["StepReadMixin"]


def _scalar(value):
    """A param group's value as :meth:`ElixirOptimizer._hyperparameters` compares it: numbers, flags, strings and
    tuples of them as they are, anything else (a tensor) ``None``. Module level: a recursive closure would be a
    reference cycle, cyclic garbage at every backward."""
    if isinstance(value, (tuple, list)):
        return tuple(_scalar(v) for v in value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else None


class StepReadMixin:
    """``ElixirOptimizer``'s read of the step's device state (:meth:`_read_step_state`) and the hyperparameter
    code the ranks compare."""

    def _hyperparameters(self) -> list[dict]:
        """Per param group, its scalar hyperparameters (numbers, flags, strings, tuples of them), as the ranks
        compare them ([Note: hyperparameter check] in ``chunk/_rank_checks.py``); a tensor value (a tensor lr) is
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
        flags = self.manager.flags
        packed = torch.cat([found.reshape(1).float(), coef.reshape(1).float(),
                            flags.checks.reduce_order_mismatch.float(), flags.checks.hyper_mismatch.float(),
                            flags.has_grad_flags.float(), self.manager.ahead_veto.float()])
        values = strict.host_read(packed).tolist()
        hyper_mismatch = values.pop(3)
        num_flags = flags.has_grad_flags.numel()
        if self.manager.ahead_veto.numel():  # [Note: agreed gathers ahead] in chunk/_agreed_gathers.py
            self.manager.agree_gathers_ahead(values[3 + num_flags:])
        if values[2] > 0 or hyper_mismatch > 0:  # [Note: reduce order check] in chunk/_rank_checks.py: nothing is updated
            self.settle_host_steps()  # the host lane's speculative updates of this backward are undone
            if self._lane is not None:
                self._lane.end_step()
            self._unscaled = False
            self._found_inf = self._host_clip_coef = None
            if values[2] <= 0:  # [Note: hyperparameter check] in chunk/_rank_checks.py
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
