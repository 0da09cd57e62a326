"""Behaviours the chunk manager must keep: gradient accumulation, unused / frozen / tied parameters,
modules called twice, activation checkpointing, eval and generate(), precisions, budget errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers
from safetensors import safe_open

import hf_elixir
from hf_elixir.chunk.params import StaleParameterError
from hf_elixir.chunk.states import TRANSITIONS, TensorState, check_transition
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model, two_groups

CHUNK = 8192


def _prepare(model, lr=5e-3, **cfg):
    opt = torch.optim.AdamW(two_groups(model), lr=lr)
    cfg.setdefault("chunk_size_numel", CHUNK)
    # the budgets in this file bound model data (the chunk mechanics under test); activations are charged
    # against an explicit budget in tests/test_activation_budget.py
    cfg.setdefault("budget_covers_activations", False)
    return hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(**cfg))


def _train_ref(model, batches, lr=5e-3, accumulate=1, clip=None):
    opt = torch.optim.AdamW(two_groups(model), lr=lr)
    for group in batches:
        for b in group:
            (model(**b).loss / accumulate).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model


def _train_elixir(model, opt, batches, accumulate=1, clip=None):
    norms = []
    for group in batches:
        for b in group:
            opt.backward(model(**b).loss / accumulate)
        if clip:
            norms.append(float(opt.clip_grad_norm(clip)))
        opt.step()
        opt.zero_grad()
    return norms


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_transition_table_is_declared_and_enforced():
    assert set(TRANSITIONS) == set(TensorState)
    check_transition(TensorState.FREE, TensorState.HOLD)
    with pytest.raises(AssertionError, match="FREE -> COMPUTE"):
        check_transition(TensorState.FREE, TensorState.COMPUTE)
    # a slot's own move checks the same table (and names the parameter) before it changes state
    from hf_elixir.chunk._slot import ParamSlot

    slot = ParamSlot(name="h.0.w", param=torch.nn.Parameter(torch.zeros(2)), offset=0, numel=2,
                     shape=torch.Size([2]), trainable=True)
    slot.set_state(TensorState.HOLD)
    with pytest.raises(AssertionError, match="HOLD -> HOLD_AFTER_FWD for parameter 'h.0.w'"):
        slot.set_state(TensorState.HOLD_AFTER_FWD)
    assert slot.state is TensorState.HOLD


def test_gradient_accumulation_equals_big_batch_with_clipping():
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref), device_memory_budget_bytes=140_000)
    big = [[batch("gpt2", s, 8)] for s in range(3)]
    micro = [[{k: v[i * 2:(i + 1) * 2] for k, v in g[0].items()} for i in range(4)] for g in big]
    _train_ref(ref, big, clip=0.5)
    _train_elixir(model, opt, micro, accumulate=4, clip=0.5)
    assert rel_l2(_state(model), _state(ref)) < 1e-5


def test_frozen_parameters_stay_frozen_and_others_match():
    ref = tiny_model("gpt2")
    for p in ref.transformer.h[0].parameters():
        p.requires_grad_(False)
    model = copy.deepcopy(ref)
    before = {k: v.clone() for k, v in ref.state_dict().items() if k.startswith("transformer.h.0.")}
    model, opt = _prepare(model, device_memory_budget_bytes=140_000)
    batches = [[batch("gpt2", s, 2)] for s in range(3)]
    _train_ref(ref, batches)
    _train_elixir(model, opt, batches)
    state = _state(model)
    for k, v in before.items():
        assert torch.equal(state[k], v), k
    assert rel_l2(state, _state(ref)) < 1e-5


class _Branchy(torch.nn.Module):
    """A layer some steps skip, a module called twice, a parameter read functionally (MHA)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.sometimes = torch.nn.Linear(16, 16)
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids, use_branch: bool):
        x = self.emb(ids)
        x = torch.tanh(self.shared(torch.tanh(self.shared(x))))  # called twice
        if use_branch:
            x = x + self.sometimes(x)
        x = x + self.mha(x, x, x, need_weights=False)[0]
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("budget", [None, 20_000])
def test_unused_branch_called_twice_functional_and_tied(budget):
    torch.manual_seed(0)
    ref = _Branchy()
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)  # MHA key bias: zero grad + noise
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=1024,
                                                                       device_memory_budget_bytes=budget,
                                                                       budget_covers_activations=False))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    sometimes_before = ref.sometimes.weight.detach().clone()
    for step in range(4):
        ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(step))
        use = step % 2 == 1 and step < 2  # used once (step 1), skipped afterwards
        ref(ids, use).backward()
        ropt.step()
        ropt.zero_grad()
        opt.backward(model(ids, use))
        opt.step()
        opt.zero_grad()
    assert rel_l2(_state(model), _state(ref)) < 1e-5
    assert not torch.equal(ref.sometimes.weight, sometimes_before)
    assert model.head.weight is model.emb.weight


