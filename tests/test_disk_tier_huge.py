"""The disk tier with huge regions ([Note: disk tier] in hf_elixir/chunk/_disk.py: from ``HUGE_MIN_BYTES`` a region is
padded to 2 MiB blocks and read by huge-page faults) in training: a GPT-2 of 10.6 M parameters whose chunk shards are
1 Mi fp32 elements (the gradient and parameter shard regions exactly ``HUGE_MIN_BYTES``, the moments' twice that), its
shards on the host, trained under the least host budget with a disk (above a quarter of its 16 B/param state), keeps
moments, gradient shards and parameter shards in huge regions of the file; 5 steps of AdamW with weight decay and
clipping match plain PyTorch at 1 and 2 gloo ranks, the host memory really used (host blocks plus the file's pages in
memory, ``cachestat``) stays within the budget at every read, read-ahead and write-back, and the regions that are only
read are written back without IO. A checkpoint resumes exactly, ``zero_grad`` punches the huge gradient regions out,
and state dicts between steps, regions just under ``HUGE_MIN_BYTES``, bf16 parameter shards, gradient accumulation
and the host lane change no bit."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os

import pytest
import torch
import transformers

import hf_elixir
from hf_elixir.checkpoint import load_checkpoint, save_checkpoint
from hf_elixir.chunk._disk import HUGE_BYTES, HUGE_MIN_BYTES, HUGE_PAGES, PAGE_BYTES, DiskFile
from hf_elixir.chunk._disk_pages import grad_region
from tests._dist import run_distributed
from tests._models import batch, rel_l2, two_groups
from tests.test_disk_tier_params import MAX_NORM, ROWS, STEPS, _HostPeak, _reference, _step

#: fp32 elements of a shard whose gradient / parameter region is exactly HUGE_MIN_BYTES (the smallest huge region)
HUGE_SHARD_NUMEL = HUGE_MIN_BYTES // 4


@functools.cache
def _initial_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=6, n_embd=384, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _model(seed: int = 0) -> torch.nn.Module:
    """A GPT-2 of 10.6 M parameters (every weight under 1 Mi elements, so a chunk of ``HUGE_SHARD_NUMEL`` per rank
    packs them: 13 chunks at 1 rank, 7 at 2), a copy of the one initialized with ``seed`` (its init is most of the
    cost of building it)."""
    return copy.deepcopy(_initial_model(seed))


def _num_params() -> int:
    return sum(p.numel() for p in _initial_model(0).parameters())


def _prepare_at(offload_dir, host_bytes, world_size, seed=0, shard_numel=HUGE_SHARD_NUMEL, **extra):
    """Shards on the host (the device budget at its floor), chunks of ``shard_numel`` per rank."""
    model = _model(seed)
    opt = torch.optim.AdamW(two_groups(model, weight_decay=0.1), lr=3e-3)
    config = hf_elixir.ElixirConfig(chunk_size_numel=shard_numel * world_size, offload_optimizer=True,
                                    default_placement="sharded", budget_covers_activations=False, **extra,
                                    offload_dir=None if offload_dir is None else str(offload_dir),
                                    host_memory_budget_bytes=host_bytes)
    floor = hf_elixir.min_device_budget_bytes(model, opt, config, world_size)
    return hf_elixir.prepare(model, opt, dataclasses.replace(config, device_memory_budget_bytes=floor))


def _budget(offload_dir, world_size, **extra) -> int:
    """max(a quarter of the 16 B/param state, the least host budget with a disk), the latter priced on the same
    model prepared with everything in host memory (a budget it fits: no file)."""
    model, opt = _prepare_at(offload_dir, 1 << 40, world_size, **extra)
    assert opt._disk is None
    least = hf_elixir.min_host_budget_bytes(model, opt)
    assert least.with_disk_bytes < least.without_disk_bytes, least  # the disk lowers what the host must hold
    return max(16 * _num_params() // world_size // 4, least.with_disk_bytes)


def _prepare(offload_dir, world_size=1, seed=0, **extra):
    return _prepare_at(offload_dir, _budget(offload_dir, world_size, **extra), world_size, seed, **extra)


class _Peak(_HostPeak):
    """:class:`_HostPeak` that samples nothing while ``paused``."""

    paused = False

    def sample(self) -> None:
        if not self.paused:
            super().sample()


def _written_bytes() -> int:
    """Bytes this process has caused to be written to storage (``/proc/self/io``: counted as pages are dirtied)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes"))


