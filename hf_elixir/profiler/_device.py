"""Which CUDA device this process computes on, and its NVML handle.

[Note: device selection]
``torchrun`` and ``accelerate launch`` start one process per GPU and tell each its ``LOCAL_RANK``; a
training script is expected to call ``torch.cuda.set_device(LOCAL_RANK)`` (Accelerate does), but many
do not, and every such process would then compute on ``cuda:0``. PyTorch keeps no record of whether a
device was chosen, so the rule is:

- no CUDA: the CPU;
- the current device is not ``cuda:0``: the process chose it (``torch.cuda.set_device`` or the
  ``torch.cuda.device`` context); keep it;
- otherwise ``cuda:LOCAL_RANK`` (``cuda:0`` without ``LOCAL_RANK``), made the current device so that
  NCCL and later ``.cuda()`` calls agree with it. With one visible device (``CUDA_VISIBLE_DEVICES``
  set per process) that is ``cuda:0`` whatever ``LOCAL_RANK`` says.

[Note: NVML handle]
NVML numbers every GPU of the machine and ignores ``CUDA_VISIBLE_DEVICES``; CUDA numbers only the
visible ones. ``nvmlDeviceGetHandleByIndex(cuda_index)`` therefore reads another GPU whenever
``CUDA_VISIBLE_DEVICES`` is set (``2,3``: CUDA's 0 is NVML's 2). The handle is found by the device's
UUID (``GPU-...``, ``MIG-...``), else by its PCI bus id, both from ``torch.cuda.get_device_properties``.

Source: PyTorch ``torch.cuda`` (``set_device``, ``get_device_properties``: ``uuid``, ``pci_bus_id``);
NVML API (``nvmlDeviceGetHandleByUUID``, ``nvmlDeviceGetHandleByPciBusId``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

__all__ = ["nvml_handle", "select_compute_device"]

logger = logging.getLogger(__name__)


def select_compute_device() -> torch.device:
    """The device ``hf_elixir.prepare`` computes on; see [Note: device selection].

    Returns:
        ``torch.device("cuda", index)`` or ``torch.device("cpu")``.

    Raises:
        ValueError: ``LOCAL_RANK`` is not an integer, or names a device beyond the visible ones.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    current = torch.cuda.current_device()
    if current != 0:
        return torch.device("cuda", current)
    index = _local_rank_device()
    if index != current:
        logger.info("no CUDA device set by this process: using cuda:%d (LOCAL_RANK) and making it current", index)
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _local_rank_device() -> int:
    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        return 0
    try:
        local_rank = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r} is not an integer; the launcher (torchrun, accelerate launch) sets it "
                         "to the process's index on its node") from None
    count = torch.cuda.device_count()
    if count == 1:  # CUDA_VISIBLE_DEVICES gives each process its own GPU
        return 0
    if not 0 <= local_rank < count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this process sees {count} CUDA devices; start at most {count} processes "
            "per node, or give each process its GPU with CUDA_VISIBLE_DEVICES, or call "
            "torch.cuda.set_device(...) before hf_elixir.prepare")
    return local_rank


def nvml_handle(pynvml: Any, index: int) -> Any | None:
    """NVML handle of CUDA device ``index`` (CUDA's numbering); see [Note: NVML handle].

    Args:
        pynvml: the ``pynvml`` module (from ``nvidia-ml-py``), already ``nvmlInit``-ed.
        index: CUDA device index, as ``torch.cuda`` numbers it.

    Returns:
        the handle, or ``None`` when neither the UUID nor the PCI bus id is known to NVML (the
        caller then reads memory through ``torch.cuda.mem_get_info``).
    """
    props = torch.cuda.get_device_properties(index)
    for uuid in _uuid_candidates(getattr(props, "uuid", None)):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            continue
    bus_id = _pci_bus_id(props)
    if bus_id is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except pynvml.NVMLError:
            pass
    logger.info("no NVML device matches CUDA device %d by UUID or PCI bus id", index)
    return None


def _uuid_candidates(uuid: Any) -> list[str]:
    """torch prints a device UUID without NVML's ``GPU-`` / ``MIG-`` prefix."""
    if uuid is None:
        return []
    text = str(uuid)
    if text.startswith(("GPU-", "MIG-")):
        return [text]
    return [f"GPU-{text}", f"MIG-{text}"]


def _pci_bus_id(props: Any) -> str | None:
    """``domain:bus:device.0`` in NVML's form (``00000000:3B:00.0``), or None if torch lacks the fields."""
    bus, device = getattr(props, "pci_bus_id", None), getattr(props, "pci_device_id", None)
    if bus is None or device is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{device:02X}.0"
