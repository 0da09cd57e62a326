"""hf_elixir.full_gradients / get_full_grad equal plain PyTorch's p.grad (hf_elixir/optim/gradients.py,
[Note: readable gradients]); a user's p.grad read between backward and step raises naming them."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_elixir
from hf_elixir.chunk.params import StaleParameterError, UnconsumedGradientError
from tests._dist import run_distributed
from tests._models import rank_batch, tiny_model, two_groups

CHUNK = 8192
LAYOUTS = {
    "sharded": dict(chunk_size_numel=CHUNK, default_placement="sharded"),
    # chunks offloaded, gradients and optimizer states on the host (the host lane takes them during backward)
    "offloaded": dict(chunk_size_numel=CHUNK, default_placement="sharded", device_memory_budget_bytes=200_000,
                      budget_covers_activations=False, offload_optimizer=True),
}
SCALE = 2.0**10
MAX_NORM = 0.05  # below the gradient norm: clipping scales every gradient


def _reference_grads(ref, precision, world_size, step=0):
    """Plain PyTorch: each rank's batch backward on a copy in the compute dtype (fp16: the loss scaled by SCALE),
    gradients in fp32
    unscaled and averaged over the ranks (what the data-parallel mean loss gives)."""
    model = ref.to({"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision])
    total: dict[str, torch.Tensor] = {}
    for r in range(world_size):
        model.zero_grad()
        loss = model(**rank_batch("gpt2", step, r, world_size, 2)).loss
        (loss * SCALE if precision == "fp16" else loss).backward()
        for name, p in model.named_parameters():
            g = p.grad.float() / (SCALE if precision == "fp16" else 1.0)
            total[name] = total.get(name, 0) + g / world_size
    return total


def _plain_clipped(grads: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """Plain PyTorch's clipping of ``grads``: ``torch.nn.utils.clip_grad_norm_`` on parameters holding them as
    ``.grad``; returns the clipped gradients and the total norm before clipping."""
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in grads.items()}
    for name, param in params.items():
        param.grad = grads[name].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM)
    assert float(norm) > MAX_NORM, "the gradients must be clipped, or the check is vacuous"
    return {n: p.grad for n, p in params.items()}, float(norm)


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in b)
    return (num / sum(float(b[k].double().norm() ** 2) for k in b)) ** 0.5


def _worker(rank, world_size, precision, layout):
    model = tiny_model("gpt2")
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        precision=precision, loss_scale=hf_elixir.LossScalePolicy(init_scale=SCALE), **LAYOUTS[layout]))
    opt.backward(model(**rank_batch("gpt2", 0, rank, world_size, 2)).loss)
    with hf_elixir.full_gradients(model) as grads:
        shapes_ok = all(grads[n].shape == p.shape and grads[n].dtype == torch.float32
                        for n, p in model.named_parameters())
    one = hf_elixir.get_full_grad(model.transformer.h[1].mlp.c_fc.weight, model)
    expected = _reference_grads(ref, precision, world_size)
    result = {"names": list(grads) == [n for n, _ in model.named_parameters()], "shapes": shapes_ok,
              "rel": _rel(grads, expected), "one": _rel({"w": one}, {"w": expected["transformer.h.1.mlp.c_fc.weight"]})}
    norm = opt.clip_grad_norm(MAX_NORM)  # unscales; on the host the clip factor is owed until the step
    with hf_elixir.full_gradients(model) as clipped:
        pass
    want_clipped, want_norm = _plain_clipped(expected)
    result["clipped_rel"] = _rel(clipped, want_clipped)
    result["norm_rel"] = abs(float(norm) - want_norm) / want_norm
    opt.step()
    opt.zero_grad()
    with hf_elixir.full_gradients(model) as after_zero:
        result["after_zero"] = len(after_zero)
    return result


CASES = [("fp32", "sharded"), ("fp32", "offloaded"), ("fp16", "sharded"), ("fp16", "offloaded"),
         ("bf16", "offloaded")]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("precision,layout", CASES)
def test_full_gradients_equal_plain_pytorch(precision, layout, world_size):
    if world_size == 1:
        results = [_worker(0, 1, precision, layout)]
    else:
        results = run_distributed(_worker, 2, precision, layout, timeout_s=240)
    tol = 1e-6
    for result in results:
        assert result["names"] and result["shapes"]
        assert result["rel"] < tol and result["one"] < tol, result
        assert result["clipped_rel"] < tol and result["norm_rel"] < tol, result
        assert result["after_zero"] == 0  # zero_grad(set_to_none=True): no parameter has a gradient


def test_p_grad_read_by_user_code_raises_naming_full_gradients_and_library_paths_still_work():
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=5e-3),
                                   hf_elixir.ElixirConfig(**LAYOUTS["offloaded"]))
    assert all(p.grad is None for p in model.parameters())  # before backward: no gradient, as in PyTorch
    opt.backward(model(**rank_batch("gpt2", 0, 0, 1, 2)).loss)
    with pytest.raises(UnconsumedGradientError, match="hf_elixir.full_gradients"):
        sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=False)  # Module.zero_grad reads p.grad (library code): routed, no error
    opt.backward(model(**rank_batch("gpt2", 0, 0, 1, 2)).loss)
    norm = opt.clip_grad_norm(1.0)
    assert torch.isfinite(norm)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # nothing pending: None, no error
    # the stale-read guard stays loud outside full_parameters (an offloaded chunk between steps)
    with pytest.raises(StaleParameterError):
        float(model.transformer.h[0].mlp.c_fc.weight.sum())


def test_full_gradients_needs_an_optimizer():
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(**LAYOUTS["sharded"]))
    with pytest.raises(ValueError, match="prepared without an optimizer"):
        with hf_elixir.full_gradients(model):
            pass


# -- tensor / expert parallel: the unmodified model's names and full shapes ------------------------------------
PARALLEL_TOL = 1e-5  # fp32, relative L2 over every gradient, and per tensor


def _switch_12_experts():
    """Switch-style per-expert modules, 12 experts over ep=2: rank 1 holds expert_6 .. expert_11, so the
    renumbering must order expert_10 after expert_9; with 16 tokens per rank some experts get none."""
    import transformers as T

    torch.manual_seed(0)
    return T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        vocab_size=128, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=12,
        expert_capacity=3, num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, router_jitter_noise=0.0,
        dropout_rate=0.0, router_z_loss_coef=0.01, router_aux_loss_coef=0.1, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1))


def _load_other_weights(model, ref, folder: str | None) -> bool:
    """New full weights (the current ones plus seeded noise, the same on every rank) into the prepared parallel
    ``model`` through ``load_full_state_dict`` (from a folder rank 0 writes with plain ``save_pretrained`` when
    ``folder`` is given, else from the dict) and into ``ref``; whether ``model`` then gathers exactly them."""
    import torch.distributed as dist

    from hf_elixir.parallel import gather_full_state_dict, load_full_state_dict

    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():  # each tied parameter once: its names keep one value
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    new = {k: v.clone() for k, v in ref.state_dict().items()}
    if folder is not None:
        if dist.get_rank() == 0:
            ref.save_pretrained(folder)
        dist.barrier()
    load_full_state_dict(model, folder if folder is not None else new)
    loaded = gather_full_state_dict(model, rank0_only=False)
    return list(loaded) == list(new) and all(torch.equal(loaded[k], new[k]) for k in new)


def _parallel_case(model, cfg, batches: list[dict], rank: int, pick: str, half_budget: bool = False,
                   load_from: str | None = None) -> dict:
    """parallelize + prepare ``model``, one backward on this rank's batch (``batches[rank]``, or the one batch
    every tp rank shares); its gradients against plain PyTorch's p.grad of the mean loss over ``batches`` on the
    unmodified model. ``pick``: a substring naming the parameter read by ``get_full_grad``.
    ``half_budget``: a model-data budget of half this rank's 16 B/param state (chunks and gradients offloaded).
    ``load_from``: first load other full weights (``load_full_state_dict``): ``"dict"``, or a folder to write."""
    import dataclasses

    from hf_elixir.parallel import parallelize

    ref = copy.deepcopy(model)
    parallelize(model, cfg)
    if half_budget:
        cfg = dataclasses.replace(cfg, device_memory_budget_bytes=8 * sum(p.numel() for p in model.parameters()),
                                  budget_covers_activations=False)
    local_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    loaded_exact = None if load_from is None else \
        _load_other_weights(model, ref, None if load_from == "dict" else load_from)
    opt.backward(model(**batches[rank % len(batches)]).loss)
    with hf_elixir.full_gradients(model) as grads:
        pass
    with hf_elixir.full_gradients(model, local=True) as local:
        pass
    pick = pick.format(expert=6 * rank + 4)  # Switch: this rank's expert_4 / expert_10
    name, param = next((n, p) for n, p in model.named_parameters() if pick in n)
    one = hf_elixir.get_full_grad(param, model)
    one_local = hf_elixir.get_full_grad(param, model, local=True)
    torch.stack([ref(**b).loss for b in batches]).mean().backward()
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    same_names = list(grads) == list(expected)
    return {
        "same_names": same_names,
        "num_without_grad": len(shapes) - len(expected),  # PyTorch left p.grad None (Switch: unrouted experts)
        "shapes": all(tuple(g.shape) == shapes[n] and g.dtype == torch.float32 for n, g in grads.items()),
        "rel": _rel(grads, expected) if same_names else float("inf"),
        "worst": max((_rel({n: grads[n]}, {n: g}), n) for n, g in expected.items() if g.norm() > 0)
        if same_names else (float("inf"), ""),
        "one": (name, one is None, expected.get(name) is None,
                0.0 if one is None or name not in expected else _rel({"w": one}, {"w": expected[name]})),
        "one_local_shape": None if one_local is None else tuple(one_local.shape),
        "picked_local_shape": local_shapes[name],
        "local_shapes": all(tuple(g.shape) == local_shapes[n] for n, g in local.items()),
        "local_names": list(local) == [n for n in local_shapes if n in local] and len(local) > 0,
        "num_sharded": sum(local_shapes[n] != shapes.get(n) for n in local),  # local shapes that are not full
        "loaded_exact": loaded_exact,
    }


def _parallel_worker(rank, world_size, out_dir):
    from parallel_harness import make_batch, make_model
    from tests._moe_ep_cases import _batch
    from tests._moe_models import make_moe_model

    torch.manual_seed(0)
    return {
        "llama_tp2": _parallel_case(
            make_model("llama"), hf_elixir.ElixirConfig(tensor_parallel_size=2, chunk_size_numel=4096),
            [make_batch("llama", 0, 0)], rank, "layers.0.self_attn.q_proj.weight", half_budget=True, load_from="dict"),
        "qwen3_tp2": _parallel_case(  # q_norm / k_norm: replicated, gradient summed over tp (grad_allreduce)
            make_model("qwen3"), hf_elixir.ElixirConfig(tensor_parallel_size=2, chunk_size_numel=4096),
            [make_batch("qwen3", 0, 0)], rank, "layers.1.self_attn.q_norm.weight"),
        "mixtral_ep2": _parallel_case(  # the fused slices kept whole (get_full_grad of one)
            make_moe_model("mixtral"), hf_elixir.ElixirConfig(placements={"*.mlp.experts": "expert"},
                                                              expert_parallel_size=2, chunk_size_numel=4096,
                                                              split_fused_experts=False),
            [_batch(0, r) for r in range(world_size)], rank, "layers.1.mlp.experts.down_proj"),
        "mixtral_ep2_split": _parallel_case(  # each local expert its own unit: the names are still the fused ones
            make_moe_model("mixtral"), hf_elixir.ElixirConfig(placements={"*.mlp.experts": "expert"},
                                                              expert_parallel_size=2, chunk_size_numel=4096),
            [_batch(0, r) for r in range(world_size)], rank, "layers.1.mlp.gate.weight",
            load_from=f"{out_dir}/mixtral"),  # written per expert, fused back by transformers' converters
        "deepseek_v3_tp2": _parallel_case(  # mla_kv_a: the rotary part's gradient summed over tp
            make_model("deepseek_v3"), hf_elixir.ElixirConfig(tensor_parallel_size=2, chunk_size_numel=4096),
            [make_batch("deepseek_v3", 0, 0)], rank, "layers.0.self_attn.kv_a_proj_with_mqa.weight",
            load_from=f"{out_dir}/deepseek_v3"),
        "phi3_packed_tp2": _parallel_case(  # packed_column: gate_r|up_r
            make_model("phi3_packed"), hf_elixir.ElixirConfig(tensor_parallel_size=2, chunk_size_numel=4096),
            [make_batch("phi3_packed", 0, 0)], rank, "layers.0.mlp.gate_up_proj.weight", load_from="dict"),
        "llama4_tp2": _parallel_case(  # moe_tp: 3-D experts split on dim 2 (two packed parts) and dim 1
            make_model("llama4"), hf_elixir.ElixirConfig(tensor_parallel_size=2, chunk_size_numel=4096),
            [make_batch("llama4", 0, 0)], rank, "layers.1.feed_forward.experts.gate_up_proj",
            load_from=f"{out_dir}/llama4"),
        "switch_ep2": _parallel_case(
            _switch_12_experts(), hf_elixir.ElixirConfig(expert_parallel_size=2, chunk_size_numel=4096),
            [make_batch("switch", 0, r) for r in range(world_size)], rank,
            "decoder.block.1.layer.2.mlp.experts.expert_{expert}.wi", load_from="dict"),
    }


def test_full_gradients_of_tp_and_ep_models_are_the_unmodified_models(tmp_path):
    """TP=2 (Llama, Qwen3, DeepSeek-V3's mla_kv_a, Phi-3's packed gate_up_proj, Llama-4's moe_tp experts) and EP=2
    (Mixtral's fused experts, Switch's expert_{i} modules) on 2 gloo ranks: after one backward, full_gradients holds
    plain PyTorch's p.grad of the unmodified model, its names, order and full shapes; local=True this rank's
    parameters; get_full_grad one full gradient (the local one with local=True). Before it, other full weights are loaded with load_full_state_dict (a
    dict, or a plain save_pretrained folder read slice by slice) into the prepared model and into the reference: the
    model gathers exactly them back, and the gradient parity is on them."""
    results = run_distributed(_parallel_worker, 2, str(tmp_path), timeout_s=240)
    for rank, per_case in enumerate(results):
        for case, m in per_case.items():
            where = f"rank {rank} {case}: {m}"
            assert m["same_names"] and m["shapes"], where
            assert m["rel"] < PARALLEL_TOL and m["worst"][0] < PARALLEL_TOL, where
            name, none, expected_none, one_rel = m["one"]
            assert none == expected_none and one_rel < PARALLEL_TOL, where
            assert m["local_shapes"] and m["local_names"], where
            if not none:
                assert m["one_local_shape"] == m["picked_local_shape"], where
            if case.endswith("tp2") or case.startswith("mixtral_ep2"):
                assert m["num_sharded"] > 0, where  # the local view really is the shards
            assert m["loaded_exact"] in (None, True), where
        assert per_case["switch_ep2"]["num_without_grad"] > 0  # some experts got no token: left out, as in PyTorch
        assert per_case["qwen3_tp2"]["one"][0].endswith("q_norm.weight")
        assert sum(m["loaded_exact"] is True for m in per_case.values()) == 6