def _huge(file) -> dict:
    """The kinds of region (``state``, ``grad``, ``param``) with a huge region, and whether each huge one is padded
    and aligned to ``HUGE_BYTES``."""
    kinds = set()
    aligned = True
    for region, (offset, nbytes) in file.regions.items():
        if nbytes >= HUGE_MIN_BYTES:
            kinds.add("state" if isinstance(region, int) else region[0])
            aligned &= offset % HUGE_BYTES == 0 and nbytes % HUGE_BYTES == 0
    return {"kinds": sorted(kinds), "aligned": aligned, "sizes": sorted({n for _, n in file.regions.values()})}


def _train_case(rank, world_size, offload_dir):
    model, opt = _prepare(offload_dir, world_size)
    manager, file = opt.manager, opt._disk.file
    pages = manager.disk_pages
    peak = _HostPeak(model, file)
    written = _written_bytes()
    for step in range(STEPS):
        _step(model, opt, step, rank, world_size, peak)
    file.settle()
    written = _written_bytes() - written
    host = [c for c in manager.chunks if c.trainable and not c.optim_on_device]
    out = {
        "rel": rel_l2({k: v.detach().clone() for k, v in model.state_dict().items()}, _reference(world_size, _model)),
        "budget": opt.config.host_memory_budget_bytes, "peak": peak.peak_bytes, "samples": peak.samples,
        "state_bytes": 16 * _num_params() // world_size, "file_bytes": file.nbytes,
        "num_chunks": len(host), "num_grads": len(pages.grads), "num_params": len(pages.params),
        "num_states": len(opt._disk.state_chunks), "huge": _huge(file), "read_bytes": file.bytes_read,
        "resident_after": file.resident_bytes(), "written_bytes": written,
    }
    opt._disk.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_huge_regions_train_like_pytorch_within_the_host_budget(tmp_path, world_size):
    for out in run_distributed(_train_case, world_size, str(tmp_path)):
        assert out["rel"] < 2e-5, out["rel"]
        # the budget (the least with a disk) is a fraction of the state: the moments, gradient and parameter shards
        # of every chunk are in the file, in huge regions
        assert out["budget"] < out["state_bytes"] * 3 // 4 < out["file_bytes"], out
        assert out["num_states"] == out["num_grads"] == out["num_params"] == out["num_chunks"] > 4, out
        if HUGE_PAGES:
            assert out["huge"]["kinds"] == ["grad", "param", "state"] and out["huge"]["aligned"], out["huge"]
            assert HUGE_MIN_BYTES in out["huge"]["sizes"], out["huge"]  # the smallest huge region: exactly at it
        # host memory really used (host blocks + the file's pages in memory) within the budget at its peak, while
        # the steps read the file many times over
        assert out["samples"] > 100 and 0 < out["peak"] <= out["budget"], out
        assert out["read_bytes"] > STEPS * out["file_bytes"], out
        assert out["resident_after"] == 0
        # a step writes the moments and parameter shards once and the gradient shards twice (backward, the clip),
        # 1.25 times the file; the regions only read (onloads, the norm, the step's gradients) write nothing (when
        # every read was mapped writable, every read region was written back whole: 2.2 times the file a step)
        assert out["written_bytes"] <= 1.5 * STEPS * out["file_bytes"], out


def test_checkpoint_resume_with_huge_regions_is_exact(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, opt = _prepare(tmp_path / "a")
    assert _huge(opt._disk.file)["kinds"] == (["grad", "param", "state"] if HUGE_PAGES else [])
    for step in range(2):
        _step(model, opt, step)
    peak = _HostPeak(model, opt._disk.file)
    save_checkpoint(tmp_path / "ckpt", model, opt, step=2)
    opt._disk.file.settle()
    # the save read every moment in the file chunk by chunk, each evicted after (it left them all in host memory,
    # twice the budget here)
    assert opt._disk.file.resident_bytes() == 0 and 0 < peak.peak_bytes <= opt.config.host_memory_budget_bytes
    for step in range(2, 4):
        _step(model, opt, step)
    resumed, ropt = _prepare(tmp_path / "b", seed=7)
    assert load_checkpoint(tmp_path / "ckpt", resumed, ropt)["step"] == 2
    assert ropt._disk.file.resident_bytes() == 0, "the loaded state went to the file"
    for step in range(2, 4):
        _step(resumed, ropt, step)
    want, got = model.state_dict(), resumed.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), "the resume is bit for bit the uninterrupted run"
    opt._disk.close()
    ropt._disk.close()