def test_activation_checkpointing_matches():
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable()
    model.train()
    model, opt = _prepare(model, device_memory_budget_bytes=140_000)
    batches = [[batch("gpt2", s, 2)] for s in range(3)]
    _train_ref(ref, batches)
    _train_elixir(model, opt, batches)
    assert rel_l2(_state(model), _state(ref)) < 1e-5


def test_eval_forward_and_generate_match_reference():
    ref = tiny_model("gpt2").eval()
    model, _ = _prepare(copy.deepcopy(ref), device_memory_budget_bytes=140_000)
    model.eval()
    ids = batch("gpt2", 0, 2)["input_ids"][:, :5]
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-6)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected)


def test_tied_weights_save_pretrained_round_trip(tmp_path):
    model, opt = _prepare(tiny_model("gpt2"), device_memory_budget_bytes=140_000)
    _train_elixir(model, opt, [[batch("gpt2", s, 2)] for s in range(2)])
    state = model.state_dict()  # as PyTorch's: one tensor under both names of the tied weight
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    # the file holds the tied weight once, as plain transformers writes it (before: lm_head.weight too)
    plain = tmp_path / "plain"
    tiny_model("gpt2").save_pretrained(plain)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f, safe_open(str(plain / "model.safetensors"), "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys()) and "lm_head.weight" not in f.keys()
    ids = batch("gpt2", 9, 2)["input_ids"]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


def test_model_and_optimizer_state_dict_resume_is_exact():
    torch.manual_seed(0)
    batches = [[batch("gpt2", s, 2)] for s in range(6)]
    model, opt = _prepare(tiny_model("gpt2"), device_memory_budget_bytes=140_000)
    _train_elixir(model, opt, batches[:3])
    msd, osd = model.state_dict(), opt.state_dict()
    _train_elixir(model, opt, batches[3:])
    resumed, ropt = _prepare(tiny_model("gpt2", seed=7), device_memory_budget_bytes=140_000)
    resumed.load_state_dict(msd)
    ropt.load_state_dict(osd)
    _train_elixir(resumed, ropt, batches[3:])
    assert rel_l2(_state(resumed), _state(model)) == 0.0


def test_bf16_tracks_fp32_reference_within_tolerance():
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref), precision="bf16", device_memory_budget_bytes=100_000)
    batches = [[batch("gpt2", s, 2)] for s in range(5)]
    ref_losses, losses = [], []
    ropt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    for (b,) in batches:
        loss = ref(**b).loss
        loss.backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(loss.item())
        out = model(**b).loss
        opt.backward(out)
        opt.step()
        opt.zero_grad()
        losses.append(out.float().item())
    assert next(model.parameters()).dtype == torch.bfloat16
    # documented tolerance: bf16 compute with fp32 master weights stays within 2% of the fp32 loss
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 2e-2


