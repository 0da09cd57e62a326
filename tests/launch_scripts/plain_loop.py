"""A plain Accelerate training loop in the style of accelerate's ``examples/nlp_example.py``: nothing of
hf_elixir in it. ``hf-elixir launch --config_file elixir.yaml plain_loop.py --model gpt2`` trains it under
hf_elixir; ``plugin_loop.py`` runs the same loop with ``ElixirPlugin().prepare`` written in (the reference).

Prints ``MODEL_CLASS <name>`` after prepare, ``DDP <bool>``, ``OPTIMIZER_CLASS <name>`` and ``FINAL_LOSS <repr>`` (this rank's last loss),
``HF_ELIXIR_MODULES <n>`` (how many ``hf_elixir`` modules the process imported by its end) and ``PREPARE_SIGNATURE_KEPT
<bool> WRAPPED_BEFORE <bool>`` (``inspect.signature(Accelerator.prepare)`` the same before the first ``prepare`` as
after, and whether something, such as the start hook's trigger, stood in for the method before it).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

import torch
import transformers
from accelerate import Accelerator
from torch.utils.data import DataLoader


def build_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def dataset(rows: int = 32, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 128, (rows, seq), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def main(prepare=None, argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    accelerator = Accelerator()
    model = build_model(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset(), batch_size=2, shuffle=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    signature_before = inspect.signature(Accelerator.prepare)
    stood_in = hasattr(Accelerator.__dict__["prepare"], "__wrapped__")  # a start hook's trigger, or a router
    if prepare is None:  # the stock call; plugin_loop.py passes ElixirPlugin().prepare
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler)
    accelerator.print(f"MODEL_CLASS {type(model).__name__}")
    kept = inspect.signature(Accelerator.prepare) == signature_before
    os.write(1, f"PREPARE_SIGNATURE_KEPT {kept} WRAPPED_BEFORE {stood_in}\n".encode())
    os.write(1, (f"DDP {isinstance(model, torch.nn.parallel.DistributedDataParallel)}" + "\n").encode())  # one write: ranks share the pipe
    os.write(1, (f"OPTIMIZER_CLASS {type(optimizer).__name__}" + "\n").encode())  # one write: ranks share the pipe
    model.train()
    loss = None
    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    os.write(1, (f"FINAL_LOSS {loss.item()!r}" + "\n").encode())  # one write: ranks share the pipe
    own = [m for m in sys.modules if m == "hf_elixir" or m.startswith("hf_elixir.")]
    os.write(1, f"HF_ELIXIR_MODULES {len(own)}\n".encode())
    accelerator.end_training()


if __name__ == "__main__":
    main()
