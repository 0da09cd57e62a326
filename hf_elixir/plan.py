"""``ElixirPlan``: the search's output and the chunk manager's input.

A plan is plain data, so it can be reviewed, edited and reused (`hf-elixir plan --output plan.yaml`,
then ``ElixirConfig(plan="plan.yaml")``). Chunk ids are positions in the list that
:func:`hf_elixir.chunk.pack_chunks` returns for ``param_order`` and ``chunk_size_numel``; the packing
is deterministic, so the ids mean the same thing to the search and to the manager.

Source: Elixir (arXiv 2212.05339) section 4 (the search space: chunk size, which chunks are kept on
the device, which optimizer states are offloaded, prefetch).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ACTIVATION_POLICIES", "PLACEMENT_NAMES", "REFRESH_CASTS", "ElixirPlan", "policy_summary"]

#: 2: ``activation_peak_bytes`` (version-1 files load unchanged: the field defaults to ``None``); 3: ``reduce_dtype``
#: (older files load as ``"fp32"``, the only dtype searched then)
PLAN_FORMAT_VERSION = 3
_PRECISIONS = ("fp32", "bf16", "fp16")
#: every placement a module can take (``hf_elixir.placement.PLACEMENTS`` documents each)
PLACEMENT_NAMES = ("sharded", "replicated", "column", "row", "column_gather", "row_split", "embedding_row",
                   "embedding_column", "grad_allreduce", "packed_column", "mla_kv_a", "moe_tp", "expert")
_PLACEMENTS = PLACEMENT_NAMES
#: what a transformer block does with the tensors autograd saves (see ``hf_elixir/runtime/activations.py``)
ACTIVATION_POLICIES = ("keep", "recompute", "offload")
#: where an uploaded chunk's fp32 master is cast to the compute dtype ([Note: refresh cast] in optim/_refresh.py)
REFRESH_CASTS = ("host", "device")
_INT = "give a whole number"
#: (field, accepted types, fix) checked by ``ElixirPlan.__post_init__``
_FIELD_TYPES: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("model_type", (str,), "give model.config.model_type, e.g. 'gpt2'"),
    ("num_params", (int,), _INT),
    ("world_size", (int,), _INT + " >= 1"),
    ("precision", (str,), "use 'fp32', 'bf16' or 'fp16'"),
    ("chunk_size_numel", (int,), _INT + " of elements"),
    ("param_order", (list,), "give a list of parameter names"),
    ("resident_chunks", (list,), "give a list of chunk ids"),
    ("device_shard_chunks", (list,), "give a list of chunk ids"),
    ("device_optim_chunks", (list,), "give a list of chunk ids"),
    ("host_copy_chunks", (list,), "give a list of chunk ids"),
    ("prefetch_depth", (int,), _INT + " >= 0"),
    ("activation_checkpointing", (bool,), "use true or false"),
    ("activation_policy", (dict,), "give a mapping of block name -> 'keep', 'recompute' or 'offload'"),
    ("placements", (dict,), "give a mapping of module name -> placement"),
    ("refresh_cast", (str,), "use 'host' or 'device'"),
    ("reduce_dtype", (str, type(None)), "use 'fp32' or null (the compute precision)"),
    ("frozen_whole", (bool,), "use true (frozen chunks whole on every rank) or false (sharded)"),
    ("predicted_step_s", (int, float, type(None)), "give seconds or null"),
    ("predicted_peak_device_bytes", (int, type(None)), "give bytes or null"),
    ("activation_peak_bytes", (int, type(None)), "give bytes or null"),
    ("reasons", (list,), "give a list of strings"),
    ("format_version", (int,), _INT),
)


def policy_summary(policy: dict[str, str]) -> str:
    """``"keep"``, or the non-keep counts over the blocks of an activation policy (``"recompute 4/12"``,
    ``"offload 2/12 recompute 1/12"``)."""
    counts = [(kind, sum(1 for v in policy.values() if v == kind)) for kind in ("offload", "recompute")]
    return " ".join(f"{kind} {n}/{len(policy)}" for kind, n in counts if n) or "keep"


@dataclass(kw_only=True)
class ElixirPlan:
    """A complete memory/placement plan for one model, world size and precision.

    Attributes:
        model_type: ``model.config.model_type`` the plan was made for (checked by ``prepare``).
        num_params: total parameter count (tied parameters once) the plan was made for.
        world_size: data-parallel ranks the chunks are sharded over (or, with every placement
            ``"replicated"``, that each hold whole: chunk ids then come from world-size-1 packing).
        precision: ``"fp32" | "bf16" | "fp16"``.
        chunk_size_numel: elements per chunk (>= the largest parameter's numel).
        param_order: canonical parameter names (first FQN of each tied group) in packing order;
            empty = module registration order.
        resident_chunks: chunk ids kept unsharded on the device for the whole step (never evicted).
        device_shard_chunks: chunk ids whose shard stays on the device between uses; the others'
            shards live on the host and are onloaded on demand.
        device_optim_chunks: chunk ids whose optimizer state (fp32 master, moments, grad shard)
            lives on the device; the others' live on the host (updated by the host optimizer).
        host_copy_chunks: chunk ids that keep a rank-local host copy of their gathered chunk (a full
            compute-dtype copy per rank: host RAM traded for the all-gather a re-unshard in the same step
            would cost; see [Note: rank-local refill] in ``hf_elixir/chunk/chunk.py``).
        prefetch_depth: chunks unsharded ahead of use in the profiled order.
        activation_checkpointing: the uniform activation switch of plans written before
            ``activation_policy``: ``True`` = every block ``"recompute"``, ``False`` = every block ``"keep"``, for
            the blocks ``activation_policy`` does not name.
        activation_policy: transformer-block FQN (an outermost child of an ``nn.ModuleList``, e.g.
            ``"transformer.h.3"``) -> ``"keep"`` (saved activations stay on the device), ``"recompute"``
            (activation checkpointing of that block) or ``"offload"`` (its saved activations go to host memory in
            forward and come back in backward); see ``hf_elixir/runtime/activations.py``. Blocks not named follow
            ``activation_checkpointing``. (ProTrain, arXiv 2406.08334: block-wise activation management.)
        placements: module FQN -> placement name (``"sharded"``, ``"column"``, ...).
        refresh_cast: where the refresh of a chunk whose fp32 master is on the host and whose compute copy is on
            the device casts fp32 to the compute dtype ([Note: refresh cast] in ``hf_elixir/optim/_refresh.py``):
            ``"host"`` (into a pinned host staging buffer, uploading ``b`` bytes per element) or ``"device"``
            (uploading the fp32 master, 4 bytes per element, through a device staging buffer of at most
            ``REFRESH_STAGING_NUMEL`` fp32 elements charged to the device budget, and casting on the device: no
            host cast in the host lane, twice the refresh bytes on PCIe at bf16/fp16). Only ``"host"`` with
            ``precision="fp32"`` (nothing to cast). Plans written before the field load as ``"host"``.
        reduce_dtype: the gradient buffers' and reduces' dtype the search priced (``ElixirConfig.reduce_dtype``:
            ``"fp32"``, 4 bytes per element, or ``None``, the compute precision's); ``prepare`` refuses a searched
            plan under another ``reduce_dtype``. Plans written before the field load as ``"fp32"``.
        frozen_whole: the frozen parameters' chunks are whole on every rank, packed as buckets (``ElixirConfig.
            frozen_placement`` resolved to ``"whole"``: [Note: whole frozen chunks] in
            ``hf_elixir/chunk/_frozen_whole.py``), which numbers the chunks otherwise; ``False``: sharded like the
            trained ones. ``prepare`` lays a given plan out so. Plans written before the field load as ``False``.
        predicted_step_s: the cost model's step time (seconds), if a search made the plan.
        predicted_peak_device_bytes: the cost model's device peak (bytes), if a search made it.
        activation_peak_bytes: device bytes to keep for the activations autograd saves (and its
            temporaries) at the step's peak, as profiled (with the plan's ``activation_checkpointing``);
            ``None``: not known. When the budget covers activations
            (``ElixirConfig.budget_covers_activations``), ``prepare`` places chunks in the budget less these
            bytes ([Note: activations in the budget] in ``hf_elixir/chunk/memory.py``).
        reasons: human-readable lines explaining the choice.
    """

    model_type: str = ""
    num_params: int = 0
    world_size: int = 1
    precision: str = "fp32"
    chunk_size_numel: int = 0
    param_order: list[str] = field(default_factory=list)
    resident_chunks: list[int] = field(default_factory=list)
    device_shard_chunks: list[int] = field(default_factory=list)
    device_optim_chunks: list[int] = field(default_factory=list)
    host_copy_chunks: list[int] = field(default_factory=list)
    prefetch_depth: int = 2
    activation_checkpointing: bool = False
    activation_policy: dict[str, str] = field(default_factory=dict)
    placements: dict[str, str] = field(default_factory=dict)
    refresh_cast: str = "host"
    reduce_dtype: str | None = "fp32"
    frozen_whole: bool = False
    predicted_step_s: float | None = None
    predicted_peak_device_bytes: int | None = None
    activation_peak_bytes: int | None = None
    reasons: list[str] = field(default_factory=list)
    format_version: int = PLAN_FORMAT_VERSION

    def __post_init__(self) -> None:
        for name, types, fix in _FIELD_TYPES:
            value = getattr(self, name)
            if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
                raise TypeError(f"ElixirPlan.{name}={value!r} has type {type(value).__name__}; {fix}")
        for name in ("param_order", "reasons"):
            if any(not isinstance(v, str) for v in getattr(self, name)):
                raise TypeError(f"ElixirPlan.{name} must be a list of str, got {getattr(self, name)!r}")
        for name in ("num_params", "chunk_size_numel", "prefetch_depth"):
            if getattr(self, name) < 0:
                raise ValueError(f"ElixirPlan.{name}={getattr(self, name)} must be >= 0")
        if self.world_size < 1:
            raise ValueError(f"ElixirPlan.world_size={self.world_size} must be >= 1")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"ElixirPlan.precision={self.precision!r} must be one of {_PRECISIONS}")
        for name in ("resident_chunks", "device_shard_chunks", "device_optim_chunks", "host_copy_chunks"):
            ids = getattr(self, name)
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                raise ValueError(f"ElixirPlan.{name}={ids!r} must be a list of chunk ids (ints >= 0)")
        for module, placement in self.placements.items():
            if not isinstance(module, str) or placement not in _PLACEMENTS:
                raise ValueError(f"ElixirPlan.placements[{module!r}]={placement!r} must map a module name to one "
                                 f"of {_PLACEMENTS}")
        for block, policy in self.activation_policy.items():
            if not isinstance(block, str) or policy not in ACTIVATION_POLICIES:
                raise ValueError(f"ElixirPlan.activation_policy[{block!r}]={policy!r} must map a block name to one of "
                                 f"{ACTIVATION_POLICIES}")
        if self.refresh_cast not in REFRESH_CASTS:
            raise ValueError(f"ElixirPlan.refresh_cast={self.refresh_cast!r} must be one of {REFRESH_CASTS}: 'host' "
                             "casts the fp32 masters on the host, 'device' uploads them and casts on the device")
        if self.refresh_cast == "device" and self.precision == "fp32":
            raise ValueError("ElixirPlan.refresh_cast='device' with precision='fp32': fp32 compute copies need no "
                             "cast; use refresh_cast='host' (or a 'bf16' / 'fp16' plan)")
        if self.reduce_dtype not in ("fp32", None):
            raise ValueError(f"ElixirPlan.reduce_dtype={self.reduce_dtype!r} must be 'fp32' or None (the compute "
                             "precision), as ElixirConfig.reduce_dtype")
        if self.predicted_step_s is not None and not self.predicted_step_s >= 0:
            raise ValueError(f"ElixirPlan.predicted_step_s={self.predicted_step_s} must be >= 0 or None")
        for name in ("predicted_peak_device_bytes", "activation_peak_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"ElixirPlan.{name}={getattr(self, name)} must be >= 0 or None")

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ElixirPlan":
        """Raises ValueError on unknown keys (naming the closest valid one) or a newer format."""
        import difflib

        valid = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in valid:
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown ElixirPlan key {key!r}.{hint}")
        if values.get("format_version", PLAN_FORMAT_VERSION) > PLAN_FORMAT_VERSION:
            raise ValueError(
                f"ElixirPlan.format_version={values['format_version']} is newer than this hf_elixir "
                f"understands ({PLAN_FORMAT_VERSION}); upgrade hf_elixir or re-run `hf-elixir plan`"
            )
        return cls(**values)

    def save(self, path: str | Path) -> None:
        """Write JSON (``.json``) or YAML (``.yaml`` / ``.yml``).

        Raises:
            ValueError: another suffix (the file would not say what it holds).
        """
        path = Path(path)
        if path.suffix not in (".json", ".yaml", ".yml"):
            raise ValueError(f"ElixirPlan.save({str(path)!r}): use a .yaml, .yml or .json file name")
        if path.suffix == ".json":
            path.write_text(json.dumps(self.to_dict(), indent=2))
        else:
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> "ElixirPlan":
        """Read a plan written by :meth:`save`.

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: the file is not a plan (unknown keys, not a mapping).
        """
        path = Path(path)
        text = path.read_text()
        if path.suffix == ".json":
            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
        if not isinstance(values, dict):
            raise ValueError(f"plan file {str(path)!r} does not hold a mapping of ElixirPlan fields")
        return cls.from_dict(values)
