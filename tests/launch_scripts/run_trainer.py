"""A stock ``transformers.Trainer`` script: nothing of hf_elixir in it.

Prints ``TRAINED_MODEL_CLASS <name>`` (the model the Trainer trained, as the accelerator holds it) and
``FINAL_LOSS <repr>``.
"""

from __future__ import annotations

import os
import sys

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments


class Report(TrainerCallback):
    def on_train_end(self, args, state, control, model=None, **kwargs):
        wrapped = self.trainer.model_wrapped
        os.write(1, (f"TRAINED_MODEL_CLASS {type(wrapped).__name__}" + "\n").encode())  # one write: ranks share the pipe
        os.write(1, (f"FINAL_LOSS {state.log_history[-2]['loss']!r}" + "\n").encode())  # one write: ranks share the pipe


def main() -> None:
    out_dir = sys.argv[1]
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 128, (16, 16), generator=g)
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = TrainingArguments(out_dir, max_steps=3, per_device_train_batch_size=2, logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, dataloader_num_workers=0)
    report = Report()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[report])
    report.trainer = trainer
    trainer.train()


if __name__ == "__main__":
    main()