def test_fp16_overflow_skips_exactly_that_step():
    model, opt = _prepare(tiny_model("gpt2"), precision="fp16")
    scale0 = opt.loss_scale
    b = batch("gpt2", 0, 2)
    opt.backward(model(**b).loss)
    opt.step()
    opt.zero_grad()
    snapshot = _state(model)
    opt.backward(model(**b).loss * float("inf"))  # injected overflow
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(v, snapshot[k]) for k, v in _state(model).items()), "overflow step must be skipped"
    assert opt.loss_scale == scale0 / 2
    opt.backward(model(**b).loss)
    opt.step()
    assert any(not torch.equal(v, snapshot[k]) for k, v in _state(model).items())
    assert all(torch.isfinite(v).all() for v in _state(model).values())
    assert hf_elixir.memory_stats(model)["num_skipped_steps"] == 1


def test_budget_too_small_fails_before_the_first_step_naming_bytes():
    model = tiny_model("gpt2")
    need = hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(model.parameters()),
                                             hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    with pytest.raises(ValueError, match=f"needs {need} bytes"):
        _prepare(model, device_memory_budget_bytes=need - 1)
    # the library's default chunk size (a budget given): the minimum is exact too
    need = hf_elixir.min_device_budget_bytes(model)
    with pytest.raises(ValueError, match=f"needs {need} bytes"):
        hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(device_memory_budget_bytes=need - 1))
    hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(device_memory_budget_bytes=need))


def test_budget_is_never_exceeded_and_traffic_is_counted():
    model = tiny_model("opt")
    need = hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(model.parameters()),
                                             hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    model, opt = _prepare(model, device_memory_budget_bytes=need)
    _train_elixir(model, opt, [[batch("opt", s, 2)] for s in range(3)])
    stats = hf_elixir.memory_stats(model)
    assert stats["device_peak_bytes"] <= need
    assert stats["h2d_bytes"] > 0 and stats["num_evictions"] > 0 and stats["step_h2d_bytes"] > 0


def _full_parameters_edit_worker(rank, world_size):
    """full_parameters(writeback=False): an edit inside is discarded on exit (as FSDP's
    summon_full_params), whatever the layout; training goes on as if it never happened."""
    results = []
    # 300_000: the whole model fits unsharded at once, the optimizer states do not; None + replicated:
    # the chunks are the parameters' only copy (snapshot on entry, restored on exit)
    for budget, placement in ((300_000, "sharded"), (None, "sharded"), (None, "replicated")):
        ref, model = tiny_model("gpt2"), tiny_model("gpt2")
        model, opt = _prepare(model, device_memory_budget_bytes=budget, precision="fp32",
                              default_placement=placement)
        batches = [[rank_batch("gpt2", s, rank, world_size, 2)] for s in range(2)]
        _train_elixir(model, opt, batches[:1])
        with hf_elixir.full_parameters(model), torch.no_grad():
            if rank == 0:  # gathered: one rank may run a forward alone (no collective in it)
                model(**batch("gpt2", 5, 1))
            model.transformer.h[0].ln_1.weight.fill_(9.0)
            edited = float(model.state_dict()["transformer.h.0.ln_1.weight"][0])
        after = float(model.state_dict()["transformer.h.0.ln_1.weight"][0])
        _train_elixir(model, opt, batches[1:])
        ref_opt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
        for s in range(2):
            ref(**batch("gpt2", s, 2 * world_size)).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        results.append((edited, after, rel_l2(_state(model), _state(ref))))
    return results


def test_full_parameters_without_writeback_discards_edits():
    for results in run_distributed(_full_parameters_edit_worker, 2, timeout_s=120):
        for edited, after, rel in results:
            assert edited == 9.0 and after != 9.0
            assert rel < 1e-5
    for edited, after, rel in _full_parameters_edit_worker(0, 1):  # one rank: fp32 chunks are the storage
        assert edited == 9.0 and after != 9.0
        assert rel < 1e-5


