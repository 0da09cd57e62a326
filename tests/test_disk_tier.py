"""The disk tier ([Note: disk tier] in hf_elixir/chunk/_disk.py, [Note: disk states] in hf_elixir/optim/_disk_state.py):
with a host budget that holds the gradient shards and the regions in flight but not the fp32 masters and Adam moments,
those live in one file per rank under ``offload_dir`` and 5 steps of AdamW with weight decay and clipping match
plain PyTorch at 1 and 2 gloo ranks; the bytes are really in the file and the host blocks hold the gradient shards
only; read-ahead runs one chunk ahead and write-backs stay within the window; a rank SIGKILLed during a write-back
resumes exactly from its last checkpoint; bad ``offload_dir`` / disk budgets are refused with the field named."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hf_elixir
from hf_elixir.checkpoint import load_checkpoint, save_checkpoint
from hf_elixir.chunk import _disk
from hf_elixir.chunk._disk import DiskFile
from hf_elixir.optim._disk_state import WINDOW_CHUNKS
from tests import _dist
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model, two_groups

CHUNK = 4096
ROWS = 2
STEPS = 5
MAX_NORM = 0.05  # below the gradient norms: clipping acts


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _prepare(model, offload_dir, world_size=1, **config):
    num_params = sum(p.numel() for p in model.parameters())
    # 16 B/param (the state of an unpadded model; these tiny chunks carry much padding): the gradient shards stay in
    # host memory beside the regions in flight, the masters and moments go to disk (a quarter of the state, the gradient
    # and parameter shards on disk too: test_disk_tier_params.py)
    config.setdefault("host_memory_budget_bytes", 16 * num_params // world_size)
    opt = torch.optim.AdamW(two_groups(model), lr=3e-3)
    return hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, offload_optimizer=True, default_placement="sharded", offload_dir=str(offload_dir),
        **config))


def _step(model, opt, step, rank=0, world_size=1):
    opt.backward(model(**rank_batch("gpt2", step, rank, world_size, ROWS)).loss)
    opt.clip_grad_norm(MAX_NORM)
    opt.step()
    opt.zero_grad()


def _reference(steps, world_size):
    ref = tiny_model("gpt2")
    ropt = torch.optim.AdamW(two_groups(ref), lr=3e-3)
    for step in steps:
        ref(**batch("gpt2", step, ROWS * world_size)).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ropt.step()
        ropt.zero_grad()
    return _params(ref)


def _train_case(rank, world_size, offload_dir):
    model, opt = _prepare(tiny_model("gpt2"), offload_dir, world_size)
    disk, manager = opt._disk, opt.manager
    file = disk.file
    events = []  # the optimizer step's (the refresh of the device shards reads each master once more, in forward)
    prefetch, write_back, opt_step = file.prefetch, file.write_back, opt.step
    in_step = [False]

    def asked(region, write=True):
        if region not in file._reads and in_step[0]:
            events.append(("read", region))
        prefetch(region, write)

    def written(region):
        write_back(region)
        if in_step[0]:
            events.append(("write", region, len(file._writes)))  # in flight after the bounded wait

    def stepped():
        in_step[0] = True
        try:
            opt_step()
        finally:
            in_step[0] = False

    file.prefetch, file.write_back, opt.step = asked, written, stepped
    resident = []
    for step in range(STEPS):
        _step(model, opt, step, rank, world_size)
        file.settle()
        resident.append(file.resident_bytes())
    host_chunks = [c for c in manager.chunks if c.trainable and not c.optim_on_device]
    shard_numel = sum(c.shard_numel for c in host_chunks)
    stepped = {v.chunk.chunk_id for v in opt.views}  # chunks with a trainable element in this rank's shard
    on_disk = [c for c in host_chunks if c.chunk_id in disk.chunks]
    moment_numel = sum(c.shard_numel for c in on_disk if c.chunk_id in stepped)
    stat = os.stat(file.path)
    out = {
        "rel": rel_l2(_params(model), _reference(range(STEPS), world_size)),
        "name": os.path.basename(file.path), "disk_chunks": sorted(disk.chunks),
        "host_chunks": sorted(c.chunk_id for c in host_chunks), "shard_numel": shard_numel,
        "disk_numel": sum(c.shard_numel for c in on_disk), "moment_numel": moment_numel,
        "kept_numel": shard_numel - sum(c.shard_numel for c in on_disk),
        "regions_are_states": all(isinstance(r, int) for r in file.regions),
        "file_bytes": stat.st_size, "allocated_bytes": stat.st_blocks * 512,
        "host_block_bytes": manager.host.requested_bytes, "host_bytes": hf_elixir.memory_stats(model)["host_bytes"],
        "resident": resident, "region_bytes": max(n for _, n in file.regions.values()), "events": events,
        "read_bytes": file.bytes_read, "written_bytes": file.bytes_written,
        "stepped": sorted(stepped & disk.chunks),
        "stepped_bytes": sum(n for r, (_, n) in file.regions.items() if r in stepped),
    }
    path = file.path
    disk.close()
    out["removed"] = not os.path.exists(path)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_disk_tier_matches_pytorch_with_the_state_on_disk(tmp_path, world_size):
    results = run_distributed(_train_case, world_size, str(tmp_path))
    for rank, out in enumerate(results):
        assert out["rel"] < 2e-5, out["rel"]
        assert out["name"].startswith(f"hf_elixir-rank{rank}-"), out["name"]
        # the masters and moments of the last chunks (most of them) are on disk, the gradient shards are not
        disk_chunks, host_chunks = out["disk_chunks"], out["host_chunks"]
        assert disk_chunks == host_chunks[len(host_chunks) - len(disk_chunks):], (disk_chunks, host_chunks)
        assert 2 * len(disk_chunks) >= len(host_chunks) and out["regions_are_states"]
        # the file holds their masters and both moments (exp_avg, exp_avg_sq), allocated on the disk
        assert out["file_bytes"] >= 4 * out["disk_numel"] + 8 * out["moment_numel"] and out["moment_numel"] > 0
        assert out["allocated_bytes"] >= out["file_bytes"]
        # the host blocks hold the fp32 gradient shards and the other chunks' masters and moments (4 B per element
        # each, 512-byte aligned slices)
        assert 4 * out["shard_numel"] <= out["host_block_bytes"] <= 4 * out["shard_numel"] + 12 * out[
            "kept_numel"] + 512 * 4 * len(host_chunks), out
        assert out["host_bytes"] == out["host_block_bytes"]
        # once each step's write-backs are done, nothing of the file is left in host memory
        assert out["resident"] == [0] * STEPS, out["resident"]
        assert out["written_bytes"] >= STEPS * out["file_bytes"] - out["region_bytes"]
        # each stepped chunk read in once a step by its step, and every chunk once by the refresh of its device shard
        # from its master (at the next forward; after the last step, by the state dict)
        assert out["read_bytes"] == STEPS * (out["stepped_bytes"] + out["file_bytes"])
        assert out["removed"]
        _check_schedule(out["events"], out["stepped"], out["disk_chunks"])


def _check_schedule(events, stepped, regions):
    """Each step reads each stepped chunk once, chunk i + 1 before chunk i is written back; every chunk is written
    back once a step (an untouched one at its end); at most WINDOW_CHUNKS write-backs in flight."""
    per_step = len(stepped) + len(regions)
    assert len(events) == STEPS * per_step, events
    for step in range(STEPS):
        order = events[step * per_step:(step + 1) * per_step]
        assert sorted(e[1] for e in order if e[0] == "read") == stepped
        assert sorted(e[1] for e in order if e[0] == "write") == regions
        for i, region in enumerate(stepped[:-1]):
            assert order.index(("read", stepped[i + 1])) < next(
                k for k, e in enumerate(order) if e[0] == "write" and e[1] == region), order
    assert max(e[2] for e in events if e[0] == "write") <= WINDOW_CHUNKS


@pytest.mark.parametrize("precision,overlap", [("bf16", False), ("fp32", True)])
def test_the_disk_tier_changes_no_bit(tmp_path, precision, overlap):
    """bf16 (the same-pass host step with its staging cast) and the host lane stepping chunks during backward:
    the run with the state on disk is bit for bit the run with it in host memory."""
    runs = []
    for offload_dir in (tmp_path, None):
        config = dict(precision=precision, overlap_host_optimizer=overlap)
        if offload_dir is None:
            config.update(host_memory_budget_bytes=None)
        elif overlap:  # the lane steps during backward: room for the step's regions and backward's at once
            config.update(host_memory_budget_bytes=20 * sum(p.numel() for p in tiny_model("gpt2").parameters()))
        model, opt = _prepare(tiny_model("gpt2"), offload_dir or tmp_path, **config)
        if offload_dir is None:
            assert opt._disk is None
        else:
            assert opt._disk is not None and opt._disk.chunks
            same_pass = set(getattr(opt, "_same_pass", {}))
            assert precision != "bf16" or same_pass & opt._disk.chunks, "the same-pass step runs on disk chunks"
            assert opt._lane.speculate == overlap
        for step in range(3):
            _step(model, opt, step)
        runs.append(_params(model))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[1])


# -- kill -9 during a write-back, resume from the checkpoint ---------------------------------------------------
def _kill_during_write_back(offload_dir, ckpt_dir):
    model, opt = _prepare(tiny_model("gpt2"), offload_dir)
    for step in range(2):
        _step(model, opt, step)
    save_checkpoint(ckpt_dir, model, opt, step=2)
    file = opt._disk.file
    libc = _disk._libc()

    def killed(region):  # half the region written to the file, then SIGKILL from the writer thread
        offset, nbytes = file.regions[region]
        libc.msync(file._base + offset, nbytes // 2, _disk._MS_SYNC)
        os.kill(os.getpid(), signal.SIGKILL)

    file._write = killed
    _step(model, opt, 2)
    raise AssertionError("the write-back did not run")


def test_kill_during_a_write_back_then_resume_from_the_checkpoint_exactly(tmp_path):
    offload_dir, ckpt_dir = tmp_path / "disk", tmp_path / "ckpt"
    offload_dir.mkdir()
    method = _dist._start_method()
    victim = mp.get_context(method).Process(target=_kill_during_write_back, args=(str(offload_dir), str(ckpt_dir)))
    victim.start()
    victim.join(120)
    assert victim.exitcode == -signal.SIGKILL, victim.exitcode
    left = os.listdir(offload_dir)
    assert len(left) == 1 and left[0].startswith(f"hf_elixir-rank0-pid{victim.pid}-"), left  # no exit handler ran
    assert not any(name.endswith(".bin") for name in os.listdir(ckpt_dir)), "a checkpoint never holds the live file"

    uninterrupted, uopt = _prepare(tiny_model("gpt2"), tmp_path)
    for step in range(STEPS):
        _step(uninterrupted, uopt, step)
    model, opt = _prepare(tiny_model("gpt2", seed=7), offload_dir)
    assert not any(f"pid{victim.pid}-" in n for n in os.listdir(offload_dir)), "the killed rank's file is removed"
    assert load_checkpoint(ckpt_dir, model, opt)["step"] == 2
    assert opt._disk.file.resident_bytes() == 0, "the loaded state went to the file"
    for step in range(2, STEPS):
        _step(model, opt, step)
    got, want = _params(model), _params(uninterrupted)
    assert all(torch.equal(got[k], want[k]) for k in want), "the resume is bit for bit the uninterrupted run"


def _train_and_return(offload_dir):
    model, opt = _prepare(tiny_model("gpt2"), offload_dir)
    _step(model, opt, 0)
    assert len(os.listdir(offload_dir)) == 1


def test_the_file_is_removed_when_a_rank_process_returns(tmp_path):
    """A multiprocessing rank exits by os._exit, skipping atexit handlers: the file goes anyway."""
    process = mp.get_context(_dist._start_method()).Process(target=_train_and_return, args=(str(tmp_path),))
    process.start()
    process.join(120)
    assert process.exitcode == 0
    assert os.listdir(tmp_path) == []


# -- bad inputs -------------------------------------------------------------------------------------------------
def test_offload_dir_that_is_not_a_writable_directory_is_refused(tmp_path):
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(ValueError, match="ElixirConfig.offload_dir=.*file' is not a directory; create it"):
        hf_elixir.ElixirConfig(offload_dir=not_dir)
    with pytest.raises(ValueError, match="ElixirConfig.offload_dir='/proc' is not writable"):
        hf_elixir.ElixirConfig(offload_dir="/proc")
    with pytest.raises(ValueError, match="ElixirConfig.disk_budget_bytes=.* at most the .* bytes free in offload_dir"):
        hf_elixir.ElixirConfig(offload_dir=tmp_path, disk_budget_bytes="1000TB")


def test_a_disk_without_the_space_the_run_needs_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="ElixirConfig.disk_budget_bytes=4096 is below the .* bytes this rank"):
        _prepare(tiny_model("gpt2"), tmp_path, disk_budget_bytes=4096)

    class Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(_disk.os, "statvfs", lambda path: Full())
    with pytest.raises(ValueError, match="ElixirConfig.offload_dir=.* has 4096 bytes free, below the"):
        _prepare(tiny_model("gpt2"), tmp_path)
    monkeypatch.undo()

    def enospc(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_disk.os, "posix_fallocate", enospc)
    with pytest.raises(ValueError, match="ElixirConfig.offload_dir=.*: cannot reserve .* bytes for the disk tier "
                                         "\\(No space left on device\\)"):
        _prepare(tiny_model("gpt2"), tmp_path)
    assert os.listdir(tmp_path) == [], "nothing is left behind"


def test_no_disk_when_the_state_fits_the_host_budget(tmp_path):
    model, opt = _prepare(tiny_model("gpt2"), tmp_path, host_memory_budget_bytes=2**30)
    assert opt._disk is None and os.listdir(tmp_path) == []


def test_disk_file_round_trip_and_residency(tmp_path):
    """The file alone: tensors are the file's bytes; a write-back leaves nothing resident; a read brings it in."""
    file = DiskFile(tmp_path, 3, {0: [("a", 1000), ("b", 10)], 5: [("a", 70000)]})
    assert os.path.basename(file.path).startswith("hf_elixir-rank3-")
    file.tensor(5, "a").fill_(2.5)
    file.write_back(5)
    file.write_back(0)
    file.settle()
    assert file.resident_bytes() == 0
    raw = torch.from_file(file.path, shared=False, size=file.nbytes // 4, dtype=torch.float32)
    offset = file.regions[5][0] // 4
    assert torch.equal(raw[offset:offset + 70000], torch.full((70000,), 2.5))
    file.ready(5)
    assert file.resident_bytes() >= 70000 * 4 and float(file.tensor(5, "a").sum()) == 2.5 * 70000
    path = file.path
    file.close()
    assert not os.path.exists(path)
