"""Streamed init reader (hf_elixir.chunk._stream_load): flat ranges of tensors from safetensors folders,
single file or sharded with an index, reading only the rows that cover the range."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hf_elixir.chunk._stream_load import CheckpointReader, SlotSource, read_chunk_range


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(7, 5, generator=g), "a.bias": torch.randn(5, generator=g),
            "b.weight": torch.randn(3, 4, 6, generator=g), "scale": torch.randn((), generator=g),
            "h": torch.randn(11, generator=g).to(torch.bfloat16)}


def _single(folder, tensors):
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _sharded(folder, tensors):
    folder.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_read_flat_matches_every_range(tmp_path, layout):
    tensors = _tensors()
    folder = (_single if layout == "single" else _sharded)(tmp_path / layout, tensors)
    with CheckpointReader(folder) as reader:
        assert reader.keys() == set(tensors)
        for key, full in tensors.items():
            flat = full.reshape(-1)
            n = flat.numel()
            for begin in range(n + 1):
                for end in range(begin, n + 1):
                    got = reader.read_flat(key, begin, end)
                    assert got.numel() == end - begin
                    if end > begin:
                        assert got.dtype == full.dtype
                        assert torch.equal(got, flat[begin:end]), (key, begin, end)


def test_read_chunk_range_cuts_mid_tensor_and_zeroes_padding(tmp_path):
    tensors = _tensors()
    folder = _single(tmp_path / "m", tensors)
    sources, offset = [], 0
    for key in ("a.weight", "b.weight", "a.bias"):
        sources.append(SlotSource(key, offset, tensors[key].numel()))
        offset += tensors[key].numel()
    chunk_numel = offset + 4  # padding (112 + 4 elements split evenly over 1, 2 and 4 ranks)
    whole = torch.cat([tensors[s.key].reshape(-1) for s in sources] + [torch.zeros(4)])
    with CheckpointReader(folder) as reader:
        for world_size in (1, 2, 4):
            shard = chunk_numel // world_size
            for rank in range(world_size):
                begin, end = rank * shard, (rank + 1) * shard
                out = torch.full((end - begin,), float("nan"), dtype=torch.bfloat16)
                read_chunk_range(reader, sources, begin, end, out)
                assert torch.equal(out, whole[begin:end].to(torch.bfloat16)), (world_size, rank)


def test_reading_a_quarter_reads_only_its_rows(tmp_path):
    """A rank reading a quarter of a 64 MiB tensor grows its peak RSS by about a quarter, not the whole
    file (the slice is a view of the memory-mapped file; only touched pages are read). Control: reading
    the whole tensor through the same reader grows it by the whole file."""
    rows, cols = 4096, 4096
    save_file({"w": torch.ones(rows, cols)}, str(tmp_path / "model.safetensors"))
    file_bytes = rows * cols * 4

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    def peak_growth(read) -> int:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        before = status("VmRSS")
        with CheckpointReader(tmp_path) as reader:
            out = torch.empty(rows * cols // 4)
            read(reader, out)
            grown = status("VmHWM") - before
            assert float(out.sum()) == out.numel()
        return grown, reader.bytes_read

    begin = rows * cols // 2 + 17  # starts and ends mid-row
    quarter, quarter_read = peak_growth(lambda r, out: read_chunk_range(
        r, [SlotSource("w", 0, rows * cols)], begin, begin + out.numel(), out))
    assert quarter_read <= file_bytes // 4 + 2 * cols * 4
    assert quarter < 0.6 * file_bytes, (quarter, file_bytes)
    whole, _ = peak_growth(lambda r, out: out.copy_(r.read("w").reshape(-1)[:out.numel()]))
    assert whole > file_bytes, (whole, file_bytes)


def test_resolve_aliases_and_prefix(tmp_path):
    folder = _single(tmp_path / "m", {"transformer.wte.weight": torch.ones(2, 2), "h.0.w": torch.ones(1)})
    with CheckpointReader(folder) as reader:
        assert reader.resolve(["lm_head.weight", "transformer.wte.weight"]) == "transformer.wte.weight"
        assert reader.resolve(["transformer.h.0.w"], prefix="transformer") == "h.0.w"
        assert reader.resolve(["wte.weight"], prefix="transformer") == "transformer.wte.weight"
        assert reader.resolve(["missing"], prefix="transformer") is None


def test_folder_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        CheckpointReader(tmp_path / "nope")
    (tmp_path / "bin").mkdir()
    torch.save({}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        CheckpointReader(tmp_path / "bin")