def test_plain_torch_optimizer_state_resumes_under_hf_elixir():
    """A run started without hf_elixir (a stock Trainer's optimizer.pt) resumes under it: the plain
    state's numbered parameters are matched by position to the param groups."""
    ref = tiny_model("gpt2")
    ropt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    batches = [[batch("gpt2", s, 2)] for s in range(4)]
    for (b,) in batches[:2]:
        ref(**b).loss.backward()
        ropt.step()
        ropt.zero_grad()
    model = tiny_model("gpt2", seed=7)
    model.load_state_dict(ref.state_dict())
    model, opt = _prepare(model, device_memory_budget_bytes=140_000)
    opt.load_state_dict(copy.deepcopy(ropt.state_dict()))
    _train_elixir(model, opt, batches[2:])
    for (b,) in batches[2:]:
        ref(**b).loss.backward()
        ropt.step()
        ropt.zero_grad()
    assert rel_l2(_state(model), _state(ref)) < 1e-5
    wrong = {"state": {}, "param_groups": [{"lr": 1.0, "params": [0, 1]}]}
    with pytest.raises(ValueError, match="matched to this optimizer by position"):
        opt.load_state_dict(wrong)


def test_state_carried_over_warning_only_for_optimizers_that_stepped(caplog):
    fresh = tiny_model("gpt2")  # Adagrad creates (step=0) state in __init__: nothing is lost
    with caplog.at_level("WARNING"):
        hf_elixir.prepare(fresh, torch.optim.Adagrad(fresh.parameters()), hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    assert "already has state" not in caplog.text
    stepped = tiny_model("gpt2")
    opt = torch.optim.AdamW(stepped.parameters())
    stepped(**batch("gpt2", 0, 2)).loss.backward()
    opt.step()
    with caplog.at_level("WARNING"):
        hf_elixir.prepare(stepped, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    assert "already has state" in caplog.text


def test_deepcopy_of_a_prepared_model_raises_with_the_way_out():
    """A deep copy (EMA / reference models) used to succeed and fail at its first forward with an
    unrelated message; it now fails at once, and the suggested plain copy works."""
    model, _ = _prepare(tiny_model("gpt2"), device_memory_budget_bytes=140_000)
    # prepare resharded this chunk: its parameters raise on any read until first use (they used to point
    # at freed storage, and the deep copy below crashed the process; then at NaN placeholders)
    with pytest.raises(StaleParameterError):
        model.transformer.h[0].mlp.c_proj.weight.sum()
    with pytest.raises(TypeError, match="deepcopy.*load_state_dict"):
        copy.deepcopy(model)
    other = type(model)(model.config)
    other.load_state_dict(model.state_dict())
    b = batch("gpt2", 0, 2)
    with torch.no_grad():
        assert torch.allclose(other(**b).logits, model(**b).logits, atol=1e-6)


def test_dtype_or_device_conversion_after_prepare_raises_and_training_goes_on():
    """``model.to(bf16)`` / ``.half()`` used to replace the chunk views by copies the optimizer never
    updates: the loss stopped moving, silently. Now it raises before changing anything; conversions that
    change nothing still pass (accelerate / Trainer call ``model.to(device)``)."""
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref), device_memory_budget_bytes=140_000)
    batches = [[batch("gpt2", s, 2)] for s in range(2)]
    _train_elixir(model, opt, batches[:1])
    model.to("cpu")
    model.float()
    for convert in (lambda: model.to(torch.bfloat16), model.half, model.double, model.transformer.h[0].half):
        with pytest.raises(ValueError, match="ElixirConfig\\(precision="):
            convert()
    _train_elixir(model, opt, batches[1:])
    _train_ref(ref, batches)
    assert rel_l2(_state(model), _state(ref)) < 1e-5


