"""Device selection against a fake CUDA / NVML layer: ``cuda:LOCAL_RANK`` when the
process set no device, and the NVML handle matched by UUID / PCI bus id so that CUDA_VISIBLE_DEVICES is
honoured. See [Note: device selection] and [Note: NVML handle] in hf_elixir/profiler/_device.py."""

from __future__ import annotations

import sys
import uuid
from types import SimpleNamespace

import pytest
import torch

from hf_elixir import api
from hf_elixir.profiler import _hardware
from hf_elixir.profiler._device import select_compute_device

GIB = 2**30


class FakeMachine:
    """Four physical GPUs (NVML sees all four, by physical index); CUDA sees those in ``visible``."""

    def __init__(self, visible=(0, 1, 2, 3), current=0, pci=True, uuids=True):
        self.physical = [SimpleNamespace(uuid=uuid.UUID(int=1000 + i), bus=0x17 + 0x20 * i, total=(80 + i) * GIB,
                                         free=(10 + i) * GIB) for i in range(4)]
        self.visible, self.current, self.set_calls = list(visible), current, []
        self.pci, self.uuids = pci, uuids

    # -- torch.cuda ---------------------------------------------------------------------------
    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: len(self.visible))
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "set_device", self._set_device)
        monkeypatch.setattr(cuda, "get_device_properties", self._props)
        monkeypatch.setattr(cuda, "get_device_name", lambda i=None: f"Fake GPU {self.visible[i]}")
        monkeypatch.setattr(cuda, "mem_get_info", lambda i=None: (self._gpu(i).free - GIB, self._gpu(i).total))
        monkeypatch.setitem(sys.modules, "pynvml", self._pynvml())
        return self

    def _gpu(self, cuda_index):
        return self.physical[self.visible[cuda_index]]

    def _set_device(self, index):
        self.set_calls.append(index)
        self.current = index

    def _props(self, index):
        gpu = self._gpu(index)
        props = SimpleNamespace(name="Fake", total_memory=gpu.total)
        if self.uuids:
            props.uuid = gpu.uuid  # torch prints it without NVML's "GPU-" prefix
        if self.pci:
            props.pci_bus_id, props.pci_device_id, props.pci_domain_id = gpu.bus, 0, 0
        return props

    # -- pynvml ---------------------------------------------------------------------------------
    def _pynvml(self):
        class NVMLError(Exception):
            pass

        def by_uuid(text):
            for i, gpu in enumerate(self.physical):
                if text == f"GPU-{gpu.uuid}":
                    return ("handle", i)
            raise NVMLError("not found")

        def by_pci(text):
            for i, gpu in enumerate(self.physical):
                if text == f"00000000:{gpu.bus:02X}:00.0":
                    return ("handle", i)
            raise NVMLError("not found")

        def memory(handle):
            gpu = self.physical[handle[1]]
            return SimpleNamespace(total=gpu.total, free=gpu.free, used=gpu.total - gpu.free)

        return SimpleNamespace(NVMLError=NVMLError, nvmlInit=lambda: None,
                               nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),  # NVML's (physical) numbering
                               nvmlDeviceGetHandleByUUID=by_uuid, nvmlDeviceGetHandleByPciBusId=by_pci,
                               nvmlDeviceGetMemoryInfo=memory)


def test_no_device_set_uses_local_rank_and_makes_it_current(monkeypatch):
    machine = FakeMachine().install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert api._compute_device() == torch.device("cuda", 2)  # what prepare computes on
    assert machine.set_calls == [2] and machine.current == 2


def test_a_device_the_process_set_is_kept(monkeypatch):
    machine = FakeMachine(current=3).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert select_compute_device() == torch.device("cuda", 3)
    assert machine.set_calls == []


def test_local_rank_zero_or_unset_is_cuda_0(monkeypatch):
    machine = FakeMachine().install(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert select_compute_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert select_compute_device() == torch.device("cuda", 0)
    assert machine.set_calls == []


def test_one_visible_device_per_process(monkeypatch):
    FakeMachine(visible=(3,)).install(monkeypatch)  # CUDA_VISIBLE_DEVICES=3 for the process with LOCAL_RANK 3
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert select_compute_device() == torch.device("cuda", 0)


@pytest.mark.parametrize("value", ["4", "-1", "two"])
def test_bad_local_rank_is_named(monkeypatch, value):
    FakeMachine().install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", value)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        select_compute_device()


def test_no_cuda_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert select_compute_device() == torch.device("cpu")


@pytest.mark.parametrize("match", ["uuid", "pci"])
def test_nvml_reads_the_visible_device_not_the_physical_index(monkeypatch, match):
    # CUDA_VISIBLE_DEVICES=2,3: CUDA's device 0 is the machine's GPU 2, NVML's index 0 another card
    FakeMachine(visible=(2, 3), uuids=match == "uuid", pci=match == "pci").install(monkeypatch)
    for cuda_index, physical in ((0, 2), (1, 3)):
        name, total, free = _hardware._device_memory(torch.device("cuda", cuda_index), None, 64 * GIB)
        assert (total, free) == ((80 + physical) * GIB, (10 + physical) * GIB), (cuda_index, total, free)


def test_nvml_without_a_match_falls_back_to_cuda_mem_get_info(monkeypatch):
    FakeMachine(visible=(1,), uuids=False, pci=False).install(monkeypatch)
    _, total, free = _hardware._device_memory(torch.device("cuda", 0), None, 64 * GIB)
    assert (total, free) == (81 * GIB, 10 * GIB)  # torch.cuda.mem_get_info of GPU 1, never NVML's GPU 0


def test_probe_default_device_is_the_selected_one(monkeypatch):
    FakeMachine().install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    seen = {}

    def stop(device, *args):
        seen["device"] = device
        raise RuntimeError("stop after device selection")

    monkeypatch.setattr(_hardware, "_device_memory", stop)
    with pytest.raises(RuntimeError, match="stop"):
        _hardware.probe_hardware()
    assert seen["device"] == torch.device("cuda", 1)
