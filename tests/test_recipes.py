"""Recipes end to end (tiny GPT-2 / OPT / Switch under hf_elixir) and the offline data module."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAST = ["--max_train_plays", "2", "--max_eval_samples", "8", "--max_steps", "6", "--logging_steps", "2",
        "--per_device_train_batch_size", "4", "--vocab_size", "512", "--learning_rate", "5e-3", "--warmup_steps", "0"]


def test_shakespeare_split_tokenizer_and_blocks():
    from hf_elixir.data import DEFAULT_EVAL_PLAYS, group_into_blocks, load_shakespeare, make_next_line_pairs
    from hf_elixir.data import train_bpe_tokenizer

    ds = load_shakespeare(max_plays=2)
    assert sorted(ds["validation"]["title"]) == sorted(DEFAULT_EVAL_PLAYS)
    assert not set(ds["train"]["title"]) & set(DEFAULT_EVAL_PLAYS) and len(ds["train"]) == 2
    assert "**" not in ds["train"][0]["text"] and ":\n" in ds["train"][0]["text"]
    tok = train_bpe_tokenizer(ds["train"]["text"], vocab_size=400)
    assert len(tok) == 400 and tok.eos_token_id == 0 and tok.pad_token_id == 1
    line = "Tomorrow, and tomorrow, and tomorrow,"
    assert tok.decode(tok(line)["input_ids"]) == line
    blocks = group_into_blocks(ds["validation"], tok, 32)
    assert len(blocks) > 100 and all(len(x) == 32 for x in blocks[:5]["input_ids"])
    assert blocks[0]["input_ids"] == blocks[0]["labels"]
    pairs = make_next_line_pairs(ds["validation"], tok, max_pairs=5)
    assert len(pairs) == 5 and pairs[0]["labels"][-1] == tok.eos_token_id
    with pytest.raises(ValueError, match="not shipped plays"):
        load_shakespeare(eval_plays=("no-such-play",))
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["x"], vocab_size=10)


def test_load_text_dataset_from_a_local_file(tmp_path):
    from hf_elixir.data import load_text_dataset

    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"line {i}" for i in range(40)))
    ds = load_text_dataset(train_file=str(path))
    assert len(ds["train"]) + len(ds["validation"]) == 40 and len(ds["validation"]) == 2
    with pytest.raises(ValueError, match="both given"):
        load_text_dataset(dataset_name="x", train_file=str(path))


def _recipe_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ELIXIR_CONFIG_FILE", None)
    return env


def _run_recipe(tmp_path: Path, script: str, *extra: str, launcher: tuple[str, ...] = ()) -> dict:
    out = tmp_path / "model"
    cmd = [sys.executable, *launcher, str(REPO / "recipes" / script), *FAST, "--output_dir", str(out), *extra]
    proc = subprocess.run(cmd, env=_recipe_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "eval perplexity before training" in proc.stdout and "sample:" in proc.stdout
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files, files
    result = json.loads((out / "recipe_results.json").read_text())
    result["stdout"], result["stderr"] = proc.stdout, proc.stderr
    return result


@pytest.mark.parametrize(
    "script,extra",
    [
        ("finetune_clm.py", ["--model_type", "gpt2"]),
        ("finetune_clm.py", ["--model_type", "opt", "--trainer"]),
        ("finetune_switch.py", ["--per_device_train_batch_size", "8"]),
    ],
    ids=["gpt2-accelerate", "opt-trainer", "switch-accelerate"],
)
def test_recipe_runs_end_to_end_under_elixir(tmp_path, script, extra):
    r = _run_recipe(tmp_path, script, *extra)
    assert r["last_loss"] < r["first_loss"]
    assert r["eval_ppl_after"] < r["eval_ppl_before"]
    assert r["num_processes"] == 1
    assert "job: 1 process (rank 0, 1 node(s))" in r["stdout"]
    # redirected output has one progress display: a line per logged step (1, 2, 4, 6), no progress bar repeating
    # them (a bar's carriage-return updates made one very long line per run in a log file)
    out = r["stdout"] + r["stderr"]
    assert "\r" not in out and "it/s]" not in out and "s/it]" not in out, out[-2000:]
    logged = [line for line in r["stdout"].splitlines() if line.startswith(("step ", "{'loss'"))]
    assert len(logged) == 4 and len(set(logged)) == 4, logged
    assert "ElixirConfig(precision=" not in out  # the settings once, as the fields that differ from the defaults


@pytest.mark.parametrize("path", [pytest.param([], marks=pytest.mark.slow), ["--trainer"]], ids=["accelerate", "trainer"])
def test_recipe_under_torchrun_on_cpu_is_really_distributed(tmp_path, path):
    """Two CPU processes are one data-parallel job of two (each its own batches), not two copies of a
    one-process job: TrainingArguments used to set accelerate's state up as non-distributed on CPU.

    Only the main process trains the tokenizer (the other receives it) and shows the dataset Map
    progress (each process used to train its own and print its own four bars). Both paths log the
    learning rate each logged step used, the Trainer's convention (the Accelerate loop logged the rate
    after the step: 0 at the last step of a linear schedule)."""
    launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()))
    r = _run_recipe(tmp_path, "finetune_clm.py", "--model_type", "gpt2", *path, launcher=launcher)
    assert r["num_processes"] == 2
    assert r["last_loss"] < r["first_loss"]  # trains, and ran to the end on both ranks
    assert r["eval_ppl_after"] < r["eval_ppl_before"]
    out = r["stdout"] + r["stderr"]
    assert out.count("trained a byte-level BPE tokenizer") == 1, out[-3000:]
    assert "Map:" not in out and "\r" not in out, out[-3000:]  # redirected output: no progress bars on any rank
    assert out.count("INFO hf_elixir.api: hf_elixir:") == 1, out[-3000:]  # the placement, logged by rank 0
    peak = 5e-3  # FAST: --learning_rate 5e-3 --warmup_steps 0 --max_steps 6 --logging_steps 2, linear decay
    lrs = {int(k): v for k, v in r["learning_rates"].items()}
    assert lrs == pytest.approx({1: peak, 2: peak * 5 / 6, 4: peak * 3 / 6, 6: peak / 6}, rel=1e-9, abs=0), lrs


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lr_schedule_spans_the_run_under_accelerate_launch_with_2_processes(tmp_path):
    """README's `accelerate launch --config_file recipes/gpt2/elixir.yaml` (2 processes): accelerate's
    prepared scheduler advances once per process on each step, so a schedule sized for --max_steps alone
    reached lr 0 at half the run. 40 steps of linear decay from the peak; the logged rate is the one the
    step used (the Trainer's convention): the peak at step 1, 21/40 of it at step 20, 1/40 at step 40."""
    launcher = ("-m", "accelerate.commands.launch", "--config_file", str(REPO / "recipes" / "gpt2" / "elixir.yaml"),
                "--main_process_port", str(_free_port()))
    peak = 5e-3  # FAST's --learning_rate
    r = _run_recipe(tmp_path, "finetune_clm.py", "--model_type", "gpt2", "--max_steps", "40", "--logging_steps", "20",
                    "--lr_scheduler_type", "linear", "--block_size", "32", "--per_device_train_batch_size", "2",
                    launcher=launcher)
    assert r["num_processes"] == 2
    assert "job: 2 processes (ranks 0-1, 1 node(s)), backend gloo" in r["stdout"]
    out = r["stdout"] + r["stderr"]
    # the Accelerate loop at 2 processes (the torchrun case above, slow-marked for this path, checks the same):
    assert out.count("trained a byte-level BPE tokenizer") == 1, out[-3000:]  # by the main process only
    assert "Map:" not in out and "\r" not in out, out[-3000:]  # redirected output: no progress bars on any rank
    assert out.count("INFO hf_elixir.api: hf_elixir:") == 1, out[-3000:]  # the placement, logged by rank 0
    assert r["last_loss"] < r["first_loss"] and r["eval_ppl_after"] < r["eval_ppl_before"]
    lrs = {int(k): v for k, v in r["learning_rates"].items()}
    assert sorted(lrs) == [1, 20, 40]
    assert abs(lrs[1] - peak) < 1e-12 and abs(lrs[20] - peak * 21 / 40) < 1e-12, lrs
    assert abs(lrs[40] - peak / 40) < 1e-12, lrs


def test_llama_recipe_trains_tensor_parallel_from_the_config_plan_under_accelerate_launch(tmp_path):
    """recipes/llama/elixir.yaml sets tensor_parallel_size: 2 and nothing else about placements: the tiny
    Llama-style model (built offline, GQA) is split as LlamaConfig's own base_model_tp_plan says, the recipe
    prints what it chose, trains, and the saved folder (gathered from both ranks' shards) reloads with plain
    from_pretrained and evaluates lower than before training."""
    launcher = ("-m", "accelerate.commands.launch", "--config_file", str(REPO / "recipes" / "llama" / "elixir.yaml"),
                "--main_process_port", str(_free_port()))
    r = _run_recipe(tmp_path, "finetune_clm.py", "--model_type", "llama", launcher=launcher)
    out = r["stdout"] + r["stderr"]
    assert r["num_processes"] == 2 and "tensor_parallel_size=2" in out
    assert "from the config's base_model_tp_plan: 20 column, 1 column_gather, 1 embedding_row, 8 row" in out, out[-3000:]
    assert r["eval_ppl_after"] < r["eval_ppl_before"]


def test_mixtral_recipe_trains_expert_parallel_from_the_config_plan_under_accelerate_launch(tmp_path):
    """recipes/mixtral/elixir.yaml sets expert_parallel_size: 2 and nothing else about placements: each process keeps
    2 of the 4 experts of every layer of the tiny Mixtral-style model (built offline), as MixtralConfig's own
    base_model_ep_plan says; the recipe prints what it chose, trains, and the saved folder (experts gathered from both
    ranks, written per expert as plain transformers writes Mixtral) reloads with plain from_pretrained and evaluates
    lower than before training."""
    from safetensors import safe_open

    launcher = ("-m", "accelerate.commands.launch", "--config_file", str(REPO / "recipes" / "mixtral" / "elixir.yaml"),
                "--main_process_port", str(_free_port()))
    r = _run_recipe(tmp_path, "finetune_clm.py", "--model_type", "mixtral", "--max_steps", "4", launcher=launcher)
    out = r["stdout"] + r["stderr"]
    assert r["num_processes"] == 2 and "expert_parallel_size=2" in out
    assert "parallelized (tensor_parallel_size=1, expert_parallel_size=2) from the config's base_model_ep_plan: " \
           "4 expert" in out, out[-3000:]
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        experts = {k for k in f.keys() if ".block_sparse_moe.experts." in k}
    assert experts == {f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
                       for i in range(4) for e in range(4) for w in ("w1", "w2", "w3")}
    assert r["eval_ppl_after"] < r["eval_ppl_before"]


def test_llama_recipe_trains_tensor_parallel_through_the_trainer_callback(tmp_path, monkeypatch):
    """The Trainer path (ElixirCallback) of the same: torchrun, ELIXIR_TENSOR_PARALLEL_SIZE=2, nothing else."""
    monkeypatch.setenv("ELIXIR_TENSOR_PARALLEL_SIZE", "2")
    launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()))
    r = _run_recipe(tmp_path, "finetune_clm.py", "--model_type", "llama", "--trainer", "--max_steps", "4",
                    launcher=launcher)
    out = r["stdout"] + r["stderr"]
    assert r["num_processes"] == 2 and "ElixirCallback(config=...): tensor_parallel_size=2" in out, out[-3000:]
    assert "from the config's base_model_tp_plan: 20 column, 1 column_gather, 1 embedding_row, 8 row" in out
    assert r["eval_ppl_after"] < r["eval_ppl_before"]


