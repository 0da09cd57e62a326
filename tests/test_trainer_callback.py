"""ElixirCallback with transformers.Trainer: 1 process (the script runs in the test's own process, as
``python script.py`` would run it: a one-process job is not distributed, under torchrun or not) and 2 processes
(torchrun, gloo on CPU).

The launched script runs, in one process group: Trainer + ElixirCallback (gradient accumulation 2,
max_grad_norm 0.5, linear schedule with warm-up, a checkpoint at step 3), the same Trainer without
the callback (DDP under 2 processes), ``save_model`` -> ``from_pretrained`` logits, and a resumed
run from the step-3 checkpoint. Results go to JSON for the assertions.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._dist import free_port

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    r'''
    import json, os, sys
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from hf_elixir.integrations import ElixirCallback

    out = sys.argv[1]
    rank = int(os.environ.get("RANK", "0"))
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_layer=2, n_embd=32, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (48, 16), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]

    def new_model():
        torch.manual_seed(0)
        return GPT2LMHeadModel(cfg)

    def args(name, **kw):
        return TrainingArguments(os.path.join(out, name), max_steps=6, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=2, max_grad_norm=0.5,
            weight_decay=0.01, logging_steps=1, save_strategy="steps", save_steps=3, report_to=[],
            use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, **kw)

    def losses(trainer):
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    cb = ElixirCallback()
    el = Trainer(new_model(), args("elixir"), train_dataset=data, callbacks=[cb])
    el.train()
    el_model = el.model
    logs = [h for h in el.state.log_history if "loss" in h]
    elixir_keys = sorted(k for k in logs[-1] if k.startswith("elixir/"))
    wrapped = type(el.model_wrapped).__name__
    probe = tokens[:2]
    el_model.eval()
    with torch.no_grad():
        logits = el_model(input_ids=probe).logits
    el.save_model(os.path.join(out, "final"))

    ref = Trainer(new_model(), args("ref"), train_dataset=data)
    ref.train()
    ref_sd = ref.accelerator.get_state_dict(ref.model)
    el_sd = el.accelerator.get_state_dict(el_model)
    max_param_diff = max(float((el_sd[k] - ref_sd[k]).abs().max()) for k in ref_sd)

    resumed = Trainer(new_model(), args("elixir"), train_dataset=data, callbacks=[ElixirCallback()])
    resumed.train(resume_from_checkpoint=os.path.join(out, "elixir", "checkpoint-3"))

    if rank == 0:
        reloaded = GPT2LMHeadModel.from_pretrained(os.path.join(out, "final")).eval()
        with torch.no_grad():
            reload_diff = float((reloaded(input_ids=probe).logits - logits).abs().max())
        json.dump(dict(
            world=int(os.environ.get("WORLD_SIZE", "1")), el=losses(el), ref=losses(ref), resumed=losses(resumed),
            el_grad_norms=[h.get("grad_norm") for h in logs], ref_grad_norms=[h.get("grad_norm") for h in ref.state.log_history if "loss" in h],
            elixir_keys=elixir_keys, wrapped=wrapped, optimizer=type(cb.optimizer).__name__,
            max_param_diff=max_param_diff, reload_diff=reload_diff,
            files=sorted(os.listdir(os.path.join(out, "final"))),
            ckpt_files=sorted(os.listdir(os.path.join(out, "elixir", "checkpoint-3"))),
        ), open(os.path.join(out, "result.json"), "w"))
    # tear the process group down on every rank before exit: a rank leaving while its gloo threads are
    # still up can abort ("terminate called without an active exception") at interpreter shutdown
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    '''
)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_trainer_with_elixir_callback(tmp_path, num_processes, monkeypatch):
    script = tmp_path / "train_trainer.py"
    script.write_text(SCRIPT)
    if num_processes == 1:  # saves a launch (a launcher and a worker starting up: most of this case's cost)
        import torch.distributed

        assert not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ
        monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path)])
        runpy.run_path(str(script), run_name="__main__")
    else:
        env = dict(os.environ)
        env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(tmp_path)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["world"] == num_processes
    assert r["optimizer"] == "ElixirOptimizer"
    assert r["wrapped"] != "DistributedDataParallel"
    # loss parity with the stock Trainer (DDP for 2 processes), step by step
    assert sorted(map(int, r["el"])) == list(range(1, 7))
    for step, loss in r["ref"].items():
        assert r["el"][step] == pytest.approx(loss, rel=1e-4), step
    for a, b in zip(r["el_grad_norms"], r["ref_grad_norms"]):
        assert a == pytest.approx(b, rel=1e-4)
    assert r["max_param_diff"] < 1e-4
    # Elixir's counters in the Trainer logs
    assert r["elixir_keys"] == ["elixir/device_peak_bytes", "elixir/loss_scale", "elixir/step_d2h_bytes", "elixir/step_h2d_bytes"]
    # save_model: a standard HF folder, same logits after from_pretrained
    assert "model.safetensors" in r["files"] and "config.json" in r["files"]
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(r["ckpt_files"])
    assert r["reload_diff"] < 1e-5
    # resume from step 3 reproduces steps 4-6 of the uninterrupted run
    for step in ("4", "5", "6"):
        assert r["resumed"][step] == pytest.approx(r["el"][step], rel=1e-6, abs=1e-7), step


def test_bf16_training_arguments_select_elixir_bf16(tmp_path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from hf_elixir import ElixirConfig
    from hf_elixir.integrations import ElixirCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_layer=1, n_embd=32, n_head=4))
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 128, (8, 16))]
    args = TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=2, bf16=True, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    cb = ElixirCallback()
    trainer = Trainer(model, args, train_dataset=data, callbacks=[cb])
    assert cb.config.precision == "bf16"
    trainer.train()
    assert type(cb.optimizer).__name__ == "ElixirOptimizer"
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
    with pytest.raises(ValueError, match="disagrees"):
        Trainer(model, TrainingArguments(str(tmp_path), fp16=False, bf16=True, use_cpu=True, report_to=[]),
                train_dataset=data, callbacks=[ElixirCallback(ElixirConfig(precision="fp16"))])


def test_trainer_and_plugin_log_the_same_settings_line(tmp_path, caplog):
    """Both integrations log one line with the ElixirConfig fields that differ from the defaults
    (``hf_elixir.integrations._binding.config_summary``), from the one call both go through: the Trainer
    callback's line and the accelerate plugin's carry the same settings."""
    import logging

    import torch
    from accelerate import Accelerator
    from transformers import Trainer, TrainingArguments

    from hf_elixir import ElixirConfig
    from hf_elixir.integrations import ElixirCallback, ElixirPlugin
    from tests._models import VOCAB, tiny_model

    config = ElixirConfig(chunk_size_numel=4096, offload_optimizer=True)
    settings = "chunk_size_numel=4096, offload_optimizer=True"

    def lines() -> list[str]:
        found = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_elixir: ElixirConfig from")]
        caplog.clear()
        return found

    caplog.set_level(logging.INFO, logger="hf_elixir")
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, VOCAB, (4, 12))]
    args = TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    Trainer(tiny_model("gpt2"), args, train_dataset=data, callbacks=[ElixirCallback(config)]).train()
    trainer_lines = lines()
    assert trainer_lines == [f"hf_elixir: ElixirConfig from ElixirCallback(config=...): {settings}"], trainer_lines

    model = tiny_model("gpt2")
    ElixirPlugin(config=config).prepare(Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters()))
    plugin_lines = lines()
    assert plugin_lines == [f"hf_elixir: ElixirConfig from ElixirPlugin(config=...): {settings}"], plugin_lines


def test_torch_compile_compiles_the_elixir_models_blocks_and_matches_the_eager_trainer(tmp_path):
    """``TrainingArguments(torch_compile=True)`` (accelerate's dynamo plugin) becomes ``ElixirConfig.compile``: each
    GPT-2 block's forward is compiled, with Elixir's hooks outside ([Note: torch.compile through the
    integrations] in ``hf_elixir/integrations/_compile.py``). Before, it only warned and ran uncompiled. The
    losses equal the eager Trainer's (backend ``eager``: dynamo's capture without a code generator)."""
    import torch
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    import hf_elixir
    from hf_elixir.integrations import ElixirCallback
    from tests._models import VOCAB, tiny_model

    torch.manual_seed(0)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, VOCAB, (6, 12))]

    def train(compiled: bool):
        AcceleratorState._reset_state()  # the dynamo plugin is process-wide state, set by the first Accelerator only
        try:
            args = TrainingArguments(str(tmp_path), max_steps=3, per_device_train_batch_size=2, use_cpu=True,
                                     report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1,
                                     torch_compile=compiled, torch_compile_backend="eager" if compiled else None)
            trainer = Trainer(tiny_model("gpt2"), args, train_dataset=data, callbacks=[ElixirCallback()])
            trainer.train()
        finally:
            AcceleratorState._reset_state()
        return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    trainer, losses = train(True)
    stats = hf_elixir.memory_stats(trainer.model)
    assert stats["num_compiled_blocks"] == 2 and stats["compile_graph_breaks"] == 0, stats
    assert hf_elixir.get_state(trainer.model).config.compile == {"backend": "eager"}
    assert trainer.model_wrapped is trainer.model  # not an OptimizedModule: the blocks are compiled inside
    _, eager_losses = train(False)
    assert len(losses) == 3 and losses == pytest.approx(eager_losses, rel=1e-5)


def test_search_auto_profiles_the_trainers_first_training_batch(tmp_path):
    """``ElixirCallback(ElixirConfig(search="auto"))`` (``ELIXIR_SEARCH=auto``) takes the profiled step's batch from
    the Trainer's own training DataLoader: the model gets a searched, profiled plan, and the Trainer then sees the
    same batches in the same shuffled order (a seeded ``data_seed`` generator included), so the losses match a
    ``search="off"`` run step for step."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import hf_elixir
    from hf_elixir.integrations import ElixirCallback

    cfg = GPT2Config(vocab_size=128, n_positions=32, n_layer=2, n_embd=32, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    tokens = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    seen: dict[str, list[int]] = {}

    def run(search: str):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)

        def spy(module, args, kwargs):  # the first token of each row of every training batch, in order
            if module.training and torch.is_grad_enabled():
                seen.setdefault(search, []).append(int(kwargs["input_ids"][:, 0].sum()))

        model.register_forward_pre_hook(spy, with_kwargs=True)
        args = TrainingArguments(str(tmp_path / search), max_steps=4, per_device_train_batch_size=2,
                                 learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, seed=0, data_seed=3, disable_tqdm=True)
        config = hf_elixir.ElixirConfig(search=search, chunk_size_numel=4096, device_memory_budget_bytes=2_000_000)
        trainer = Trainer(model, args, train_dataset=data, callbacks=[ElixirCallback(config)])
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return hf_elixir.get_state(trainer.model).plan, losses

    _, expected = run("off")
    plan, losses = run("auto")
    assert plan is not None and plan.predicted_step_s is not None and plan.activation_peak_bytes, plan
    # the profiled forwards ran on the first batch, then training saw the same 4 batches as search="off"
    profiled, trained = seen["auto"][:-4], seen["auto"][-4:]
    assert len(seen["off"]) == 4 and trained == seen["off"], seen
    assert profiled and set(profiled) == {seen["off"][0]}, seen
    assert losses == pytest.approx(expected, rel=1e-5)