def test_backward_without_an_optimizer_says_so():
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    with pytest.raises(RuntimeError, match="prepared without an optimizer"):
        model(**batch("gpt2", 0, 2)).loss.backward()
    with torch.no_grad():
        assert torch.isfinite(model(**batch("gpt2", 0, 2)).loss)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_set_to_none_semantics_match_pytorch_with_idle_experts(set_to_none):
    """set_to_none=False keeps a zero gradient for every parameter that had one, so AdamW still moves
    MoE experts that got no tokens this step (weight decay, momentum); True skips them."""
    ref = tiny_model("switch")
    model = copy.deepcopy(ref)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ref, model)]
    model, eopt = hf_elixir.prepare(model, opts[1], hf_elixir.ElixirConfig(chunk_size_numel=CHUNK))
    for step in range(4):
        b = batch("switch", step, 1, seq=4)  # few tokens: some experts idle in some steps
        ref(**b).loss.backward()
        opts[0].step()
        opts[0].zero_grad(set_to_none=set_to_none)
        eopt.backward(model(**b).loss)
        eopt.step()
        eopt.zero_grad(set_to_none=set_to_none)
    assert rel_l2(_state(model), _state(ref)) < 1e-5


def test_many_idle_experts_train_at_the_minimum_budget_and_match_pytorch():
    """32 experts, 3-token inputs: most experts get no tokens. Their chunks used to hold up the reduce
    order, keeping every later chunk's gradient buffer alive past the working set that
    min_device_budget_bytes promises ([Note: idle experts])."""
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=32,
        expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, dropout_rate=0.0,
        router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    ref = transformers.SwitchTransformersForConditionalGeneration(cfg)
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    budget = hf_elixir.min_device_budget_bytes(model, opt)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(device_memory_budget_bytes=budget,
                                                                      budget_covers_activations=False))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        b = {"input_ids": torch.randint(1, 256, (2, 3), generator=g), "labels": torch.randint(1, 256, (2, 6), generator=g)}
        opt.backward(model(**b).loss)
        opt.step()
        opt.zero_grad()
        ref(**b).loss.backward()
        ropt.step()
        ropt.zero_grad()
    assert hf_elixir.memory_stats(model)["device_peak_bytes"] <= budget
    assert rel_l2(_state(model), _state(ref)) < 1e-5


def test_unfreezing_a_parameter_after_prepare_raises():
    """A parameter frozen at prepare has no gradient buffer or optimizer state: unfreezing it later
    raises. (Freezing a trainable one later works as in PyTorch: tests/test_loud_failures.py.)"""
    model = tiny_model("gpt2")
    head = model.transformer.wpe.weight
    head.requires_grad_(False)
    model, opt = _prepare(model)
    _train_elixir(model, opt, [[batch("gpt2", 0, 2)]])
    head.requires_grad_(True)
    with pytest.raises(ValueError, match="transformer.wpe.weight' was unfrozen .* Set requires_grad before prepare"):
        model(**batch("gpt2", 1, 2))
    with torch.no_grad():  # evaluation does not care
        model(**batch("gpt2", 1, 2))


def test_unsupported_optimizer_is_rejected_with_the_list():
    model = tiny_model("gpt2")
    with pytest.raises(TypeError, match="torch.optim.AdamW"):
        hf_elixir.prepare(model, torch.optim.LBFGS(model.parameters()))


def _moe_uneven_worker(rank, world_size):
    # rank 1's batch is routed so that some experts get no tokens there: no hang, exact parity
    model = tiny_model("switch")
    ref = copy.deepcopy(model)
    model, opt = _prepare(model, device_memory_budget_bytes=250_000)
    ropt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    for step in range(3):
        full = batch("switch", step, 2 * world_size)
        full["input_ids"][2:] = 5  # rank 1: one repeated token -> one expert per layer
        mine = {k: v[rank * 2:(rank + 1) * 2] for k, v in full.items()}
        opt.backward(model(**mine).loss)
        opt.step()
        opt.zero_grad()
        slices = [{k: v[r * 2:(r + 1) * 2] for k, v in full.items()} for r in range(world_size)]
        (sum(ref(**b).loss for b in slices) / world_size).backward()  # DDP semantics: mean of rank losses
        ropt.step()
        ropt.zero_grad()
    return rel_l2(_state(model), _state(ref))


