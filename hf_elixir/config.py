"""User-facing configuration: :class:`ElixirConfig` and its small policy dataclasses.

Every field is validated in ``__post_init__``; a bad value raises ``ValueError``/``TypeError``
naming the field, the value and the fix (docs/design/rules.md, *Errors and layers*).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["ElixirConfig", "EXPORT_DTYPES", "LossScalePolicy", "PRECISIONS"]

PRECISIONS = ("fp32", "bf16", "fp16")
EXPORT_DTYPES = ("fp32", "compute")
#: ``ElixirConfig.frozen_placement`` values ([Note: whole frozen chunks] in ``hf_elixir/chunk/_frozen_whole.py``)
FROZEN_PLACEMENTS = ("auto", "sharded", "whole")
_SEARCH_MODES = ("off", "auto")
_DEFAULT_PLACEMENTS = ("auto", "sharded", "replicated")


_COMPILE_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")


def _check_compile(setting: Any) -> None:
    """``ElixirConfig.compile``: False/None, True, a ``torch.compile`` backend name or a dict of its arguments."""
    if setting is None or isinstance(setting, (bool, str)):
        return
    if not isinstance(setting, Mapping):
        raise TypeError(f"ElixirConfig.compile={setting!r} must be False, True, a torch.compile backend name "
                        "('inductor', 'aot_eager', 'eager') or a dict of torch.compile arguments")
    unknown = sorted(set(setting) - set(_COMPILE_KEYS))
    if unknown:
        raise ValueError(f"ElixirConfig.compile has unknown torch.compile arguments {unknown}; use {_COMPILE_KEYS}")


def _check_type(name: str, value: Any, types: tuple[type, ...], fix: str) -> None:
    if isinstance(value, bool) and bool not in types:
        raise TypeError(f"ElixirConfig.{name}={value!r} is a bool; {fix}")
    if not isinstance(value, types):
        raise TypeError(f"ElixirConfig.{name}={value!r} has type {type(value).__name__}; {fix}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``"40GiB"`` -> 42949672960; accepts B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB and K/M/G/T
    (powers of 2), plain integers and ``1e9``-style numbers (YAML reads ``1e9`` as a string).

    Raises:
        ValueError: unparseable text (naming it and the accepted forms).
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 40GiB, 512GB, 1.5TiB or 1073741824")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1)
    return f" Did you mean {match[0]!r}?" if match else ""


@dataclass(frozen=True, kw_only=True)
class LossScalePolicy:
    """Dynamic loss scaling for ``precision="fp16"`` (Micikevicius et al., 2018; same rule as
    ``torch.amp.GradScaler``).

    Args:
        init_scale: first loss scale (float, > 0). Default 2**16.
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiply the scale by this on overflow (0 < f < 1).
        growth_interval: clean steps between growths (int >= 1).
        min_scale: smallest scale; reaching it ``max_consecutive_min_scale_overflows`` times in a
            row stops training with ``FloatingPointError`` instead of silently not learning.
        max_consecutive_min_scale_overflows: see ``min_scale`` (int >= 1).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_consecutive_min_scale_overflows: int = 10

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"LossScalePolicy.{name}={value!r} must be a number")
            if not math.isfinite(value):
                raise ValueError(f"LossScalePolicy.{name}={value!r} must be a finite number")
        if self.init_scale <= 0 or self.min_scale <= 0:
            raise ValueError(
                f"LossScalePolicy.init_scale={self.init_scale} and min_scale={self.min_scale} must be > 0"
            )
        if self.min_scale > self.init_scale:
            raise ValueError(f"LossScalePolicy.min_scale={self.min_scale} is above init_scale={self.init_scale}; "
                             "use min_scale <= init_scale")
        if self.growth_factor <= 1.0:
            raise ValueError(f"LossScalePolicy.growth_factor={self.growth_factor} must be > 1, e.g. 2.0")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"LossScalePolicy.backoff_factor={self.backoff_factor} must be in (0, 1), e.g. 0.5")
        for name in ("growth_interval", "max_consecutive_min_scale_overflows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LossScalePolicy.{name}={value!r} must be an int >= 1")
            if value < 1:
                raise ValueError(f"LossScalePolicy.{name}={value!r} must be an int >= 1")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "LossScalePolicy":
        """Build from a mapping (the ``loss_scale:`` section of a YAML config).

        Raises:
            TypeError: ``values`` is not a mapping.
            ValueError: an unknown key, naming the closest valid one.
        """
        if not isinstance(values, Mapping):
            raise TypeError(f"ElixirConfig.loss_scale={values!r} must be a mapping of LossScalePolicy fields")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in valid:
                raise ValueError(f"unknown LossScalePolicy key {key!r}.{_closest(str(key), valid)} Valid keys: {valid}")
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class ElixirConfig:
    """How :func:`hf_elixir.prepare` lays out and moves a model's parameters.

    Args:
        precision (`str`, defaults to `"fp32"`):
            Compute precision: `"fp32"`, `"bf16"` or `"fp16"`. Low precisions keep fp32 master
            weights in the optimizer state; `"fp16"` adds dynamic loss scaling (`loss_scale`).
        export_dtype (`str`, defaults to `"fp32"`):
            What `model.state_dict()`, `save_pretrained`, the Trainer's `save_model` and
            `accelerator.get_state_dict` write under `precision="bf16"`/`"fp16"`: `"fp32"` writes the
            optimizer's fp32 master weights (every other managed parameter, e.g. a frozen one, upcast exactly),
            as PyTorch AMP, the Trainer's `bf16=True` and FSDP2's mixed precision do; `"compute"` writes the
            compute copy (`bf16`/`fp16`, half the bytes, master values rounded). A model prepared without an
            optimizer has no masters and writes its compute dtype either way. `config.json`'s `dtype` names
            what was written (docs/exports-and-gradients.md).
        device_memory_budget_bytes (`int` or `str`, *optional*):
            Bytes (or a size such as `"40GiB"`, `"512MB"`) of device memory hf_elixir may use on each rank:
            model data (parameter shards, gathered chunks, gradient buffers, device optimizer states) and,
            with `budget_covers_activations=True` (the default), the activations autograd saves for backward
            and its temporaries (a parameter's `.grad` before it lands in its chunk). Chunks are evicted to
            make room for activations; a step whose activations cannot fit beside the chunks it needs raises
            `DeviceBudgetExceededError` naming the bytes and the fixes. When `prepare` knows the activation
            bytes (a plan's `activation_peak_bytes`, e.g. from `search="auto"`), the chunks are placed in the
            budget less those bytes (`hf_elixir/chunk/memory.py`, [Note: activations in the budget]).
            `None` means all the device has: on CUDA the free memory at `prepare` less a reserve (the
            smallest over the ranks), activations included; on CPU-only machines unlimited, everything
            resident. Without CUDA the budget bounds a simulated device pool so every
            onload/offload/eviction path still runs.
        budget_covers_activations (`bool`, defaults to `True`):
            Whether `device_memory_budget_bytes` also pays for activations and autograd's temporaries (what
            a user setting "use at most 20 GiB of this card" expects). `False` restores the model-data-only
            meaning: activations are measured (`memory_stats`) but not charged, so leave their room outside
            the budget yourself. A budget of `None` on CUDA always covers activations.
        host_memory_budget_bytes (`int` or `str`, *optional*):
            Bytes (or a size such as `"64GiB"`) of host RAM this rank may hold for model data (host
            shards, host optimizer states, rank-local refill copies of gathered chunks). Refill copies
            (a full compute-dtype copy of a chunk, which saves re-gathering it in backward) are kept
            only where the plan chooses them and they fit this budget. `None`: 80% of this machine's
            RAM (psutil) divided by the ranks on this machine (`LOCAL_WORLD_SIZE`). Without `offload_dir`,
            a budget below the host shards and optimizer states is exceeded, and a warning names the least.
        offload_dir (`str` or `os.PathLike`, *optional*):
            A writable directory (on a local SSD/NVMe; `~` is expanded) for the disk tier: what of the host
            optimizer chunks does not fit `host_memory_budget_bytes` (fp32 masters and optimizer moments first,
            then fp32 gradient shards and parameter host shards) lives in one file per rank there, read ahead in
            the step's order and written back after use (docs/disk.md). A budget below what must stay in host
            memory even then is refused naming the least (`hf_elixir.min_host_budget_bytes`). `None`: no disk tier.
        disk_budget_bytes (`int` or `str`, *optional*):
            Bytes (or a size such as `"2TB"`) of `offload_dir` this rank may fill; `None`: the space free there.
        chunk_size_numel (`int`, *optional*):
            Elements per chunk; must be >= the largest parameter's numel, except for `"replicated"`
            chunks, which are gradient all-reduce buckets: there a larger parameter gets a chunk of its own
            and every chunk is trimmed to what it holds (DDP's `bucket_cap_mb`). `None` lets the search (or a
            heuristic) pick it (replicated: DDP's 25 MiB).
        reduce_dtype (`str`, *optional*):
            dtype of the gradient reduce-scatter: `"fp32"` or `None` (= compute precision).
        offload_optimizer (`bool` or `"auto"`, defaults to `"auto"`):
            Keep optimizer states (fp32 master, moments) on the host. `"auto"` offloads only what the
            budget cannot hold.
        overlap_host_optimizer (`bool`, *optional*):
            Run the host-side optimizer update of a chunk whose optimizer state is on the host as soon as
            its gradient shard is reduced and offloaded, on one worker thread, while backward goes on
            (SuperOffload, arXiv 2509.21271). The step is speculative: it assumes no gradient clipping and
            no fp16 overflow; `step()` validates it and rolls back and redoes the chunks concerned when
            clipping triggered or gradients overflowed. Adam/AdamW roll back by the inverse update with the
            same gradient (no copy kept; about one ulp off, not bitwise: [Note: inverse rollback]); AMSGrad and
            other optimizers from a host copy of the chunk's master and optimizer state (`(1 + k) * 4` bytes per
            shard element; exact). With gradient
            accumulation only the last backward before `step()` speculates (learned from the previous
            step). `None` (default): on whenever some optimizer state is on the host and the compute device
            is a GPU (CUDA); off when the compute device is the CPU, where the lane's thread would share the
            cores with the compute and gains nothing; `True`: on on any device;
            `False`: the host update runs inside `step()`.
        prefetch_depth (`int`, defaults to 2):
            How many chunks ahead to unshard early, in the access order of the previous step (the previous
            training step; for a model prepared without an optimizer the previous forward, so from the second
            forward on).
        plan (`ElixirPlan`, `str` path or `None`):
            A plan from the search (or a YAML/JSON file written by `hf-elixir plan --output`).
        search (`str`, defaults to `"off"`):
            `"auto"` profiles one step and searches for the fastest plan inside `prepare`: a training step,
            or with `prepare(model, None, ...)` (inference) one forward under `torch.no_grad()`.
        placements (`dict[str, str]`, *optional*):
            Module-name glob -> placement (`"sharded"`, `"replicated"`, `"column"`, `"row"`, `"column_gather"`,
            `"row_split"`, `"embedding_row"`, `"embedding_column"`, `"grad_allreduce"`, `"packed_column"`,
            `"mla_kv_a"`, `"moe_tp"`, `"expert"`; see
            `hf_elixir.placement.PLACEMENTS`). Tensor-parallel ones apply with `tensor_parallel_size > 1` and
            override the model config's own plan (`config.base_model_tp_plan`) or registered spec.
        default_placement (`str`, defaults to `"auto"`):
            Placement of the modules no `placements` glob (and no tensor/expert-parallel spec) covers:
            `"sharded"` (ZeRO-3: parameters, gradients and optimizer states sharded over the
            data-parallel group), `"replicated"` (a whole copy per rank, gradients all-reduced, as
            `DistributedDataParallel`), or `"auto"`: replicated when the whole model, its gradients and
            its optimizer states fit `device_memory_budget_bytes` on every rank (with no budget: always
            on CPU; on CUDA the budget is the card's), sharded otherwise; a plan's placements win
            (Elixir, arXiv 2212.05339 section 5: no partitioning when memory allows). Models rewritten by
            `hf_elixir.parallel.parallelize` treat `"auto"` as `"sharded"`.
        tensor_parallel_size / expert_parallel_size (`int`, defaults to 1):
            Sizes of the tensor-parallel / expert-parallel mesh axes. Both above 1: tensor and expert parallel on
            one mesh, laid out as transformers' `DistributedConfig(tp_size, fsdp_size, ep_size)` (the expert size a
            multiple of the tensor size, dividing the world; `docs/expert-parallel.md`).
        activation_policy (`str` or `dict[str, str]`, *optional*):
            What each transformer block (an outermost child of an `nn.ModuleList`, e.g. `"transformer.h.3"`) does
            with the activations autograd saves for backward: `"keep"` (on the device), `"recompute"` (activation
            checkpointing of that block, non-reentrant) or `"offload"` (to host memory in forward, back in
            backward). One string applies to every block; a dict maps block-name globs (`"transformer.h.*"`) to
            policies, the first matching glob wins and unmatched blocks follow the plan. `None`: the plan's
            policy (`ElixirPlan.activation_policy`), else every block `"keep"`. A glob that matches no block
            raises at `prepare`.
        loss_scale (`LossScalePolicy`): dynamic loss-scale settings (fp16 only).
        process_group: data-parallel `torch.distributed` group; `None` = the default world group.
        split_fused_experts (`bool` or `"auto"`, defaults to `"auto"`):
            Give each expert of a fused 3-D MoE experts module (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss:
            `gate_up_proj` `(E, 2I, H)`, `down_proj` `(E, H, I)`) its own child module and chunk slots, so only one
            expert's chunks need to be unsharded at a time and the device floor drops from E experts per unit to
            one (Mixtral-8x7B bf16, 1 rank: 18.97 GiB -> 2.65 GiB). The numerics, `state_dict()` /
            `save_pretrained` names and shapes and `full_gradients` names stay the unmodified model's;
            `named_parameters()` shows `...experts.<j>.gate_up_proj` `(1, 2I, H)`, and an optimizer built on the
            fused parameters is pointed at the pieces. Each expert then runs as its own call (one hook unit per
            expert), which costs time per expert, so `"auto"` splits only where it is needed: when the agreed
            device budget is below the fused model's `min_device_budget_bytes`, or when `plan` was made for the
            split model; `True` always splits, `False` keeps the fused tensors (each one slot: a chunk of E
            experts). See [Note: split fused experts] in `hf_elixir/parallel/_expert_units.py`.
        frozen_placement (`str`, defaults to `"auto"`):
            Where the chunks of frozen parameters (a LoRA model's base weights; they never share a chunk with trained
            ones) live with several data-parallel ranks. `"sharded"`: like trained chunks, sharded over the ranks and
            all-gathered at each use (`1 / world_size` of their bytes in host RAM per rank). `"whole"`: every rank
            keeps each frozen chunk whole (no all-gather, no gradient, no all-reduce), offloaded to the host under
            the budget and copied in whole at each use; they are packed in chunks of at most DDP's 25 MiB bucket
            (a parameter larger than that gets a chunk of its own), so the largest frozen parameter no longer sets
            the device floor; costs the frozen bytes in host RAM on every rank. `"auto"`: whole where a whole copy
            fits `host_memory_budget_bytes` and whole-chunk copies cost less than shard copies plus all-gathers at
            this machine's measured rates (none measured yet: whole on a CPU, sharded on a GPU), else sharded; one
            rank, tensor/expert parallel models and models that train nothing (reference models): sharded; with a
            `plan`, as the plan was made (`ElixirPlan.frozen_whole`). See [Note: whole frozen chunks] in
            `hf_elixir/chunk/_frozen_whole.py`.
        allow_missing_keys (`bool`, defaults to `False`):
            With `prepare(..., checkpoint=folder)`: parameters the folder has no tensor for raise (naming them);
            `True` lets them start from their own values, or on the meta device from the model's `_init_weights`
            (as `from_pretrained` initialises missing keys), with a warning naming them. Tensors of the folder the
            model does not use are always reported as a warning. See docs/loading.md.
        compile (`bool`, `str` or `dict`, defaults to `False`): `torch.compile` each transformer block (the
            outermost children of the model's `nn.ModuleList`s), with the unshard/reshard hooks outside the
            compiled code: `True` for `torch.compile`'s defaults (inductor), a backend name (`"aot_eager"`,
            `"eager"`, `"inductor"`), or a dict of `torch.compile` arguments (`backend`, `mode`, `fullgraph`,
            `dynamic`, `options`). `TrainingArguments(torch_compile=True)` and accelerate's `dynamo_backend` set
            it through the integrations. See [Note: compiled blocks] in `hf_elixir/runtime/compile.py`.

    Raises:
        TypeError / ValueError: naming the field, the bad value and the fix.

    Example:
    ```python
    >>> import hf_elixir
    >>> cfg = hf_elixir.ElixirConfig(precision="bf16", device_memory_budget_bytes=8 * 2**30)
    ```
    """

    precision: str = "fp32"
    export_dtype: str = "fp32"
    device_memory_budget_bytes: int | None = None
    budget_covers_activations: bool = True
    host_memory_budget_bytes: int | None = None
    offload_dir: str | os.PathLike | None = None
    disk_budget_bytes: int | None = None
    chunk_size_numel: int | None = None
    reduce_dtype: str | None = "fp32"
    offload_optimizer: bool | str = "auto"
    overlap_host_optimizer: bool | None = None
    prefetch_depth: int = 2
    plan: Any = None
    search: str = "off"
    placements: Mapping[str, str] = field(default_factory=dict)
    default_placement: str = "auto"
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    activation_policy: str | Mapping[str, str] | None = None
    loss_scale: LossScalePolicy = field(default_factory=LossScalePolicy)
    process_group: Any = None
    compile: bool | str | Mapping[str, Any] = False
    split_fused_experts: bool | str = "auto"
    frozen_placement: str = "auto"
    allow_missing_keys: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.allow_missing_keys, bool):
            raise TypeError(f"ElixirConfig.allow_missing_keys={self.allow_missing_keys!r} must be True (parameters a "
                            "checkpoint= folder lacks start from the model's _init_weights) or False (they raise)")
        if not isinstance(self.split_fused_experts, bool) and self.split_fused_experts != "auto":
            raise TypeError(f"ElixirConfig.split_fused_experts={self.split_fused_experts!r} is not supported; give "
                            "'auto' (split fused MoE experts per expert only where the device budget needs it, the "
                            "default), True (always one chunk unit per expert) or False (keep the fused tensors)")
        if self.frozen_placement not in FROZEN_PLACEMENTS:
            raise ValueError(f"ElixirConfig.frozen_placement={self.frozen_placement!r} is not supported; use 'auto' "
                             "(priced per machine, the default), 'sharded' (all-gathered like trained chunks) or "
                             "'whole' (every rank keeps each frozen chunk whole, offloaded under the budget)")
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise ValueError(
                f"ElixirConfig.precision={self.precision!r} is not supported; use one of {PRECISIONS}."
                f"{_closest(str(self.precision).lower().replace('float', 'fp'), list(PRECISIONS))}"
            )
        if not isinstance(self.export_dtype, str) or self.export_dtype not in EXPORT_DTYPES:
            raise ValueError(
                f"ElixirConfig.export_dtype={self.export_dtype!r} is not supported; use 'fp32' (the optimizer's fp32 "
                "master weights, the default) or 'compute' (the compute dtype the precision field sets)."
                f"{_closest(str(self.export_dtype).lower(), list(EXPORT_DTYPES))}")
        if isinstance(self.device_memory_budget_bytes, str):  # "40GiB" (YAML, env, CLI-style)
            try:
                object.__setattr__(self, "device_memory_budget_bytes", parse_bytes(self.device_memory_budget_bytes))
            except ValueError as err:
                raise ValueError(f"ElixirConfig.device_memory_budget_bytes: {err}") from None
        if isinstance(self.host_memory_budget_bytes, str):
            try:
                object.__setattr__(self, "host_memory_budget_bytes", parse_bytes(self.host_memory_budget_bytes))
            except ValueError as err:
                raise ValueError(f"ElixirConfig.host_memory_budget_bytes: {err}") from None
        if self.host_memory_budget_bytes is not None:
            _check_type("host_memory_budget_bytes", self.host_memory_budget_bytes, (int,),
                        "give a whole number of bytes, e.g. 64 * 2**30, or None for a share of this machine's RAM")
            if self.host_memory_budget_bytes <= 0:
                raise ValueError(f"ElixirConfig.host_memory_budget_bytes={self.host_memory_budget_bytes} must be > 0 "
                                 "(or None for a share of this machine's RAM)")
        self._check_disk()
        if isinstance(self.loss_scale, Mapping):  # the YAML form
            try:
                object.__setattr__(self, "loss_scale", LossScalePolicy.from_dict(self.loss_scale))
            except (TypeError, ValueError) as err:
                raise type(err)(f"ElixirConfig.loss_scale: {err}") from None
        if self.device_memory_budget_bytes is not None:
            _check_type("device_memory_budget_bytes", self.device_memory_budget_bytes, (int,),
                        "give a whole number of bytes, e.g. 8 * 2**30, or None for all the device has")
            if self.device_memory_budget_bytes <= 0:
                raise ValueError(
                    f"ElixirConfig.device_memory_budget_bytes={self.device_memory_budget_bytes} must be > 0 "
                    "(or None for all the device has)"
                )
        if not isinstance(self.budget_covers_activations, bool):
            raise TypeError(f"ElixirConfig.budget_covers_activations={self.budget_covers_activations!r} has type "
                            f"{type(self.budget_covers_activations).__name__}; use True (the budget pays for "
                            "activations too) or False (model data only)")
        if self.chunk_size_numel is not None:
            _check_type("chunk_size_numel", self.chunk_size_numel, (int,), "give a whole number of elements")
            if self.chunk_size_numel <= 0:
                raise ValueError(f"ElixirConfig.chunk_size_numel={self.chunk_size_numel} must be > 0 (or None)")
        if self.reduce_dtype not in (None, "fp32"):
            raise ValueError(f"ElixirConfig.reduce_dtype={self.reduce_dtype!r} must be 'fp32' or None")
        if not (isinstance(self.offload_optimizer, bool) or self.offload_optimizer == "auto"):
            raise ValueError(
                f"ElixirConfig.offload_optimizer={self.offload_optimizer!r} must be True, False or 'auto'"
            )
        if self.overlap_host_optimizer is not None and not isinstance(self.overlap_host_optimizer, bool):
            raise TypeError(f"ElixirConfig.overlap_host_optimizer={self.overlap_host_optimizer!r} must be True, "
                            "False or None (on whenever some optimizer state is on the host and the compute device is CUDA)")
        _check_type("prefetch_depth", self.prefetch_depth, (int,), "give a whole number >= 0")
        if self.prefetch_depth < 0:
            raise ValueError(f"ElixirConfig.prefetch_depth={self.prefetch_depth} must be >= 0")
        if self.search not in _SEARCH_MODES:
            raise ValueError(f"ElixirConfig.search={self.search!r} must be one of {_SEARCH_MODES}")
        self._check_plan_field()
        if not isinstance(self.placements, Mapping):
            raise TypeError(
                f"ElixirConfig.placements={self.placements!r} must be a dict of module-name glob -> placement"
            )
        from hf_elixir.plan import PLACEMENT_NAMES as _PLACEMENT_NAMES  # noqa: PLC0415 (as ACTIVATION_POLICIES)

        for pattern, placement in self.placements.items():
            if not isinstance(pattern, str):
                raise TypeError(f"ElixirConfig.placements key {pattern!r} must be a module-name glob (str)")
            if placement not in _PLACEMENT_NAMES:
                raise ValueError(
                    f"ElixirConfig.placements[{pattern!r}]={placement!r} is not a placement; use one of "
                    f"{_PLACEMENT_NAMES}.{_closest(str(placement), list(_PLACEMENT_NAMES))}"
                )
        if self.default_placement not in _DEFAULT_PLACEMENTS:
            raise ValueError(
                f"ElixirConfig.default_placement={self.default_placement!r} must be one of {_DEFAULT_PLACEMENTS}."
                f"{_closest(str(self.default_placement), list(_DEFAULT_PLACEMENTS))}"
            )
        self._check_activation_policy()
        _check_compile(self.compile)
        for name in ("tensor_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            _check_type(name, value, (int,), "give a whole number >= 1")
            if value < 1:
                raise ValueError(f"ElixirConfig.{name}={value} must be >= 1")
        if self.plan is not None and not isinstance(self.plan, (str, os.PathLike)) and \
                type(self.plan).__name__ != "ElixirPlan":
            raise TypeError(f"ElixirConfig.plan={self.plan!r} must be an ElixirPlan, a path to a plan file "
                            "(`hf-elixir plan --output plan.yaml`), or None")
        if not isinstance(self.loss_scale, LossScalePolicy):
            raise TypeError(f"ElixirConfig.loss_scale={self.loss_scale!r} must be a LossScalePolicy")
        if self.process_group is not None and not callable(getattr(self.process_group, "size", None)):
            raise TypeError(f"ElixirConfig.process_group={self.process_group!r} must be a torch.distributed "
                            "process group (e.g. torch.distributed.new_group(ranks)) or None for the default "
                            "group; the backend (nccl / gloo) is chosen at init_process_group")

    def _check_disk(self) -> None:
        """``offload_dir``: an existing directory this process can create files in; ``disk_budget_bytes``: a size
        no larger than the space free there."""
        if isinstance(self.disk_budget_bytes, str):
            try:
                object.__setattr__(self, "disk_budget_bytes", parse_bytes(self.disk_budget_bytes))
            except ValueError as err:
                raise ValueError(f"ElixirConfig.disk_budget_bytes: {err}") from None
        if self.offload_dir is None:
            if self.disk_budget_bytes is not None:
                raise ValueError(f"ElixirConfig.disk_budget_bytes={self.disk_budget_bytes} is set without offload_dir; "
                                 "give offload_dir (a directory on a local SSD) or leave disk_budget_bytes=None")
            return
        _check_type("offload_dir", self.offload_dir, (str, os.PathLike), "give a directory path, e.g. '/nvme/elixir'")
        path = os.path.expanduser(os.fspath(self.offload_dir))
        if path != os.fspath(self.offload_dir):  # "~/elixir": the user's home, as a shell would expand it
            object.__setattr__(self, "offload_dir", path)
        if self.offload_optimizer is False:  # the disk tier holds host optimizer state only: it would be ignored
            raise ValueError(f"ElixirConfig.offload_dir={path!r} is set with offload_optimizer=False, which keeps the "
                             "optimizer state on the device, so nothing would go to disk; set offload_optimizer=True "
                             "(or 'auto'), or leave offload_dir=None")
        if not os.path.isdir(path):
            raise ValueError(f"ElixirConfig.offload_dir={path!r} is not a directory; create it (mkdir -p) or give "
                             "an existing directory on a local SSD")
        try:  # os.access says yes to root on a read-only file system: try what the disk tier will do
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as err:
            raise ValueError(f"ElixirConfig.offload_dir={path!r} is not writable (creating a file there failed: "
                             f"{err.strerror}); give a directory this process can create files in, or fix its "
                             "permissions") from None
        if self.disk_budget_bytes is not None:
            _check_type("disk_budget_bytes", self.disk_budget_bytes, (int,),
                        "give a whole number of bytes, e.g. 2 * 10**12, or None for the space free in offload_dir")
            free = shutil.disk_usage(path).free
            if self.disk_budget_bytes <= 0 or self.disk_budget_bytes > free:
                raise ValueError(f"ElixirConfig.disk_budget_bytes={self.disk_budget_bytes} must be > 0 and at most "
                                 f"the {free} bytes free in offload_dir={path!r}; free space there, lower the budget, "
                                 "or give None (all the free space)")

    def _check_activation_policy(self) -> None:
        from hf_elixir.plan import ACTIVATION_POLICIES  # noqa: PLC0415 (plan.py imports nothing from here)

        policy = self.activation_policy
        if policy is None:
            return
        if isinstance(policy, str):
            if policy not in ACTIVATION_POLICIES:
                raise ValueError(f"ElixirConfig.activation_policy={policy!r} is not a policy; use one of "
                                 f"{ACTIVATION_POLICIES} or a dict of block-name glob -> policy."
                                 f"{_closest(policy, list(ACTIVATION_POLICIES))}")
            return
        if not isinstance(policy, Mapping):
            raise TypeError(f"ElixirConfig.activation_policy={policy!r} has type {type(policy).__name__}; give one of "
                            f"{ACTIVATION_POLICIES}, a dict of block-name glob -> policy, or None")
        for pattern, value in policy.items():
            if not isinstance(pattern, str):
                raise TypeError(f"ElixirConfig.activation_policy key {pattern!r} must be a block-name glob (str), "
                                "e.g. 'transformer.h.*'")
            if value not in ACTIVATION_POLICIES:
                raise ValueError(f"ElixirConfig.activation_policy[{pattern!r}]={value!r} is not a policy; use one of "
                                 f"{ACTIVATION_POLICIES}.{_closest(str(value), list(ACTIVATION_POLICIES))}")

    def _check_plan_field(self) -> None:
        from hf_elixir.plan import ElixirPlan  # noqa: PLC0415 (plan.py imports nothing from here)

        plan = self.plan
        if plan is None or isinstance(plan, ElixirPlan):
            return
        if not isinstance(plan, (str, os.PathLike)):
            raise TypeError(f"ElixirConfig.plan={plan!r} must be an ElixirPlan, a path to a plan file "
                            "(`hf-elixir plan --output plan.yaml`), or None")
        if not os.path.isfile(plan):
            raise FileNotFoundError(f"ElixirConfig.plan={str(plan)!r}: no such plan file; write one with "
                                    "`hf-elixir plan --output plan.yaml` or pass plan=None")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ElixirConfig":
        """Build a config from a plain mapping (YAML/JSON), rejecting unknown keys.

        Raises:
            ValueError: an unknown key, naming the closest valid one.
        """
        if not isinstance(values, Mapping):
            raise TypeError(f"an ElixirConfig section must be a mapping of fields, got {values!r}")
        valid = [f.name for f in dataclasses.fields(cls)]
        values = dict(values)
        for key in values:
            if key not in valid:
                raise ValueError(f"unknown ElixirConfig key {key!r}.{_closest(str(key), valid)} Valid keys: {valid}")
        if isinstance(values.get("loss_scale"), Mapping):
            values["loss_scale"] = LossScalePolicy.from_dict(values["loss_scale"])
        return cls(**values)

    @classmethod
    def from_env(cls, prefix: str = "ELIXIR_") -> "ElixirConfig":
        """Read ``ELIXIR_<FIELD>`` environment variables (how settings reach launched processes).

        Raises:
            ValueError / TypeError: a value that does not parse or is not valid for its field, naming the
                variables read from the environment.
        """
        values = env_values(prefix)
        try:
            return cls.from_dict(values)
        except (TypeError, ValueError) as err:
            used = [prefix + k.upper() for k in values]
            raise type(err)(f"{err} (read from the environment: {', '.join(used)})") from None


def env_values(prefix: str = "ELIXIR_") -> dict[str, Any]:
    """The ``ELIXIR_<FIELD>`` environment variables as ``{field: value}``, each value parsed as YAML ("1024",
    "true", "{'*.mlp': sharded}"); not yet validated. The one reader for :meth:`ElixirConfig.from_env`, the
    Accelerate plugin and the Trainer callback, so a typo warns and a bad value names its variable everywhere.

    Warns:
        UserWarning: a variable with the prefix that is no field (a typo such as ``ELIXIR_CHUNK_SIZE``), naming
            the closest field's variable; it is ignored (``ELIXIR_CONFIG_FILE`` is the launch file, not a field).

    Raises:
        ValueError: a value that is not valid YAML, naming the variable, its value and the YAML form to use.
    """
    import yaml  # parse "1024", "true", "{a: b}" the way YAML does

    fields = [f.name for f in dataclasses.fields(ElixirConfig)]
    names = [prefix + name.upper() for name in fields]
    for key in os.environ:
        if key.startswith(prefix) and key not in names and key != prefix + "CONFIG_FILE":
            warnings.warn(f"environment variable {key} is not an ElixirConfig field and is ignored."
                          f"{_closest(key, names)}", stacklevel=3)
    values: dict[str, Any] = {}
    for name, key in zip(fields, names):
        raw = os.environ.get(key)
        if raw is None:
            continue
        try:
            values[name] = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            problem = str(getattr(err, "problem", None) or type(err).__name__)
            raise ValueError(f"environment variable {key}={raw!r} is not a valid YAML value ({problem}); give "
                             f"the value as YAML, e.g. {key}=\"{{'*.mlp': sharded}}\" for a mapping, "
                             f"{key}=true for a flag") from None
    return values
