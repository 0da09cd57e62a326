"""Silent failures turned loud: a stale parameter never reads as a number; gradients that
nobody consumes; every way PyTorch users clear gradients clears them here.

Each behaviour is checked at one rank under a device budget (chunks offloaded and resharded between
uses) and at two gloo ranks (every chunk sharded), against plain PyTorch where a result is expected."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_elixir
from hf_elixir.chunk.params import StaleParameterError, UnconsumedGradientError, is_stale
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model, two_groups

CHUNK = 8192
BUDGET = 140_000  # one rank: the model's chunks do not all fit unsharded at once


def _prepare(model, budget, lr=5e-3):
    opt = torch.optim.AdamW(two_groups(model), lr=lr)
    # "sharded": at two ranks without a budget the default may keep small models replicated (whole,
    # always current); sharding is what ZeRO-3 users scale to
    # a model-data budget (activations outside it): the chunk mechanics are under test
    return hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded",
                                                                device_memory_budget_bytes=budget,
                                                                budget_covers_activations=False))


def _batches(rank, world_size, steps, first=0):
    return [rank_batch("gpt2", s, rank, world_size, 2) for s in range(first, first + steps)]


def _ref_steps(ref, ref_opt, world_size, steps, first=0):
    for s in range(first, first + steps):
        ref(**batch("gpt2", s, 2 * world_size)).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _step(model, opt, b):
    opt.backward(model(**b).loss)
    opt.step()
    opt.zero_grad()


# -- 1. a stale parameter never reads as a number -----------------------------------------------------

def _reads(p, other):
    return {
        "add": lambda: p + 1, "mul": lambda: p * 2.0, "torch.sum": lambda: torch.sum(p), "sum": lambda: p.sum(),
        "clone": lambda: p.clone(), "index": lambda: p[0], "tolist": lambda: p.tolist(),
        "numpy": lambda: p.numpy(), "item": lambda: p.item(), "detach": lambda: p.detach(),
        "data": lambda: p.data, "cpu": lambda: p.cpu(), "to(float64)": lambda: p.to(torch.float64),
        "lerp_ (EMA)": lambda: other.lerp_(p, 0.1), "copy_ from": lambda: other.copy_(p),
        "torch.cat": lambda: torch.cat([p.flatten()]), "torch.stack": lambda: torch.stack([p]),
        "norm": lambda: p.norm(), "eq": lambda: p == 0, "isnan": lambda: torch.isnan(p),
        "matmul": lambda: p @ p.T if p.dim() == 2 else p @ p, "zeros_like": lambda: torch.zeros_like(p),
        "float": lambda: p.float(), "bool": lambda: bool(p), "len": lambda: len(p), "iter": lambda: list(p),
        "storage": lambda: p.untyped_storage(), "data_ptr": lambda: p.data_ptr(),
    }


def _writes(p, other):
    return {
        "add_": lambda: p.add_(1.0), "zero_": lambda: p.zero_(), "fill_(nan)": lambda: p.fill_(float("nan")),
        "copy_ into": lambda: p.copy_(other), "data.copy_": lambda: p.data.copy_(other),
        "data =": lambda: setattr(p, "data", other.clone()), "setitem": lambda: p.__setitem__(0, 1.0),
        "init.normal_": lambda: torch.nn.init.normal_(p), "mul_": lambda: p.mul_(0.0),
        "lerp_ into": lambda: p.lerp_(other, 0.5),
    }


def _stale_ops_worker(rank, world_size, budget):
    """Every kind of read and write of a stale parameter raises (naming it and the fix); metadata works;
    training then goes on exactly as plain PyTorch."""
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref), budget)
    ref_opt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    _step(model, opt, _batches(rank, world_size, 1)[0])
    _ref_steps(ref, ref_opt, world_size, 1)
    stale = [(n, p) for n, p in model.named_parameters() if is_stale(p)]
    assert stale, "no stale parameter after a step"
    name, p = next((n, p) for n, p in stale if p.dim() == 2)
    problems = []
    refp = dict(ref.named_parameters())[name]
    meta = (p.shape == refp.shape, p.dtype == refp.dtype, p.device == refp.device, p.requires_grad,
            p.numel() == refp.numel(), p.dim() == 2, p.size(0) == refp.size(0), p.grad is None,
            isinstance(p, torch.nn.Parameter), name in repr(p))
    if not all(meta):
        problems.append(f"metadata {meta}")
    for kind, ops in (("read", _reads), ("write", _writes)):
        for op, call in ops(p, torch.zeros(p.shape)).items():
            try:
                with torch.no_grad():
                    call()
                problems.append(f"{kind} {op}: no error")
            except StaleParameterError as err:
                if name not in str(err) or "full_parameters" not in str(err) or "state_dict" not in str(err):
                    problems.append(f"{kind} {op}: message {err}")
            except Exception as err:  # noqa: BLE001 (any other error is a failure of the placeholder)
                problems.append(f"{kind} {op}: {type(err).__name__}: {err}")
    for b in _batches(rank, world_size, 2, first=1):
        _step(model, opt, b)
    _ref_steps(ref, ref_opt, world_size, 2, first=1)
    return problems, rel_l2(_state(model), _state(ref))


def test_every_read_and_write_of_a_stale_parameter_raises_one_rank_with_budget():
    problems, rel = _stale_ops_worker(0, 1, BUDGET)
    assert problems == []
    assert rel < 1e-5


def test_every_read_and_write_of_a_stale_parameter_raises_two_ranks():
    for problems, rel in run_distributed(_stale_ops_worker, 2, None, timeout_s=180):
        assert problems == []
        assert rel < 1e-5


def _ema_worker(rank, world_size, budget):
    """An EMA of the weights, updated after each step over model.parameters(): plain ``lerp_`` raises
    when a parameter is stale (it used to give all-NaN silently); inside full_parameters it is exact."""
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref), budget)
    ref_opt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    with hf_elixir.full_parameters(model):
        ema = [p.detach().clone() for p in model.parameters()]
    ref_ema = [p.detach().clone() for p in ref.parameters()]
    raised = None
    for s, b in enumerate(_batches(rank, world_size, 3)):
        _step(model, opt, b)
        _ref_steps(ref, ref_opt, world_size, 1, first=s)
        if s == 0:
            try:
                with torch.no_grad():
                    for e, p in zip(ema, model.parameters()):
                        e.lerp_(p, 0.1)
            except StaleParameterError as err:
                raised = str(err)
            with hf_elixir.full_parameters(model):  # the failed loop may have updated some entries: redo all
                ema = [p.detach().clone() for p in model.parameters()]
            ref_ema = [p.detach().clone() for p in ref.parameters()]
            continue
        with hf_elixir.full_parameters(model), torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.lerp_(p, 0.1)
        with torch.no_grad():
            for e, p in zip(ref_ema, ref.parameters()):
                e.lerp_(p, 0.1)
    err = max(float((a - b).abs().max()) for a, b in zip(ema, ref_ema))
    nan = any(bool(torch.isnan(e).any()) for e in ema)
    return raised, err, nan, rel_l2(_state(model), _state(ref))


def test_ema_of_stale_parameters_raises_and_is_exact_inside_full_parameters():
    # 300_000: full_parameters needs the whole model unsharded at once; the optimizer states do not fit
    results = [_ema_worker(0, 1, 300_000), *run_distributed(_ema_worker, 2, None, timeout_s=180)]
    for raised, err, nan, rel in results:
        assert raised is not None and "full_parameters" in raised
        assert not nan and err < 1e-5
        assert rel < 1e-5
    raised, err, nan, rel = _ema_worker(0, 1, None)  # one rank, no budget: parameters are the chunks, current
    assert raised is None and not nan and err < 1e-5 and rel < 1e-5


def test_parameters_evicted_by_an_eval_forward_or_state_dict_raise_not_freed_memory():
    """Chunks resharded between steps (an eval forward, model.state_dict() under a budget) leave their
    parameters as placeholders, not views into freed storage."""
    model, opt = _prepare(tiny_model("gpt2"), BUDGET)
    _step(model, opt, batch("gpt2", 0, 2))
    for action in (lambda: model(**batch("gpt2", 1, 2)), model.state_dict):
        with torch.no_grad():
            action()
        stale = [p for p in model.parameters() if is_stale(p)]
        assert stale
        for p in stale:
            with pytest.raises(StaleParameterError):
                p.sum()
        current = [p for p in model.parameters() if not is_stale(p)]
        assert all(torch.isfinite(p).all() for p in current)


# -- 2. gradients nobody consumes ------------------------------------------------------------------

def _unconsumed_worker(rank, world_size, budget):
    """After a backward: another optimizer's step over the managed parameters (the one given to prepare,
    or a new one) and torch.nn.utils.clip_grad_norm_ / clip_grad_value_ raise, naming the fix (they used
    to do nothing, silently: p.grad is None). Nothing is lost: the run then matches plain PyTorch."""
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    user_opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, user_opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, default_placement="sharded", device_memory_budget_bytes=budget,
        budget_covers_activations=False))
    ref_opt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    messages = {}
    b = _batches(rank, world_size, 1)[0]
    opt.backward(model(**b).loss)
    attempts = {
        "prepared optimizer's original": user_opt.step,
        "another SGD": torch.optim.SGD(model.parameters(), lr=0.1).step,
        "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        "clip_grad_value_": lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1.0),
    }
    for what, call in attempts.items():
        try:
            call()
            messages[what] = None
        except UnconsumedGradientError as err:
            messages[what] = str(err)
    norm = float(opt.clip_grad_norm(1.0))
    opt.step()
    opt.zero_grad()
    ref(**batch("gpt2", 0, 2 * world_size)).loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    ref_opt.step()
    ref_opt.zero_grad()
    return messages, abs(norm - ref_norm) / ref_norm, rel_l2(_state(model), _state(ref))


def test_other_optimizers_and_torch_clipping_raise_on_chunk_gradients():
    results = [_unconsumed_worker(0, 1, BUDGET), *run_distributed(_unconsumed_worker, 2, None, timeout_s=180)]
    for messages, norm_err, rel in results:
        for what, message in messages.items():
            assert message is not None, f"{what} did not raise"
            assert "hf_elixir.prepare" in message and "p.grad" in message
        assert "clip_grad_norm" in messages["clip_grad_norm_"]
        assert norm_err < 1e-5 and rel < 1e-5


def test_clipping_without_pending_gradients_and_plain_models_are_untouched():
    """No gradient waiting (before backward, after step + zero_grad): torch clipping sees p.grad None and
    returns 0 as in PyTorch; a second, plain model's optimizer and clipping work as usual."""
    model, opt = _prepare(tiny_model("gpt2"), BUDGET)
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0
    _step(model, opt, batch("gpt2", 0, 2))
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0
    plain = tiny_model("gpt2")
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(**batch("gpt2", 0, 2)).loss.backward()
    assert float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)) > 0
    plain_opt.step()