def test_zero_grad_punches_the_huge_gradient_regions_out(tmp_path):
    """``zero_grad`` punches every gradient region on disk (huge) out: it then holds no page in memory, keeps its
    reserved space, and reads as zeros."""
    model, opt = _prepare(tmp_path)
    file, grads = opt._disk.file, sorted(opt.manager.disk_pages.grads)
    punched, zero = [], file.zero
    file.zero = lambda region: punched.append((region, zero(region))) or punched[-1][1]
    opt.backward(model(**batch("gpt2", 0, ROWS)).loss)
    opt.step()
    allocated = os.stat(file.path).st_blocks * 512
    assert all(float(opt.manager.grad_shards[cid].abs().sum()) > 0 for cid in grads)
    file.settle()
    opt.zero_grad()
    file.settle()
    assert punched == [(grad_region(cid), True) for cid in grads], punched
    # the punched blocks are reserved again (ext4 may add a block or two to the file's extent tree)
    assert allocated <= os.stat(file.path).st_blocks * 512 <= allocated + 64 * 1024, (allocated, os.stat(file.path))
    sizes = [file.regions[grad_region(cid)][1] for cid in grads]
    assert not HUGE_PAGES or sum(n >= HUGE_MIN_BYTES for n in sizes) == len(sizes) - 1, sizes  # (the last: smaller)
    assert all(file.resident_bytes(grad_region(cid)) == 0 for cid in grads)
    assert all(float(opt.manager.grad_shards[cid].abs().sum()) == 0.0 for cid in grads)
    opt._disk.close()


@pytest.mark.parametrize("shard_numel,precision,overlap,micro,state_dicts", [
    (HUGE_SHARD_NUMEL, "fp32", True, 1, True),
    (HUGE_SHARD_NUMEL - PAGE_BYTES // 4, "fp32", False, 2, False),
    (2 * HUGE_SHARD_NUMEL, "bf16", False, 1, True),
])
def test_huge_regions_change_no_bit(tmp_path, shard_numel, precision, overlap, micro, state_dicts):
    """The run with everything on disk is bit for bit the run with everything in host memory: the host lane on
    (it takes the gradients on its thread), shards a page under ``HUGE_MIN_BYTES`` (gradient and parameter regions
    read by ``preadv`` beside huge moment regions) with gradient accumulation, bf16 parameter shards in huge regions
    (2 Mi elements: 4 MiB) beside fp32 ones, and the model and optimizer state dicts loaded back between steps (a
    write to the file outside the step's schedule)."""
    runs = []
    for offload_dir in (tmp_path, None):
        kwargs = dict(shard_numel=shard_numel, precision=precision,
                      overlap_host_optimizer=overlap and bool(offload_dir))
        model, opt = _prepare(offload_dir, **kwargs) if offload_dir else _prepare_at(None, None, 1, **kwargs)
        peak = None
        if offload_dir is not None:
            file = opt._disk.file
            assert len(opt.manager.disk_pages.params) == len(opt._disk.state_chunks) > 4
            huge = _huge(file)["kinds"]
            assert huge == ([] if not HUGE_PAGES else ["state"] if shard_numel < HUGE_SHARD_NUMEL else
                            ["grad", "param", "state"]), huge
            peak = _Peak(model, file)
        for step in range(2):  # (the second step reads the moments the first wrote)
            for index in range(micro):
                opt.backward(model(**batch("gpt2", 10 * step + index, ROWS)).loss / micro)
            opt.clip_grad_norm(MAX_NORM)
            opt.step()
            opt.zero_grad()
            if state_dicts:
                saved = model.state_dict(), opt.state_dict()  # (sampled at the latter's write-backs)
                if peak is not None:
                    peak.sample()
                if peak is not None:  # (a load writes every chunk before it evicts them all: outside the budget)
                    peak.paused = True
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                if peak is not None:
                    assert file.resident_bytes() == 0, "the loaded state is written back and evicted"
                    peak.paused = False
        if peak is not None:
            assert peak.peak_bytes <= opt.config.host_memory_budget_bytes, (peak.peak_bytes, opt.config)
        runs.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if peak is not None:
            opt._disk.close()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[1])


