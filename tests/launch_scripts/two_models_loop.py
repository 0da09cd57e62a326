"""A plain Accelerate loop with two trained models in one ``accelerator.prepare`` call (a policy and a value model,
as in PPO) and one loss reaching both: nothing of hf_elixir in it.

Prints, per rank, ``OPTIMIZER_P <class> OPTIMIZER_V <class>``, ``DDP <bool>`` and ``FINAL_LOSS <repr>`` (this rank's last loss).
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from plain_loop import build_model, dataset


def main() -> None:
    accelerator = Accelerator()
    policy, value = build_model("gpt2"), build_model("gpt2")
    with torch.no_grad():
        for p in value.parameters():  # another model than the policy, the same on every rank
            p.mul_(0.5)
    opt_p = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    opt_v = torch.optim.AdamW(value.parameters(), lr=1e-3)
    loader = DataLoader(dataset(), batch_size=2, shuffle=False)
    policy, value, opt_p, opt_v, loader = accelerator.prepare(policy, value, opt_p, opt_v, loader)
    os.write(1, f"OPTIMIZER_P {type(opt_p).__name__} OPTIMIZER_V {type(opt_v).__name__}\n".encode())
    os.write(1, f"DDP {isinstance(policy, torch.nn.parallel.DistributedDataParallel)}\n".encode())
    loss = None
    for step, batch in enumerate(loader):
        if step == 3:
            break
        value_loss = (value(input_ids=batch["input_ids"]).logits.mean() - 0.5).pow(2)
        loss = policy(**batch).loss + value_loss
        accelerator.backward(loss)  # one loss, two trained models
        for model, optimizer in ((policy, opt_p), (value, opt_v)):
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    os.write(1, f"FINAL_LOSS {loss.item()!r}\n".encode())
    accelerator.end_training()


if __name__ == "__main__":
    main()
