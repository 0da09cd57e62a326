"""TRL trainers with and without ElixirCallback on a tiny Llama built from a config, with a word-level tokenizer built
offline: ``python trl_trainers.py OUT CASE [CASE ...]`` (or under torchrun) writes ``OUT/CASE.json`` on rank 0 with
both runs' losses and the relative L2 distance of their final weights (fp32: ``bf16=False``, which TRL's configs turn
on by default). ``python trl_trainers.py OUT --unchanged CASE ...`` runs each case once, without the callback (for
``accelerate launch``)."""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

from hf_elixir import ElixirConfig, memory_stats
from hf_elixir.integrations import ElixirCallback

WORDS = "the a cat dog sat ran on under mat log big small red blue and then".split()
#: model-data bytes on the device (activations not counted): far under the ~110 KB of fp32 weights and gradients
BUDGET = ElixirConfig(device_memory_budget_bytes=60_000, budget_covers_activations=False, chunk_size_numel=2048)


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def sentences(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g)) for k in lengths]


def llama(cls=LlamaForCausalLM, **kw):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                      bos_token_id=1, tie_word_embeddings=False, **kw)
    return cls(cfg)


def common(out: str, **kw) -> dict:
    return dict(output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, save_strategy="no", bf16=False,
                dataloader_drop_last=True, **kw)


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def sft(case: str, out: str, callbacks: list):
    from trl import SFTConfig, SFTTrainer

    if case == "sft_completion":
        data = Dataset.from_dict({"prompt": sentences(16, 1), "completion": [" " + s for s in sentences(16, 2)]})
    else:
        data = Dataset.from_dict({"text": sentences(16, 1)})
    args = SFTConfig(**common(out), packing=case == "sft_packing", max_length=24)
    return SFTTrainer(model=llama(), args=args, train_dataset=data, processing_class=tokenizer(), callbacks=callbacks,
                      peft_config=lora() if case == "sft_lora" else None)


def preference() -> Dataset:
    return Dataset.from_dict({"prompt": sentences(16, 1), "chosen": sentences(16, 2), "rejected": sentences(16, 3)})


def dpo(case: str, out: str, callbacks: list):
    from trl import DPOConfig, DPOTrainer

    peft = case == "dpo_lora"
    args = DPOConfig(**common(out), max_length=24)
    return DPOTrainer(model=llama(), ref_model=None if peft else llama(), args=args, train_dataset=preference(),
                      processing_class=tokenizer(), callbacks=callbacks, peft_config=lora() if peft else None)


def reward(case: str, out: str, callbacks: list):
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(**common(out), max_length=24)
    return RewardTrainer(model=llama(LlamaForSequenceClassification, num_labels=1), args=args,
                         train_dataset=preference(), processing_class=tokenizer(), callbacks=callbacks)


def grpo(case: str, out: str, callbacks: list):
    from trl import GRPOConfig, GRPOTrainer

    def reward_len(completions, **kwargs):  # a reward function: shorter completions score higher
        return [-float(len(c)) for c in completions]

    # the KL reference is loaded from the policy's folder: once the process group exists save_pretrained writes on rank
    # 0 only (the others wait for it); before, each rank writes its own
    if torch.distributed.is_initialized():
        base = os.path.join(os.path.dirname(out), "base")
        llama().save_pretrained(base)
        torch.distributed.barrier()
    else:
        base = os.path.join(os.path.dirname(out), f"base-{os.environ.get('RANK', '0')}")
        llama().save_pretrained(base)
    args = GRPOConfig(**common(out), num_generations=2, max_completion_length=6, beta=0.1,
                      generation_batch_size=2 * int(os.environ.get("WORLD_SIZE", "1")))
    return GRPOTrainer(model=LlamaForCausalLM.from_pretrained(base), reward_funcs=reward_len, args=args,
                       train_dataset=Dataset.from_dict({"prompt": sentences(16, 1)}), processing_class=tokenizer(),
                       callbacks=callbacks)


BUILDERS = {"grpo": grpo, "sft": sft, "sft_packing": sft, "sft_completion": sft, "sft_lora": sft, "dpo": dpo, "dpo_lora": dpo,
            "reward": reward}


def run(case: str, out: str) -> dict:
    def losses(trainer):
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    el = BUILDERS[case](case, os.path.join(out, case, "elixir"), [ElixirCallback(BUDGET)])
    el.train()
    evictions = memory_stats(el.model)["num_evictions"]
    ref = BUILDERS[case](case, os.path.join(out, case, "ref"), [])
    ref.train()
    got, want = el.accelerator.get_state_dict(el.model), ref.accelerator.get_state_dict(ref.model)
    num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in want)
    den = sum(float(want[k].double().norm() ** 2) for k in want)
    return dict(losses=losses(el), ref_losses=losses(ref), rel_l2=(num / den) ** 0.5, evictions=evictions,
                world=int(os.environ.get("WORLD_SIZE", "1")), keys=sorted(got) == sorted(want))


def run_unchanged(case: str, out: str) -> dict:
    """The case as a user's script has it, no callback (``--unchanged``): under ``accelerate launch --config_file
    elixir.yaml`` hf_elixir puts the Trainer's model under Elixir itself; the final weights go to ``OUT/CASE.pt``."""
    import hf_elixir

    trainer = BUILDERS[case](case, os.path.join(out, case), [])
    trainer.train()
    try:
        hf_elixir.get_state(trainer.model)
        under_elixir = True
    except ValueError:
        under_elixir = False
    weights = trainer.accelerator.get_state_dict(trainer.model)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({k: v.detach().float().clone() for k, v in weights.items()}, os.path.join(out, f"{case}.pt"))
    return dict(losses=[h["loss"] for h in trainer.state.log_history if "loss" in h], under_elixir=under_elixir,
                world=int(os.environ.get("WORLD_SIZE", "1")))


def main(out: str, cases: list[str]) -> None:
    unchanged = cases[0] == "--unchanged"
    run_cases(out, cases[unchanged:], run_unchanged if unchanged else run)


def run_cases(out: str, cases: list[str], run_case) -> None:
    """``run_case(case, out)`` for each case; rank 0 writes each result to ``out/<case>.json``; the group ends."""
    transformers.logging.set_verbosity_error()
    for case in cases:
        result = run_case(case, out)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(os.path.join(out, f"{case}.json"), "w") as f:
                json.dump(result, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
