"""The host optimizer's element-wise states live in the manager's host blocks ([Note: host optimizer
state] in hf_elixir/optim/_host_state.py): every per-element state tensor of a host optimizer chunk is a
view into a host block, made as ``torch.optim`` would make it (same keys, order, scalar dtypes), counted
in ``host_bytes``; training, state dicts, checkpoints and forgetting one parameter's state match plain
PyTorch at 1 and 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_elixir
from hf_elixir.checkpoint import load_checkpoint, save_checkpoint
from tests._dist import run_distributed
from tests._models import batch, rank_batch, rel_l2, tiny_model, two_groups

CHUNK = 4096
ROWS = 2

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=5e-3),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=5e-3, amsgrad=True),
    "sgd-momentum-dampening": lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, dampening=0.1),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, nesterov=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=5e-2, initial_accumulator_value=0.1),
    "rmsprop-centered-momentum": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    "adamax": lambda p: torch.optim.Adamax(p, lr=5e-3),
    "nadam": lambda p: torch.optim.NAdam(p, lr=5e-3),
    "radam": lambda p: torch.optim.RAdam(p, lr=5e-3),
}


def _prepare(model, make_opt=OPTIMIZERS["adamw"], **config):
    opt = make_opt(two_groups(model))
    return hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, offload_optimizer=True, default_placement="sharded", **config))


def _train(model, opt, steps, rank=0, world_size=1):
    for step in steps:
        opt.backward(model(**rank_batch("gpt2", step, rank, world_size, ROWS)).loss)
        opt.step()
        opt.zero_grad()


def _train_ref(model, opt, steps, world_size=1):
    for step in steps:
        model(**batch("gpt2", step, ROWS * world_size)).loss.backward()
        opt.step()
        opt.zero_grad()


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _in_blocks(manager, tensor: torch.Tensor) -> bool:
    base = tensor.untyped_storage().data_ptr()
    return any(b.data.untyped_storage().data_ptr() == base for b in manager.host.blocks)


def _host_states(opt):
    """(view, its state) of every host view the inner optimizer holds a state for."""
    manager = opt.manager
    return [(v, opt.inner.state[v.tensor]) for v in opt.views
            if not manager.chunks[v.chunk.chunk_id].optim_on_device and opt.inner.state.get(v.tensor)]


def _snapshot_bytes(opt) -> int:
    """The host lane's rollback snapshots ([Note: host lane]), counted in host_bytes on top of the blocks."""
    lane = opt._lane
    return sum(t.numel() * 4 for s in lane._snapshots.values() for t in (s.master, *s.states.values()))


def _per_element(view, state) -> dict[str, torch.Tensor]:
    return {k: t for k, t in state.items() if torch.is_tensor(t) and t.dim() > 0 and t.numel() == view.tensor.numel()}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_host_states_are_views_into_host_blocks_made_as_torch_makes_them(name):
    """Each supported optimizer: after 3 steps the states are slices of the host blocks, with the keys (in
    order), scalar dtypes and values plain PyTorch has, and the parameters match plain PyTorch."""
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref), OPTIMIZERS[name])
    ropt = OPTIMIZERS[name](two_groups(ref))
    _train(model, opt, range(3))
    _train_ref(ref, ropt, range(3))
    assert rel_l2(_params(model), _params(ref)) < 1e-5
    manager = opt.manager
    states = _host_states(opt)
    assert len(states) == len(opt.views), "every host view has a state after 3 steps"
    names = {p: n for n, p in ref.named_parameters()}
    ref_by_name = {names[p]: s for p, s in ropt.state.items()}
    for view, state in states:
        expected = ref_by_name[view.slot.name]
        assert list(state) == list(expected), f"{view.slot.name}: keys {list(state)} != torch's {list(expected)}"
        per_element = _per_element(view, state)
        assert per_element, f"{name}: no element-wise state"
        for key, tensor in per_element.items():
            assert _in_blocks(manager, tensor), f"{view.slot.name}.{key} is not a view into a host block"
            part = expected[key].reshape(-1)[view.start:view.stop]
            assert torch.allclose(tensor, part, rtol=1e-4, atol=1e-7), f"{view.slot.name}.{key}"
        for key, value in state.items():
            if key not in per_element:
                assert value.dtype == expected[key].dtype and value.device == expected[key].device, key
                assert float(value) == pytest.approx(float(expected[key]), rel=1e-6), key