# -- 3. every way PyTorch users clear gradients clears them here --------------------------------------

CLEARS = ("model.zero_grad()", "model.zero_grad(set_to_none=False)", "optimizer.zero_grad()",
          "p.grad = None", "submodules zero_grad()", "requires_grad_(False) between steps")


def _clear(way, model, opt):
    if way == "model.zero_grad()":
        model.zero_grad()
    elif way == "model.zero_grad(set_to_none=False)":
        model.zero_grad(set_to_none=False)
    elif way == "optimizer.zero_grad()":
        opt.zero_grad()
    elif way == "p.grad = None" or way.startswith("requires_grad_"):
        for p in model.parameters():
            p.grad = None
    elif way == "submodules zero_grad()":
        for child in model.children():
            child.zero_grad()


def _clear_worker(rank, world_size, budget, way, accumulate):
    """Three steps of SGD (momentum, weight decay) cleared the given way, against plain PyTorch cleared
    the same way; gradients used to accumulate silently across steps for all but optimizer.zero_grad()."""
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    make = lambda m: torch.optim.SGD(two_groups(m, 0.01), lr=0.05, momentum=0.9)  # noqa: E731
    model, opt = hf_elixir.prepare(model, make(model), hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, default_placement="sharded", device_memory_budget_bytes=budget,
        budget_covers_activations=False))
    ref_opt = make(ref)
    for s in range(3):
        if s == 1 and way.startswith("requires_grad_"):
            model.transformer.h[0].requires_grad_(False)
            ref.transformer.h[0].requires_grad_(False)
        for i in range(accumulate):
            micro = 3 * s + i
            (model(**rank_batch("gpt2", micro, rank, world_size, 2)).loss / accumulate).backward()
            (ref(**batch("gpt2", micro, 2 * world_size)).loss / accumulate).backward()
        opt.step()
        ref_opt.step()
        _clear(way, model, opt)
        _clear(way, ref, ref_opt)
    return rel_l2(_state(model), _state(ref))


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("way", CLEARS)
def test_every_way_of_clearing_gradients_matches_pytorch_one_rank(way, accumulate):
    assert _clear_worker(0, 1, None, way, accumulate) < 1e-5
    assert _clear_worker(0, 1, BUDGET, way, accumulate) < 1e-5


