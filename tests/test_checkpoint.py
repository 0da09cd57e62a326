"""Checkpoints: exact resume, checksums, tied weights, atomicity under SIGKILL, sharded optimizer state
across runs and world sizes (hf_elixir/checkpoint.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import hf_elixir
from hf_elixir.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from tests._dist import run_distributed
from tests._models import batch, rank_batch, tiny_model, two_groups

CHUNK = 8192
ROOT = Path(__file__).resolve().parents[1]


def _prepare(model, precision="fp32", budget=200_000, lr=5e-3):
    opt = torch.optim.AdamW(two_groups(model), lr=lr)
    cfg = hf_elixir.ElixirConfig(precision=precision, chunk_size_numel=CHUNK, device_memory_budget_bytes=budget,
                                 budget_covers_activations=False)  # a model-data budget: chunks offloaded
    model, opt = hf_elixir.prepare(model, opt, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps, rows=2, rank=0, world_size=1):
    losses = []
    for s in steps:
        mine = rank_batch("gpt2", s, rank, world_size, rows)
        loss = model(**mine).loss
        opt.backward(loss)
        opt.clip_grad_norm(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision,layout,fused", [
    ("fp32", "consolidated", False), ("fp32", "sharded", False), ("bf16", "sharded", False),
    ("bf16", "consolidated", False),
    ("fp32", "sharded", True),  # Adam moments held by the fused chunk update (the CUDA path, interpreted)
])
def test_resume_gives_identical_losses(tmp_path, monkeypatch, precision, layout, fused):
    monkeypatch.setattr(hf_elixir.ElixirOptimizer, "_force_fused", fused)
    model, opt, sched = _prepare(tiny_model("gpt2"), precision)
    _train(model, opt, sched, range(3))
    save_checkpoint(tmp_path / "ckpt", model, opt, step=3, extra={"scheduler": sched.state_dict()},
                    optimizer_layout=layout)
    expected = _train(model, opt, sched, range(3, 6))
    expected_params = _params(model)

    fresh, fopt, fsched = _prepare(tiny_model("gpt2", seed=11), precision)
    info = load_checkpoint(tmp_path / "ckpt", fresh, fopt)
    fsched.load_state_dict(info["extra"]["scheduler"])
    assert info["step"] == 3 and info["world_size"] == 1
    resumed = _train(fresh, fopt, fsched, range(info["step"], 6))
    assert resumed == expected  # bit-identical losses
    assert all(torch.equal(v, expected_params[k]) for k, v in _params(fresh).items())


def test_manifest_records_step_world_size_plan_and_checksums(tmp_path):
    model, opt, sched = _prepare(tiny_model("gpt2"))
    _train(model, opt, sched, range(1))
    save_checkpoint(tmp_path / "c", model, opt, step=1)
    manifest = read_manifest(tmp_path / "c")
    assert manifest["step"] == 1 and manifest["world_size"] == 1 and manifest["format_version"] == 1
    assert manifest["plan"]["model_type"] == "gpt2" and manifest["plan"]["chunk_size_numel"] == CHUNK
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.safetensors", "optimizer.json"}
    assert all(len(r["sha256"]) == 64 and r["bytes"] > 0 for r in manifest["files"].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary leftovers


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("name,damage,message", [
    ("model.safetensors", _corrupt_flip, "SHA-256"),
    ("optimizer.safetensors", _corrupt_truncate, "truncated"),
    ("optimizer.json", lambda p: p.unlink(), "missing"),
    ("manifest.json", _corrupt_truncate, "manifest .* is corrupted"),
])
def test_corrupted_or_truncated_file_is_detected_before_anything_loads(tmp_path, name, damage, message):
    model, opt, sched = _prepare(tiny_model("gpt2"))
    _train(model, opt, sched, range(1))
    save_checkpoint(tmp_path / "c", model, opt, step=1)
    damage(tmp_path / "c" / name)
    fresh, fopt, _ = _prepare(tiny_model("gpt2", seed=3))
    before = _params(fresh)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path / "c", fresh, fopt)
    assert all(torch.equal(v, before[k]) for k, v in _params(fresh).items()), "a failed load changed the model"


@pytest.mark.parametrize("kind", ["gpt2", "opt"])
def test_tied_embeddings_round_trip_without_key_errors(tmp_path, kind):
    model = tiny_model(kind)
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=5e-3),
                                   hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    b = batch(kind, 0, 2)
    opt.backward(model(**b).loss)
    opt.step()
    opt.zero_grad()
    save_checkpoint(tmp_path / "c", model, opt, step=1)
    fresh = tiny_model(kind, seed=5)
    fresh, fopt = hf_elixir.prepare(fresh, torch.optim.AdamW(fresh.parameters(), lr=5e-3),
                                    hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    load_checkpoint(tmp_path / "c", fresh, fopt)  # raises on missing/unexpected keys
    assert fresh.get_output_embeddings().weight is fresh.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=b["input_ids"]).logits, model(input_ids=b["input_ids"]).logits)


def test_user_errors_are_clear(tmp_path):
    model, opt, sched = _prepare(tiny_model("gpt2"))
    with pytest.raises(TypeError, match="step"):
        save_checkpoint(tmp_path / "c", model, opt, step="3")
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path / "c", model, opt, step=1, extra={"t": torch.ones(2)})
    with pytest.raises(ValueError, match="optimizer_layout"):
        save_checkpoint(tmp_path / "c", model, opt, step=1, optimizer_layout="zero3")
    with pytest.raises(FileNotFoundError, match="no hf_elixir checkpoint"):
        load_checkpoint(tmp_path / "nothing", model, opt)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match="not an hf_elixir checkpoint; refusing to replace it"):
        save_checkpoint(tmp_path / "data", model, opt, step=1)
    assert (tmp_path / "data" / "notes.txt").read_text() == "precious"
    save_checkpoint(tmp_path / "m", model, None, step=0)
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(tmp_path / "m", model, opt)
    save_checkpoint(tmp_path / "c", model, opt, step=0)
    other = tiny_model("gpt2")  # one param group instead of two
    other, oopt = hf_elixir.prepare(other, torch.optim.AdamW(other.parameters()),
                                    hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    with pytest.raises(ValueError, match="param groups"):
        load_checkpoint(tmp_path / "c", other, oopt)
    opt_model = tiny_model("opt")
    opt_model, _ = hf_elixir.prepare(opt_model, None, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    with pytest.raises(ValueError, match="does not match this model: missing keys"):
        load_checkpoint(tmp_path / "c", opt_model, None)


def test_interrupted_between_renames_falls_back_to_previous_and_next_save_recovers(tmp_path):
    model, opt, sched = _prepare(tiny_model("gpt2"))
    save_checkpoint(tmp_path / "c", model, opt, step=1)
    # the state a kill between "DIR -> .DIR.previous" and ".DIR.saving -> DIR" leaves behind
    os.rename(tmp_path / "c", tmp_path / ".c.previous")
    (tmp_path / ".c.saving").mkdir()
    (tmp_path / ".c.saving" / "model.safetensors").write_bytes(b"partial")
    assert load_checkpoint(tmp_path / "c", model, opt)["step"] == 1
    save_checkpoint(tmp_path / "c", model, opt, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert load_checkpoint(tmp_path / "c", model, opt)["step"] == 2


# -- SIGKILL during saves --------------------------------------------------------------------------
_WIDTH = 384


def _constant_model(value: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(8)])  # ~1.2M params
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def saver_child(directory: str, ready_file: str) -> None:
    """Save checkpoints 1, 2, 3, ... forever; each checkpoint's model is filled with its step number."""
    torch.set_num_threads(1)
    model = _constant_model(0.0)
    model, opt = hf_elixir.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   hf_elixir.ElixirConfig(chunk_size_numel=_WIDTH * _WIDTH + _WIDTH))
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        save_checkpoint(directory, model, opt, step=step)
        if step == 1:
            Path(ready_file).write_text("ready")


