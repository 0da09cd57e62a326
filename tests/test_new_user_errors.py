"""Mistakes a new user makes with the disk tier, ``hf-elixir probe`` and ``hf-elixir plan --lora-rank``: each is
refused before any work, naming the field or flag, the value and the fix (docs/disk.md, docs/plans.md), instead of
being silently ignored, filling a disk or ending in a traceback."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hf_elixir import ElixirConfig


def test_offload_dir_without_host_optimizer_state_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"ElixirConfig.offload_dir='.*' is set with offload_optimizer=False.*"
                                         r"set offload_optimizer=True \(or 'auto'\), or leave offload_dir=None"):
        ElixirConfig(offload_dir=str(tmp_path), offload_optimizer=False)
    for value in (True, "auto"):  # the two settings that keep optimizer state on the host
        assert ElixirConfig(offload_dir=str(tmp_path), offload_optimizer=value).offload_dir == str(tmp_path)


def test_offload_dir_not_writable_says_what_failed_not_a_bare_strerror():
    """root passes ``os.access`` on /proc, where creating a file fails with ENOENT: "not writable (No such file or
    directory)" read as a contradiction, so the message says that creating a file there failed."""
    with pytest.raises(ValueError, match=re.escape("ElixirConfig.offload_dir='/proc' is not writable (creating a file "
                                                   "there failed: ") + r".*give a directory this process can create"):
        ElixirConfig(offload_dir="/proc", offload_optimizer=True)


def _probe(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    from hf_elixir.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["probe", *argv])
    return code, err.getvalue()


def test_probe_refuses_a_folder_it_cannot_write_with_the_flag_not_a_traceback():
    # root passes os.access on /proc, where no file can be created: the probe tries to create one
    code, err = _probe(["--disk-dir", "/proc", "--disk-size", "8KiB"])
    assert code == 2 and "--disk-dir /proc: not writable" in err and "give a folder you can write to" in err


def test_probe_refuses_a_file_larger_than_half_the_free_space(tmp_path, monkeypatch):
    """A typo such as ``--disk-size 100TB`` would otherwise write until the disk is full (and leave the file when
    the probe is killed); here the disk reports 1 MiB free, so the case is harmless even without the check."""
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    code, err = _probe(["--disk-dir", str(tmp_path), "--disk-size", "1MiB", "--repeats", "1"])
    assert code == 2 and f"--disk-size {2**20} bytes is more than half the {2**20} bytes free in" in err, err
    assert "256MiB" in err and not list(tmp_path.iterdir())  # refused before any byte was written
    from hf_elixir.profiler._disk_probe import measure_disk

    with pytest.raises(ValueError, match=r"measure_disk\(size_bytes=...\) 1048576 bytes is more than half"):
        measure_disk(tmp_path, size_bytes=2**20, repeats=1)
    assert measure_disk(tmp_path, size_bytes=2**19, repeats=1).size_bytes == 2**19  # half the free space: allowed


def test_plan_lora_without_peft_names_the_flag_and_the_install(monkeypatch):
    """``hf-elixir plan --lora-rank`` in an install without peft (``pip install -e ".[recipes]"`` has none): an error
    naming the flag and the install, before any work, not a ModuleNotFoundError traceback."""
    import contextlib
    import importlib.util
    import io

    from hf_elixir.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["plan", "--model", "tiny-gpt2", "--gpu-memory", "600KiB", "--seq-len", "32", "--lora-rank", "4"])
    assert code == 2 and "--lora-rank 4 plans peft's LoRA adapters, and peft is not installed" in err.getvalue()
    assert "pip install peft" in err.getvalue()


