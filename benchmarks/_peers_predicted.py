"""Predicted step time of the peers, from what each one moves *by construction*.

Each peer is priced on the same :class:`~hf_elixir.profiler.HardwareProfile` (a GPU preset) and the
same :class:`~hf_elixir.profiler.StepProfile` (FLOPs counted on meta) as hf_elixir's searched plan. The
step is cut into *units*: one per outermost repeated block (a transformer layer, the granularity every
peer wraps or hooks), plus the ``root`` (embeddings, final norm, LM head). Per rank, ``W`` ranks, ``n`` a
unit's parameter numel, ``b`` the compute dtype's bytes (2 for bf16/fp16):

* ``fsdp2_offload``: FSDP2 ``fully_shard`` per block + root, ``CPUOffloadPolicy`` and a
  ``MixedPrecisionPolicy(param_dtype=bf16)``. fp32 parameter shards, fp32 gradient shards and the AdamW
  states live on the host. Each unit's use (forward, and backward again: ``reshard_after_forward``)
  copies its fp32 shard to the device (``4 n / W`` H2D) and all-gathers it in ``b`` (``b n``, ``W > 1``);
  after its backward the gradient is reduce-scattered in ``b`` (``b n``) and the fp32 gradient shard
  copied to the host (``4 n / W`` D2H). The root is gathered once (FSDP2 keeps the root unsharded
  between forward and backward). AdamW runs on the host after backward over ``P / W`` elements; the
  updated fp32 shards stay on the host.
* ``ds_zero3_offload``: DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on the CPU.
  The ``b`` parameter partitions live on the host: each use copies ``b n / W`` H2D and all-gathers
  ``b n``; gradients are reduce-scattered (``b n``) and the ``b`` partition copied to the host
  (``b n / W`` D2H; the fp32 up-cast runs on the host); DeepSpeedCPUAdam updates the fp32 master and
  writes the ``b`` partition on the host. The root is fetched in forward and in backward like any
  submodule.
* ``zero_offload``: ZeRO-Offload (ZeRO-2 + CPU Adam, Ren et al. 2021): ``b`` parameters whole and
  resident on every GPU (nothing fetched); gradients reduce-scattered (``b n``, ``W > 1``) and the
  ``b`` partition copied to the host (``b n / W``) during backward; CPU Adam over ``P / W`` elements
  after backward, then the updated ``b`` partition copied back (``b P / W`` H2D) and, with ``W > 1``,
  all-gathered (``b P``) before the next forward. No delayed parameter update (off by default).

Overlap, as each peer's runtime does it: the fetch (H2D then all-gather, on one side stream) of the
next unit is issued when the current unit's compute starts (one unit of prefetch: FSDP2's implicit
prefetch, DeepSpeed's prefetch bucket); gradient reduce + D2H run on their own stream and overlap the
backward of the units before them; the optimizer step and ZeRO-Offload's parameter copy back do not
overlap anything. Per-module hook costs of the peers are not charged (this favours the peers).

Device memory (per rank) decides activation checkpointing as hf_elixir's search does: no
checkpointing if the activations fit next to the peer's model data, else checkpointing (recompute
adds each block's forward FLOPs to its backward), else the peer does not fit (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_elixir.profiler import HardwareProfile, StepProfile
from hf_elixir.search._cost import DTYPE_BYTES, activation_bytes

__all__ = ["PEER_MODELS", "PeerPrediction", "Unit", "predict_peer", "units_of"]

PEER_MODELS = ("fsdp2_offload", "ds_zero3_offload", "zero_offload")
ZERO2_BUCKET_NUMEL = 500_000_000  # DeepSpeed reduce_bucket_size default (elements), two buckets live


@dataclass
class Unit:
    """One wrapped module: parameter numel and compute seconds (forward; backward without recompute)."""

    name: str
    numel: int
    fwd_s: float = 0.0
    bwd_s: float = 0.0


@dataclass
class PeerPrediction:
    """Seconds and bytes per rank for one step of one peer."""

    peer: str
    step_s: float
    forward_backward_s: float
    optimizer_s: float
    compute_s: float
    activation_checkpointing: bool
    device_peak_bytes: int
    bytes: dict[str, int] = field(default_factory=dict)  # h2d, d2h, allgather, reduce_scatter


def _outer_blocks(profile: StepProfile) -> list[str]:
    blocks = sorted(profile.block_activation_bytes)
    return [b for b in blocks if not any(b != o and b.startswith(o + ".") for o in blocks)]


def units_of(profile: StepProfile, hardware: HardwareProfile, precision: str) -> tuple[Unit, list[Unit]]:
    """``(root, blocks)``: the step's units in forward order, with FLOPs priced at the device's rate."""
    outer = _outer_blocks(profile)
    rate = hardware.flops_rate(precision)

    def unit_name(module: str) -> str:
        return next((b for b in outer if module == b or module.startswith(b + ".")), "root")

    units: dict[str, Unit] = {"root": Unit("root", 0)}
    owner: dict[int, str] = {}
    for e in profile.events:
        name = unit_name(e.module)
        unit = units.setdefault(name, Unit(name, 0))
        seconds = e.flops / rate
        if e.phase == "fwd":
            unit.fwd_s += seconds
        else:
            unit.bwd_s += seconds
        for i in e.params:
            owner.setdefault(i, name)
    for i, numel in enumerate(profile.param_numels):
        units[owner.get(i, "root")].numel += numel
    root = units.pop("root")
    return root, list(units.values())


def _device_bytes(peer: str, root: Unit, blocks: list[Unit], ws: int, b: int) -> int:
    """Model data a peer holds on one device at its peak (two units in flight, one gradient unit)."""
    total = root.numel + sum(u.numel for u in blocks)
    big = max((u.numel for u in blocks), default=0)
    if peer == "fsdp2_offload":
        return root.numel * (b + 4) + 2 * big * (b + 4 // ws) + 2 * big * (b + 4 // ws)
    if peer == "ds_zero3_offload":
        return 2 * max(big, root.numel) * (b + b // ws) + 2 * big * b
    return total * b + 2 * min(total, ZERO2_BUCKET_NUMEL) * b  # zero_offload: params + gradient buckets


def _flows(peer: str, n: int, ws: int, b: int) -> tuple[dict, dict]:
    """Bytes of one unit's fetch and of its gradient's way out: ({h2d, allgather}, {reduce_scatter, d2h})."""
    if peer == "zero_offload":
        fetch = {"h2d": 0, "allgather": 0}
    else:
        fetch = {"h2d": (4 if peer == "fsdp2_offload" else b) * n // ws, "allgather": b * n if ws > 1 else 0}
    grad = {"reduce_scatter": b * n if ws > 1 else 0, "d2h": (4 if peer == "fsdp2_offload" else b) * n // ws}
    return fetch, grad


def _seconds(flow: dict, hw: HardwareProfile) -> float:
    rates = {"h2d": hw.h2d_bytes_per_s, "d2h": hw.d2h_bytes_per_s, "allgather": hw.allgather_bytes_per_s,
             "reduce_scatter": hw.reduce_scatter_bytes_per_s}
    return sum(v / rates[k] for k, v in flow.items() if v)


def _pipeline(fetch_s: list[float], compute_s: list[float], grad_s: list[float]) -> float:
    """One pass over units: unit ``i``'s fetch is issued when unit ``i - 1``'s compute starts (one unit of
    prefetch, one fetch stream); its gradient leaves on the reduce stream after its compute."""
    t_fetch = t_compute = t_grad = 0.0
    prev_start = 0.0
    for f, c, g in zip(fetch_s, compute_s, grad_s):
        t_fetch = max(t_fetch, prev_start) + f
        prev_start = max(t_compute, t_fetch)
        t_compute = prev_start + c
        if g:
            t_grad = max(t_grad, t_compute) + g
    return max(t_compute, t_grad)


def predict_peer(peer: str, profile: StepProfile, hardware: HardwareProfile, *, precision: str = "bf16",
                 world_size: int = 1, device_bytes: int | None = None,
                 host_adam_numel_per_s: float | None = None) -> PeerPrediction | None:
    """Predicted step of ``peer`` (one of :data:`PEER_MODELS`) per rank; ``None`` if it does not fit
    ``device_bytes`` (default: the hardware's device memory) even with activation checkpointing.

    Raises:
        ValueError: unknown peer or precision, or ``world_size < 1``.
    """
    if peer not in PEER_MODELS:
        raise ValueError(f"peer={peer!r} is not one of {PEER_MODELS}")
    if precision not in DTYPE_BYTES:
        raise ValueError(f"precision={precision!r} must be one of {tuple(DTYPE_BYTES)}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ws, b, hw = world_size, DTYPE_BYTES[precision], hardware
    root, blocks = units_of(profile, hw, precision)
    total = root.numel + sum(u.numel for u in blocks)
    limit = device_bytes if device_bytes is not None else hw.device_total_bytes
    model_bytes = _device_bytes(peer, root, blocks, ws, b)
    ckpt = None
    for option in (False, True):
        if limit is None or model_bytes + activation_bytes(profile, precision, option) <= limit:
            ckpt = option
            break
    if ckpt is None:
        return None
    moved = {"h2d": 0, "d2h": 0, "allgather": 0, "reduce_scatter": 0}

    def count(flow: dict) -> float:
        for k, v in flow.items():
            moved[k] += v
        return _seconds(flow, hw)

    root_fetch, root_grad = _flows(peer, root.numel, ws, b)
    root_fetch_s = count(root_fetch)
    if peer == "ds_zero3_offload":  # the root's modules are fetched again in backward
        root_fetch_s += count(root_fetch)
    fwd_fetch = [count(_flows(peer, u.numel, ws, b)[0]) for u in blocks]
    bwd_fetch = [count(_flows(peer, u.numel, ws, b)[0]) for u in reversed(blocks)]
    bwd_grad = [count(_flows(peer, u.numel, ws, b)[1]) for u in reversed(blocks)]
    root_grad_s = count(root_grad)
    fwd = [u.fwd_s for u in blocks]
    bwd = [u.bwd_s + (u.fwd_s if ckpt else 0.0) for u in reversed(blocks)]
    fwd_bwd = (root_fetch_s + root.fwd_s + _pipeline(fwd_fetch, fwd, [0.0] * len(fwd))
               + _pipeline(bwd_fetch, bwd, bwd_grad) + root.bwd_s + root_grad_s)
    adam = host_adam_numel_per_s or hw.host_adam_numel_per_s or 1e9
    optim_s = (total // ws) / adam
    if peer == "zero_offload":  # updated b partition back, then all-gathered into the resident copy
        optim_s += count({"h2d": b * total // ws, "allgather": b * total if ws > 1 else 0})
    return PeerPrediction(
        peer=peer, step_s=fwd_bwd + optim_s, forward_backward_s=fwd_bwd, optimizer_s=optim_s,
        compute_s=sum(fwd) + sum(bwd) + root.fwd_s + root.bwd_s, activation_checkpointing=ckpt,
        device_peak_bytes=model_bytes + activation_bytes(profile, precision, ckpt), bytes=moved)