def test_moe_experts_without_tokens_on_one_rank_do_not_hang():
    for rel in run_distributed(_moe_uneven_worker, 2, timeout_s=120):
        assert rel < 1e-5


def test_fused_triton_adamw_path_matches_torch(monkeypatch):
    """Device optimizer chunks run triton_kernels.fused_adamw_ (here through the Triton interpreter on
    CPU): same trajectory as torch.optim.AdamW with two param groups, a schedule, clipping and a
    parameter that skips steps."""
    monkeypatch.setattr(hf_elixir.ElixirOptimizer, "_force_fused", True)
    torch.manual_seed(0)
    ref = _Branchy()
    model = copy.deepcopy(ref)
    groups = lambda m: [{"params": [m.emb.weight, m.shared.weight, m.sometimes.weight], "weight_decay": 0.1},
                        {"params": [m.shared.bias, m.sometimes.bias, m.mha.in_proj_weight, m.mha.in_proj_bias,
                                    m.mha.out_proj.weight, m.mha.out_proj.bias], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups(model), lr=1e-2, eps=1e-4)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=1024))
    assert opt.fused_chunks, "device Adam chunks must take the fused path"
    ropt = torch.optim.AdamW(groups(ref), lr=1e-2, eps=1e-4)
    for step in range(4):
        ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(step))
        ref(ids, step == 1).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ropt.step()
        ropt.zero_grad()
        opt.backward(model(ids, step == 1))
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    assert rel_l2(_state(model), _state(ref)) < 1e-5
    saved = opt.state_dict()
    assert set(saved["state"]["emb.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    assert float(saved["state"]["sometimes.weight"]["step"]) == 1.0


def test_fp16_unscale_norm_kernel_path_matches_pytorch_path(monkeypatch):
    """fp16: device gradient shards are unscaled, overflow-checked and normed by one Triton kernel
    (interpreter on CPU); the clipped norm and the trained weights equal the PyTorch path's."""
    results = []
    for forced in (False, True):
        monkeypatch.setattr(hf_elixir.ElixirOptimizer, "_force_fused", forced)
        model, opt = _prepare(tiny_model("gpt2"), precision="fp16")
        norms = _train_elixir(model, opt, [[batch("gpt2", s, 2)] for s in range(3)], clip=0.5)
        results.append((norms, _state(model)))
    (norms_ref, state_ref), (norms_kernel, state_kernel) = results
    assert norms_kernel[0] == pytest.approx(norms_ref[0], rel=1e-6)  # same gradients, same norm
    assert norms_kernel == pytest.approx(norms_ref, rel=1e-3)  # later steps: fused AdamW rounding in fp16
    assert rel_l2(state_kernel, state_ref) < 1e-3  # fp16 weights; fused vs torch AdamW rounding


def _replicated_worker(rank, world_size):
    cfg = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, placements={"*ln_*": "replicated"},
                                 device_memory_budget_bytes=200_000, budget_covers_activations=False)
    model = tiny_model("gpt2")
    ref = copy.deepcopy(model)
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(two_groups(model), lr=5e-3), cfg)
    state = hf_elixir.get_state(model)
    replicated = [c for c in state.manager.chunks if c.replicate_group is not None]
    ropt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    for step in range(4):
        full = batch("gpt2", step, 2 * world_size)
        mine = {k: v[rank * 2:(rank + 1) * 2] for k, v in full.items()}
        opt.backward(model(**mine).loss)
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        ref(**full).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ropt.step()
        ropt.zero_grad()
    names = {s.name for c in replicated for s in c.slots}
    return (rel_l2(_state(model), _state(ref)), names, all(c.resident and c.world_size == 1 for c in replicated),
            state.plan.placements.get("transformer.h.0.ln_1"))


