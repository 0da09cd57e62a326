"""Triton kernels vs their PyTorch references (interpreter mode on CPU) and vs torch.optim.

tests/conftest.py sets TRITON_INTERPRET=1 before this module imports triton_kernels.
Note: Triton's interpreter converts fp32 -> bf16 by truncation (a GPU rounds to nearest even), so
bf16 outputs of a kernel are compared with a tolerance of one bf16 ulp.
"""

import pytest
import torch

import triton_kernels
from triton_kernels import cast_, fused_adamw_, unscale_norm_

SIZES = [1, 1023, 4097, 5000]  # 5000 is a multiple of neither block size (2048, 4096)
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# tolerance on values stored in a dtype: (atol, rtol); bf16 allows one ulp (interpreter truncation)
STORE_TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 2 ** -7), torch.float16: (1e-3, 2 ** -10)}
ADAM = dict(beta1=0.9, beta2=0.999, eps=1e-8)


def _segments(n: int, num_segments: int, gen: torch.Generator):
    """Random segment table; with 3 segments one of them is empty when n allows."""
    if num_segments == 1 or n < 3:
        bounds = [0, n]
        num_segments = 1
    else:
        cut = sorted(torch.randint(1, n, (1,), generator=gen).tolist())
        bounds = [0, cut[0], cut[0], n]  # middle segment empty: the search must skip it
    lr = torch.rand(num_segments, generator=gen) * 1e-2 + 1e-3
    wd = torch.rand(num_segments, generator=gen) * 0.2
    return torch.tensor(bounds, dtype=torch.int64), lr, wd


