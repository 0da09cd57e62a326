"""Strict device simulation: on the simulated (CPU) device, host memory is told apart from device memory
and the rules CUDA and NCCL enforce are enforced here too.

[Note: strict device] Without CUDA the compute device is the CPU, so the manager's host buffers and
the model's device memory are both CPU tensors, and gloo accepts either in a collective. NCCL does
not: a collective over a host tensor fails on the first GPU run. Strict mode makes the simulation
refuse what the hardware refuses. The rule that tells the two kinds of memory apart:

* **host memory** is what the library allocated *as* host memory: every buffer made by
  :func:`host_empty` (host shards, host gradient shards, fp32 masters and the rank-local copies of
  offloaded chunks; pinned on CUDA) and every host copy made by :func:`to_host` (state-dict tensors,
  optimizer-state reads). They are registered by their untyped storage (a ``weakref.WeakSet``, so a
  freed buffer leaves the registry with its storage; views share their base's storage and count too).
* **device memory** is everything else: chunks, device shards and optimizer states, activations and
  any tensor the model computes on the simulated device. (Registering device allocations instead
  would have to catch every activation the model makes; registering host allocations catches every
  host buffer the library makes, which is where the known bugs were, and never rejects a model's own
  tensors.)

Under strict mode (``HF_ELIXIR_STRICT_DEVICE=1``, or :func:`enable`; ``tests/conftest.py`` turns it on
for the whole test suite and its spawned ranks):

* a collective of ``torch.distributed`` (``all_reduce``, ``all_gather``, ``all_gather_into_tensor``,
  ``all_gather_single``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``reduce_scatter_single``,
  ``broadcast``, ``all_to_all``,
  ``all_to_all_single``, ``reduce``; ``async_op=True`` included) over a host tensor raises
  :class:`HostMemoryError`, as NCCL does. Object collectives (``all_gather_object``, ...) are exempt:
  they stage through the backend's own buffers.
* ``Tensor.copy_`` between a host buffer and a device buffer the manager owns (registered by
  :func:`register_device`: chunks, device shards, gradient shards, fp32 masters, fused optimizer
  moments) raises unless it runs inside :func:`host_copies`, the context the chunk manager's counted
  copy paths (onload, offload, refresh of the compute copies, state-dict loads) use: every
  host<->device copy of model state is one the manager counts. (A copy between a host buffer and a
  tensor nobody registered, e.g. a plain model the user keeps on the CPU, is not checked: on the
  simulated device it cannot be told from host memory.)

On a real CUDA device the hardware enforces both rules itself; the registry is then only a record.
The checks wrap the ``torch.distributed`` module attributes (what ``dist.all_reduce(...)`` looks up)
and ``torch.Tensor.copy_``, once, when strict mode is first enabled.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref

import torch
import torch.distributed as dist

__all__ = ["HostMemoryError", "STRICT_ENV", "enable", "disable", "enabled", "host_copies", "host_empty",
           "host_read", "is_host", "is_managed_device", "register_device", "register_host", "to_device", "to_host"]

STRICT_ENV = "HF_ELIXIR_STRICT_DEVICE"

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "all_to_all", "all_to_all_single",
                "reduce")

_host_storages: weakref.WeakSet = weakref.WeakSet()
_device_storages: weakref.WeakSet = weakref.WeakSet()
_state = {"enabled": False, "installed": False}
_local = threading.local()


class HostMemoryError(RuntimeError):
    """A collective or an uncounted copy touched host memory where the hardware needs device memory."""


def enabled() -> bool:
    """Is strict mode on in this process?"""
    return _state["enabled"]


def register_host(tensor: torch.Tensor) -> torch.Tensor:
    """Record ``tensor``'s storage as host memory (see [Note: strict device]); returns ``tensor``."""
    if tensor.device.type == "cpu":
        _host_storages.add(tensor.untyped_storage())
    return tensor


def register_device(tensor: torch.Tensor) -> torch.Tensor:
    """Record ``tensor``'s storage as a device buffer the chunk manager owns (chunks, device shards,
    gradient shards, fp32 masters, optimizer moments); returns ``tensor``."""
    _device_storages.add(tensor.untyped_storage())
    return tensor


