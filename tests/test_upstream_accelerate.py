"""accelerate's own test scripts, run unchanged with every model + optimizer routed through ``ElixirPlugin``.

``tests/upstream/accelerate_shim.py`` imports ``accelerate/test_utils/scripts/<name>.py`` from the
installed accelerate, patches ``Accelerator.prepare`` so a call with a model and an optimizer goes
through ``ElixirPlugin().prepare``, replaces only the upstream checks named in its ``EXCLUDED`` table
(each with the reason next to it) and runs the script's ``main()``. These scripts use patterns our own
tests do not: 0-d parameters (``RegressionModel.a``/``.b``), ``model.zero_grad()`` as the only way
gradients are cleared, dataloaders and schedulers prepared in the same call, several Accelerators and
models in one process, ``accumulate()`` with a scheduler, and an exact (1e-6) comparison with a plain
single-process SGD baseline.

Runs:

* ``test_script`` at 1 process with the default config (all resident): upstream's checks exactly.
* ``test_script`` and ``test_sync`` at 2 gloo processes with sharded placement and the smallest budget
  ``prepare`` accepts (chunks offloaded and onloaded every step); ``ELIXIR_SHIM_READ_FULL=1`` lets the
  after-training reads of ``model.a`` see the full values (see the shim's docstring).
* ``test_sync`` at 1 process, offloaded.

* ``test_distributed_data_loop`` at 2 gloo processes: the dataloader checks (``even_batches`` padding
  and its opt-out, sampler/batch-sampler variants, pickling a prepared accelerator) in a process where
  hf_elixir patched ``Accelerator.prepare``. Its models are prepared without an optimizer, so they stay
  plain DDP; its ``join_uneven_inputs`` checks need accelerate's multi-GPU branch (on CPU processes the
  call does nothing, and ``test_can_join_uneven_inputs`` hangs with stock accelerate), so they are
  excluded in the shim with that reason. What ``join_uneven_inputs`` does with an hf_elixir model
  (uneven batches refused at once, even batches run) is
  ``tests/test_accelerate_plugin.py::test_join_uneven_inputs_refuses_uneven_batches_for_an_elixir_model_instead_of_hanging``.

``test_ops`` (no model) passes through the shim too but never reaches hf_elixir; it is not run here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port
from tests.upstream.accelerate_shim import EXCLUDED

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "tests" / "upstream" / "accelerate_shim.py"
OFFLOAD = {"ELIXIR_DEFAULT_PLACEMENT": "sharded", "ELIXIR_SHIM_BUDGET": "min", "ELIXIR_SHIM_READ_FULL": "1"}


def _launch(tmp_path: Path, script: str, num_processes: int, elixir_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELIXIR_")}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf_home"), **elixir_env)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["--multi_gpu", "--num_processes", str(num_processes)] if num_processes > 1 else ["--cpu", "--num_processes", "1"]
    proc = subprocess.run(cmd + [str(SHIM), script], env=env, capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out


def _check_common(out: str, script: str, num_processes: int, prepared_per_rank: int) -> None:
    # every rank routed the expected number of model/optimizer pairs through hf_elixir
    assert re.findall(r"ELIXIR_SHIM prepared (\d+)", out) == [str(prepared_per_rank)] * num_processes, out[-4000:]
    # only excluded checks were skipped, each printing its reason
    skipped = set(re.findall(r"SKIPPED (\w+): ", out))
    assert skipped <= set(EXCLUDED[script]), skipped


@pytest.mark.parametrize("num_processes", [1, 2])
def test_accelerate_test_script_training_check(tmp_path, num_processes):
    elixir_env = OFFLOAD if num_processes > 1 else {}
    out = _launch(tmp_path, "test_script", num_processes, elixir_env)
    # training_check twice (plain and seedable sampler), each training with and without split batches
    _check_common(out, "test_script", num_processes, prepared_per_rank=4)
    assert set(re.findall(r"SKIPPED (\w+): ", out)) == {"is_bf16_available", "is_fp16_available"}
    assert out.count("Training yielded the same results on one CPU or distributed setup with no batch split") == 2
    assert out.count("Training yielded the same results on one CPU or distributed setup with batch split") == 2
    assert "**Test reinstantiated state**" in out


@pytest.mark.parametrize("num_processes", [1, 2])
def test_accelerate_test_sync_accumulate_with_scheduler(tmp_path, num_processes):
    out = _launch(tmp_path, "test_sync", num_processes, OFFLOAD)
    _check_common(out, "test_sync", num_processes, prepared_per_rank=1)
    assert "gradient accumulation with optimizer and scheduler" in out
    assert "SKIPPED" not in out
    if num_processes > 1:  # upstream's gradient comparison, on full_gradients: once per iteration (3 batches a rank)
        assert out.count("ELIXIR_SHIM check_model_parameters on full_gradients") == 3 * num_processes


def test_accelerate_distributed_data_loop_at_2_processes(tmp_path):
    """Upstream's dataloader checks at 2 CPU processes, finishing (it hung in the join check before that
    check was excluded for CPU processes: see the shim's EXCLUDED reasons)."""
    out = _launch(tmp_path, "test_distributed_data_loop", 2, {})
    _check_common(out, "test_distributed_data_loop", 2, prepared_per_rank=0)
    assert out.count("SKIPPED test_can_join_uneven_inputs") == 2
    for check in ("Test that even_batches variable ensures uniform batches", "Run tests with even_batches disabled",
                  "Test join with non DDP distributed raises warning", "Test pickling an accelerator",
                  "Test DataLoader with sampler as an instance of `BatchSampler`"):
        assert check in out, out[-4000:]
