"""A stock ``transformers.Trainer`` script: nothing of hf_elixir in it.

Prints ``TRAINED_MODEL_CLASS <name>`` (the model the Trainer trained, as the accelerator holds it) and
``FINAL_LOSS <repr>``. ``run_trainer.py OUT [--model gpt2|mixtral] [--batch N] [--save]``: a tiny GPT-2 (default) or
Mixtral, ``N`` rows per process and step (default 2); ``--save`` ends with ``trainer.save_model(OUT/final)``.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments


class Report(TrainerCallback):
    def on_train_end(self, args, state, control, model=None, **kwargs):
        wrapped = self.trainer.model_wrapped
        os.write(1, (f"TRAINED_MODEL_CLASS {type(wrapped).__name__}" + "\n").encode())  # one write: ranks share the pipe
        os.write(1, (f"FINAL_LOSS {state.log_history[-2]['loss']!r}" + "\n").encode())  # one write: ranks share the pipe


def _model(kind: str) -> torch.nn.Module:
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2))
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--model", choices=["gpt2", "mixtral"], default="gpt2")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--save", action="store_true")
    cli = parser.parse_args()
    torch.manual_seed(0)
    model = _model(cli.model)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 128, (16, 16), generator=g)
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = TrainingArguments(cli.out_dir, max_steps=3, per_device_train_batch_size=cli.batch, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0)
    report = Report()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[report])
    report.trainer = trainer
    trainer.train()
    if cli.save:
        trainer.save_model(os.path.join(cli.out_dir, "final"))

if __name__ == "__main__":
    main()
