"""MoE token permutation: Triton kernels (interpreter) vs PyTorch reference vs a loop reference vs HF Switch."""

import pytest
import torch

from triton_kernels import moe_permute, moe_routing_map, moe_unpermute

DTYPE_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _loop_routing(expert_index, num_experts, capacity, group_size):
    """Plain-python capacity rule: per group, first choices in token order, then second choices, ..."""
    ei = expert_index.reshape(expert_index.shape[0], -1).tolist()
    num_tokens, k = len(ei), len(ei[0]) if ei else 1
    group = group_size or num_tokens
    kept = set()
    for g0 in range(0, num_tokens, group):
        load = [0] * num_experts
        for j in range(k):
            for t in range(g0, g0 + group):
                e = ei[t][j]
                if capacity is None or load[e] < capacity:
                    load[e] += 1
                    kept.add((t, j))
    rows = sorted(kept, key=lambda tj: (ei[tj[0]][tj[1]], tj[0], tj[1]))  # expert, token, choice
    return rows, [sum(1 for t, j in rows if ei[t][j] == e) for e in range(num_experts)]


def _loop_unpermute(permuted_out, rows, gates_2d, num_tokens):
    out = torch.zeros(num_tokens, permuted_out.shape[1], dtype=torch.float64)
    for r, (t, j) in enumerate(rows):
        out[t] += gates_2d[t, j].double() * permuted_out[r].double()
    return out


@pytest.mark.parametrize("num_tokens, hidden", [(1, 1), (37, 33), (64, 1100)])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity", [None, 3])
def test_routing_matches_loop_reference(num_tokens, hidden, k, capacity):
    gen = torch.Generator().manual_seed(num_tokens * 10 + k)
    num_experts = 4
    expert_index = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)])
    if k == 1:
        expert_index = expert_index[:, 0]
    group_size = 8 if num_tokens % 8 == 0 else None
    hidden_states = torch.randn(num_tokens, hidden, generator=gen)
    rows, counts = _loop_routing(expert_index, num_experts, capacity, group_size)
    for force in (True, False):
        permuted, row_map, got_counts = moe_permute(hidden_states, expert_index, num_experts, capacity,
                                                    group_size=group_size, force_triton=force)
        assert got_counts.tolist() == counts
        assert row_map.shape == expert_index.shape
        expected = torch.stack([hidden_states[t] for t, _ in rows]) if rows else torch.empty(0, hidden)
        torch.testing.assert_close(permuted, expected, atol=0, rtol=0)
        rm = row_map.reshape(num_tokens, -1)
        assert sorted((t, j) for t in range(num_tokens) for j in range(rm.shape[1]) if rm[t, j] >= 0) == sorted(rows)
        for r, (t, j) in enumerate(rows):
            assert rm[t, j].item() == r
        gates = torch.rand(expert_index.shape, generator=gen)
        out = moe_unpermute(permuted * 2.0, row_map, gates, num_tokens, force_triton=force)
        expected_out = _loop_unpermute(permuted * 2.0, rows, gates.reshape(num_tokens, -1), num_tokens)
        torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)


def test_routing_map_capacity_zero_drops_everything():
    row_map, counts = moe_routing_map(torch.tensor([0, 1, 1, 2]), 3, capacity=0)
    assert counts.tolist() == [0, 0, 0] and (row_map == -1).all()
    out = moe_unpermute(torch.empty(0, 5), row_map, torch.ones(4), 4, force_triton=True)
    assert torch.equal(out, torch.zeros(4, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2])
