"""Shared plumbing for the kernel dispatchers: Triton availability, backend choice, scalar operands.

[Note: dispatch rule]
Every public op in this package has a PyTorch reference and a Triton kernel. The dispatcher runs
the Triton kernel when the tensors live on a CUDA device, and the reference everywhere else. A
caller may ask for the kernel on CPU tensors with ``force_triton=True``; that only works when
``TRITON_INTERPRET=1`` was set before this package was imported (Triton reads it when the
``@triton.jit`` decorators run), which is what the tests do.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is a Linux-only dependency; the references work without it.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without Triton
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "use_triton", "scalar_operand", "check_1d_contiguous"]


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor, force_triton: bool) -> bool:
    """Decide whether the Triton kernel (True) or the PyTorch reference (False) runs.

    Args:
        tensor: the op's main tensor; its device decides.
        force_triton: run the kernel even on CPU tensors (needs ``TRITON_INTERPRET=1``).

    Raises:
        RuntimeError: ``force_triton=True`` but Triton is missing, or the tensor is on the CPU and
            Triton's interpreter was not switched on before import.
    """
    if force_triton:
        if not HAS_TRITON:
            raise RuntimeError("force_triton=True but triton is not importable; install triton or drop force_triton")
        if tensor.device.type == "cpu" and not _interpreter_on():
            raise RuntimeError(
                "force_triton=True on CPU tensors needs TRITON_INTERPRET=1 set before triton_kernels is "
                "imported (the @triton.jit decorators read it); set it or pass CUDA tensors"
            )
        return True
    return HAS_TRITON and tensor.is_cuda


def scalar_operand(value, name: str, device: torch.device) -> tuple[float, torch.Tensor | None]:
    """Split a scalar operand into (python value, device tensor) for a kernel launch.

    A python number is passed to the kernel by value; a 0-d or 1-element tensor is passed by
    pointer so that its value never has to reach the host (no device sync).

    Returns:
        ``(float(value), None)`` for a number, ``(1.0, fp32 tensor of 1 element on device)`` for a tensor.

    Raises:
        TypeError: ``value`` is neither a number nor a tensor.
        ValueError: the tensor has more than one element.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
        t = value.reshape(1)
        if t.dtype != torch.float32 or t.device != device:
            t = t.to(device=device, dtype=torch.float32)
        return 1.0, t
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), None
    raise TypeError(f"{name} must be a float or a 1-element tensor, got {type(value).__name__}")


def check_1d_contiguous(name: str, tensor: torch.Tensor, numel: int | None = None, dtypes=None) -> None:
    """Raise ValueError/TypeError unless ``tensor`` is a contiguous 1-D tensor of the given numel/dtypes."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D tensor, got shape {tuple(tensor.shape)} "
            f"(contiguous={tensor.is_contiguous()}); pass a flat chunk shard"
        )
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements, expected {numel} (same as param)")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {tensor.dtype}, expected one of {[str(d) for d in dtypes]}")
