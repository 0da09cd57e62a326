"""Streamed init of parameters a checkpoint stores in another layout, through transformers' own weight converters.

[Note: converted tensors] transformers 5 writes a fused MoE experts tensor un-fused: Mixtral's
``model.layers.0.mlp.experts.gate_up_proj`` ``(E, 2I, H)`` is on disk as ``...experts.{e}.w1.weight`` and
``...experts.{e}.w3.weight`` ``(I, H)`` for every expert e, and ``from_pretrained`` fuses them through the
model's conversion mapping (``transformers.conversion_mapping.get_model_conversion_mapping``: renamings,
then one ``WeightConverter`` whose ``operations``, e.g. ``MergeModulelist(dim=0)`` then
``Concatenate(dim=1)``, build the target from its source tensors). Streamed init must not build the whole
target on every rank, so :class:`ConvertedSource` runs the same converter one expert at a time: the
operations get expert e's source tensors only (a list of one per source pattern) and give expert e's
``(1, ...)`` slice of the target, i.e. rows ``[e, e + 1)`` of dim 0. A flat element range of the target then
costs the experts it covers (one expert's source bytes each), never the others. A converter whose
operations do not give that per-expert slice (checked on expert 0 against the parameter's shape) is
refused with a message rather than loaded wrong.

Source: transformers ``core_model_loading.py`` (``WeightConverter``, ``rename_source_key`` semantics:
every matching renaming, then at most one converter) and ``conversion_mapping.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

__all__ = ["ConvertedSource", "check_converted", "converted_sources"]


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclass
class ConvertedSource:
    """A target tensor built from several checkpoint tensors by one transformers ``WeightConverter``.

    Attributes:
        target: the model's tensor name (e.g. ``model.layers.0.mlp.experts.gate_up_proj``).
        converter: the ``WeightConverter`` (its ``operations`` and ``source_patterns`` are used as is).
        sources: source pattern -> checkpoint keys, one per expert, in expert order.
        shape: the target's full shape (dim 0 = experts).
    """

    target: str
    converter: object
    sources: dict[str, list[str]] = field(default_factory=dict)
    shape: torch.Size | None = None

    @property
    def num_experts(self) -> int:
        return len(next(iter(self.sources.values())))

    def expert(self, read, index: int) -> torch.Tensor:
        """Rows ``[index, index + 1)`` of the target, built by the converter from expert ``index``'s source
        tensors (``read(key)`` gives a checkpoint tensor)."""
        collected = {pattern: [read(keys[index])] for pattern, keys in self.sources.items()}
        for op in self.converter.operations:
            collected = op.convert(collected, source_patterns=self.converter.source_patterns,
                                   target_patterns=self.converter.target_patterns, full_layer_name=self.target)
        (tensor,) = collected.values()
        return tensor

    def read_flat(self, read, begin: int, end: int) -> torch.Tensor:
        """Elements ``[begin, end)`` of the flattened target, building only the experts they cover."""
        per_expert = math.prod(self.shape[1:])
        first, last = begin // per_expert, -(-end // per_expert)
        rows = torch.cat([self.expert(read, e).reshape(-1) for e in range(first, last)])
        return rows[begin - first * per_expert:end - first * per_expert]


def converted_sources(model: torch.nn.Module, keys: set[str],
                      wanted: dict[str, torch.Size]) -> tuple[dict[str, ConvertedSource], dict[str, str]]:
    """How ``model``'s conversion mapping reaches the parameters of ``wanted`` (name -> full shape) from
    ``keys`` (the checkpoint's tensor names).

    Returns:
        ``(converted, renamed)``: targets built by a converter, as :class:`ConvertedSource`\\ s; and targets
        stored under another name (a ``WeightRenaming``, e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``) ->
        the checkpoint key. Parameters reached by neither are left out.

    Raises:
        ValueError: a converter builds a wanted parameter but not one expert at a time (see [Note: converted
            tensors]), or builds it with another shape than the parameter's.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: PLC0415
        from transformers.core_model_loading import WeightConverter, WeightRenaming  # noqa: PLC0415
    except ImportError:
        return {}, {}
    if not hasattr(model, "config"):
        return {}, {}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", "") or ""
    found: dict[str, ConvertedSource] = {}
    renamed_keys: dict[str, str] = {}
    for key in sorted(keys, key=_natural_key):
        renamed = key
        for renaming in renamings:  # every matching renaming, then at most one converter (as transformers)
            renamed, _ = renaming.rename_source_key(renamed)
        converter, pattern = next(((c, p) for c in converters for _, p in [c.rename_source_key(renamed)] if p),
                                  (None, None))
        if converter is None:
            target = _in_model(renamed, wanted, prefix)
            if target is not None and renamed != key:
                renamed_keys[target] = key
            continue
        target = _in_model(converter.rename_source_key(renamed)[0], wanted, prefix)
        if target is not None:
            source = found.setdefault(target, ConvertedSource(target, converter, shape=wanted[target]))
            source.sources.setdefault(pattern, []).append(key)
    return found, renamed_keys


def _in_model(name: str, wanted: dict, prefix: str) -> str | None:
    """``name`` as one of ``wanted``'s names (with the base-model prefix added or removed), or ``None``."""
    dotted = prefix + "." if prefix else ""
    for candidate in (name, name[len(dotted):] if dotted and name.startswith(dotted) else dotted + name):
        if candidate in wanted:
            return candidate
    return None


def check_converted(source: ConvertedSource, read) -> None:
    """Raise ``ValueError`` unless ``source`` holds one tensor per expert for every pattern and its converter
    builds expert 0's slice with the target's shape (checked once, at resolve time; ``read`` may give meta
    tensors of the files' shapes, so nothing is read)."""
    counts = {pattern: len(keys) for pattern, keys in source.sources.items()}
    expected = (1, *source.shape[1:])
    if len(set(counts.values())) != 1 or len(counts) != len(source.converter.source_patterns):
        raise ValueError(f"the checkpoint's tensors for {source.target!r} do not cover every source of its "
                         f"transformers weight converter ({counts} for {source.converter.source_patterns})")
    if source.num_experts != source.shape[0]:
        raise ValueError(f"checkpoint holds tensors of {source.num_experts} experts for {source.target!r} "
                         f"({source.converter.source_patterns}), the model has {source.shape[0]}: build the model "
                         "from the folder's config.json (AutoConfig.from_pretrained(folder))")
    got = tuple(source.expert(read, 0).shape)
    if got != expected:
        raise ValueError(
            f"transformers' weight converter for {source.target!r} ({source.converter!r}) builds {got} from one "
            f"expert's tensors, not {expected}: streamed "
            "loading cannot build it expert by expert; load with from_pretrained and call prepare without checkpoint=")