def test_host_bytes_counts_the_states_in_the_blocks():
    """``host_bytes`` is what the host blocks hold, and the blocks hold the moments: the bytes handed out
    cover shards, gradient shards and both Adam moments, allocated at prepare (not at the first step)."""
    model, opt = _prepare(tiny_model("gpt2"), precision="bf16")
    manager = opt.manager
    host = [c for c in manager.chunks if c.trainable and not c.optim_on_device]
    assert host
    shard_numel = sum(c.shard_numel for c in host)
    host_shard_bytes = sum(c.shard_bytes for c in host if not c.shard_on_device)
    after_prepare = hf_elixir.memory_stats(model)["host_bytes"]
    # fp32 gradient shards + fp32 masters + exp_avg + exp_avg_sq (4 B each), + the bf16 shards kept on the host
    assert manager.host.requested_bytes >= shard_numel * 4 * 4 + host_shard_bytes
    assert after_prepare == manager.host.reserved_bytes
    _train(model, opt, range(2))
    assert hf_elixir.memory_stats(model)["host_bytes"] == after_prepare + _snapshot_bytes(opt)
    assert after_prepare == manager.host.reserved_bytes
    moments = [t for view, state in _host_states(opt) for t in _per_element(view, state).values()]
    assert len(moments) == 2 * len(opt.views) and all(_in_blocks(manager, t) for t in moments)
    assert len(manager.host.blocks) <= 2


def test_a_forgotten_state_starts_afresh_in_its_used_slice():
    """A loaded state without an entry for a parameter forgets that parameter's state (torch.optim's rule);
    its next step starts from zero moments, although its slice of the block holds the old ones."""
    ref = tiny_model("gpt2")
    model, opt = _prepare(copy.deepcopy(ref))
    ropt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
    _train(model, opt, range(2))
    _train_ref(ref, ropt, range(2))
    dropped = "transformer.h.0.mlp.c_fc.weight"
    state = opt.state_dict()
    del state["state"][dropped]
    opt.load_state_dict(state)
    rstate = ropt.state_dict()
    numbered = [p for g in ropt.param_groups for p in g["params"]]  # torch numbers them in group order
    del rstate["state"][next(i for i, p in enumerate(numbered) if p is ref.get_parameter(dropped))]
    ropt.load_state_dict(rstate)
    _train(model, opt, range(2, 4))
    _train_ref(ref, ropt, range(2, 4))
    assert rel_l2(_params(model), _params(ref)) < 1e-5
    for view, st in _host_states(opt):
        assert all(_in_blocks(opt.manager, t) for t in _per_element(view, st).values())


@pytest.mark.parametrize("how", ["state_dict", "plain-torch", "checkpoint-sharded", "checkpoint-consolidated"])
def test_loaded_states_land_in_the_blocks_and_resume_exactly(tmp_path, how):
    model, opt = _prepare(tiny_model("gpt2"))
    _train(model, opt, range(3))
    fresh, fopt = _prepare(tiny_model("gpt2", seed=5))
    if how == "state_dict":
        fresh.load_state_dict(model.state_dict())
        fopt.load_state_dict(opt.state_dict())
    elif how == "plain-torch":  # a stock torch optimizer's state, matched by position
        ref = tiny_model("gpt2")
        ropt = torch.optim.AdamW(two_groups(ref), lr=5e-3)
        _train_ref(ref, ropt, range(3))
        model, opt = _prepare(copy.deepcopy(ref))
        opt.load_state_dict(copy.deepcopy(ropt.state_dict()))
        fresh.load_state_dict(ref.state_dict())
        fopt.load_state_dict(copy.deepcopy(ropt.state_dict()))
    else:
        layout = how.split("-")[1]
        save_checkpoint(tmp_path / "ckpt", model, opt, step=3, optimizer_layout=layout)
        load_checkpoint(tmp_path / "ckpt", fresh, fopt)
    states = _host_states(fopt)
    assert len(states) == len(fopt.views)
    assert all(_in_blocks(fopt.manager, t) for view, st in states for t in _per_element(view, st).values())
    _train(model, opt, range(3, 5))
    _train(fresh, fopt, range(3, 5))
    assert rel_l2(_params(fresh), _params(model)) == 0.0


def _two_rank_worker(rank, world_size):
    model, opt = _prepare(tiny_model("gpt2"))
    _train(model, opt, range(3), rank, world_size)
    in_blocks = all(_in_blocks(opt.manager, t) for view, st in _host_states(opt) for t in _per_element(view, st).values())
    stats = hf_elixir.memory_stats(model)
    return _params(model), in_blocks, len(_host_states(opt)) == len(opt.views), \
        stats["host_bytes"] == opt.manager.host.reserved_bytes + _snapshot_bytes(opt)


def test_two_ranks_states_in_blocks_and_parity_with_pytorch():
    ref = tiny_model("gpt2")
    _train_ref(ref, torch.optim.AdamW(two_groups(ref), lr=5e-3), range(3), world_size=2)
    for params, in_blocks, all_views, counted in run_distributed(_two_rank_worker, 2, timeout_s=180):
        assert in_blocks and all_views and counted
        assert rel_l2(params, _params(ref)) < 1e-5