def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    """Kill a process that saves in a loop at several delays; the directory always loads a complete,
    self-consistent checkpoint (every parameter equals its manifest's step)."""
    fork = multiprocessing.get_context("fork")  # the child inherits the imports: starts in milliseconds
    for trial, delay_s in enumerate([0.0, 0.03, 0.07, 0.13, 0.21, 0.34, 0.55]):
        directory, ready = tmp_path / f"c{trial}", tmp_path / f"ready{trial}"
        proc = fork.Process(target=saver_child, args=(str(directory), str(ready)), daemon=True)
        proc.start()
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert proc.is_alive(), "saver died before its first checkpoint"
                assert time.monotonic() < deadline, "saver never finished its first checkpoint"
                time.sleep(0.01)
            time.sleep(delay_s)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        assert proc.exitcode == -signal.SIGKILL
        model = _constant_model(-1.0)
        model, opt = hf_elixir.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       hf_elixir.ElixirConfig(chunk_size_numel=_WIDTH * _WIDTH + _WIDTH))
        info = load_checkpoint(directory, model, opt)
        assert info["step"] >= 1
        for name, value in model.state_dict().items():
            assert torch.all(value == float(info["step"])), f"trial {trial}: {name} is not from step {info['step']}"


# -- sharded optimizer state across runs and world sizes ----------------------------------------------
def _sharded_worker(rank, world_size, directory, single_rank_directory):
    # a checkpoint saved by a 1-rank run loads into this 2-rank run (resharded through the consolidated path)
    model, opt, sched = _prepare(tiny_model("gpt2", seed=4))
    load_checkpoint(single_rank_directory, model, opt)
    from_single = (_params(model), opt.state_dict()["state"]["transformer.h.0.mlp.c_fc.weight"]["exp_avg"])

    model, opt, sched = _prepare(tiny_model("gpt2"))
    _train(model, opt, sched, range(3), rank=rank, world_size=world_size)
    save_checkpoint(directory, model, opt, step=3, extra={"scheduler": sched.state_dict()},
                    optimizer_layout="sharded")
    save_checkpoint(directory + "-consolidated", model, opt, step=3, extra={"scheduler": sched.state_dict()})
    expected = _train(model, opt, sched, range(3, 5), rank=rank, world_size=world_size)
    exp_avg = opt.state_dict()["state"]["transformer.h.0.mlp.c_fc.weight"]["exp_avg"]
    expected_params = _params(model)
    # a fresh run with the same configuration (new model, optimizer, scheduler objects)
    fresh, fopt, fsched = _prepare(tiny_model("gpt2", seed=9))
    info = load_checkpoint(directory, fresh, fopt)
    fsched.load_state_dict(info["extra"]["scheduler"])
    resumed = _train(fresh, fopt, fsched, range(3, 5), rank=rank, world_size=world_size)
    same = all(torch.equal(v, expected_params[k]) for k, v in _params(fresh).items())
    return expected, resumed, same, exp_avg, from_single