def test_switch_trainer_logs_the_true_mean_loss_at_2_processes(tmp_path):
    """Switch's forward takes **kwargs but its loss is a per-batch mean: the Trainer multiplied it by the
    number of processes (it assumed the loss used the global token count). The first logged loss of the
    untrained model is its cross-entropy, about log(held-out perplexity) (+ small router losses)."""
    import math

    launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()))
    r = _run_recipe(tmp_path, "finetune_switch.py", "--trainer", "--max_steps", "2", "--learning_rate", "1e-9",
                    "--per_device_train_batch_size", "8", launcher=launcher)
    assert r["num_processes"] == 2
    true_loss = math.log(r["eval_ppl_before"])  # ~ log(vocab 512) = 6.2; twice it was 12.5
    assert abs(r["first_loss"] - true_loss) < 0.5, (r["first_loss"], true_loss)


@pytest.mark.parametrize("path", [["--trainer"], []], ids=["trainer", "accelerate"])
def test_switch_recipe_trains_expert_parallel_from_the_config(tmp_path, monkeypatch, path):
    """recipes/switch/elixir.yaml offers expert_parallel_size; set (here through ELIXIR_EXPERT_PARALLEL_SIZE=2) it
    stopped both recipe paths at prepare ("needs a model rewritten for it"): the recipe never called parallelize.
    Now the model is parallelized before its optimizer is built, trains, and the saved folder (gathered from both
    ranks' experts) reloads with plain from_pretrained and evaluates lower than before training."""
    monkeypatch.setenv("ELIXIR_EXPERT_PARALLEL_SIZE", "2")
    launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()))
    r = _run_recipe(tmp_path, "finetune_switch.py", *path, "--max_steps", "4", "--per_device_train_batch_size", "8",
                    launcher=launcher)
    assert r["num_processes"] == 2 and "expert_parallel_size=2" in r["stderr"] + r["stdout"]
    assert r["eval_ppl_after"] < r["eval_ppl_before"]


