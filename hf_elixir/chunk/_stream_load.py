"""Streamed init: read only the byte ranges a rank needs from a Hugging Face folder's safetensors files.

[Note: streamed init] ``prepare(model_on_meta, ..., checkpoint=folder)`` never materialises the whole
model on any rank (what DeepSpeed's ``zero.Init`` and FSDP2's meta-device init avoid too). Each rank
fills its own shard of each chunk from the files: a chunk shard ``[lo, hi)`` (chunk elements) covers
parts of one or more parameters, possibly starting or ending mid-tensor. For each covered parameter
the reader asks ``safetensors`` for the rows that cover the flat range
(``safe_open(...).get_slice(name)[row_begin:row_end]``, a view of the memory-mapped file: only the
touched pages are read) and cuts the flat range out of them. So a rank reads its shard's bytes plus at
most one row on each side of each cut, never a whole parameter it does not own.

Names: a parameter is looked up under its canonical name, then its aliases (tied weights: the same
``nn.Parameter`` under two names, e.g. GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``; a
file written by ``save_pretrained`` keeps only one), then each of those with the model's
``base_model_prefix`` added or removed (a base-model checkpoint loaded into a head model, or back).

Source: the safetensors format (a little-endian u64 header size, a JSON header with dtype, shape and
data offsets per tensor, then the raw bytes) and its ``safe_open``/``get_slice`` API; Hugging Face's
sharded layout (``model.safetensors.index.json`` with a ``weight_map`` from tensor name to file).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CheckpointReader", "SlotSource", "read_chunk_range"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class SlotSource:
    """One parameter's place in a chunk and the tensor in the folder it is read from.

    Attributes:
        key: the tensor's name in the folder's files.
        offset / numel: element range ``[offset, offset + numel)`` inside the chunk.
    """

    key: str
    offset: int
    numel: int


class CheckpointReader:
    """Reads tensors, or flat element ranges of them, from a Hugging Face folder's safetensors files.

    Args:
        folder: a folder with ``model.safetensors``, or with ``model.safetensors.index.json`` and the
            shard files it names (``save_pretrained`` writes either).

    Attributes:
        bytes_read: bytes of tensor data requested so far (the rows covering each requested range).

    Raises:
        FileNotFoundError: the folder is missing, or holds no safetensors weights (e.g. only
            ``pytorch_model.bin``: re-save it with ``save_pretrained(folder, safe_serialization=True)``).

    Use as a context manager (or call :meth:`close`): open files stay memory-mapped until then.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"checkpoint={str(folder)!r} is not a folder; pass a Hugging Face model folder "
                                    "(written by save_pretrained) holding model.safetensors")
        index = self.folder / _INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {key: self.folder / name for key, name in weight_map.items()}
        elif (self.folder / _SINGLE).is_file():
            from safetensors import safe_open  # noqa: PLC0415 (optional dependency of this path only)

            with safe_open(str(self.folder / _SINGLE), framework="pt") as handle:
                self._file_of = {key: self.folder / _SINGLE for key in handle.keys()}
        else:
            found = sorted(p.name for p in self.folder.iterdir())[:10]
            raise FileNotFoundError(
                f"checkpoint={str(folder)!r} holds neither {_SINGLE} nor {_INDEX} (found {found}); streamed "
                "loading reads safetensors only: re-save the model with save_pretrained(folder) "
                "(safe_serialization is the default)")
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop every open file (their memory maps go with the last tensor viewing them)."""
        self._handles.clear()

    def keys(self) -> set[str]:
        return set(self._file_of)

    def _handle(self, key: str):
        path = self._file_of[key]
        handle = self._handles.get(path)
        if handle is None:
            from safetensors import safe_open  # noqa: PLC0415

            handle = self._handles[path] = safe_open(str(path), framework="pt")
        return handle

    def resolve(self, names: list[str], prefix: str = "") -> str | None:
        """The first of ``names`` (then each with ``prefix + "."`` added or removed) the files hold."""
        candidates = list(names)
        if prefix:
            dotted = prefix + "."
            candidates += [n[len(dotted):] if n.startswith(dotted) else dotted + n for n in names]
        return next((n for n in candidates if n in self._file_of), None)

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (a copy in its file dtype; for buffers and small tensors)."""
        tensor = self._handle(key).get_tensor(key)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.clone()

    def read_flat(self, key: str, begin: int, end: int) -> torch.Tensor:
        """Elements ``[begin, end)`` of tensor ``key`` flattened in row-major order.

        Reads only the rows (slices along dim 0) that cover the range, then cuts it out.

        Returns:
            a 1-D tensor of ``end - begin`` elements in the file's dtype, viewing the memory-mapped
            file (copy it where it must outlive the reader).
        """
        view = self._handle(key).get_slice(key)
        shape = view.get_shape()
        numel = math.prod(shape)
        assert 0 <= begin <= end <= numel, f"range [{begin}, {end}) outside {key!r} of {numel} elements"
        if begin == end:
            return torch.empty(0)
        if len(shape) == 0:
            rows, first = view[...].reshape(-1), 0
        else:
            row_numel = numel // shape[0] if shape[0] else 1
            first, last = begin // row_numel, -(-end // row_numel)
            rows = view[first:last].reshape(-1)
            first *= row_numel
        self.bytes_read += rows.numel() * rows.element_size()
        return rows[begin - first:end - first]


def read_chunk_range(reader: CheckpointReader, sources: list[SlotSource], begin: int, end: int,
                     out: torch.Tensor) -> None:
    """Fill ``out`` (1-D, ``end - begin`` elements, any dtype/device) with chunk elements ``[begin, end)``.

    Elements no source covers (chunk padding) are set to zero; every covered element is read from the
    file (cast to ``out.dtype`` as ``Tensor.copy_`` does, which is what ``prepare`` does to a loaded
    parameter).
    """
    assert out.numel() == end - begin, f"out has {out.numel()} elements for range [{begin}, {end})"
    out.zero_()
    for src in sources:
        lo, hi = max(begin, src.offset), min(end, src.offset + src.numel)
        if lo >= hi:
            continue
        values = reader.read_flat(src.key, lo - src.offset, hi - src.offset)
        out[lo - begin:hi - begin].copy_(values)
