"""Benchmark triton_kernels on a GPU: achieved GB/s vs measured copy bandwidth and vs PyTorch.

Usage:
    python benchmarks/kernel_bench.py [--shard-mib 64] [--sweep]

For each kernel it times one call with ``triton.testing.do_bench`` (median, L2 flushed between runs),
counts the bytes the op must move at minimum (each input read once, each output written once) and
prints achieved GB/s, the fraction of the device's measured device-to-device copy bandwidth (the
practical physical limit for these memory-bound ops), and the PyTorch equivalent on the same data:

    fused_adamw_          vs torch.optim.AdamW(fused=True) and AdamW(foreach=True) (torch._foreach_*)
    unscale_norm_         vs torch._amp_foreach_non_finite_check_and_unscale_ + torch._foreach_norm
    cast_                 vs Tensor.copy_
    moe permute/unpermute vs index_select / gate-weighted index_add_

Target: fused AdamW >= 80% of copy bandwidth on a 64 MiB fp32 shard and faster than
``torch.optim.AdamW(fused=True)``. ``--sweep`` also times the AdamW kernel over a few
(BLOCK_SIZE, num_warps) choices. Without a CUDA device it prints so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

GB = 1e9
MIB = 1 << 20
DEVICE = "cuda"  # "cpu" only in --smoke mode


def _bench_ms(fn) -> float:
    if DEVICE == "cpu":  # --smoke: check the script runs end to end; the numbers mean nothing
        import time

        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _row(name: str, nbytes: float, ms: float, copy_gbs: float, baseline_ms: float | None = None) -> None:
    gbs = nbytes / (ms * 1e-3) / GB
    line = f"  {name:<48} {ms * 1e3:9.1f} us {gbs:9.1f} GB/s {100 * gbs / copy_gbs:6.1f}% of copy"
    if baseline_ms is not None:
        line += f"   x{baseline_ms / ms:5.2f} vs first row"
    print(line)


def bench_copy(numel: int) -> float:
    src = torch.randn(numel, device=DEVICE)
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    gbs = 2 * src.nbytes / (ms * 1e-3) / GB
    print(f"device-to-device copy of {src.nbytes / MIB:.0f} MiB: {ms * 1e3:.1f} us, {gbs:.1f} GB/s (read + write)")
    return gbs


def _adam_inputs(numel: int, grad_dtype: torch.dtype):
    param = torch.randn(numel, device=DEVICE)
    grad = torch.randn(numel, device=DEVICE).to(grad_dtype)
    return param, grad, torch.zeros_like(param), torch.zeros_like(param)


def bench_adamw(numel: int, copy_gbs: float, sweep: bool) -> dict[str, float]:
    from triton_kernels import fused_adam, fused_adamw_

    hp = dict(beta1=0.9, beta2=0.999, eps=1e-8)
    seg = dict(seg_bounds=torch.tensor([0, numel], device=DEVICE), seg_lr=torch.tensor([1e-3], device=DEVICE),
               seg_weight_decay=torch.tensor([0.01], device=DEVICE))
    found_inf = torch.zeros(1, device=DEVICE)
    scale = torch.ones(1, device=DEVICE)
    results = {}
    print(f"\nAdamW step on a {numel * 4 / MIB:.0f} MiB fp32 shard ({numel} elements)")

    # PyTorch baselines: fp32 param + fp32 grad, 4 reads + 3 writes of 4 bytes per element
    nbytes = 28 * numel
    torch_ms = {}
    for label, kw in (("torch.optim.AdamW(fused=True)", dict(fused=True)),
                      ("torch.optim.AdamW(foreach=True) [_foreach_*]", dict(foreach=True))):
        p = torch.nn.Parameter(torch.randn(numel, device=DEVICE))
        p.grad = torch.randn(numel, device=DEVICE)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kw)
        opt.step()  # allocate state
        torch_ms[label] = _bench_ms(opt.step)
        del opt, p
    first = torch_ms["torch.optim.AdamW(fused=True)"]
    for label, ms in torch_ms.items():
        _row(label, nbytes, ms, copy_gbs, first)

    param, grad, m, v = _adam_inputs(numel, torch.float32)
    ms = _bench_ms(lambda: fused_adamw_(param, grad, m, v, step=10, grad_scale=scale, found_inf=found_inf, **seg, **hp))
    _row("fused_adamw_ (fp32 grad)", nbytes, ms, copy_gbs, first)
    results["adamw_fp32_ms"] = ms
    results["adamw_fp32_gbs"] = nbytes / (ms * 1e-3) / GB

    param, grad, m, v = _adam_inputs(numel, torch.bfloat16)
    lowp = torch.empty(numel, device=DEVICE, dtype=torch.bfloat16)
    ms_b = _bench_ms(lambda: fused_adamw_(param, grad, m, v, step=10, grad_scale=scale, found_inf=found_inf,
                                          out_lowp=lowp, **seg, **hp))
    _row("fused_adamw_ (bf16 grad, writes bf16 copy)", 26 * numel, ms_b, copy_gbs)

    seg4 = dict(seg_bounds=torch.tensor([0, numel // 4, numel // 2, 3 * numel // 4, numel], device=DEVICE),
                seg_lr=torch.tensor([1e-3, 2e-3, 1e-3, 2e-3], device=DEVICE),
                seg_weight_decay=torch.tensor([0.01, 0.0, 0.01, 0.0], device=DEVICE))
    param, grad, m, v = _adam_inputs(numel, torch.float32)
    ms_s = _bench_ms(lambda: fused_adamw_(param, grad, m, v, step=10, found_inf=found_inf, **seg4, **hp))
    _row("fused_adamw_ (fp32 grad, 4 segments)", nbytes, ms_s, copy_gbs)

    if sweep:
        default = (fused_adam.BLOCK_SIZE, fused_adam.NUM_WARPS)
        for block, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)):
            fused_adam.BLOCK_SIZE, fused_adam.NUM_WARPS = block, warps
            param, grad, m, v = _adam_inputs(numel, torch.float32)
            ms_w = _bench_ms(lambda: fused_adamw_(param, grad, m, v, step=10, found_inf=found_inf, **seg, **hp))
            _row(f"  sweep BLOCK_SIZE={block} num_warps={warps}", nbytes, ms_w, copy_gbs)
        fused_adam.BLOCK_SIZE, fused_adam.NUM_WARPS = default

    results["torch_fused_ms"] = first
    return results


def bench_unscale_norm(numel: int, copy_gbs: float) -> None:
    from triton_kernels import unscale_norm_

    print(f"\nunscale + overflow check + squared norm, {numel * 4 / MIB:.0f} MiB fp32 gradient")
    grad = torch.randn(numel, device=DEVICE)
    found_inf = torch.zeros(1, device=DEVICE)
    inv_scale = torch.ones(1, device=DEVICE)

    def torch_version():
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, inv_scale)
        return torch._foreach_norm([grad])[0] ** 2

    base = _bench_ms(torch_version)
    _row("torch _amp_foreach_..._unscale_ + _foreach_norm", 8 * numel, base, copy_gbs, base)
    ms = _bench_ms(lambda: unscale_norm_(grad, inv_scale=inv_scale, found_inf=found_inf))
    _row("unscale_norm_", 8 * numel, ms, copy_gbs, base)


def bench_cast(numel: int, copy_gbs: float) -> None:
    from triton_kernels import cast_

    print(f"\ncast fp32 -> bf16, {numel * 4 / MIB:.0f} MiB source")
    src = torch.randn(numel, device=DEVICE)
    dst = torch.empty(numel, device=DEVICE, dtype=torch.bfloat16)
    base = _bench_ms(lambda: dst.copy_(src))
    _row("Tensor.copy_", 6 * numel, base, copy_gbs, base)
    ms = _bench_ms(lambda: cast_(src, dst))
    _row("cast_", 6 * numel, ms, copy_gbs, base)


def bench_moe(copy_gbs: float, num_tokens: int = 16384, hidden: int = 2048, num_experts: int = 8) -> None:
    from triton_kernels import moe_permute, moe_unpermute
    from triton_kernels.moe_permutation import _gather_rows, _inverse_rows

    print(f"\nMoE top-1 permutation, T={num_tokens} H={hidden} E={num_experts} bf16, capacity 1.25*T/E")
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    expert_index = torch.randint(0, num_experts, (num_tokens,), device=DEVICE)
    gates = torch.rand(num_tokens, device=DEVICE)
    capacity = int(1.25 * num_tokens / num_experts)
    permuted, row_map, counts = moe_permute(x, expert_index, num_experts, capacity)
    rows = permuted.shape[0]
    nbytes = 2 * rows * hidden * 2  # read + write of the kept rows
    src_row = _inverse_rows(row_map.reshape(num_tokens, 1), rows)
    base = _bench_ms(lambda: x.index_select(0, src_row))
    _row("torch index_select (rows only)", nbytes, base, copy_gbs, base)
    ms = _bench_ms(lambda: _gather_rows(x, src_row, rows, triton_path=True))
    _row("permute gather kernel (rows only)", nbytes, ms, copy_gbs, base)
    ms = _bench_ms(lambda: moe_permute(x, expert_index, num_experts, capacity))
    _row("moe_permute (routing map + gather, 1 host sync)", nbytes, ms, copy_gbs, base)

    kept = (row_map >= 0).nonzero().squeeze(-1)

    def torch_unpermute():
        out = torch.zeros_like(x)
        return out.index_add_(0, kept, permuted * gates[kept, None].to(permuted.dtype))

    base = _bench_ms(torch_unpermute)
    _row("torch gate-scale + index_add_", nbytes + num_tokens * hidden * 2, base, copy_gbs, base)
    ms = _bench_ms(lambda: moe_unpermute(permuted, row_map, gates, num_tokens))
    _row("moe_unpermute", nbytes + num_tokens * hidden * 2, ms, copy_gbs, base)


# -- correctness on the device: every kernel against its PyTorch reference (benchmarks/gpu.py) --------------
# (atol, rtol) per stored dtype; bf16/fp16 outputs may differ by one rounding step from the CPU reference
_CHECK_TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 2 ** -7), torch.float16: (1e-3, 2 ** -10)}


def _compare(name: str, case: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.detach().cpu(), want.detach().cpu()
    atol, rtol = _CHECK_TOL.get(want.dtype, (1e-6, 1e-5))
    err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    ok = got.shape == want.shape and bool(torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol))
    return {"kernel": name, "case": case, "max_abs_err": err, "atol": atol, "rtol": rtol, "ok": ok}


def check_kernels(device: str = "cuda", force_triton: bool = False, large: bool = True) -> list[dict]:
    """Run every Triton op on ``device`` tensors (the kernel: CUDA, or the CPU with ``force_triton`` under
    ``TRITON_INTERPRET=1``) and on CPU clones (the PyTorch reference) at odd sizes (``large``: also ~1M
    elements, many blocks); one row per output compared: ``{"kernel", "case", "max_abs_err", "atol", "rtol",
    "ok"}``."""
    from triton_kernels import cast_, fused_adamw_, unscale_norm_

    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    hp = dict(beta1=0.9, beta2=0.999, eps=1e-8, step=3)
    for n in (1, 4097) + (((1 << 20) + 3,) if large else ()):
        for grad_dtype in (torch.float32, torch.bfloat16):
            cut = max(1, n // 3)
            table = dict(seg_bounds=torch.tensor([0, cut, n]), seg_lr=torch.tensor([1e-3, 2e-3]),
                         seg_weight_decay=torch.tensor([0.01, 0.0]))
            state = [torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(grad_dtype),
                     torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01]
            outs = []
            for dev, force in ((device, force_triton), ("cpu", False)):
                p, g, m, v = (t.clone().to(dev) for t in state)
                lowp = torch.zeros(n, dtype=torch.bfloat16, device=dev)
                fused_adamw_(p, g, m, v, **{k: t.to(dev) for k, t in table.items()}, **hp,
                             grad_scale=torch.tensor([0.5], device=dev), out_lowp=lowp, force_triton=force)
                outs.append((p, m, v, lowp))
            case = f"n={n} grad={str(grad_dtype).split('.')[-1]}"
            for label, got, want in zip(("param", "exp_avg", "exp_avg_sq", "bf16 copy"), *outs):
                rows.append(_compare("fused_adamw_", f"{case} {label}", got, want))
    for n in (5000,) + (((1 << 20) + 7,) if large else ()):
        grad = torch.randn(n, generator=gen)
        outs = []
        for dev, force in ((device, force_triton), ("cpu", False)):
            g = grad.clone().to(dev)
            found = torch.zeros(1, device=dev)
            sq = unscale_norm_(g, inv_scale=torch.tensor([0.25], device=dev), found_inf=found, force_triton=force)
            outs.append((g, sq.reshape(-1), found))
        rows.append(_compare("unscale_norm_", f"n={n} grad", outs[0][0], outs[1][0]))
        got, want = outs[0][1].double(), outs[1][1].double()
        rows.append({"kernel": "unscale_norm_", "case": f"n={n} squared norm", "ok": bool(torch.allclose(
            got.cpu(), want.cpu(), rtol=1e-5)), "max_abs_err": float((got.cpu() - want.cpu()).abs().max()),
            "atol": 0.0, "rtol": 1e-5})
    grad = torch.randn(4097, generator=gen)
    grad[17] = float("inf")
    found = torch.zeros(1, device=device)
    unscale_norm_(grad.to(device), inv_scale=1.0, found_inf=found, force_triton=force_triton)
    rows.append({"kernel": "unscale_norm_", "case": "inf sets found_inf", "ok": float(found.cpu()[0]) == 1.0,
                 "max_abs_err": 0.0, "atol": 0.0, "rtol": 0.0})
    src = torch.randn(5003, generator=gen)
    outs = []
    for dev, force in ((device, force_triton), ("cpu", False)):
        dst = torch.zeros(5003, dtype=torch.bfloat16, device=dev)
        cast_(src.to(dev), dst, force_triton=force)
        outs.append(dst)
    rows.append(_compare("cast_", "fp32->bf16 n=5003", *outs))
    rows += _check_moe(device, force_triton, gen, hidden=1100 if large else 40)
    return rows


def _check_moe(device: str, force_triton: bool, gen: torch.Generator, hidden: int) -> list[dict]:
    from triton_kernels import moe_permute, moe_unpermute

    tokens, experts = 257, 4
    x = torch.randn(tokens, hidden, generator=gen)
    expert_index = torch.randint(0, experts, (tokens,), generator=gen)
    gates = torch.rand(tokens, generator=gen)
    outs = []
    for dev, force in ((device, force_triton), ("cpu", False)):
        permuted, row_map, counts = moe_permute(x.to(dev), expert_index.to(dev), experts, 80, force_triton=force)
        back = moe_unpermute(permuted, row_map, gates.to(dev), tokens, force_triton=force)
        outs.append((permuted, row_map, counts, back))
    (p1, r1, c1, b1), (p2, r2, c2, b2) = outs
    rows = [_compare("moe_permute", f"T={tokens} H={hidden} E={experts} rows", p1, p2),
            _compare("moe_unpermute", f"T={tokens} H={hidden} E={experts} combine", b1, b2)]
    same_map = torch.equal(r1.cpu(), r2.cpu()) and torch.equal(c1.cpu(), c2.cpu())
    rows.append({"kernel": "moe_permute", "case": "row map and counts", "ok": same_map, "max_abs_err": 0.0,
                 "atol": 0.0, "rtol": 0.0})
    return rows


def adamw_bandwidth(numel: int) -> dict[str, float]:
    """Device copy bandwidth and the fused AdamW kernel's (and torch's fused AdamW's) on one ``numel`` fp32
    shard: ``{"copy_gbs", "adamw_fp32_gbs", "adamw_fraction_of_copy", "adamw_fp32_ms", "torch_fused_ms",
    "speedup_vs_torch_fused"}`` (GB/s counts each byte the op must read or write once)."""
    copy_gbs = bench_copy(numel)
    res = bench_adamw(numel, copy_gbs, sweep=False)
    return {"copy_gbs": copy_gbs, "adamw_fp32_gbs": res["adamw_fp32_gbs"],
            "adamw_fraction_of_copy": res["adamw_fp32_gbs"] / copy_gbs, "adamw_fp32_ms": res["adamw_fp32_ms"],
            "torch_fused_ms": res["torch_fused_ms"], "speedup_vs_torch_fused": res["torch_fused_ms"] / res["adamw_fp32_ms"],
            "shard_bytes": numel * 4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard-mib", type=int, default=64, help="size of the fp32 shard in MiB (default 64)")
    parser.add_argument("--sweep", action="store_true", help="also sweep AdamW BLOCK_SIZE / num_warps")
    parser.add_argument("--smoke", action="store_true",
                        help="run every step on the CPU at a tiny size (Triton interpreter) to check the script")
    args = parser.parse_args(argv)
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"  # before triton_kernels is imported by the bench functions
        numel = 4096 + 123
        copy_gbs = 1.0
        bench_adamw(numel, copy_gbs, args.sweep)
        bench_unscale_norm(numel, copy_gbs)
        bench_cast(numel, copy_gbs)
        bench_moe(copy_gbs, num_tokens=64, hidden=40, num_experts=4)
        print("smoke run finished (CPU timings are meaningless)")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/kernel_bench.py: no CUDA device on this machine; nothing to measure (kernels are "
              "tested on CPU under TRITON_INTERPRET=1 by tests/test_kernels*.py).")
        return 0
    numel = args.shard_mib * MIB // 4
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    copy_gbs = bench_copy(numel)
    res = bench_adamw(numel, copy_gbs, args.sweep)
    bench_unscale_norm(numel, copy_gbs)
    bench_cast(numel, copy_gbs)
    bench_moe(copy_gbs)
    frac = res["adamw_fp32_gbs"] / copy_gbs
    faster = res["adamw_fp32_ms"] < res["torch_fused_ms"]
    print(f"\ntarget: fused AdamW >= 80% of copy bandwidth: {100 * frac:.1f}% -> {'met' if frac >= 0.8 else 'NOT met'}; "
          f"faster than AdamW(fused=True): x{res['torch_fused_ms'] / res['adamw_fp32_ms']:.2f} -> "
          f"{'met' if faster else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
