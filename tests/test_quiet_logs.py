"""Quiet logs: a training step at 2 ranks with a budget raises no FutureWarning (deprecated collective
names) and no "on expanded tensors" warning, and the Trainer logs a few ``elixir/*`` keys by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests._dist import free_port

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    r'''
    import json, os, sys, warnings
    # what must stay silent, as errors: deprecated torch names (FutureWarning, e.g. all_gather_into_tensor
    # on torch 2.13) and advanced-index writes on expanded placeholder tensors
    warnings.filterwarnings("error", category=FutureWarning)
    warnings.filterwarnings("error", message=".*on expanded tensors.*")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    import hf_elixir
    from hf_elixir.integrations import ElixirCallback

    out = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_layer=2, n_embd=32, n_head=4)
    tokens = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]

    def run(name, **callback_kw):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        budget = hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(model.parameters()), world_size=world)
        args = TrainingArguments(os.path.join(out, name), max_steps=2, per_device_train_batch_size=2,
                                 logging_steps=1, save_strategy="steps", save_steps=2, report_to=[], use_cpu=True,
                                 disable_tqdm=True)
        config = hf_elixir.ElixirConfig(device_memory_budget_bytes=budget, budget_covers_activations=False)
        trainer = Trainer(model, args, train_dataset=data, callbacks=[ElixirCallback(config, **callback_kw)])
        trainer.train()  # forward, backward (reduce-scatter), step, checkpoint (optimizer state all-gather)
        trainer.model.eval()
        with torch.no_grad():
            trainer.model(input_ids=tokens[:2])  # evaluation forward between steps (unshard, reshard)
        trainer.model.state_dict()
        return sorted(k for k in trainer.state.log_history[0] if k.startswith("elixir/"))

    keys = {"default": run("default"), "all": run("all", log_all_stats=True)}
    if int(os.environ.get("RANK", "0")) == 0:
        json.dump(keys, open(os.path.join(out, "keys.json"), "w"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    '''
)


def test_training_step_at_2_ranks_warns_nothing_and_logs_few_elixir_keys(tmp_path):
    script = tmp_path / "quiet.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "FutureWarning" not in proc.stderr and "expanded tensors" not in proc.stderr
    keys = json.loads((tmp_path / "keys.json").read_text())
    assert keys["default"] == ["elixir/device_peak_bytes", "elixir/loss_scale", "elixir/step_d2h_bytes",
                               "elixir/step_h2d_bytes"]
    assert {"elixir/num_evictions", "elixir/allgather_bytes", "elixir/step_reduce_scatter_bytes"} <= set(keys["all"])
    assert len(keys["all"]) > 15


def test_compat_collectives_use_the_current_torch_names(monkeypatch):
    """torch 2.13 names them *_single; torch 2.11 only has all_gather_into_tensor / reduce_scatter_tensor."""
    import torch.distributed as dist

    from hf_elixir import _compat

    calls = []
    monkeypatch.setattr(dist, "all_gather_single", lambda *a, **k: calls.append("all_gather_single"), raising=False)
    monkeypatch.setattr(dist, "reduce_scatter_single", lambda *a, **k: calls.append("reduce_scatter_single"),
                        raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: calls.append("all_gather_into_tensor"))
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda *a, **k: calls.append("reduce_scatter_tensor"))
    _compat.all_gather_single(None, None)
    _compat.reduce_scatter_single(None, None)
    monkeypatch.delattr(dist, "all_gather_single")  # torch 2.11
    monkeypatch.delattr(dist, "reduce_scatter_single")
    _compat.all_gather_single(None, None)
    _compat.reduce_scatter_single(None, None)
    assert calls == ["all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor"]


def _prepare_and_capture_info(rank: int, world_size: int) -> list[str]:
    import io
    import logging

    import torch

    import hf_elixir
    from tests._models import tiny_model

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.INFO)
    root = logging.getLogger("hf_elixir")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        model = tiny_model("gpt2")
        config = hf_elixir.ElixirConfig(default_placement="sharded", activation_policy="recompute")
        hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), config=config)
    finally:
        root.removeHandler(handler)
    return stream.getvalue().splitlines()


def test_placement_summary_is_logged_once_per_job_by_rank_0():
    """Under torchrun / accelerate launch every rank printed the same placement summary ("N params in M
    chunks ...") and activation-policy line; the ranks agree on both, so only rank 0 logs them (the
    others at DEBUG), as accelerate's main_process_only logging does."""
    from tests._dist import run_distributed

    lines = run_distributed(_prepare_and_capture_info, 2)
    for marker in (" params in ", "activation policy over "):
        assert sum(marker in line for line in lines[0]) == 1, lines[0]
        assert not any(marker in line for line in lines[1]), lines[1]