def test_regions_at_the_huge_threshold_and_mixed_dtypes_round_trip(tmp_path):
    """Regions a page under, at and 64 bytes over ``HUGE_MIN_BYTES``, one of bf16 and fp32 tensors: each reads back
    what was written, alone (nothing of a neighbour comes in), and a write-back leaves nothing in memory."""
    entries = {0: [("x", HUGE_SHARD_NUMEL - PAGE_BYTES // 4)], 1: [("x", HUGE_SHARD_NUMEL)],
               2: [("x", HUGE_SHARD_NUMEL + 16)], 3: [("x", 3000)],
               4: [("x", HUGE_SHARD_NUMEL, torch.bfloat16), ("y", HUGE_SHARD_NUMEL // 2 + 7)]}
    file = DiskFile(tmp_path, 0, entries)
    for region, (offset, nbytes) in file.regions.items():
        huge = HUGE_PAGES and region in (1, 2, 4)
        assert (nbytes >= HUGE_MIN_BYTES) == (region in (1, 2, 4)) or not HUGE_PAGES
        used = sum(-(-numel * (dtype[0].itemsize if dtype else 4) // 64) * 64 for _, numel, *dtype in entries[region])
        assert not huge or (offset % HUGE_BYTES == 0 and nbytes % HUGE_BYTES == 0
                            and used <= nbytes < used + HUGE_BYTES)
        for key, *_ in entries[region]:
            file.tensor(region, key).copy_(torch.arange(file.tensor(region, key).numel()) % 251 + region)
        file.write_back(region)
    file.evict_all()
    for region in (4, 1, 3, 2, 0):
        file.ready(region)
        assert file.resident_bytes() == file.resident_bytes(region) == file.regions[region][1]
        assert file.mincore_bytes(0, file.nbytes) == file.regions[region][1]  # (cachestat's count is mincore's)
        for key, *_ in entries[region]:
            got = file.tensor(region, key)
            assert torch.equal(got, (torch.arange(got.numel()) % 251 + region).to(got.dtype)), (region, key)
        file.write_back(region)
        file.settle()
        assert file.resident_bytes() == 0
    file.close()


def test_a_read_for_reading_only_writes_nothing_back(tmp_path):
    """A region read in only to be read (a parameter shard's onload, a master's upload: ``ready(write=False)``) is
    mapped by read faults, so its pages stay clean and its write-back writes nothing; a read for the step (``ready()``)
    maps it writable (a write fault per folio there, not one per page in the step). Populating every read writable
    dirtied every page of the region (a write fault of a shared file mapping), so each onload wrote its parameter
    shard back whole. Only huge regions (16 MiB here) are populated readable; a small one (1.2 MB) is mapped writable,
    as a read fault's fault-around could map a neighbour's pages during its write-back."""
    file = DiskFile(tmp_path, 0, {0: [("x", 1 << 22)], 1: [("x", 300000)]})
    for region in file.regions:
        file.tensor(region, "x").fill_(float(region) + 1)
        file.write_back(region)
    file.settle()
    for region, (_, nbytes) in file.regions.items():
        before = _written_bytes()
        file.ready(region, write=False)  # (a huge region: read faults of its huge blocks, nothing past it)
        assert file.resident_bytes() == file.resident_bytes(region) == nbytes
        assert float(file.tensor(region, "x")[-1]) == region + 1
        file.write_back(region)
        file.settle()
        written = _written_bytes() - before  # a small region is mapped writable all the same ([Note: disk tier])
        assert written < 64 << 10 if HUGE_PAGES and nbytes >= HUGE_MIN_BYTES else written >= nbytes, (region, written)
        assert file.resident_bytes() == 0
        file.prefetch(region, write=False)  # read ahead for an onload, then taken by the step: writable after all
        file.ready(region)
        file.tensor(region, "x").add_(1)
        file.write_back(region)
        file.settle()
        assert _written_bytes() - before >= nbytes
    file.evict_all()
    assert [float(file.tensor(r, "x").sum()) for r in (0, 1)] == [2.0 * (1 << 22), 3.0 * 300000]
    file.close()


def test_resident_bytes_without_cachestat_counts_by_mincore(tmp_path, monkeypatch):
    """Where the kernel has no ``cachestat`` (before 6.5, or a seccomp filter), ``resident_bytes`` counts the pages by
    ``mincore``, the same numbers."""
    from hf_elixir.chunk import _disk

    file = DiskFile(tmp_path, 0, {0: [("x", HUGE_SHARD_NUMEL)], 1: [("x", 3000)]})
    file.tensor(0, "x").fill_(1.0)
    file.write_back(1)
    file.settle()
    counts = [file.resident_bytes(), file.resident_bytes(0), file.resident_bytes(1)]
    assert counts == [file.regions[0][1], file.regions[0][1], 0], counts
    monkeypatch.setattr(_disk, "_cachestat_missing", [True])
    assert [file.resident_bytes(), file.resident_bytes(0), file.resident_bytes(1)] == counts
    file.close()