def test_kernels_match_reference_forward_and_backward(dtype, k):
    gen = torch.Generator().manual_seed(7 + k)
    num_tokens, hidden, num_experts = 40, 70, 5
    expert_index = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)])
    hidden0 = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gates0 = torch.rand(num_tokens, k, generator=gen)
    weight = torch.randn(hidden, hidden, generator=gen).to(dtype) * 0.1
    grad_out = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    results = []
    for force in (True, False):
        h = hidden0.clone().requires_grad_(True)
        gates = gates0.clone().requires_grad_(True)
        permuted, row_map, counts = moe_permute(h, expert_index, num_experts, 6, force_triton=force)
        expert_out = permuted @ weight  # one "expert" for all rows is enough to exercise the gradients
        out = moe_unpermute(expert_out, row_map, gates, num_tokens, force_triton=force)
        out.backward(grad_out)
        results.append((permuted, out, h.grad, gates.grad))
    atol, rtol = DTYPE_TOL[dtype]
    assert int(counts.sum()) < num_tokens * k  # capacity 6 really dropped something
    for got, want in zip(results[0], results[1]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    assert results[0][3].dtype == torch.float32 and results[0][3].abs().sum() > 0


@pytest.mark.parametrize("force", [True, False])
def test_gradcheck_fp64(force):
    gen = torch.Generator().manual_seed(3)
    num_tokens, hidden, num_experts = 7, 5, 3  # small: every gradcheck evaluation runs interpreted kernels
    expert_index = torch.randint(0, num_experts, (num_tokens, 2), generator=gen)
    h = torch.randn(num_tokens, hidden, dtype=torch.float64, generator=gen, requires_grad=True)
    gates = torch.rand(num_tokens, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(hidden, hidden, dtype=torch.float64, generator=gen)

    def fn(h, gates):
        permuted, row_map, _ = moe_permute(h, expert_index, num_experts, 4, force_triton=force)
        return moe_unpermute(torch.tanh(permuted @ w), row_map, gates, num_tokens, force_triton=force)

    assert torch.autograd.gradcheck(fn, (h, gates), fast_mode=force)


def _tiny_switch_config(capacity):
    from transformers import SwitchTransformersConfig

    return SwitchTransformersConfig(d_model=16, d_ff=24, num_experts=4, expert_capacity=capacity, d_kv=4,
                                    num_heads=2, num_layers=1, vocab_size=32, router_jitter_noise=0.0,
                                    dropout_rate=0.0)


@pytest.mark.parametrize("force", [True, False])
def test_matches_hf_switch_sparse_mlp(force):
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

    torch.manual_seed(0)
    capacity, batch, seq = 3, 2, 10  # 10 tokens over 4 experts per sequence: some expert overflows
    mlp = SwitchTransformersSparseMLP(_tiny_switch_config(capacity)).train()
    x = torch.randn(batch, seq, 16, requires_grad=True)
    hf_out = mlp(x)
    hf_mask, router_probs, router_logits = mlp.router(x)  # HF one-hot dispatch mask after dropping
    assert int(hf_mask.sum()) < batch * seq  # the case really drops tokens

    x2 = x.detach().clone().requires_grad_(True)
    probs = torch.softmax(mlp.router.classifier(x2), dim=-1)
    gates, expert_index = probs.max(dim=-1)
    flat = x2.reshape(-1, 16)
    permuted, row_map, counts = moe_permute(flat, expert_index.reshape(-1), 4, capacity, group_size=seq,
                                            force_triton=force)
    # kept tokens are exactly HF's dispatch mask
    ours_mask = torch.zeros(batch * seq, 4, dtype=hf_mask.dtype)
    kept = row_map >= 0
    ours_mask[kept.nonzero().squeeze(-1), expert_index.reshape(-1)[kept]] = 1
    assert torch.equal(ours_mask, hf_mask.reshape(-1, 4))
    pieces = torch.split(permuted, counts.tolist())
    expert_out = torch.cat([mlp.experts[f"expert_{e}"](p) for e, p in enumerate(pieces)])
    ours = moe_unpermute(expert_out, row_map, gates.reshape(-1), batch * seq, force_triton=force).reshape(x.shape)
    torch.testing.assert_close(ours, hf_out, atol=1e-6, rtol=1e-5)

    grad = torch.randn_like(hf_out)
    hf_out.backward(grad)
    hf_grads = {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}
    mlp.zero_grad()
    ours.backward(grad)
    torch.testing.assert_close(x2.grad, x.grad, atol=1e-6, rtol=1e-5)
    for name, p in mlp.named_parameters():
        if name in hf_grads:
            torch.testing.assert_close(p.grad, hf_grads[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(expert_index=torch.tensor([0.0, 1.0])), TypeError),
        (dict(expert_index=torch.tensor([0, 4])), ValueError),  # out of range for E=4
        (dict(capacity=-1), ValueError),
        (dict(group_size=3), ValueError),  # does not divide T=2
    ],
)
def test_permute_rejects_bad_arguments(kwargs, error):
    args = dict(hidden=torch.randn(2, 3), expert_index=torch.tensor([0, 1]), num_experts=4, capacity=2)
    args.update(kwargs)
    with pytest.raises(error):
        moe_permute(**args)
