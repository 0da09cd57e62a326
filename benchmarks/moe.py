"""Training throughput of a Switch-Transformers MoE vs a dense model with the same parameter count.

Both are ``SwitchTransformersForConditionalGeneration``; the dense one has no sparse layers and a
feed-forward width of ``experts * d_ff`` (so each dense FFN holds as many weights as one MoE layer's
experts together). Each token of the MoE runs through one expert (top-1 routing), so its FLOPs per
token are close to a dense model of width ``d_ff``: the Elixir paper (arXiv 2212.05339, section 6)
reports 5.3x for large MoE models over dense ones of the same size.

Usage::

    python benchmarks/moe.py --experts 8 --d-model 256 --d-ff 512 --layers 4 --batch 8 --seq 128

Prints one line per model (parameters, tokens/s of a full AdamW training step) and the ratio.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import transformers as T


def build(args: argparse.Namespace, sparse: bool) -> T.SwitchTransformersForConditionalGeneration:
    capacity = math.ceil(args.seq / args.experts * args.capacity_factor)
    cfg = T.SwitchTransformersConfig(
        vocab_size=args.vocab, d_model=args.d_model, d_kv=args.d_model // args.heads, num_heads=args.heads,
        d_ff=args.d_ff if sparse else args.d_ff * args.experts, num_layers=args.layers,
        num_decoder_layers=args.layers, num_experts=args.experts if sparse else 1, expert_capacity=capacity,
        num_sparse_encoder_layers=args.layers if sparse else 0, num_sparse_decoder_layers=args.layers if sparse else 0,
        router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    return T.SwitchTransformersForConditionalGeneration(cfg)


def tokens_per_s(model: torch.nn.Module, args: argparse.Namespace, device: torch.device, sparse: bool) -> float:
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, args.vocab, (args.batch, args.seq), generator=g).to(device)
    labels = torch.randint(2, args.vocab, (args.batch, args.seq), generator=g).to(device)

    def step() -> None:
        loss = model(input_ids=ids, labels=labels, output_router_logits=sparse).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed_s = time.perf_counter() - start
    return 2 * args.batch * args.seq * args.steps / elapsed_s  # encoder + decoder tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)

    results = {}
    for name, sparse in (("switch", True), ("dense", False)):
        model = build(args, sparse)
        num_params = sum(p.numel() for p in model.parameters())
        tps = tokens_per_s(model, args, device, sparse)
        results[name] = (num_params, tps)
        print(f"{name:7s} experts={args.experts if sparse else 1:3d} params={num_params / 1e6:8.2f}M "
              f"tokens/s={tps:10.1f} device={device.type}")
        del model
    (p_moe, t_moe), (p_dense, t_dense) = results["switch"], results["dense"]
    print(f"parameter ratio switch/dense = {p_moe / p_dense:.3f} (same size by construction)")
    print(f"throughput ratio switch/dense = {t_moe / t_dense:.2f}x")


if __name__ == "__main__":
    main()