def test_recipe_overwrites_with_the_flag_and_streams_a_local_folder_into_a_meta_model(tmp_path):
    """--overwrite_output_dir writes over another run's files (without it the recipe refuses: the subprocess case
    of test_recipe_cli_error_is_the_last_line_not_buried_under_usage). That run's folder is then given as
    --model_name_or_path under hf_elixir (Accelerate path): the model is built on the meta device and
    ElixirPlugin(checkpoint=folder) streams each process's shards; its held-out perplexity before training is the
    one the folder's model had when it was saved. (One recipe run serves both checks.)"""
    out = tmp_path / "model"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"another run")
    first = _run_recipe(tmp_path, "finetune_clm.py", "--model_type", "gpt2", "--max_steps", "1",
                        "--overwrite_output_dir")
    assert first["num_processes"] == 1 and (out / "model.safetensors").read_bytes() != b"another run"
    folder = tmp_path / "pretrained"
    out.rename(folder)
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(REPO / "recipes" / "finetune_clm.py"), *FAST, "--model_type", "gpt2", "--max_steps",
           "2", "--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "again")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "streaming the weights from" in proc.stdout + proc.stderr
    second = json.loads((tmp_path / "again" / "recipe_results.json").read_text())
    assert second["eval_ppl_before"] == pytest.approx(first["eval_ppl_after"], rel=1e-5)