def test_replicated_placement_keeps_chunks_whole_and_all_reduces():
    for rel, names, whole, placement in run_distributed(_replicated_worker, 2, timeout_s=120):
        assert rel < 1e-5
        assert names and all(".ln_" in n for n in names)
        assert whole and placement == "replicated"


def _min_budget_worker(rank, world_size):
    """min_device_budget_bytes, computed without a process group, is exactly the bytes prepare needs."""
    results = []
    for extra in ({"default_placement": "sharded"}, {"default_placement": "replicated"},
                  {"placements": {"*ln_*": "replicated"}}, {"chunk_size_numel": None}):
        cfg = hf_elixir.ElixirConfig(**{"chunk_size_numel": CHUNK, "budget_covers_activations": False,  # model data
                                        **extra})  # None: prepare's default size
        need = hf_elixir.min_device_budget_bytes(tiny_model("gpt2"), torch.optim.AdamW(tiny_model("gpt2").parameters()),
                                                 cfg, world_size=world_size)
        below_model = tiny_model("gpt2")
        try:
            hf_elixir.prepare(below_model, torch.optim.AdamW(below_model.parameters()),
                              dataclasses.replace(cfg, device_memory_budget_bytes=need - 1))
            below = "accepted"
        except ValueError as err:
            below = str(err)
        model = tiny_model("gpt2")
        model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=5e-3),
                                       dataclasses.replace(cfg, device_memory_budget_bytes=need))
        _train_elixir(model, opt, [[rank_batch("gpt2", s, rank, world_size, 2)] for s in range(2)])
        results.append((need, below, hf_elixir.memory_stats(model)["device_peak_bytes"]))
    return results


def test_min_device_budget_is_exact_for_sharded_replicated_and_mixed_placements():
    for results in run_distributed(_min_budget_worker, 2, timeout_s=120):
        (sharded, *_), (replicated, *_), _, _ = results
        assert replicated > sharded  # whole parameters on every rank vs two units' worth
        for need, below, peak in results:
            assert f"needs {need} bytes" in below
            assert peak <= need


def test_full_parameters_reads_and_writes_between_steps():
    ref = tiny_model("gpt2")
    # a budget that holds the whole model unsharded at once (what full_parameters needs), but not the
    # optimizer states: chunks are offloaded and resharded between uses
    model, opt = _prepare(copy.deepcopy(ref), device_memory_budget_bytes=300_000)
    _train_elixir(model, opt, [[batch("gpt2", 0, 2)]])
    assert hf_elixir.memory_stats(model)["h2d_bytes"] > 0
    expected = _state(model)
    with hf_elixir.full_parameters(model, writeback=True):
        w = model.transformer.h[1].mlp.c_fc.weight
        assert torch.equal(w, expected["transformer.h.1.mlp.c_fc.weight"])
        w.data.mul_(0.0)
    assert float(model.state_dict()["transformer.h.1.mlp.c_fc.weight"].abs().sum()) == 0.0
    _train_elixir(model, opt, [[batch("gpt2", 1, 2)]])  # the zeroed weight trains on from the write-back
    assert hf_elixir.memory_stats(model)["device_peak_bytes"] > 0


def test_nadam_scalar_state_survives_a_consolidated_resume():
    """NAdam keeps a 0-d ``mu_product`` per parameter next to ``step``; a resume that dropped it would
    restart the momentum-decay product at 1 and diverge from the uninterrupted run."""
    def prepare(seed):
        model = tiny_model("gpt2", seed=seed)
        opt = torch.optim.NAdam(model.parameters(), lr=5e-3, momentum_decay=4e-3)
        return hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK,
                                                                    device_memory_budget_bytes=140_000,
                                                                    budget_covers_activations=False))

    batches = [[batch("gpt2", s, 2)] for s in range(6)]
    model, opt = prepare(0)
    _train_elixir(model, opt, batches[:3])
    msd, osd = model.state_dict(), opt.state_dict()
    mu = [entry["mu_product"] for entry in osd["state"].values()]
    assert mu and all(float(m) < 1.0 for m in mu), "mu_product missing from the consolidated state"
    _train_elixir(model, opt, batches[3:])
    resumed, ropt = prepare(7)
    resumed.load_state_dict(msd)
    ropt.load_state_dict(osd)
    _train_elixir(resumed, ropt, batches[3:])
    assert rel_l2(_state(resumed), _state(model)) == 0.0


