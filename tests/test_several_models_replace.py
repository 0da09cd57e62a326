"""Several models under one ``SharedDeviceBudget`` are counted together ([Note: re-placing for a newcomer] in
hf_elixir/chunk/_shared_budget.py): a frozen reference prepared first takes every chunk resident, and a trained policy
whose floor does not fit beside that (first-come placement refused it) joins by re-placing the reference's chunks off
the device; the DPO-like loop then trains as plain PyTorch on the whole global batch, at 1 and 2 gloo ranks, and the
pools' budgets add up to the one budget. A budget below both floors is refused naming each model's need.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests._dist import run_distributed
from tests._models import batch, float_state, rank_batch, rel_l2, tiny_model
from tests.test_several_models import _kl, _kl_steps

ROWS, STEPS = 2, 3
CHUNK = 4096  # elements: the largest parameter; several chunks per model, the same with or without a budget


def _sizes(world_size: int) -> dict:
    """The reference's bytes with every chunk resident and at its floor, and the policy's floor, at this world size."""
    import hf_elixir

    config = hf_elixir.ElixirConfig(default_placement="sharded", chunk_size_numel=CHUNK,
                                    budget_covers_activations=False)
    policy, reference = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)
    floors = dict(policy=hf_elixir.min_device_budget_bytes(policy, torch.optim.AdamW(policy.parameters()), config,
                                                            world_size),
                  reference=hf_elixir.min_device_budget_bytes(reference, None, config, world_size))
    alone, _ = hf_elixir.prepare(reference, None, config)  # no budget: everything resident
    return dict(floors, resident=hf_elixir.get_state(alone).manager.pool.committed_bytes)


def _reference_then_policy(rank: int, world_size: int) -> dict:
    import hf_elixir

    sizes = _sizes(world_size)
    # first come, first placed would keep the reference resident and leave the policy less than its floor
    budget = sizes["policy"] + (sizes["reference"] + sizes["resident"]) // 2
    policy, reference = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)
    plain_policy, plain_reference = copy.deepcopy(policy), copy.deepcopy(reference)
    plain_opt = torch.optim.AdamW(plain_policy.parameters(), lr=1e-2)
    config = hf_elixir.ElixirConfig(default_placement="sharded", device_memory_budget_bytes=budget,
                                    chunk_size_numel=CHUNK, budget_covers_activations=False)
    shared = hf_elixir.SharedDeviceBudget()
    with shared:
        reference, _ = hf_elixir.prepare(reference, None, config)
        ref_manager = hf_elixir.get_state(reference).manager
        before = dict(committed=ref_manager.pool.committed_bytes, resident=all(c.resident for c in ref_manager.chunks))
        policy, opt = hf_elixir.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2), config)
    for model in (reference, policy):  # the reference's peak so far was reached alone, before it was re-placed
        hf_elixir.get_state(model).manager.reset_peak()
    losses, plain_losses = _kl_steps(rank, world_size, (policy, reference, opt),
                                     (plain_policy, plain_reference, plain_opt), STEPS)
    # ranks stopping at different lengths: the re-placed reference gathers again, so generate keeps the ranks in step
    prompt = batch("gpt2", 0, 1)["input_ids"][:, :4]
    generated = reference.generate(prompt, max_new_tokens=2 + 5 * rank, do_sample=False, pad_token_id=0)
    pools = [hf_elixir.get_state(m).manager.pool for m in (reference, policy)]
    return dict(generated=generated.shape[1] - prompt.shape[1], sizes=sizes, budget=budget, before=before,
                losses=losses, plain_losses=plain_losses,
                rel=rel_l2(float_state(policy), float_state(plain_policy)),
                ref_rel=rel_l2(float_state(reference), float_state(plain_reference)),
                committed=[p.committed_bytes for p in pools], budgets=[p.budget_bytes for p in pools],
                peaks=[hf_elixir.memory_stats(m)["device_peak_bytes"] for m in (reference, policy)],  # model data
                moved=sum(not c.resident and not c.shard_on_device for c in ref_manager.chunks),
                num_chunks=len(ref_manager.chunks))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_frozen_reference_placed_first_is_re_placed_for_the_policy(world_size):
    results = run_distributed(_reference_then_policy, world_size, timeout_s=180)
    mean_losses = [sum(r["losses"][i] for r in results) / world_size for i in range(STEPS)]
    assert mean_losses == pytest.approx(results[0]["plain_losses"], rel=1e-5)
    for r in results:
        sizes, budget = r["sizes"], r["budget"]
        assert r["before"] == dict(committed=sizes["resident"], resident=True)  # alone, it took everything
        assert sizes["resident"] + sizes["policy"] > budget >= sizes["reference"] + sizes["policy"]
        assert 0 < r["moved"] < r["num_chunks"] and r["committed"][0] < sizes["resident"], r
        assert sum(r["budgets"]) <= budget and r["committed"][1] >= sizes["policy"], r
        assert all(p <= b for p, b in zip(r["peaks"], r["budgets"])), (r["peaks"], r["budgets"])
        assert r["rel"] < 1e-5 and r["ref_rel"] == 0.0, (r["rel"], r["ref_rel"])
    assert [r["generated"] for r in results] == [2 + 5 * rank for rank in range(world_size)]


def test_models_whose_floors_do_not_fit_are_refused_naming_each_need():
    import hf_elixir
    from hf_elixir.runtime._state import is_prepared

    sizes = _sizes(1)
    budget = sizes["policy"] + sizes["reference"] - 1
    policy, reference = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)
    config = hf_elixir.ElixirConfig(default_placement="sharded", device_memory_budget_bytes=budget,
                                    chunk_size_numel=CHUNK, budget_covers_activations=False)
    with hf_elixir.SharedDeviceBudget():
        reference, _ = hf_elixir.prepare(reference, None, config)
        manager = hf_elixir.get_state(reference).manager
        committed = manager.pool.committed_bytes
        assert committed > sizes["reference"]  # placed alone, it keeps more than its floor on the device
        with pytest.raises(ValueError) as err:
            hf_elixir.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2), config)
    message = str(err.value)
    assert f"device_memory_budget_bytes={budget} is the whole device" in message, message
    assert f"GPT2LMHeadModel (frozen) commits {committed} bytes ({sizes['reference']} once re-placed)" in message
    assert f"GPT2LMHeadModel (trained) needs at least {sizes['policy']} bytes" in message, message
    assert f"{sizes['policy'] + sizes['reference']} in all" in message, message
    assert not is_prepared(policy)
    assert manager.pool.committed_bytes == committed  # nothing was moved for a model that was refused
    reference(**batch("gpt2", 0, 1))  # the reference still runs


def _partly_frozen():
    """A trained model with a frozen part (as a LoRA model's base): only the last block trains."""
    model = tiny_model("gpt2", seed=0)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("transformer.h.1."))
    return model


