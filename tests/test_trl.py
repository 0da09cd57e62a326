"""TRL's trainers (SFT, DPO, Reward, GRPO without vLLM) with their defaults (fp32: ``bf16=False``) through ``callbacks=[ElixirCallback(...)]``, at 1 process
(in this process, as ``python script.py`` runs it) and 2 processes (torchrun, gloo on CPU), against the same TRL run
without the callback (DDP at 2 processes): losses step by step and final weights, under a device budget that evicts.

TRL's SFT and DPO losses read ``lm_head.weight`` directly (their fused LM head), so these also cover parameters read
outside their own module's forward ([Note: external reads] in hf_elixir/chunk/_external.py). The script is
``tests/launch_scripts/trl_trainers.py``: a tiny Llama built from a config, a word-level tokenizer built offline.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port


REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "launch_scripts" / "trl_trainers.py"

ONE_PROCESS = ["sft", "sft_packing", "sft_completion", "sft_lora", "dpo", "dpo_lora", "reward", "grpo"]
TWO_PROCESSES = ["sft", "sft_lora", "dpo", "dpo_lora", "reward", "grpo"]


def _check(out: Path, cases: list[str], world: int) -> None:
    for case in cases:
        r = json.loads((out / f"{case}.json").read_text())
        assert r["world"] == world
        assert r["keys"], case  # the same state-dict keys (PEFT's included)
        assert len(r["losses"]) == 3, case
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-7), case  # GRPO's first loss is ~0
        assert r["rel_l2"] < 1e-5, (case, r["rel_l2"])
        assert r["evictions"] > 0, case  # the budget evicted chunks: parameters really were sharded / offloaded


def test_trl_trainers_one_process(tmp_path, monkeypatch):
    import torch.distributed

    assert not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(tmp_path), *ONE_PROCESS])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    _check(tmp_path, ONE_PROCESS, 1)


def test_trl_trainers_two_processes(tmp_path):
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(SCRIPT), str(tmp_path), *TWO_PROCESSES]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    _check(tmp_path, TWO_PROCESSES, 2)


def _accelerate_launch(tmp_path: Path, config: Path, out: Path, cases: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELIXIR_")}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf_home"),
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
           str(free_port()), "--multi_gpu", "--num_processes", "2", str(SCRIPT), str(out), "--unchanged", *cases]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_unchanged_trl_script_under_accelerate_launch_with_the_elixir_config(tmp_path):
    """``accelerate launch --config_file elixir.yaml`` (2 processes) of a TRL script with no hf_elixir line trains its
    SFT and DPO models under Elixir, with the losses and final weights of the same launch without the elixir
    section (DDP)."""
    import torch

    yaml = (REPO / "tests" / "launch_scripts" / "elixir_test.yaml").read_text()
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.split("dynamo_config:")[0])  # the same config without its elixir section
    cases = ["sft", "dpo"]
    _accelerate_launch(tmp_path, REPO / "tests" / "launch_scripts" / "elixir_test.yaml", tmp_path / "elixir", cases)
    _accelerate_launch(tmp_path, plain, tmp_path / "plain", cases)
    for case in cases:
        el = json.loads((tmp_path / "elixir" / f"{case}.json").read_text())
        ref = json.loads((tmp_path / "plain" / f"{case}.json").read_text())
        assert el["under_elixir"] and not ref["under_elixir"] and el["world"] == 2, case
        assert el["losses"] == pytest.approx(ref["losses"], rel=1e-5), case
        got, want = torch.load(tmp_path / "elixir" / f"{case}.pt"), torch.load(tmp_path / "plain" / f"{case}.pt")
        num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in want)
        den = sum(float(want[k].double().norm() ** 2) for k in want)
        assert (num / den) ** 0.5 < 1e-5, case
