"""No silent single-process runs (hf_elixir/parallel/_launch.py, [Note: silent single-process runs]): a launch of
several processes whose accelerator or process group sees one raises at prepare, naming the cause and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_elixir
from hf_elixir.parallel._launch import check_launch_world_size
from tests._dist import free_port

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import torch, accelerate, hf_elixir
accelerator = accelerate.Accelerator()  # no cpu=True: on a machine without a GPU each process sees itself only
print(f"distributed_type={accelerator.distributed_type} num_processes={accelerator.num_processes}", flush=True)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = hf_elixir.ElixirPlugin().prepare(accelerator, model, optimizer)
print("TRAINED ALONE", flush=True)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the silent case is a machine without a GPU")
def test_two_cpu_processes_that_each_see_one_raise_at_prepare(tmp_path):
    """The shipped recipe yaml (distributed_type MULTI_GPU, 2 processes) with a script that builds a plain
    Accelerator(): two processes with WORLD_SIZE=2 whose accelerators say NO / 1."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          str(ROOT / "recipes/gpt2/elixir.yaml"), "--num_processes", "2",
                          "--main_process_port", str(free_port()), str(script)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert text.count("distributed_type=DistributedType.NO num_processes=1") == 2  # the silent setting
    assert "TRAINED ALONE" not in text
    assert "the launcher started 2 processes (WORLD_SIZE=2) but the accelerator reports num_processes=1" in text
    assert "Accelerator(cpu=True)" in text and "ACCELERATE_USE_CPU=1" in text and "use_cpu=True" in text


def test_prepare_without_a_process_group_under_a_multi_process_launch_raises(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2.*torch.distributed is not initialized.*init_process_group"):
        hf_elixir.prepare(torch.nn.Linear(4, 4), None)


@pytest.mark.parametrize("world_size,num_processes,raises", [
    ("1", 1, False), ("", None, False), ("2", 2, False), ("2", 1, True), ("4", 1, True)])
def test_check_launch_world_size(monkeypatch, world_size, num_processes, raises):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    if raises:
        with pytest.raises(ValueError, match=f"WORLD_SIZE={world_size}.*num_processes=1"):
            check_launch_world_size(num_processes)
    else:
        check_launch_world_size(num_processes)
