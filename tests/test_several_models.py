"""Several models in one run (policy + frozen reference as in DPO, policy + value as in PPO), each a parity test
against plain PyTorch on the whole global batch at 1 and 2 gloo ranks:

* ``hf_elixir.prepare`` of a trained and a frozen model inside one ``SharedDeviceBudget``: the pools' budgets add up
  to the one device budget, the frozen model keeps no gradients, optimizer states or reduce-scatters, and a budget
  both cannot fit is refused naming both models' needs ([Note: one device budget for several models]);
* an unchanged accelerate loop (``accelerator.prepare(policy, value, teacher, opt_p, opt_v)``, routed as ``accelerate
  launch --config_file elixir.yaml`` routes it) with two trained models and a frozen teacher:
  ``accelerator.backward`` of each model's loss and of a sum of both finds the models the loss reached ([Note: which
  model a loss belongs to]).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._dist import run_distributed
from tests._models import batch, float_state, rank_batch, rel_l2, tiny_model

ROWS, STEPS = 2, 3


def _kl(logits: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.kl_div(logits.log_softmax(-1), target_logp, log_target=True, reduction="batchmean")


def _kl_steps(rank: int, world_size: int, mine: tuple, plain: tuple, steps: int = STEPS) -> tuple[list, list]:
    """``steps`` DPO-like steps (a policy's loss plus its KL to a frozen reference) of ``(policy, reference,
    optimizer)`` on this rank's rows and of the plain ``plain`` on every rank's rows; the two lists of losses."""
    losses, plain_losses = [], []
    for step in range(steps):
        rows, full = rank_batch("gpt2", step, rank, world_size, ROWS), batch("gpt2", step, ROWS * world_size)
        for (model, ref, optimizer), b, out in ((mine, rows, losses), (plain, full, plain_losses)):
            with torch.no_grad():
                target = ref(input_ids=b["input_ids"]).logits.log_softmax(-1)
            result = model(**b)
            loss = result.loss + _kl(result.logits, target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(float(loss.detach()))
    return losses, plain_losses


def _policy_and_reference(rank: int, world_size: int, budget: int) -> dict:
    import hf_elixir

    policy, reference = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)
    plain_policy, plain_reference = copy.deepcopy(policy), copy.deepcopy(reference)
    plain_opt = torch.optim.AdamW(plain_policy.parameters(), lr=1e-2)
    config = hf_elixir.ElixirConfig(default_placement="sharded", device_memory_budget_bytes=budget)
    shared = hf_elixir.SharedDeviceBudget()
    with shared:
        policy, opt = hf_elixir.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2), config)
        reference, none = hf_elixir.prepare(reference, None, config)
    losses, plain_losses = _kl_steps(rank, world_size, (policy, reference, opt),
                                     (plain_policy, plain_reference, plain_opt))
    pools = [hf_elixir.get_state(m).manager.pool for m in (policy, reference)]
    frozen = hf_elixir.memory_stats(reference)
    state = hf_elixir.get_state(reference)
    return {
        "rel": rel_l2(float_state(policy), float_state(plain_policy)),
        "losses": losses, "plain_losses": plain_losses,
        "budgets": [p.budget_bytes for p in pools], "committed": [p.committed_bytes for p in pools],
        "peaks": [hf_elixir.memory_stats(m)["device_total_peak_bytes"] for m in (policy, reference)],
        "shared_budget": shared.budget_bytes, "frozen_optimizer": none,
        "frozen_reduce_scatter_bytes": frozen["reduce_scatter_bytes"],
        "frozen_grad_buffers": sum(c.grad_full is not None for c in state.manager.chunks),
        "frozen_bytes": (frozen["device_used_bytes"], frozen["host_bytes"]),
        "frozen_numel": sum(p.numel() for p in reference.parameters()),
        "frozen_chunk_numel": sum(c.chunk_numel for c in state.manager.chunks),  # the parameters plus padding
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_trained_and_a_frozen_model_share_one_budget_and_train_as_plain_pytorch(world_size):
    budget = 1_600_000
    results = run_distributed(_policy_and_reference, world_size, budget, timeout_s=180)
    mean_losses = [sum(r["losses"][i] for r in results) / world_size for i in range(STEPS)]
    assert mean_losses == pytest.approx(results[0]["plain_losses"], rel=1e-5)  # equal rows: the global mean
    for r in results:
        assert r["rel"] < 1e-5, r["rel"]
        assert r["shared_budget"] == budget and sum(r["budgets"]) <= budget, r["budgets"]
        assert all(c <= b for c, b in zip(r["committed"], r["budgets"])), (r["committed"], r["budgets"])
        assert all(p <= b for p, b in zip(r["peaks"], r["budgets"])), (r["peaks"], r["budgets"])
        assert r["frozen_optimizer"] is None and r["frozen_reduce_scatter_bytes"] == 0
        assert r["frozen_grad_buffers"] == 0, r["frozen_grad_buffers"]
        # one fp32 copy of its chunks (the parameters and a little padding): no master, gradient or optimizer state
        assert sum(r["frozen_bytes"]) <= 4 * r["frozen_chunk_numel"] < 4.2 * r["frozen_numel"], r


def test_two_models_whose_budget_does_not_fit_are_refused_naming_both_models_needs():
    import hf_elixir
    from hf_elixir.runtime._state import is_prepared

    policy, reference = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)
    config = hf_elixir.ElixirConfig(default_placement="sharded", device_memory_budget_bytes=700_000)
    before = float_state(reference)
    with hf_elixir.SharedDeviceBudget():
        policy, opt = hf_elixir.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2), config)
        committed = hf_elixir.get_state(policy).manager.pool.committed_bytes
        need = hf_elixir.min_device_budget_bytes(reference, None, config)
        assert committed + need > 700_000  # the policy took the room (everything resident)
        with pytest.raises(ValueError) as err:
            hf_elixir.prepare(reference, None, config)
    message = str(err.value)
    assert f"GPT2LMHeadModel (trained) commits {committed} bytes" in message, message
    assert f"GPT2LMHeadModel (frozen) needs at least {need} bytes, {committed + need} in all" in message, message
    assert f"device_memory_budget_bytes={700_000 - need} of their own" in message
    assert not is_prepared(reference) and rel_l2(float_state(reference), before) == 0.0
    policy(**batch("gpt2", 0, 1)).loss.backward()  # the first model trains on, in its whole budget
    opt.step()
    # the fix the message names: the first model prepared with its own smaller budget leaves the rest
    policy, reference = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)
    with hf_elixir.SharedDeviceBudget():
        small = hf_elixir.ElixirConfig(default_placement="sharded", device_memory_budget_bytes=700_000 - need)
        hf_elixir.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2), small)
        hf_elixir.prepare(reference, None, config)


# ------------------------------------------------------------------------------------------ an unchanged loop
def _value_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A value head's loss on the logits' mean, as a stand-in for PPO's value regression."""
    return (model(input_ids=ids).logits.mean(-1) - 0.5).pow(2).mean()


