"""The disk tier with parameter and gradient shards on disk ([Note: disk parameters] in hf_elixir/chunk/_disk_pages.py,
[Note: disk states] in hf_elixir/optim/_disk_state.py): an fp32 model whose shards live on the host (its masters are
those shards) under a host budget of a quarter of the 16 B/param state (fp32 parameter = master, gradient, two Adam
moments) keeps its moments, gradient shards and parameter shards in the file; 5 steps of AdamW with weight decay and
clipping match plain PyTorch at 1 and 2 gloo ranks, and the host memory really used (the host blocks plus the file's
pages in memory, ``mincore``) stays within the budget at every read, read-ahead and write-back. A checkpoint resumes
exactly; a budget below what must stay in host memory is refused naming the least, which
``hf_elixir.min_host_budget_bytes`` gives and which trains; ``~`` in ``offload_dir`` is the home directory."""

from __future__ import annotations

import dataclasses
import os
import re
import time

import pytest
import torch
import transformers

import hf_elixir
from hf_elixir.checkpoint import load_checkpoint, save_checkpoint
from hf_elixir.chunk._disk import (HUGE_BYTES, HUGE_MIN_BYTES, HUGE_PAGES, PAGE_BYTES, DiskFile, region_nbytes,
                                    scratch_bytes)
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, two_groups

CHUNK = 4096
ROWS = 2
STEPS = 5
MAX_NORM = 1.0


def _model(seed: int = 0) -> torch.nn.Module:
    """A tiny GPT-2 with enough chunks (33 of 4096 elements) that the regions in flight are a small part of it."""
    torch.manual_seed(seed)
    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=6, n_embd=32, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _num_params() -> int:
    return sum(p.numel() for p in _model().parameters())


def _prepare(offload_dir, world_size=1, seed=0, host_bytes=None, shards="host", **extra):
    """Shards on the host (``shards="host"``: the device budget is the floor, no room for any shard; ``"device"``: no
    device budget), a quarter of the state's host bytes by default; ``offload_dir=None``: no disk, no host budget."""
    model = _model(seed)
    opt = torch.optim.AdamW(two_groups(model, weight_decay=0.1), lr=3e-3)
    budget = host_bytes or 16 * _num_params() // world_size // 4
    config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, offload_optimizer=True, default_placement="sharded",
                                    budget_covers_activations=False, **extra,
                                    offload_dir=None if offload_dir is None else str(offload_dir),
                                    host_memory_budget_bytes=None if offload_dir is None else budget)
    if shards == "device":
        return hf_elixir.prepare(model, opt, config)
    floor = hf_elixir.min_device_budget_bytes(model, opt, config, world_size)
    return hf_elixir.prepare(model, opt, dataclasses.replace(config, device_memory_budget_bytes=floor))


class _HostPeak:
    """The host memory really used: the host blocks (``memory_stats()["host_bytes"]``) plus the file's pages in
    memory (``mincore``), sampled around every read, read-ahead and write-back of the file and after each phase."""

    def __init__(self, model, file) -> None:
        self.model, self.file, self.peak_bytes, self.samples = model, file, 0, 0
        for name in ("prefetch", "ready", "write_back"):
            original = getattr(file, name)

            def wrapped(region, *args, original=original, **kwargs):
                self.sample()
                original(region, *args, **kwargs)
                self.sample()

            setattr(file, name, wrapped)

    def sample(self) -> None:
        used = hf_elixir.memory_stats(self.model)["host_bytes"] + self.file.resident_bytes()
        self.peak_bytes = max(self.peak_bytes, used)
        self.samples += 1


def _step(model, opt, step, rank=0, world_size=1, peak=None):
    loss = model(**rank_batch("gpt2", step, rank, world_size, ROWS)).loss
    opt.backward(loss)
    for phase in (lambda: opt.clip_grad_norm(MAX_NORM), opt.step, opt.zero_grad):
        if peak is not None:
            peak.sample()
        phase()


def _reference(world_size, model=None):
    """Plain PyTorch on the global batch: ``model`` (default this file's ``_model``) after ``STEPS`` clipped AdamW
    steps (also the reference of tests/test_disk_tier_huge.py)."""
    ref = (model or _model)()
    ropt = torch.optim.AdamW(two_groups(ref, weight_decay=0.1), lr=3e-3)
    for step in range(STEPS):
        ref(**batch("gpt2", step, ROWS * world_size)).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ropt.step()
        ropt.zero_grad()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _in_file(tensor, file) -> bool:
    return file.storage.data_ptr() <= tensor.data_ptr() < file.storage.data_ptr() + file.nbytes