def _state(n: int, grad_dtype, gen):
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    exp_avg = torch.randn(n, generator=gen) * 0.1
    exp_avg_sq = torch.rand(n, generator=gen) * 0.01
    return param, grad, exp_avg, exp_avg_sq


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("num_segments", [1, 3])
@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_adam_kernel_matches_reference(n, grad_dtype, num_segments, decoupled):
    gen = torch.Generator().manual_seed(n * 7 + num_segments)
    bounds, lr, wd = _segments(n, num_segments, gen)
    state = _state(n, grad_dtype, gen)
    lowp_dtype = torch.float16 if grad_dtype == torch.float16 else torch.bfloat16
    results = []
    for force in (True, False):
        p, g, m, v = (t.clone() for t in state)
        lowp = torch.full((n,), 7.0, dtype=lowp_dtype)
        fused_adamw_(p, g, m, v, seg_bounds=bounds, seg_lr=lr, seg_weight_decay=wd, step=3,
                     grad_scale=torch.tensor(0.5), out_lowp=lowp, decoupled_weight_decay=decoupled,
                     force_triton=force, **ADAM)
        results.append((p, m, v, lowp))
    (pk, mk, vk, lk), (pr, mr, vr, lr_) = results
    assert not torch.equal(pk, state[0])  # the kernel did update
    torch.testing.assert_close(pk, pr, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mk, mr, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(vk, vr, atol=1e-9, rtol=1e-5)
    atol, rtol = STORE_TOL[lowp_dtype]
    torch.testing.assert_close(lk.float(), lr_.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lk.float(), pk, atol=atol, rtol=rtol)


def _two_group_setup(seed: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = [300, 517, 50, 2100]  # groups: A, B, A, B  -> 4 segments
    groups = [0, 1, 0, 1]
    params = [torch.randn(s, generator=gen) for s in sizes]
    grads = [[torch.randn(s, generator=gen) for s in sizes] for _ in range(6)]
    return sizes, groups, params, grads


@pytest.mark.parametrize("force", [True, False])
@pytest.mark.parametrize("optim_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_fused_adam_trajectory_matches_torch_optim(force, optim_cls):
    sizes, groups, init, grads = _two_group_setup(0)
    hp = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.02)]
    ref_params = [torch.nn.Parameter(p.clone()) for p in init]
    opt = optim_cls(
        [{"params": [p for p, g in zip(ref_params, groups) if g == i], **hp[i]} for i in range(2)],
        betas=(0.9, 0.99), eps=1e-7, foreach=False,
    )
    shard = torch.cat(init)
    exp_avg, exp_avg_sq = torch.zeros_like(shard), torch.zeros_like(shard)
    bounds = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist())
    loss_scale = 1024.0
    for step, step_grads in enumerate(grads, start=1):
        if step == 4:  # an LR scheduler changes lr between steps
            for group in opt.param_groups:
                group["lr"] *= 0.5
        for p, g in zip(ref_params, step_grads):
            p.grad = g.clone()
        opt.step()
        seg_lr = torch.tensor([opt.param_groups[g]["lr"] for g in groups])
        seg_wd = torch.tensor([opt.param_groups[g]["weight_decay"] for g in groups])
        scaled_grad = torch.cat(step_grads) * loss_scale
        fused_adamw_(shard, scaled_grad, exp_avg, exp_avg_sq, seg_bounds=bounds, seg_lr=seg_lr,
                     seg_weight_decay=seg_wd, beta1=0.9, beta2=0.99, eps=1e-7, step=step,
                     grad_scale=torch.tensor([1.0 / loss_scale]),
                     decoupled_weight_decay=optim_cls is torch.optim.AdamW, force_triton=force)
    expected = torch.cat([p.detach() for p in ref_params])
    assert not torch.allclose(expected, torch.cat(init), atol=1e-3)  # the trajectory moved
    torch.testing.assert_close(shard, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(exp_avg, torch.cat([opt.state[p]["exp_avg"] for p in ref_params]),
                               atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(exp_avg_sq, torch.cat([opt.state[p]["exp_avg_sq"] for p in ref_params]),
                               atol=1e-9, rtol=1e-5)


@pytest.mark.parametrize("force", [True, False])
def test_fused_adam_found_inf_skips_everything(force):
    gen = torch.Generator().manual_seed(1)
    n = 4097
    state = _state(n, torch.float32, gen)
    p, g, m, v = (t.clone() for t in state)
    lowp = torch.full((n,), 3.0, dtype=torch.bfloat16)
    kwargs = dict(seg_bounds=torch.tensor([0, n]), seg_lr=torch.tensor([1e-2]), seg_weight_decay=torch.tensor([0.1]),
                  step=1, out_lowp=lowp, force_triton=force, **ADAM)
    fused_adamw_(p, g, m, v, found_inf=torch.ones(1), **kwargs)
    for after, before in zip((p, g, m, v), state):
        assert torch.equal(after, before)
    assert torch.equal(lowp, torch.full((n,), 3.0, dtype=torch.bfloat16))
    fused_adamw_(p, g, m, v, found_inf=torch.zeros(1), **kwargs)
    assert not torch.equal(p, state[0]) and not torch.equal(m, state[2])
    atol, rtol = STORE_TOL[torch.bfloat16]
    torch.testing.assert_close(lowp.float(), p, atol=atol, rtol=rtol)


def test_fused_adam_cpu_dispatch_uses_reference(monkeypatch):
    from triton_kernels import fused_adam

    def _fail(*args, **kwargs):
        raise AssertionError("the Triton launcher must not run for CPU tensors without force_triton")

    monkeypatch.setattr(fused_adam, "_launch_fused_adam", _fail)
    p, g, m, v = _state(10, torch.float32, torch.Generator().manual_seed(2))
    before = p.clone()
    fused_adamw_(p, g, m, v, seg_bounds=[0, 10], seg_lr=[1e-2], seg_weight_decay=[0.0], step=1, **ADAM)
    assert not torch.equal(p, before)


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(step=0), ValueError),
        (dict(seg_bounds=torch.tensor([0, 5, 10])), ValueError),  # 3 bounds for 1 segment
        (dict(seg_bounds=torch.tensor([0, 9])), ValueError),  # does not end at N
        (dict(grad=torch.zeros(10, dtype=torch.int32)), TypeError),
        (dict(grad=torch.zeros(9)), ValueError),
        (dict(found_inf=torch.zeros(2)), ValueError),
    ],
)
def test_fused_adam_rejects_bad_arguments(change, error):
    p, g, m, v = _state(10, torch.float32, torch.Generator().manual_seed(3))
    kwargs = dict(seg_bounds=torch.tensor([0, 10]), seg_lr=torch.tensor([1e-2]), seg_weight_decay=torch.tensor([0.0]),
                  step=1, **ADAM)
    g = change.pop("grad", g)
    kwargs.update(change)
    with pytest.raises(error):
        fused_adamw_(p, g, m, v, **kwargs)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("scale_as_tensor", [True, False])