def test_a_trained_model_gives_back_its_frozen_chunks_between_steps_only():
    """The frozen chunks of a trained model prepared first move off the device for a newcomer, but not while that
    model is inside a step (its gradients not yet stepped): the newcomer is refused then, and joins after the step."""
    import hf_elixir

    config = hf_elixir.ElixirConfig(default_placement="sharded", chunk_size_numel=CHUNK,
                                    budget_covers_activations=False)
    with hf_elixir.SharedDeviceBudget() as dry:  # the first model's bytes alone, and once re-placed
        first = _partly_frozen()
        hf_elixir.prepare(first, torch.optim.AdamW([p for p in first.parameters() if p.requires_grad]), config)
        resident, floor = hf_elixir.get_state(first).manager.pool.committed_bytes, dry.committed_by_others()
    need = hf_elixir.min_device_budget_bytes(tiny_model("gpt2", seed=1), None, config)
    assert floor < resident
    budget = need + (floor + resident) // 2
    config = dataclasses.replace(config, device_memory_budget_bytes=budget)
    first = _partly_frozen()
    with hf_elixir.SharedDeviceBudget():
        first, opt = hf_elixir.prepare(first, torch.optim.AdamW([p for p in first.parameters() if p.requires_grad],
                                                                lr=1e-2), config)
        manager = hf_elixir.get_state(first).manager
        assert manager.pool.committed_bytes == resident
        first(**batch("gpt2", 0, ROWS)).loss.backward()  # inside a step: nothing of it moves
        with pytest.raises(ValueError, match=rf"GPT2LMHeadModel \(trained\) commits {resident} bytes, and"):
            hf_elixir.prepare(tiny_model("gpt2", seed=1), None, config)
        opt.step()
        opt.zero_grad()
        hf_elixir.prepare(tiny_model("gpt2", seed=1), None, config)
    moved = [c for c in manager.chunks if not c.resident and not c.shard_on_device]
    assert moved and not any(c.trainable for c in moved)
    assert floor <= manager.pool.committed_bytes < resident


def _accelerate_prepare(rank: int, world_size: int) -> dict:
    import accelerate

    import hf_elixir
    from hf_elixir.integrations import _route

    sizes = _sizes(world_size)
    config = hf_elixir.ElixirConfig(default_placement="sharded", chunk_size_numel=CHUNK)
    policy_alone = tiny_model("gpt2", seed=0)
    hf_elixir.prepare(policy_alone, torch.optim.AdamW(policy_alone.parameters()), config)
    policy_resident = hf_elixir.get_state(policy_alone).manager.pool.committed_bytes
    # placed first, the policy would keep every chunk resident and leave the reference less than its floor
    budget = policy_resident + sizes["reference"] // 2
    _route._STATE.update(config=hf_elixir.ElixirConfig(default_placement="sharded", device_memory_budget_bytes=budget,
                                                       chunk_size_numel=CHUNK, budget_covers_activations=False),
                         source="test")
    accelerate.Accelerator.prepare = _route._routed_prepare(accelerate.Accelerator.prepare)  # as the launch does
    accelerator = accelerate.Accelerator(cpu=True)
    policy, reference = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1).requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    policy, reference, opt = accelerator.prepare(policy, reference, opt)  # the trained model named first
    b = rank_batch("gpt2", 0, rank, world_size, ROWS)
    with torch.no_grad():
        target = reference(input_ids=b["input_ids"]).logits.log_softmax(-1)
    out = policy(**b)
    accelerator.backward(out.loss + _kl(out.logits, target))
    opt.step()
    managers = [hf_elixir.get_state(m).manager for m in (policy, reference)]
    return dict(budget=budget, pools=[m.pool.budget_bytes for m in managers],
                policy_resident=all(c.resident for c in managers[0].chunks))


def test_accelerate_prepare_places_the_frozen_model_first_so_it_can_make_room():
    """``accelerator.prepare(policy, reference, optimizer)`` (routed as ``accelerate launch --config_file
    elixir.yaml`` routes it) prepares the frozen reference first, and the policy is placed beside it (counted
    together). In the order given, the policy kept every chunk resident and the reference was refused."""
    for r in run_distributed(_accelerate_prepare, 1, timeout_s=180):
        assert sum(r["pools"]) <= r["budget"] and not r["policy_resident"], r  # the policy placed beside it