def _train_case(rank, world_size, offload_dir, shards="host"):
    model, opt = _prepare(offload_dir, world_size, shards=shards)
    manager, disk = opt.manager, opt._disk
    pages, file = manager.disk_pages, disk.file
    peak = _HostPeak(model, file)
    for step in range(STEPS):
        _step(model, opt, step, rank, world_size, peak)
    file.settle()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    host = [c for c in manager.chunks if c.trainable and not c.optim_on_device]
    out = {
        "rel": rel_l2(params, _reference(world_size)),
        "budget": opt.config.host_memory_budget_bytes, "peak": peak.peak_bytes, "samples": peak.samples,
        "shards_on_host": all(not c.shard_on_device for c in manager.chunks),
        "shards_on_device": all(c.shard_on_device for c in manager.chunks),
        # every chunk with moments (a trainable element in this rank's shard) has them on disk
        "all_states_on_disk": disk.state_chunks == {v.chunk.chunk_id for v in opt.views},
        "num_grads": len(pages.grads), "num_params": len(pages.params), "num_chunks": len(host),
        # a parameter shard on disk is the file's bytes and, fp32 on the host, the chunk's master
        "params_in_file": all(_in_file(manager.chunks[cid].shard, file) and opt.masters[cid] is
                              manager.chunks[cid].shard for cid in pages.params),
        "grads_in_file": all(_in_file(manager.grad_shards[cid], file) for cid in pages.grads),
        "resident_after": file.resident_bytes(),
    }
    disk.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_quarter_of_the_state_in_host_memory_matches_pytorch(tmp_path, world_size):
    for out in run_distributed(_train_case, world_size, str(tmp_path)):
        assert out["rel"] < 2e-5, out["rel"]
        assert out["shards_on_host"] and out["all_states_on_disk"]
        # the spill order: every chunk's moments, then gradient shards, then parameter shards (the last chunks')
        assert out["num_grads"] == out["num_chunks"] and 0 < out["num_params"] <= out["num_chunks"], out
        assert out["params_in_file"] and out["grads_in_file"]
        # host memory really used (host blocks + the file's resident pages) within the budget at its peak
        assert out["samples"] > 100 and 0 < out["peak"] <= out["budget"], out
        assert out["resident_after"] == 0


def test_shards_on_the_device_masters_moments_and_gradients_on_disk(tmp_path):
    """Shards on the device (separate fp32 masters, uploaded to the device after each step from the file: the upload
    reads the master's region in and evicts it): a quarter of the state in host memory, PyTorch's numbers."""
    (out,) = run_distributed(_train_case, 1, str(tmp_path), "device")
    assert out["rel"] < 2e-5, out["rel"]
    assert out["shards_on_device"] and out["all_states_on_disk"] and out["num_params"] == 0 and out["num_grads"]
    assert out["samples"] > 100 and 0 < out["peak"] <= out["budget"], out
    assert out["resident_after"] == 0


@pytest.mark.parametrize("precision,overlap,micro", [("fp32", True, 1), ("fp32", False, 2), ("bf16", False, 1)])
def test_parameters_on_disk_change_no_bit(tmp_path, precision, overlap, micro):
    """``overlap_host_optimizer=True`` (the host lane takes the gradients on its thread, and does not step during
    backward while they are on disk), gradient accumulation (the second micro-batch added to a gradient shard on
    disk), and bf16 (bf16 host shards on disk refreshed from fp32 masters on disk): the run with the parameters on
    disk is bit for bit the run with everything in host memory, within the host budget."""
    runs = []
    for offload_dir in (tmp_path, None):
        # (the reference without the disk does not speculate either: an undone speculative step is an ulp off)
        model, opt = _prepare(offload_dir, precision=precision, overlap_host_optimizer=overlap and bool(offload_dir))
        peak = None
        if offload_dir is not None:
            assert opt.manager.disk_pages.params and opt.manager.disk_pages.grads
            peak = _HostPeak(model, opt._disk.file)
        for step in range(3):
            for index in range(micro):
                opt.backward(model(**batch("gpt2", 10 * step + index, ROWS)).loss / micro)
            opt.clip_grad_norm(MAX_NORM)
            opt.step()
            opt.zero_grad()
        if peak is not None:  # (a bf16 state dict then reads the fp32 masters through the page cache)
            assert peak.peak_bytes <= opt.config.host_memory_budget_bytes, (peak.peak_bytes, opt.config)
            assert not opt._lane.speculate and opt._lane.num_speculated == 0
        runs.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if peak is not None:
            opt._disk.close()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[1])