def _clear_worker_all(rank, world_size):
    return [(way, acc, _clear_worker(rank, world_size, None, way, acc)) for way in CLEARS for acc in (1, 2)]


def test_every_way_of_clearing_gradients_matches_pytorch_two_ranks():
    for results in run_distributed(_clear_worker_all, 2, timeout_s=300):
        bad = [(way, acc, rel) for way, acc, rel in results if not rel < 1e-5]
        assert bad == []


def test_accelerate_loop_clearing_through_the_model_matches_pytorch():
    """Accelerate's own test scripts clear with ``model.zero_grad()`` (not the optimizer); with
    ElixirPlugin that now clears the chunk gradients too (they used to pile up across steps)."""
    from accelerate import Accelerator

    from hf_elixir.integrations import ElixirPlugin

    accelerator = Accelerator(cpu=True)
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    plugin = ElixirPlugin(config=hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, device_memory_budget_bytes=BUDGET,
                                                        budget_covers_activations=False))
    model, opt = plugin.prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for s in range(3):
        b = batch("gpt2", s, 2)
        accelerator.backward(model(**b).loss)
        opt.step()
        model.zero_grad()
        ref(**b).loss.backward()
        ref_opt.step()
        ref.zero_grad()
    assert rel_l2(_state(model), _state(ref)) < 1e-5