def test_search_auto_leaves_no_idle_worker_processes_of_the_profiled_draw(tmp_path):
    """The profiled batch of ``search="auto"`` is drawn from the Trainer's plain training DataLoader; with
    ``dataloader_persistent_workers=True`` that loader kept its one-batch iterator and so ``dataloader_num_workers``
    idle processes for the whole training, beside the prepared loader's own (before: 2 worker processes with
    ``dataloader_num_workers=1``, 1 without the callback)."""
    import psutil
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    import hf_elixir
    from hf_elixir.integrations import ElixirCallback

    tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    counts = []

    before = {p.pid for p in psutil.Process().children(recursive=True)}  # other tests' processes, if any

    class CountWorkers(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            counts.append(len({p.pid for p in psutil.Process().children(recursive=True)} - before))

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_layer=1, n_embd=32, n_head=4))
    args = TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=2, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=1,
                             dataloader_persistent_workers=True)
    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[ElixirCallback(hf_elixir.ElixirConfig(search="auto")), CountWorkers()])
    trainer.train()
    assert hf_elixir.get_state(trainer.model).plan.predicted_step_s is not None  # it searched
    assert counts == [1, 1], counts  # the training loader's one worker, no idle one left by the draw


def test_search_auto_without_labels_says_the_profile_runs_the_model_alone(tmp_path):
    """A Trainer subclass computing its own loss from batches without labels: ``search="auto"``'s profiled step
    (``model(**batch).loss``) finds no loss. The error speaks to the Trainer user, who can pass neither
    ``sample_batch`` nor ``loss_fn`` (before: "pass labels in sample_batch or give loss_fn=" from the profiler),
    and the model is left unprepared."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import hf_elixir
    from hf_elixir.integrations import ElixirCallback
    from hf_elixir.runtime._state import is_prepared

    class OwnLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            logits = model(input_ids=inputs["input_ids"]).logits
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), inputs["input_ids"][:, 1:].flatten())

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_layer=1, n_embd=32, n_head=4))
    data = [{"input_ids": t} for t in torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))]
    args = TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=2, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = OwnLossTrainer(model, args, train_dataset=data,
                             callbacks=[ElixirCallback(hf_elixir.ElixirConfig(search="auto"))])
    with pytest.raises(ValueError, match=r"returned no loss for a batch with \['input_ids'\].*compute_loss.*search='off'"):
        trainer.train()
    assert not is_prepared(model)