def test_checkpoint_resume_with_parameters_on_disk_is_exact(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, opt = _prepare(tmp_path / "a")
    assert opt.manager.disk_pages.params
    for step in range(2):
        _step(model, opt, step)
    save_checkpoint(tmp_path / "ckpt", model, opt, step=2)
    for step in range(2, STEPS):
        _step(model, opt, step)
    resumed, ropt = _prepare(tmp_path / "b", seed=7)
    assert load_checkpoint(tmp_path / "ckpt", resumed, ropt)["step"] == 2
    for step in range(2, STEPS):
        _step(resumed, ropt, step)
    want, got = model.state_dict(), resumed.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), "the resume is bit for bit the uninterrupted run"


def test_loading_state_dicts_stays_within_the_host_budget(tmp_path):
    """``opt.load_state_dict`` and ``model.load_state_dict`` write every disk chunk's regions: each chunk's leave host
    memory once written (not all at the end), and nothing stays resident after the load."""
    model, opt = _prepare(tmp_path)
    for step in range(2):
        _step(model, opt, step)
    file = opt._disk.file
    saved = model.state_dict(), opt.state_dict()
    assert file.resident_bytes() == 0  # the state dicts read every region and leave none in host memory
    peak = _HostPeak(model, file)
    set_view_state = opt.set_view_state

    def sampled(view, target):  # a sample after each parameter's optimizer state is written
        set_view_state(view, target)
        peak.sample()

    opt.set_view_state = sampled
    for load, state in ((opt.load_state_dict, saved[1]), (model.load_state_dict, saved[0])):
        load(state)
        peak.sample()
        assert file.resident_bytes() == 0
    assert peak.peak_bytes <= opt.config.host_memory_budget_bytes, (peak.peak_bytes, opt.config.host_memory_budget_bytes)
    again = model.state_dict(), opt.state_dict()
    assert all(torch.equal(again[0][k], v) for k, v in saved[0].items())
    assert all(torch.equal(again[1]["state"][n][k], v) for n, e in saved[1]["state"].items() for k, v in e.items())
    opt._disk.close()


def test_a_bf16_export_reads_the_masters_from_disk_within_the_host_budget(tmp_path):
    """Under bf16 ``model.state_dict()`` writes the fp32 masters ([Note: fp32 exports]): each chunk's, read from the
    file, leaves host memory once gathered (it stayed resident: 528 KB over a 330 KB budget after the export)."""
    model, opt = _prepare(tmp_path, precision="bf16")
    for step in range(2):
        _step(model, opt, step)
    file = opt._disk.file
    file.settle()
    peak = _HostPeak(model, file)
    state = model.state_dict()
    peak.sample()
    assert state["lm_head.weight"].dtype == torch.float32 and file.resident_bytes() == 0
    assert peak.peak_bytes <= opt.config.host_memory_budget_bytes, (peak.peak_bytes, opt.config.host_memory_budget_bytes)
    opt._disk.close()


def test_the_least_host_budget_trains_and_below_it_is_refused(tmp_path):
    model, opt = _prepare(tmp_path)
    floor = hf_elixir.min_host_budget_bytes(model, opt)
    quarter = 16 * _num_params() // 4
    assert floor.with_disk_bytes < quarter < floor.without_disk_bytes, floor
    opt._disk.close()
    model, opt = _prepare(tmp_path, host_bytes=floor.with_disk_bytes)
    peak = _HostPeak(model, opt._disk.file)
    for step in range(2):
        _step(model, opt, step, peak=peak)
    assert peak.peak_bytes <= floor.with_disk_bytes, (peak.peak_bytes, floor)
    opt._disk.close()
    below = floor.with_disk_bytes - 1
    message = (f"ElixirConfig.host_memory_budget_bytes={below} is below the {floor.with_disk_bytes} bytes this rank "
               f"keeps in host memory even with every optimizer state, gradient shard and parameter host shard on disk")
    with pytest.raises(ValueError, match=re.escape(message) + f".*at least {floor.with_disk_bytes}"):
        _prepare(tmp_path, host_bytes=below)
    with pytest.raises(TypeError, match="min_host_budget_bytes\\(optimizer=AdamW\\)"):
        hf_elixir.min_host_budget_bytes(model, torch.optim.AdamW(_model().parameters()))