def test_one_rank_gradients_accumulate_straight_into_the_optimizer_shard():
    """One rank, optimizer state on the device: backward adds gradients into the optimizer's gradient
    shard (no transient gradient buffer), so a training step does not raise the device peak above what
    prepare charged; the result still matches plain PyTorch (two micro-batches accumulated)."""
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref))
    before = hf_elixir.memory_stats(model)["device_used_bytes"]
    batches = [[batch("gpt2", 2 * s, 2), batch("gpt2", 2 * s + 1, 2)] for s in range(3)]
    _train_elixir(model, opt, batches, accumulate=2)
    assert hf_elixir.memory_stats(model)["device_peak_bytes"] == before
    _train_ref(ref, batches, accumulate=2)
    assert rel_l2(_state(model), _state(ref)) < 1e-5


def test_stale_parameters_raise_between_steps_instead_of_reading_freed_memory():
    """After a step under a tight budget, parameters whose chunk is resharded (or stale) are placeholders:
    metadata is right, any read raises naming the parameter and the way out (freed storage used to
    crash the process, NaN placeholders let reads through), and state_dict / the next forward see the
    updated values."""
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref), device_memory_budget_bytes=140_000)
    b = batch("gpt2", 0, 2)
    _train_elixir(model, opt, [[b]])
    weight = model.transformer.h[0].mlp.c_proj.weight
    assert weight.shape == ref.transformer.h[0].mlp.c_proj.weight.shape
    assert model.num_parameters() == ref.num_parameters()
    with pytest.raises(StaleParameterError, match=r"transformer\.h\.0\.mlp\.c_proj\.weight.*full_parameters"):
        torch.isnan(weight)
    with pytest.raises(StaleParameterError), torch.no_grad():
        weight.add_(1.0)
    _train_ref(ref, [[b]])
    state = model.state_dict()
    assert not any(torch.isnan(v).any() for v in state.values())
    assert rel_l2(state, _state(ref)) < 1e-5
    with torch.no_grad():
        assert torch.allclose(model(**b).logits, ref(**b).logits, atol=1e-5)


@pytest.mark.parametrize("write", ["zero_", "data.fill_", "data =", "fill_(nan)"])
def test_writes_to_stale_parameters_raise_instead_of_being_lost(write):
    """A write to a stale parameter cannot reach the chunk: it raises at once, whatever the value
    (NaN too), naming the parameter and the supported ways; the write is discarded, and training goes
    on exactly as without it."""
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref), device_memory_budget_bytes=140_000)
    batches = [[batch("gpt2", s, 2)] for s in range(3)]
    _train_elixir(model, opt, batches[:1])
    weight = model.transformer.h[0].mlp.c_proj.weight
    with pytest.raises(StaleParameterError, match=r"transformer\.h\.0\.mlp\.c_proj\.weight.*full_parameters"):
        with torch.no_grad():
            if write == "zero_":
                weight.zero_()
            elif write == "data.fill_":
                weight.data.fill_(3.0)
            elif write == "fill_(nan)":
                weight.fill_(float("nan"))
            else:
                weight.data = torch.zeros(weight.shape)
    _train_elixir(model, opt, batches[1:])
    _train_ref(ref, batches)
    assert rel_l2(_state(model), _state(ref)) < 1e-5
