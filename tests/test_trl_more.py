"""TRL 1.16's other trainers with their defaults (fp32: ``bf16=False``; small batches, lengths and vocabularies) through
``callbacks=[ElixirCallback(...)]``, at 1 process (in this process) and 2 processes (torchrun, gloo on CPU), against the
same TRL run without the callback (DDP at 2 processes), under a device budget that evicts: ``RLOOTrainer`` (also with
``sync_ref_model=True``), ``KTOTrainer`` and ``DistillationTrainer`` (a wider teacher; both also with a LoRA
``peft_config``), and from ``trl.experimental`` GKD, GOLD (with the byte-level BPE tokenizer it needs) and IW-OPD
(teachers), ORPO, CPO, online DPO, TPO, GMPO, A2PO, SDFT and SDPO (an EMA teacher synced from the student after every
step). The script is ``tests/launch_scripts/trl_more_trainers.py``; ``tests/test_trl.py`` covers SFT, DPO, Reward and
GRPO.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "launch_scripts" / "trl_more_trainers.py"

CASES = ["rloo", "rloo_sync", "kto", "kto_lora", "distillation", "distillation_lora", "gkd", "gold", "iw_opd", "orpo",
         "cpo", "online_dpo", "tpo", "gmpo", "a2po", "sdft", "sdpo"]
SYNCED = {"rloo_sync", "sdpo"}  # TRL syncs a reference / teacher from the trained model between steps


def _check(out: Path, world: int) -> None:
    for case in CASES:
        r = json.loads((out / f"{case}.json").read_text())
        assert r["world"] == world and r["keys"], case
        assert len(r["losses"]) == len(r["ref_losses"]) == 3, case
        # RLOO's and GMPO's losses are 0 up to fp32 rounding of O(1) terms (advantages sum to zero), and the
        # distillation losses are small differences of O(1) terms: the absolute tolerance covers that rounding, the
        # gradient norms and weights carry the comparison
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=2e-6), case
        assert r["grad_norms"] == pytest.approx(r["ref_grad_norms"], rel=5e-5), case
        assert r["rel_l2"] < 1e-5, (case, r["rel_l2"])
        assert r["moved"] > 1e-2, case  # three steps at lr 1e-2 really trained the weights
        assert r["evictions"] > 0, case  # the budget evicted chunks: parameters really were sharded / offloaded
        if case in SYNCED:
            assert r["target_moved"] > 1e-3 and r["target_rel_l2"] < 1e-5, (case, r)


def test_more_trl_trainers_one_process(tmp_path, monkeypatch):
    import torch.distributed

    assert not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(tmp_path), *CASES])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    _check(tmp_path, 1)


def test_more_trl_trainers_two_processes(tmp_path):
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(SCRIPT), str(tmp_path), *CASES]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    _check(tmp_path, 2)


def test_reference_sync_of_a_plain_model_is_trls_own():
    """The sync ElixirCallback gives TRL's ``SyncRefModelCallback`` leaves a model that is not under hf_elixir to
    TRL's own update (the same values bit for bit)."""
    from accelerate import Accelerator
    from trl.trainer.callbacks import SyncRefModelCallback

    from hf_elixir.integrations._target_sync import serve_target_syncs

    Accelerator(cpu=True)  # TRL's sync reads the accelerator state (DeepSpeed or not)
    torch.manual_seed(0)
    model, target, want = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    want.load_state_dict(target.state_dict())
    callback = SyncRefModelCallback(ref_model=target, accelerator=None)
    assert serve_target_syncs([callback, object()]) == 1 and serve_target_syncs([callback]) == 0  # once per callback
    callback.sync_target_model(model, target, 0.3)
    SyncRefModelCallback._sync_target_model(model, want, 0.3)
    for got, ref in zip(target.parameters(), want.parameters()):
        assert torch.equal(got, ref)