def test_plan_says_when_its_disk_holds_what_prepare_keeps_in_host_memory(tmp_path, monkeypatch):
    """docs/plans.md's disk example spills parameter chunks, of which prepare's disk tier takes the trained chunks'
    host shards but not frozen shards or rank-local refill copies (docs/disk.md): the report says so beside the plan,
    so a user does not size the host from it alone."""
    import contextlib
    import io

    from hf_elixir.cli import main

    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path))
    base = ["plan", "--model", "tiny-gpt2", "--gpu-memory", "600KiB", "--batch-size", "2", "--seq-len", "32",
            "--precision", "fp32", "--disk", "1GB", "--disk-gbps", "2"]
    for host, spills in (("200KiB", True), ("1GiB", False)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert main([*base, "--host-memory", host]) == 0
        text = " ".join(out.getvalue().split())  # the report wraps its lines to the terminal
        assert ("frozen chunks' shards and rank-local refill copies stay in host memory" in text) is spills, host


def _tiny_gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    return model, torch.optim.AdamW(model.parameters())


def _prepare_logged(caplog, config):
    import logging

    import hf_elixir

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_elixir"):
        model, optimizer = hf_elixir.prepare(*_tiny_gpt2(), config)
    return model, optimizer, [r for r in caplog.records if r.name.startswith("hf_elixir.optim")]


def test_offload_dir_that_nothing_reaches_is_said_not_silently_ignored(tmp_path, caplog):
    """``offload_dir`` with ``offload_optimizer='auto'`` (the default) and no device budget: the optimizer state stays
    on the device, so nothing can go to disk; a warning names the field and the fix instead of an empty folder."""
    *_, records = _prepare_logged(caplog, ElixirConfig(offload_dir=str(tmp_path), host_memory_budget_bytes="100KB"))
    warned = [r.getMessage() for r in records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"ElixirConfig.offload_dir='{tmp_path}' is unused" in warned[0], warned
    assert "offload_optimizer='auto'" in warned[0] and "set offload_optimizer=True" in warned[0]
    assert not list(tmp_path.iterdir())
    _, optimizer, records = _prepare_logged(caplog, ElixirConfig(  # the fix: the state on the host, then the disk
        offload_dir=str(tmp_path), host_memory_budget_bytes=2_400_000, offload_optimizer=True, chunk_size_numel=32768))
    assert not [r for r in records if r.levelname == "WARNING"] and len(list(tmp_path.iterdir())) == 1
    optimizer._disk.close()


def test_host_budget_below_the_host_state_without_a_disk_is_said(caplog):
    """Without ``offload_dir`` nothing can leave host memory, so a smaller ``host_memory_budget_bytes`` is exceeded:
    a warning names the field, the value, the least without a disk and the disk as the other fix."""
    import hf_elixir

    model, optimizer, records = _prepare_logged(caplog, ElixirConfig(
        offload_optimizer=True, host_memory_budget_bytes=1000, chunk_size_numel=32768))
    floor = hf_elixir.min_host_budget_bytes(model, optimizer)
    assert floor.with_disk_bytes < floor.without_disk_bytes, floor
    warned = [r.getMessage() for r in records if r.levelname == "WARNING"]
    assert warned == [f"hf_elixir: ElixirConfig.host_memory_budget_bytes=1000 is below the {floor.without_disk_bytes} "
                      "bytes of model data this rank keeps in host memory without a disk, so it is exceeded; raise it "
                      f"to at least {floor.without_disk_bytes}, or give offload_dir (a directory on a local SSD; the "
                      f"least budget with it is {floor.with_disk_bytes}: hf_elixir.min_host_budget_bytes)"], warned
    assert hf_elixir.memory_stats(model)["host_bytes"] == floor.without_disk_bytes
    *_, records = _prepare_logged(caplog, ElixirConfig(offload_optimizer=True, host_memory_budget_bytes="1GiB"))
    assert not [r for r in records if r.levelname == "WARNING"]


def test_offload_dir_never_raises_the_least_host_budget_above_the_no_disk_one(tmp_path, caplog):
    """One large chunk: the disk's regions in flight (two chunks' regions and two write-backs) cost more than the whole
    host state, so the least budget with ``offload_dir`` is the one without it; a budget that holds everything trains
    with nothing on disk, and one below it is refused naming the least and that the disk cannot lower it."""
    import hf_elixir

    config = ElixirConfig(offload_optimizer=True, chunk_size_numel=131072, offload_dir=str(tmp_path))
    model, optimizer, _ = _prepare_logged(caplog, config)
    floor = hf_elixir.min_host_budget_bytes(model, optimizer)
    assert floor.with_disk_bytes == floor.without_disk_bytes, floor
    optimizer._disk is None or optimizer._disk.close()
    model, optimizer, records = _prepare_logged(caplog, dataclasses.replace(
        config, host_memory_budget_bytes=floor.without_disk_bytes))
    assert optimizer._disk is None and not list(tmp_path.iterdir())
    assert any("nothing goes to offload_dir" in r.getMessage() for r in records)
    below = floor.without_disk_bytes - 1
    with pytest.raises(ValueError, match=re.escape(
            f"ElixirConfig.host_memory_budget_bytes={below} is below the {floor.without_disk_bytes} bytes of model "
            "data this rank keeps in host memory, and offload_dir cannot lower that") + ".*raise host_memory_budget_"
            f"bytes to at least {floor.without_disk_bytes}"):
        hf_elixir.prepare(*_tiny_gpt2(), dataclasses.replace(config, host_memory_budget_bytes=below))