def _unchanged_loop(rank: int, world_size: int) -> dict:
    import accelerate

    import hf_elixir
    from hf_elixir.integrations import _route
    from hf_elixir.integrations._binding import _optimizers_reached, binding_of

    _route._STATE.update(config=hf_elixir.ElixirConfig(default_placement="sharded",
                                                       device_memory_budget_bytes=4_000_000), source="test")
    accelerate.Accelerator.prepare = _route._routed_prepare(accelerate.Accelerator.prepare)  # as the launch does
    accelerator = accelerate.Accelerator(cpu=True)
    policy, value, teacher = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=2), tiny_model("gpt2", seed=1)
    teacher.requires_grad_(False)
    plain = [copy.deepcopy(m) for m in (policy, value, teacher)]
    plain_opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in plain[:2]]
    opt_p, opt_v = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (policy, value))
    policy, value, teacher, opt_p, opt_v = accelerator.prepare(policy, value, teacher, opt_p, opt_v)
    routed = [hf_elixir.get_state(m) is not None for m in (policy, value, teacher)]
    for step in range(STEPS):
        mine, full = rank_batch("gpt2", step, rank, world_size, ROWS), batch("gpt2", step, ROWS * world_size)
        for (pol, val, tea, (op, ov)), b, elixir in (((policy, value, teacher, (opt_p, opt_v)), mine, True),
                                                     ((*plain, plain_opts), full, False)):
            with torch.no_grad():
                target = tea(input_ids=b["input_ids"]).logits.log_softmax(-1)
            out = pol(**b)
            policy_loss = out.loss + _kl(out.logits, target)
            value_loss = _value_loss(val, b["input_ids"])
            if elixir and step == 0:  # which trained models each loss reaches, by its autograd graph
                binding = binding_of(accelerator)
                names = {id(o): n for n, o in (("policy", opt_p.optimizer), ("value", opt_v.optimizer))}
                reached = [[names[id(o)] for o in _optimizers_reached(loss, binding.trained())]
                           for loss in (policy_loss, value_loss, policy_loss + value_loss)]
            if step == 1:  # one loss reaching both trained models
                (accelerator.backward if elixir else torch.Tensor.backward)(policy_loss + value_loss)
            else:  # each model's own loss, the value model's first
                for loss in (value_loss, policy_loss):
                    (accelerator.backward if elixir else torch.Tensor.backward)(loss)
            for model, optimizer in ((pol, op), (val, ov)):
                if elixir:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
    pools = [hf_elixir.get_state(m).manager.pool.budget_bytes for m in (policy, value, teacher)]
    return {"routed": routed, "reached": reached, "types": [type(o).__name__ for o in (opt_p, opt_v)], "pools": pools,
            "rel": [rel_l2(float_state(m), float_state(p)) for m, p in zip((policy, value), plain[:2])]}


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_unchanged_accelerate_loop_with_two_trained_models_and_a_frozen_teacher(world_size):
    for r in run_distributed(_unchanged_loop, world_size, timeout_s=240):
        assert r["routed"] == [True, True, True]
        assert r["reached"] == [["policy"], ["value"], ["policy", "value"]], r["reached"]
        assert r["types"] == ["ElixirAcceleratedOptimizer"] * 2
        assert sum(r["pools"]) <= 4_000_000, r["pools"]
        assert max(r["rel"]) < 1e-5, r["rel"]


def test_a_loss_reaching_two_fp16_models_is_refused_by_name_and_each_models_own_loss_is_scaled():
    import accelerate

    import hf_elixir
    from hf_elixir.integrations import ElixirPlugin

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        plugin = ElixirPlugin(config=hf_elixir.ElixirConfig(precision="fp16"))
        a, b = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=2)
        a, opt_a = plugin.prepare(accelerator, a, torch.optim.AdamW(a.parameters(), lr=1e-3))
        b, opt_b = plugin.prepare(accelerator, b, torch.optim.AdamW(b.parameters(), lr=1e-3))
        ids = batch("gpt2", 0, ROWS)["input_ids"]
        loss_a, loss_b = a(input_ids=ids, labels=ids).loss, b(input_ids=ids, labels=ids).loss
        with pytest.raises(ValueError, match=r"reaches 2 trained hf_elixir models, and fp16 models \(GPT2LMHeadModel, "
                                             r"GPT2LMHeadModel\)"):
            accelerator.backward(loss_a + loss_b)
        for loss, optimizer in ((loss_a, opt_a), (loss_b, opt_b)):
            accelerator.backward(loss)  # each loss reaches its own model: that model's loss scale
            assert optimizer.optimizer._scaled_backward
            optimizer.step()
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