def _exp_avg(opt):
    return opt.state_dict()["state"]["transformer.h.0.mlp.c_fc.weight"]["exp_avg"]


def test_sharded_optimizer_state_loads_into_a_fresh_run_and_another_world_size(tmp_path):
    directory, single = str(tmp_path / "c"), tmp_path / "single"
    model, opt, sched = _prepare(tiny_model("gpt2"))
    _train(model, opt, sched, range(2), rows=4)
    save_checkpoint(single, model, opt, step=2, optimizer_layout="sharded")
    single_params, single_exp_avg = _params(model), _exp_avg(opt)

    results = run_distributed(_sharded_worker, 2, directory, str(single), timeout_s=120)
    assert {p.name for p in Path(directory).iterdir()} >= {"optimizer.rank0.safetensors",
                                                           "optimizer.rank1.safetensors"}
    for expected, resumed, same, _, (params, exp_avg) in results:
        assert resumed == expected and same  # identical continuation on each rank
        assert all(torch.equal(v, single_params[k]) for k, v in params.items())  # 1 -> 2 ranks
        assert torch.equal(exp_avg, single_exp_avg)
    # 2 -> 1 rank, from shards and from the consolidated files: after 2 more steps on both ranks'
    # batches, the moments equal the 2-rank run's
    for source in (directory, directory + "-consolidated"):
        model, opt, sched = _prepare(tiny_model("gpt2", seed=9))
        info = load_checkpoint(source, model, opt)
        sched.load_state_dict(info["extra"]["scheduler"])
        assert info["world_size"] == 2
        _train(model, opt, sched, range(3, 5), rows=4)
        assert torch.allclose(_exp_avg(opt), results[0][3], rtol=1e-4, atol=1e-7)
    # shards over a sub-group (a tensor/expert-parallel mesh) cannot be resharded: a clear error
    manifest_path = Path(directory) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["chunk_layout"][0]["group_size"] = 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="sub-groups .* resume with world size 2"):
        load_checkpoint(directory, model, opt)
