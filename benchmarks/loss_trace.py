"""Losses of a short tiny-GPT-2 run under a device budget, bit for bit: a refactor of the runtime must not move them.

Run it on two checkouts and compare the printed lines (``float.hex``, so equal means bitwise equal)::

    torchrun --standalone --nproc_per_node 2 benchmarks/loss_trace.py            # optimizer state on the device
    torchrun --standalone --nproc_per_node 2 benchmarks/loss_trace.py --host     # offloaded, host lane overlapped

With ``PYTHONPATH`` pointing at another checkout, the same script traces that checkout's package. Setup: GPT-2 with 4
layers, 64 wide, vocabulary 256; AdamW (weight decay 0.1), gradient clipping at 1.0, 5 steps of 4 x 32 tokens a
rank; budget 0.6 x the fp32 parameter bytes, chunks of 16384 elements, so chunks are evicted and re-gathered.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import transformers

import hf_elixir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", action="store_true", help="offload the optimizer, host lane overlapped")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    numel = sum(p.numel() for p in model.parameters())
    knobs = dict(chunk_size_numel=16384, device_memory_budget_bytes=int(numel * 4 * 0.6),
                 budget_covers_activations=False)
    if args.host:
        knobs.update(offload_optimizer=True, overlap_host_optimizer=True)
    model, optimizer = hf_elixir.prepare(model, optimizer, hf_elixir.ElixirConfig(**knobs))
    batches = torch.Generator().manual_seed(1234 + rank)
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(0, 256, (4, 32), generator=batches)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item().hex())
    onloads = hf_elixir.memory_stats(model)["num_onloads"]
    print(f"rank {rank} {'host' if args.host else 'device'} losses {' '.join(losses)} onloads={onloads}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