def test_unscale_norm_matches_reference(n, dtype, scale_as_tensor):
    gen = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=gen) * 64).to(dtype)
    inv_scale = torch.tensor(0.125) if scale_as_tensor else 0.125
    outs = []
    for force in (True, False):
        g = grad.clone()
        found_inf = torch.zeros(1)
        sq = unscale_norm_(g, inv_scale=inv_scale, found_inf=found_inf, force_triton=force)
        outs.append((g, found_inf, sq))
    (gk, fk, sk), (gr, fr, sr) = outs
    atol, rtol = STORE_TOL[dtype]
    torch.testing.assert_close(gk.float(), gr.float(), atol=atol, rtol=rtol)
    assert fk.item() == 0.0 and fr.item() == 0.0
    assert sk.dtype == torch.float32 and sk.dim() == 0
    torch.testing.assert_close(sk, sr, atol=0, rtol=1e-5 if dtype == torch.float32 else 2e-2)
    torch.testing.assert_close(sk, gk.float().square().sum(), atol=0, rtol=1e-5)  # norm of stored values


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("force", [True, False])
def test_unscale_norm_flags_non_finite(bad, force):
    grad = torch.randn(5000)
    grad[4321] = bad
    found_inf = torch.zeros(1)
    unscale_norm_(grad, inv_scale=0.5, found_inf=found_inf, force_triton=force)
    assert found_inf.item() == 1.0
    # an earlier overflow is never cleared by a clean chunk
    unscale_norm_(torch.randn(100), inv_scale=0.5, found_inf=found_inf, force_triton=force)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("force", [True, False])
def test_unscale_norm_accumulates_over_chunks(force):
    chunks = [torch.randn(1023), torch.randn(4097)]
    expected = sum((c * 0.5).square().sum() for c in chunks)
    total = torch.zeros(())
    found_inf = torch.zeros(1)
    for c in chunks:
        returned = unscale_norm_(c, inv_scale=torch.tensor([0.5]), found_inf=found_inf, out_sq_norm=total,
                                 force_triton=force)
        assert returned is total
    torch.testing.assert_close(total, expected, atol=0, rtol=1e-5)
    assert found_inf.item() == 0.0


def test_unscale_norm_requires_fp32_flag():
    with pytest.raises(ValueError, match="found_inf"):
        unscale_norm_(torch.randn(4), inv_scale=1.0, found_inf=torch.zeros(1, dtype=torch.float16))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                  (torch.bfloat16, torch.float32)])
def test_cast_matches_reference(n, src_dtype, dst_dtype):
    src = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(src_dtype)
    dst_kernel = cast_(src, torch.empty(n, dtype=dst_dtype), force_triton=True)
    dst_ref = cast_(src, torch.empty(n, dtype=dst_dtype))
    atol, rtol = STORE_TOL[dst_dtype]
    torch.testing.assert_close(dst_kernel.float(), dst_ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(dst_ref, src.to(dst_dtype), atol=0, rtol=0)


def test_cast_rejects_mismatched_numel():
    with pytest.raises(ValueError, match="dst_lowp"):
        cast_(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16))


def test_public_surface():
    for name in ("fused_adamw_", "unscale_norm_", "moe_permute", "moe_unpermute", "cast_"):
        assert name in triton_kernels.__all__ and callable(getattr(triton_kernels, name))
