"""Measured hardware profile: memory sizes, copy bandwidths, collective bandwidths, optimizer speed.

Nothing here is a constant: bandwidths and throughputs are timed on this machine the first time and
cached in a JSON file (``$HF_ELIXIR_CACHE_DIR/hardware.json``, default ``~/.cache/hf_elixir``) keyed by
``hostname|device name``. Memory sizes are re-read on every call (they change between runs).

On a machine without CUDA the "device" is the CPU: the chunk manager then keeps a simulated device pool
whose onloads/offloads are ``memcpy``s between two host buffers, so that is what the probe times.

Source: docs/design/rules.md (*Measured, never hard-coded*); Elixir (arXiv 2212.05339) section 5.2 measures the
same quantities before searching.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch

from hf_elixir.profiler._device import nvml_handle, select_compute_device
from hf_elixir.profiler._disk_probe import DiskRates, measure_disk
from hf_elixir.profiler._disk_probe import cache_key as disk_cache_key

__all__ = ["HardwareProfile", "probe_disk", "probe_hardware", "default_cache_path"]

logger = logging.getLogger(__name__)

#: how the Adam rates were timed; cached entries timed otherwise are measured again
_ADAM_IMPL = "fused"

_MEASURED_FIELDS = (
    "h2d_bytes_per_s", "d2h_bytes_per_s", "allgather_bytes_per_s", "reduce_scatter_bytes_per_s",
    "host_adam_numel_per_s", "device_adam_numel_per_s", "device_flops_per_s", "device_fp32_flops_per_s",
)
#: what a runtime probe times (:class:`~hf_elixir.profiler._runtime_probe.RuntimeProbe`)
_RUNTIME_FIELDS = ("hook_event_s", "onload_fixed_s", "optim_tensor_s")


@dataclass
class HardwareProfile:
    """What the cost model knows about the machine (per rank).

    Attributes:
        hostname / device_name: cache key parts; ``device_kind`` is ``"cuda"`` or ``"cpu"``.
        device_total_bytes / device_free_bytes: device memory (on CPU: the configured budget, else host
            memory).
        host_total_bytes / host_available_bytes: host memory (psutil).
        h2d_bytes_per_s / d2h_bytes_per_s: copy bandwidth host->device and back (pinned on CUDA; on CPU
            memcpy between two buffers).
        allgather_bytes_per_s / reduce_scatter_bytes_per_s: gathered (output) bytes per second of
            ``all_gather_into_tensor`` / input bytes per second of ``reduce_scatter_tensor`` on the
            current group; ``None`` when no process group was initialised.
        allreduce_bytes_per_s: bytes of the reduced tensor per second of ``all_reduce`` on the current
            group (what replicated chunks' gradients cost, DDP-style); ``None`` without a group or in a
            profile cached before it was measured (:meth:`allreduce_rate` then derives it).
        host_adam_numel_per_s / device_adam_numel_per_s: fp32 elements per second of one AdamW step.
        device_flops_per_s: fp32 (CPU) or bf16 (CUDA) matmul throughput, to turn FLOPs into seconds.
        device_fp32_flops_per_s: fp32 matmul throughput (on CUDA with the TF32 setting at probe time);
            ``None`` in profiles cached before it was measured (:meth:`flops_rate` then uses
            ``device_flops_per_s``).
        hook_event_s: hf_elixir's own cost per module call (forward or backward hooks, gradient copy),
            timed on a small model prepared all-resident against the same model run plainly.
        onload_fixed_s: cost of one chunk onload + eviction beyond the bytes copied (allocation, the
            manager's bookkeeping), timed on the same model prepared with the smallest budget.
        optim_tensor_s: ``ElixirOptimizer.step`` cost per parameter shard view beyond the elements
            updated (the inner optimizer's per-tensor overhead).
        world_size: size of the group the collectives were timed on (1 without a group).
        can_overlap: copies run concurrently with compute (CUDA streams); ``False`` on CPU.
        intra_node_bytes_per_s / inter_node_bytes_per_s: bytes per second one rank sends to the others of its
            node (NVLink, or PCIe without it) / of other nodes (its network card), per direction; ``None``: not
            known (a GPU preset sets both; :meth:`link_rate` then derives them). They price the all-to-all of
            expert parallelism (``hf_elixir/search/_expert_parallel.py``) and collectives of groups other than
            the one timed.
        disk_read_bytes_per_s / disk_write_bytes_per_s / disk_dir: the sequential rates of the disk holding
            ``disk_dir``, timed by ``hf-elixir probe`` (:func:`probe_disk`, [Note: disk probe] in ``_disk_probe.py``)
            and kept in the cache beside the rest; ``None``: never measured on this machine.
    """

    hostname: str = ""
    device_name: str = "cpu"
    device_kind: str = "cpu"
    device_total_bytes: int = 0
    device_free_bytes: int = 0
    host_total_bytes: int = 0
    host_available_bytes: int = 0
    h2d_bytes_per_s: float = 0.0
    d2h_bytes_per_s: float = 0.0
    allgather_bytes_per_s: float | None = None
    reduce_scatter_bytes_per_s: float | None = None
    allreduce_bytes_per_s: float | None = None
    host_adam_numel_per_s: float = 0.0
    device_adam_numel_per_s: float = 0.0
    device_flops_per_s: float = 0.0
    device_fp32_flops_per_s: float | None = None
    hook_event_s: float = 0.0
    onload_fixed_s: float = 0.0
    optim_tensor_s: float = 0.0
    world_size: int = 1
    can_overlap: bool = False
    intra_node_bytes_per_s: float | None = None
    inter_node_bytes_per_s: float | None = None
    disk_read_bytes_per_s: float | None = None
    disk_write_bytes_per_s: float | None = None
    disk_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def allreduce_rate(self) -> float | None:
        """All-reduce bytes per second: measured, else a reduce-scatter followed by an all-gather of the
        same tensor (``1 / (1 / reduce_scatter + 1 / all_gather)``, how ring all-reduce works), else
        ``None`` (no collective was timed)."""
        if self.allreduce_bytes_per_s:
            return self.allreduce_bytes_per_s
        if self.reduce_scatter_bytes_per_s and self.allgather_bytes_per_s:
            return 1.0 / (1.0 / self.reduce_scatter_bytes_per_s + 1.0 / self.allgather_bytes_per_s)
        return None

    def link_rate(self, across_nodes: bool) -> float:
        """Bytes per second one rank sends per direction to ranks of its node (``across_nodes=False``) or of
        other nodes: ``intra_node_bytes_per_s`` / ``inter_node_bytes_per_s`` where set; else within a node the
        per-link rate of the timed ring all-gather (``allgather_bytes_per_s * (W - 1) / W``: a ring moves
        ``(W - 1) / W`` of the gathered bytes over each link), or the host<->device rate without one; across nodes
        the lower of that and the host<->device rate (a network card sits behind the host's PCIe)."""
        intra = self.intra_node_bytes_per_s
        if not intra and self.allgather_bytes_per_s and self.world_size > 1:
            intra = self.allgather_bytes_per_s * (self.world_size - 1) / self.world_size
        intra = intra or self.h2d_bytes_per_s or 1e10
        if not across_nodes:
            return intra
        return self.inter_node_bytes_per_s or min(intra, self.h2d_bytes_per_s or intra)

    def flops_rate(self, precision: str) -> float:
        """Matmul FLOPs per second for a step in ``precision`` (``"fp32" | "bf16" | "fp16"``): the fp32 rate
        for fp32 when measured, else ``device_flops_per_s``; 0.0 when nothing was measured."""
        if precision == "fp32" and self.device_fp32_flops_per_s:
            return self.device_fp32_flops_per_s
        return self.device_flops_per_s

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "HardwareProfile":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def default_cache_path() -> Path:
    """``$HF_ELIXIR_CACHE_DIR/hardware.json`` or ``~/.cache/hf_elixir/hardware.json``."""
    root = os.environ.get("HF_ELIXIR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hf_elixir")
    return Path(root) / "hardware.json"


def _best_time(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm up
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _device_memory(device: torch.device, budget_bytes: int | None, host_total: int) -> tuple[str, int, int]:
    """(device name, total bytes, free bytes): pynvml, then torch.cuda.mem_get_info, then the budget."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        try:
            import pynvml

            try:
                pynvml.nvmlInit()
                handle = nvml_handle(pynvml, index)  # by UUID / PCI bus id: NVML ignores CUDA_VISIBLE_DEVICES
                if handle is not None:
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                    return name, int(info.total), int(info.free)
            except pynvml.NVMLError as exc:
                logger.info("pynvml failed (%s); using torch.cuda.mem_get_info", exc)
        except ImportError:
            logger.info("nvidia-ml-py is not installed; using torch.cuda.mem_get_info")
        free, total = torch.cuda.mem_get_info(index)
        return name, int(total), int(free)
    total = budget_bytes if budget_bytes is not None else host_total
    return "cpu", int(total), int(total)


def _measure(device: torch.device, process_group: Any, size_bytes: int, repeats: int,
             runtime_probe: Callable[..., dict[str, float]] | None) -> dict[str, Any]:
    is_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    numel = max(1, size_bytes // 4)
    host = torch.empty(numel, dtype=torch.float32, pin_memory=is_cuda)
    dev = torch.empty(numel, dtype=torch.float32, device=device)
    host.fill_(1.0)
    out: dict[str, Any] = {}
    out["h2d_bytes_per_s"] = numel * 4 / _best_time(lambda: dev.copy_(host, non_blocking=is_cuda), repeats, sync)
    out["d2h_bytes_per_s"] = numel * 4 / _best_time(lambda: host.copy_(dev, non_blocking=is_cuda), repeats, sync)
    del host, dev

    def adam_rate(on: torch.device) -> float:
        adam_numel = min(numel, 2**22)  # states (64 MiB) exceed caches, as real chunks do
        param = torch.nn.Parameter(torch.zeros(adam_numel, device=on))
        param.grad = torch.ones_like(param)
        # what ElixirOptimizer runs on shards when the user left the implementation to PyTorch:
        # PyTorch's fused AdamW (see [Note: fused shard update] in hf_elixir/optim/_inner.py)
        try:
            opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
        except (RuntimeError, ValueError):  # no fused kernel for this device type
            opt = torch.optim.AdamW([param], lr=1e-3)
        sync_on = torch.cuda.synchronize if on.type == "cuda" else (lambda: None)
        return adam_numel / _best_time(opt.step, repeats, sync_on)

    out["adam_impl"] = _ADAM_IMPL
    out["host_adam_numel_per_s"] = adam_rate(torch.device("cpu"))
    out["device_adam_numel_per_s"] = adam_rate(device) if is_cuda else out["host_adam_numel_per_s"]
    side = 2048 if is_cuda else 256
    dtype = torch.bfloat16 if is_cuda else torch.float32
    a = torch.randn(side, side, device=device, dtype=dtype)
    b = torch.randn(side, side, device=device, dtype=dtype)
    out["device_flops_per_s"] = 2 * side**3 / _best_time(lambda: torch.mm(a, b), repeats, sync)
    if is_cuda:
        a, b = a.float(), b.float()
        out["device_fp32_flops_per_s"] = 2 * side**3 / _best_time(lambda: torch.mm(a, b), repeats, sync)
    else:
        out["device_fp32_flops_per_s"] = out["device_flops_per_s"]
    out.update(_measure_collectives(device, process_group, numel, repeats, sync))
    if runtime_probe is not None:  # [Note: runtime probe] in _runtime_probe.py
        out.update(runtime_probe(device, out, repeats, sync))
    return out


def _measure_collectives(device: torch.device, group: Any, numel: int, repeats: int,
                         sync: Callable[[], None]) -> dict[str, Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {"allgather_bytes_per_s": None, "reduce_scatter_bytes_per_s": None, "allreduce_bytes_per_s": None,
                "world_size": 1}
    world = dist.get_world_size(group)
    coll_device = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    shard = max(1, numel // (4 * world))
    inp = torch.ones(shard, device=coll_device)
    full = torch.empty(shard * world, device=coll_device)
    from hf_elixir._compat import all_gather_single, reduce_scatter_single

    ag = _best_time(lambda: all_gather_single(full, inp, group=group), repeats, sync)
    rs = _best_time(lambda: reduce_scatter_single(inp, full, group=group), repeats, sync)
    ar = _best_time(lambda: dist.all_reduce(full, group=group), repeats, sync)
    # every rank must agree on the numbers (they feed identical plans): take the slowest
    times = torch.tensor([ag, rs, ar], dtype=torch.float64, device=coll_device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    nbytes = full.numel() * 4
    return {"allgather_bytes_per_s": nbytes / float(times[0]), "reduce_scatter_bytes_per_s": nbytes / float(times[1]),
            "allreduce_bytes_per_s": nbytes / float(times[2]), "world_size": world}


def _read_cache(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("ignoring unreadable hardware cache %s (%s)", path, exc)
        return {}


def _write_cache(path: Path, cache: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=2))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not write hardware cache %s (%s)", path, exc)


def cached_rates(device: torch.device, world_size: int, cache_path: str | Path | None = None) -> dict[str, Any] | None:
    """The measured fields :func:`probe_hardware` cached for this machine's ``device`` at ``world_size`` ranks, read
    without measuring anything (no collective; ``None`` where nothing is cached yet)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())
    else:
        name = "cpu"
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    return _read_cache(path).get(f"{socket.gethostname()}|{name}|world{world_size}")


def probe_disk(directory: str | os.PathLike, *, size_bytes: int = 256 * 2**20, repeats: int = 2,
               cache_path: str | Path | None = None) -> DiskRates:
    """Measure the sequential write and read rates of the disk holding ``directory`` ([Note: disk probe] in
    ``_disk_probe.py``) and keep them in the hardware cache (``hostname|disk``), so that every later
    :func:`probe_hardware` on this machine carries them (``disk_read_bytes_per_s`` / ``disk_write_bytes_per_s``).

    Raises:
        ValueError: ``directory`` is not a writable folder, or ``size_bytes`` / ``repeats`` below 1.
    """
    rates = measure_disk(directory, size_bytes=size_bytes, repeats=repeats)
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    cache = _read_cache(path)
    cache[disk_cache_key()] = rates.to_cache()
    _write_cache(path, cache)
    logger.info("disk %s: write %.3g GB/s, read %.3g GB/s (%s reads, %d bytes)", rates.directory,
                rates.write_bytes_per_s / 1e9, rates.read_bytes_per_s / 1e9, rates.method, rates.size_bytes)
    return rates


def probe_hardware(device: str | torch.device | None = None, *, budget_bytes: int | None = None,
                   cache_path: str | Path | None = None, refresh: bool = False, process_group: Any = None,
                   size_bytes: int = 32 * 2**20, repeats: int = 3,
                   runtime_probe: Callable[..., dict[str, float]] | None = None) -> HardwareProfile:
    """Measure (or load from the per-machine cache) this machine's :class:`HardwareProfile`.

    Args:
        device: compute device; default: the one ``hf_elixir.prepare`` would use
            (:func:`hf_elixir.profiler._device.select_compute_device`).
        budget_bytes: device bytes to report on CPU (the simulated pool's budget); ignored on CUDA.
        cache_path: JSON cache file; default :func:`default_cache_path`. Entries are keyed by
            ``hostname|device name|world size``.
        refresh: re-measure even if cached.
        process_group: group to time collectives on (default world group, if initialised).
        size_bytes: buffer size for the copy/collective timings (bytes).
        repeats: timed repetitions (the fastest counts).
        runtime_probe: times hf_elixir's own overheads (``hook_event_s``, ``onload_fixed_s``, ``optim_tensor_s``):
            a :class:`~hf_elixir.profiler._runtime_probe.RuntimeProbe` given ``hf_elixir.prepare`` by its caller
            (``hf_elixir.probe_hardware`` and ``prepare`` pass one). ``None``: those fields come from the cache,
            else stay 0 ([Note: runtime probe] in ``_runtime_probe.py``).

    Returns:
        :class:`HardwareProfile` (memory fields always current; measured fields possibly cached).
    """
    import psutil

    dev = torch.device(device) if device is not None else select_compute_device()
    vm = psutil.virtual_memory()
    name, total, free = _device_memory(dev, budget_bytes, int(vm.total))
    if dev.type != "cuda" and budget_bytes is None:
        free = int(vm.available)
    import torch.distributed as dist

    world = dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
    key = f"{socket.gethostname()}|{name}|world{world}"
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    cache = _read_cache(path)
    measured = cache.get(key) if not refresh else None
    wanted = _MEASURED_FIELDS + (_RUNTIME_FIELDS if runtime_probe is not None else ())
    need = measured is None or any(f not in measured for f in wanted)
    if world > 1 and not need and measured.get("allreduce_bytes_per_s") is None:
        need = True  # cached before all-reduce was timed: time the collectives again
    if not need and measured.get("adam_impl") != _ADAM_IMPL:
        need = True  # Adam rates timed with another implementation than the one the optimizer runs
    if world > 1:
        # collectives must be timed by every rank or none (a rank that skips would hang the others)
        flag_device = dev if dist.get_backend(process_group) != "gloo" else torch.device("cpu")
        flag = torch.tensor([1.0 if need else 0.0], device=flag_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        need = bool(flag.item())
    if need:
        logger.info("measuring hardware (%s)", key)
        measured = _measure(dev, process_group, size_bytes, repeats, runtime_probe)
        cache[key] = measured
        _write_cache(path, cache)
    values = dict(measured)
    values.update(cache.get(disk_cache_key(), {}))  # hf-elixir probe's disk rates, where measured here
    values.update(hostname=socket.gethostname(), device_name=name, device_kind=dev.type,
                  device_total_bytes=total, device_free_bytes=free, host_total_bytes=int(vm.total),
                  host_available_bytes=int(vm.available), can_overlap=dev.type == "cuda")
    return HardwareProfile.from_dict(values)