def test_default_warmup_scales_with_a_short_run(tmp_path, monkeypatch):
    """The default warm-up is a fraction of --max_steps: a 20-step run warms up and decays to 0 (a fixed
    30-step warm-up never finished warming up there, ending at a lr above the start)."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "recipes"))
    from _recipe_common import RecipeTrainingArguments, build_optimizer_and_scheduler

    args = RecipeTrainingArguments(output_dir=str(tmp_path), max_steps=20, use_cpu=True, report_to=[])
    model = torch.nn.Linear(4, 4)
    optimizer, scheduler = build_optimizer_and_scheduler(model, args, num_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    peak = args.learning_rate
    assert max(lrs) == pytest.approx(peak, rel=0.05), lrs
    assert lrs.index(max(lrs)) <= 3, lrs
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def _recipe_trainer_log(tmp_path, monkeypatch, name: str, elixir: bool) -> list[dict]:
    """log_history of a 20-step Trainer run with the recipe's default TrainingArguments (tiny GPT-2)."""
    import torch
    from transformers import Trainer

    from hf_elixir.integrations import ElixirCallback
    from tests._models import VOCAB, tiny_model

    monkeypatch.syspath_prepend(str(REPO / "recipes"))
    from _recipe_common import RecipeTrainingArguments

    args = RecipeTrainingArguments(output_dir=str(tmp_path / name), max_steps=20, per_device_train_batch_size=2,
                                   use_cpu=True, report_to=[], disable_tqdm=True)
    tokens = torch.randint(0, VOCAB, (40, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    trainer = Trainer(tiny_model("gpt2"), args, train_dataset=data,
                      callbacks=[ElixirCallback()] if elixir else [])
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_short_trainer_run_logs_several_steps_with_the_plain_trainer_lr_schedule(tmp_path, monkeypatch):
    """A fresh user's `--trainer --max_steps 20` logged step 1 only (lr 0, the first warm-up step): the
    recipe's fixed --logging_steps 25 was longer than the run. The default is now a fraction of --max_steps,
    so a short run logs every few steps, and the learning rates logged under ElixirCallback are plain
    Trainer's at the same settings (warm-up, then linear decay)."""
    logged = _recipe_trainer_log(tmp_path, monkeypatch, "elixir", elixir=True)
    steps = [h["step"] for h in logged]
    assert len(steps) >= 8 and steps[0] == 1 and steps[-1] == 20, steps
    lrs = {h["step"]: h["learning_rate"] for h in logged}
    assert all(lr > 0 for step, lr in lrs.items() if step > 2), lrs  # after the 2-step warm-up
    plain = _recipe_trainer_log(tmp_path, monkeypatch, "plain", elixir=False)
    assert {h["step"]: h["learning_rate"] for h in plain} == pytest.approx(lrs, rel=1e-12, abs=0), (plain, lrs)


def _own_lines(stderr: str) -> list[str]:
    """``stderr``'s lines less what other packages print when first imported (torchao's "Failed to load ...so",
    torch's W-level pytree notes): what is left is the recipe's own output."""
    return [ln for ln in stderr.strip().splitlines()
            if not ln.startswith("Failed to load ") and not re.match(r"W\d{4} [\d:.]+ \d+ \S*torch/", ln)]


def test_recipe_cli_error_is_the_last_line_not_buried_under_usage(tmp_path, monkeypatch, capsys):
    """argparse printed the whole usage (over 100 lines of TrainingArguments) before the one line that
    says what is wrong; now a one-line usage, then the error, last. Exit status stays 2. `--help` works
    (a bare '%' in a help text made it raise). The recipe refuses to write over another run's files
    (without --overwrite_output_dir): usage + one line, no traceback, the files untouched.

    One real process (the refusal: the script's own start-up and exit status); the other two errors go through
    the same parser in this process (``parse_args`` reads ``sys.argv``; argparse exits by ``SystemExit``)."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"another run")
    script = str(REPO / "recipes" / "finetune_clm.py")
    proc = subprocess.run([sys.executable, script, "--output_dir", str(out)], env=_recipe_env(), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    # lines other packages print at import (torchao's "Failed to load ...so", torch's W-level pytree notes) are not
    # the recipe's: the recipe's own output is the one-line usage and the error, last
    lines = _own_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) <= 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = f"--output_dir {out} already holds another run's files (model.safetensors)"
    assert lines[-1].startswith("finetune_clm.py: error: ") and message in lines[-1], lines
    assert "--overwrite_output_dir" in lines[-1] and "--help" in lines[-2], lines
    assert (out / "model.safetensors").read_bytes() == b"another run"

    monkeypatch.syspath_prepend(str(REPO / "recipes"))
    from _recipe_common import parse_args

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["finetune_clm.py", "--max_steps", "x"])
    with pytest.raises(SystemExit) as exited:
        parse_args("gpt2")
    lines = _own_lines(capsys.readouterr().err)
    assert exited.value.code == 2 and len(lines) <= 3, lines
    assert lines[-1].startswith("finetune_clm.py: error: ") and \
        "argument --max_steps/--max-steps: invalid int value: 'x'" in lines[-1], lines
    assert "--help" in lines[-2], lines
    monkeypatch.setattr(sys, "argv", ["finetune_clm.py", "--help"])
    with pytest.raises(SystemExit) as exited:
        parse_args("gpt2")
    shown = capsys.readouterr().out
    assert exited.value.code == 0 and "--logging_steps" in shown and "7.5%" in shown, shown[-3000:]


def test_default_models_build_and_compute_a_loss_without_transformers_warnings(tmp_path):
    """A fresh run printed transformers warnings: "loss_type=None ... unrecognized" (GPT2LMHeadModel's
    class name names no loss) for the recipes' GPT-2, and bos/eos ids of 50256 outside the 128-token
    vocabulary of `hf-elixir profile`'s default model (tiny-gpt2). Each default model now builds and
    computes its loss (and the recipe's reloaded folder too) with nothing on stderr."""
    code = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from _recipe_common import ModelArguments, build_model, _mark_loss
        from transformers import AutoModelForCausalLM
        from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch

        class Tok:  # what build_model reads from the BPE tokenizer the recipe trains
            bos_token_id, eos_token_id, pad_token_id = 0, 0, 1
            def __len__(self):
                return 512

        ids = torch.randint(2, 512, (2, 16))
        for kind in ("gpt2", "opt"):
            model = build_model(ModelArguments(model_type=kind), Tok(), 128)
            model(input_ids=ids, labels=ids).loss.item()
            model.save_pretrained(sys.argv[2] + "/" + kind)
            _mark_loss(AutoModelForCausalLM.from_pretrained(sys.argv[2] + "/" + kind))(input_ids=ids, labels=ids)
        model, batch = meta_model_and_batch(load_config("tiny-gpt2"), batch_size=2, seq_len=16, device="cpu")
        model(**batch).loss.item()
        print("done")
        """)
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "recipes"), str(tmp_path)], env=_recipe_env(),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
    assert "loss_type" not in proc.stderr and "within the vocabulary" not in proc.stderr, proc.stderr


def test_settings_line_names_the_recipe_flags(monkeypatch):
    """The recipe's settings line named "defaults/env" as the source even when --device_memory_budget_bytes
    and --budget_covers_activations had replaced those fields (README's 5 MB budget run logged
    device_memory_budget_bytes=5000000 "(settings from defaults/env)"); it now names the flags too."""
    monkeypatch.syspath_prepend(str(REPO / "recipes"))
    from _recipe_common import ElixirArguments, elixir_config_overrides, settings_source

    args = ElixirArguments(device_memory_budget_bytes=5_000_000, budget_covers_activations=False)
    overrides = elixir_config_overrides(args)
    assert settings_source(None, overrides) == (
        "defaults/env, recipe flags --device_memory_budget_bytes --budget_covers_activations")
    assert settings_source(None, elixir_config_overrides(ElixirArguments())) == "defaults/env"
    assert settings_source("recipes/gpt2/elixir.yaml", {}) == "recipes/gpt2/elixir.yaml"
