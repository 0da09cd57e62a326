"""The package's Triton kernels run on its hot paths: here the chunk cast kernel in the
optimizer's refresh of the low-precision compute copies, run through the Triton interpreter on CPU.
(The MoE permutation kernels on the expert-parallel path: tests/test_expert_parallel.py, case
``switch_ep2_kernels``.)"""

from __future__ import annotations

import pytest
import torch

import hf_elixir
import triton_kernels.cast as cast_module
from tests._models import batch, tiny_model, two_groups


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_compute_copies_are_refreshed_by_the_cast_kernel(monkeypatch, precision, dtype):
    launches = []
    launch = cast_module._launch_cast
    monkeypatch.setattr(cast_module, "_launch_cast", lambda src, dst: (launches.append(src.numel()), launch(src, dst)))
    monkeypatch.setattr(hf_elixir.ElixirOptimizer, "_force_fused", True)  # kernels on CPU tensors
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=8192, precision=precision))
    manager = hf_elixir.get_state(model).manager
    for step in range(2):
        opt.backward(model(**batch("gpt2", step, 2)).loss)
        opt.step()
        opt.zero_grad()
    trainable = [c for c in manager.chunks if c.trainable]
    # every trainable chunk's compute copy was cast from its fp32 master by the kernel, every step
    assert sum(launches) == 2 * sum(c.shard_numel for c in trainable), launches
    for chunk in trainable:
        target = chunk.full if chunk.full_alias else chunk.shard
        master = opt.masters[chunk.chunk_id]
        assert target.dtype == dtype and master.dtype == torch.float32
        # bitwise: the kernel and torch's copy_ both round to nearest even
        assert torch.equal(target, master.to(dtype)), chunk.chunk_id


@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                  (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_cast_kernel_rounds_bitwise_like_torch(src_dtype, dst_dtype):
    """Round to nearest even, ties, overflow to inf, subnormals: bitwise ``Tensor.to`` (the Triton
    interpreter's own bf16 conversion truncates; see [Note: bf16 rounding] in triton_kernels/cast.py)."""
    from triton_kernels import cast_

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=gen) * torch.logspace(-44, 38, 20000)
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -133 * 3, 65520.0, 3.3895e38])
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 2 ** -126, 3.4028e38])
    x = torch.cat([ties, edges, x]).to(src_dtype)
    got = cast_(x, torch.empty(x.numel(), dtype=dst_dtype), force_triton=True)
    assert torch.equal(got, x.to(dst_dtype))