def is_managed_device(tensor: torch.Tensor) -> bool:
    """``tensor`` is (a view of) a device buffer the chunk manager owns (:func:`register_device`)."""
    return tensor.untyped_storage() in _device_storages


def is_host(tensor: torch.Tensor) -> bool:
    """``tensor`` lives in host memory: it is (a view of) a buffer registered by :func:`register_host`
    (see [Note: strict device]). Never true of a CUDA tensor."""
    if tensor.device.type != "cpu":
        return False
    return tensor.untyped_storage() in _host_storages


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host buffer of ``numel`` elements of ``dtype``, pinned when ``pin`` (CUDA:
    asynchronous copies need page-locked memory), registered as host memory."""
    return register_host(torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin))


def to_host(tensor: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """A new host copy of ``tensor`` (a device->host copy; always a copy, also on the simulated device),
    registered as host memory. On CUDA with ``non_blocking`` the copy lands in pinned memory and is
    complete only after the current stream is synchronised (or an event recorded after it waited)."""
    pin = non_blocking and tensor.is_cuda
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    register_host(out)
    with host_copies():
        out.copy_(tensor, non_blocking=pin)
    return out


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` in device memory on ``device``: itself when it already is; else a host->device copy
    (always a copy on the simulated device, where ``.to("cpu")`` of a host buffer would alias it)."""
    if not is_host(tensor) and tensor.device == torch.device(device):
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    with host_copies():
        out.copy_(tensor, non_blocking=True)
    return out


def host_read(tensor: torch.Tensor) -> torch.Tensor:
    """Read ``tensor`` on the host: the one sanctioned host sync of a training step.

    On CUDA the copy is issued non-blocking into pinned memory and ordered with an event recorded after
    it on the current stream; the host waits for that event only (not for other streams). Elsewhere a
    plain host copy. Returns the host tensor (registered as host memory).
    """
    if not tensor.is_cuda:
        return to_host(tensor)
    out = to_host(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return out


@contextlib.contextmanager
def host_copies():
    """Sanction host<->device ``copy_`` calls inside (the chunk manager's counted copy paths)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _describe(tensor: torch.Tensor) -> str:
    return f"tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype}"


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def _check_collective(name: str, args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        for tensor in _tensors(value):
            if is_host(tensor):
                raise HostMemoryError(
                    f"torch.distributed.{name} over a host-memory {_describe(tensor)}: NCCL accepts device "
                    f"memory only (strict device simulation, {STRICT_ENV}=1). Move the tensor to the compute "
                    "device before the collective and copy the result to the host after it")


def _wrap_collective(name: str, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        if _state["enabled"]:
            _check_collective(name, args, kwargs)
        return original(*args, **kwargs)

    collective._hf_elixir_original = original
    return collective


def _check_copy(dst: torch.Tensor, src) -> None:
    if not isinstance(src, torch.Tensor) or getattr(_local, "depth", 0):
        return
    dst_host, src_host = is_host(dst), is_host(src)
    if (dst_host and is_managed_device(src)) or (src_host and is_managed_device(dst)):
        direction = "device->host" if dst_host else "host->device"
        raise HostMemoryError(
            f"a {direction} copy_ of a {_describe(src)} outside the chunk manager's copy paths (strict device "
            f"simulation, {STRICT_ENV}=1): every host<->device copy goes through the manager, where it is "
            "counted; wrap a new copy path in hf_elixir.chunk.strict.host_copies() and count its bytes")


def _install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _wrap_collective(name, original))
    original_copy = torch.Tensor.copy_

    @functools.wraps(original_copy)
    def copy_(self, src, non_blocking=False):
        if _state["enabled"]:
            _check_copy(self, src)
        return original_copy(self, src, non_blocking)

    torch.Tensor.copy_ = copy_


def enable() -> None:
    """Turn strict mode on in this process (installs the checks once)."""
    _install()
    _state["enabled"] = True


def disable() -> None:
    """Turn strict mode off (the wrappers stay installed and pass through)."""
    _state["enabled"] = False


if os.environ.get(STRICT_ENV, "0") == "1":
    enable()