def test_offload_dir_expands_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "nvme").mkdir()
    config = hf_elixir.ElixirConfig(offload_dir="~/nvme", offload_optimizer=True)
    assert config.offload_dir == str(tmp_path / "nvme")
    file = DiskFile("~/nvme", 0, {0: [("a", 10)]})
    assert os.path.dirname(file.path) == str(tmp_path / "nvme")
    file.close()


def test_a_zeroed_region_reads_zeros_without_io_and_keeps_its_blocks(tmp_path):
    """``zero_grad`` of a gradient shard on disk punches its blocks out and reserves them again (``DiskFile.zero``)."""
    file = DiskFile(tmp_path, 0, {("grad", 0): [("grad", 5000)], ("grad", 1): [("grad", 5000)]})
    file.tensor(("grad", 0), "grad").fill_(3.0)
    file.tensor(("grad", 1), "grad").fill_(2.0)
    allocated = os.stat(file.path).st_blocks
    assert file.zero(("grad", 0))
    assert file.resident_bytes(("grad", 0)) == 0 and os.stat(file.path).st_blocks == allocated
    assert float(file.tensor(("grad", 0), "grad").abs().sum()) == 0.0
    assert float(file.tensor(("grad", 1), "grad").sum()) == 2.0 * 5000
    file.close()


def test_a_read_brings_in_its_region_and_nothing_past_it(tmp_path):
    """The kernel's readahead (``read_ahead_kb``, MBs) brought the regions after a 16 MiB one into memory, unasked
    (``posix_fadvise(WILLNEED)`` + populate on a ``MADV_NORMAL`` mapping: 17-50 MB more here); the tier reads exactly
    the region ([Note: disk tier]): a small one by ``preadv`` on a ``POSIX_FADV_RANDOM`` descriptor, a huge one
    (from ``HUGE_MIN_BYTES``, padded and aligned to ``HUGE_BYTES``) by its own faults, whole huge blocks."""
    numels = [1 << 22, 3000, (1 << 20) + 1000, 1 << 18, 1 << 22, 3 << 18]  # 16 MiB, 12 KB, 4 MiB + 4 KB, 1, 16, 3 MiB
    entries = {r: [("x", n)] for r, n in enumerate(numels)}
    file = DiskFile(tmp_path, 0, entries)
    assert len(file._scratch) == scratch_bytes([n for _, n in file.regions.values()])
    for region, (offset, nbytes) in file.regions.items():
        assert nbytes == region_nbytes(entries[region])  # what the host budget counts in flight
        huge = HUGE_PAGES and nbytes >= HUGE_MIN_BYTES
        assert huge == (HUGE_PAGES and region in (0, 2, 4))
        assert offset % (HUGE_BYTES if huge else PAGE_BYTES) == 0 and nbytes % (HUGE_BYTES if huge else PAGE_BYTES) == 0
        file.tensor(region, "x").fill_(float(region))
        file.write_back(region)
    file.evict_all()
    for region in (0, 2, 1, 4, 3, 5):
        file.ready(region)
        time.sleep(0.3)  # an asynchronous readahead would land by now
        assert file.resident_bytes() == file.resident_bytes(region) == file.regions[region][1]
        assert float(file.tensor(region, "x")[-1]) == float(file.tensor(region, "x")[0]) == float(region)
        file.write_back(region)
        file.settle()
    assert file.resident_bytes() == 0
    file.close()


def test_huge_regions_need_linux_5_18_with_transparent_huge_pages(monkeypatch):
    """Before Linux 5.18 a file fault in a ``MADV_HUGEPAGE`` + ``MADV_RANDOM`` mapping reads one page (0.07 GB/s
    measured for 4 KiB faults), so no region is huge there and every region is read by ``preadv``."""
    from hf_elixir.chunk import _disk

    uname = os.uname()
    for release, huge in (("5.15.0-91-generic", False), ("4.18.0-553.el8_10.x86_64", False),
                          ("5.18.0", True), ("6.18.44-fc-v1300", True)):
        monkeypatch.setattr(_disk.os, "uname", lambda r=release: os.uname_result((*uname[:2], r, *uname[3:])))
        assert _disk._huge_pages() == (huge and os.path.isdir("/sys/kernel/mm/transparent_hugepage")), release
