"""GPU presets from published spec sheets, for planning on a machine that is not the target.

``hf-elixir plan`` on a laptop or a CPU-only node cannot time the target GPU. Timing the CPU instead
(what it did before) predicted hours per step for a model an A100 runs in seconds, and picked plans
for CPU rates. A preset gives the cost model the target's rates from its data sheet:

* device matmul TFLOP/s per compute dtype (dense, i.e. without 2:4 sparsity; ``fp32`` is the
  non-tensor-core rate, which is what ``torch.mm`` runs in fp32 unless TF32 is allowed);
* HBM bandwidth (bounds the fused AdamW on device shards: 28 bytes per fp32 element, reading
  parameter, gradient and two moments and writing three of them back);
* PCIe host<->device bandwidth per direction (offload / onload of chunks);
* NVLink bandwidth per direction per GPU (all-gather / reduce-scatter between the ranks), or the
  PCIe rate for cards without NVLink;
* memory size.

[Note: peak vs achieved]
Spec sheets give peaks. What a training step reaches is lower: large bf16 GEMMs reach about 70% of
the dense tensor peak, pinned host<->device copies and NCCL ring collectives about 80% of the
link's per-direction rate (the network's too), bandwidth-bound element-wise kernels about 80% of HBM peak. The
``ACHIEVED_FRACTION`` factors below apply these once, here; the flags ``--device-tflops``,
``--h2d-gbps`` and ``--device-adam-gelems`` of ``hf-elixir plan`` replace them with a measured value.

The peers' step-time predictions (`benchmarks/_peers_predicted.py`) read the same table: keep every preset here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Mapping

from hf_elixir.profiler._hardware import HardwareProfile

__all__ = ["ACHIEVED_FRACTION", "DEFAULT_PRESET", "GPU_PRESETS", "INTERNODE_BYTES_PER_S", "GpuPreset",
           "preset_hardware"]

_GB = 10**9
_GIB = 2**30

#: fraction of a spec-sheet peak a training step reaches (see [Note: peak vs achieved])
ACHIEVED_FRACTION: Mapping[str, float] = MappingProxyType({"matmul": 0.7, "hbm": 0.8, "pcie": 0.8, "nvlink": 0.8})

#: bytes one fused AdamW step moves per fp32 element: reads p, g, m, v; writes p, m, v
_ADAM_BYTES_PER_NUMEL = 28


@dataclass(frozen=True, kw_only=True)
class GpuPreset:
    """One GPU's published numbers (peaks; see [Note: peak vs achieved]).

    Attributes:
        name: the ``--gpu`` value (``"a100-80gb"``).
        device_name: the product name as the spec sheet writes it.
        memory_bytes: device memory, bytes.
        tflops: dense peak matmul TFLOP/s by compute dtype (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``).
        hbm_bytes_per_s: device memory bandwidth, bytes/s.
        pcie_bytes_per_s: host<->device bandwidth per direction, bytes/s.
        nvlink_bytes_per_s: GPU<->GPU bandwidth per direction, bytes/s (``None``: no NVLink, peers
            talk over PCIe).
        source: the spec sheet the numbers come from.
    """

    name: str
    device_name: str
    memory_bytes: int
    tflops: Mapping[str, float]
    hbm_bytes_per_s: float
    pcie_bytes_per_s: float
    nvlink_bytes_per_s: float | None
    source: str


GPU_PRESETS: Mapping[str, GpuPreset] = MappingProxyType({p.name: p for p in (
    # NVIDIA A100 Tensor Core GPU data sheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
    # nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), SXM columns: FP32 19.5, TF32 156, BF16/FP16 312
    # TFLOPS (dense; the sheet's 624 is with sparsity); HBM2 1,555 GB/s (40GB), HBM2e 2,039 GB/s (80GB);
    # NVLink 600 GB/s (both directions); PCIe Gen4 64 GB/s (both directions).
    GpuPreset(name="a100-40gb", device_name="NVIDIA A100-SXM4-40GB", memory_bytes=40 * _GIB,
              tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}, hbm_bytes_per_s=1555 * _GB,
              pcie_bytes_per_s=32 * _GB, nvlink_bytes_per_s=300 * _GB, source="NVIDIA A100 data sheet"),
    GpuPreset(name="a100-80gb", device_name="NVIDIA A100-SXM4-80GB", memory_bytes=80 * _GIB,
              tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}, hbm_bytes_per_s=2039 * _GB,
              pcie_bytes_per_s=32 * _GB, nvlink_bytes_per_s=300 * _GB, source="NVIDIA A100 data sheet"),
    # NVIDIA H100 Tensor Core GPU data sheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet),
    # H100 SXM column: FP32 67, TF32 494.5, BF16/FP16 989.5 TFLOPS dense (the sheet's 989/1,979 are with
    # sparsity); 80GB HBM3 at 3.35 TB/s; NVLink 900 GB/s and PCIe Gen5 128 GB/s (both directions).
    GpuPreset(name="h100", device_name="NVIDIA H100 80GB HBM3 (SXM5)", memory_bytes=80 * _GIB,
              tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}, hbm_bytes_per_s=3350 * _GB,
              pcie_bytes_per_s=64 * _GB, nvlink_bytes_per_s=450 * _GB, source="NVIDIA H100 data sheet"),
    # NVIDIA H200 Tensor Core GPU data sheet (nvidia.com/en-us/data-center/h200/), H200 SXM column: same
    # compute as H100 SXM; 141GB HBM3e at 4.8 TB/s; NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions).
    GpuPreset(name="h200", device_name="NVIDIA H200 (SXM)", memory_bytes=141 * _GB,
              tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}, hbm_bytes_per_s=4800 * _GB,
              pcie_bytes_per_s=64 * _GB, nvlink_bytes_per_s=450 * _GB, source="NVIDIA H200 data sheet"),
    # NVIDIA L4 Tensor Core GPU data sheet: FP32 30.3, TF32 60, BF16/FP16 121 TFLOPS dense (242 with
    # sparsity); 24GB GDDR6 at 300 GB/s; PCIe Gen4 x16 64 GB/s (both directions); no NVLink.
    GpuPreset(name="l4", device_name="NVIDIA L4", memory_bytes=24 * _GIB,
              tflops={"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}, hbm_bytes_per_s=300 * _GB,
              pcie_bytes_per_s=32 * _GB, nvlink_bytes_per_s=None, source="NVIDIA L4 data sheet"),
    # NVIDIA Ada Lovelace GPU architecture whitepaper (v2.1), appendix table for GeForce RTX 4090: FP32
    # 82.6 TFLOPS; peak FP16/BF16 tensor TFLOPS with FP32 accumulate 165.2 (dense); 24GB GDDR6X at
    # 1,008 GB/s; PCIe Gen4 x16 (32 GB/s per direction); no NVLink.
    GpuPreset(name="rtx4090", device_name="NVIDIA GeForce RTX 4090", memory_bytes=24 * _GIB,
              tflops={"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}, hbm_bytes_per_s=1008 * _GB,
              pcie_bytes_per_s=32 * _GB, nvlink_bytes_per_s=None, source="NVIDIA Ada Lovelace architecture whitepaper"),
)})

#: bytes/s per direction one GPU sends to other nodes: one 400 Gb/s InfiniBand NDR port per GPU (ConnectX-7, as in
#: NVIDIA's DGX H100 / H200 user guide: eight single-port OSFP 400 Gb/s for the eight GPUs), the same for every
#: preset; ``hf-elixir plan --internode-gbps`` replaces it
INTERNODE_BYTES_PER_S = 50 * _GB

#: the preset ``hf-elixir plan`` uses when this machine has no GPU and ``--gpu`` is not given
DEFAULT_PRESET = "a100-80gb"


def preset_hardware(name: str, base: HardwareProfile, *, world_size: int = 1) -> HardwareProfile:
    """``base`` (host-side rates and host memory measured on this machine) with the device-side rates of
    the preset ``name``, derated to what a step reaches (:data:`ACHIEVED_FRACTION`).

    Args:
        name: a key of :data:`GPU_PRESETS`.
        base: the profile to start from (its host memory, host AdamW rate and hf_elixir's per-event
            overheads are kept).
        world_size: data-parallel ranks; above 1 the collective rates are ring rates over NVLink (or PCIe).

    Returns:
        A new :class:`HardwareProfile` with ``device_kind="cuda"`` and ``can_overlap=True``; its
        ``device_flops_per_s`` is the bf16 rate and ``device_fp32_flops_per_s`` the fp32 one (what
        :meth:`HardwareProfile.flops_rate` picks from by precision, as for a measured GPU).

    Raises:
        ValueError: unknown preset.
    """
    if name not in GPU_PRESETS:
        raise ValueError(f"--gpu {name!r} is not a GPU preset; use one of {', '.join(GPU_PRESETS)}")
    preset = GPU_PRESETS[name]
    frac = ACHIEVED_FRACTION
    pcie = preset.pcie_bytes_per_s * frac["pcie"]
    values: dict = dict(
        device_name=preset.device_name, device_kind="cuda", can_overlap=True,
        device_total_bytes=preset.memory_bytes, device_free_bytes=preset.memory_bytes,
        h2d_bytes_per_s=pcie, d2h_bytes_per_s=pcie,
        device_flops_per_s=preset.tflops["bf16"] * 1e12 * frac["matmul"],
        device_fp32_flops_per_s=preset.tflops["fp32"] * 1e12 * frac["matmul"],
        device_adam_numel_per_s=preset.hbm_bytes_per_s * frac["hbm"] / _ADAM_BYTES_PER_NUMEL,
        world_size=world_size,
    )
    link = (preset.nvlink_bytes_per_s or preset.pcie_bytes_per_s) * frac["nvlink" if preset.nvlink_bytes_per_s else "pcie"]
    values.update(intra_node_bytes_per_s=link, inter_node_bytes_per_s=INTERNODE_BYTES_PER_S * frac["nvlink"])
    if world_size > 1:
        # ring collectives: all-gather / reduce-scatter move (W-1)/W of the full tensor over each link,
        # all-reduce twice that (one reduce-scatter then one all-gather)
        ring = link * world_size / (world_size - 1)
        values.update(allgather_bytes_per_s=ring, reduce_scatter_bytes_per_s=ring, allreduce_bytes_per_s=ring / 2)
    return replace(base, **values)
