"""Edges of ``model.load_state_dict`` on a prepared model ([Note: a load that raises] in
hf_elixir/runtime/state_dict.py), each checked against plain PyTorch given the same load: a size mismatch, a load
refused by a hook that runs before hf_elixir's own, and a load called through ``nn.Module.load_state_dict``
directly that raises, then a normal one."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import hf_elixir


def _gpt2():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


_IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))


def _train(model, opt, steps: int = 2):
    for _ in range(steps):
        model(input_ids=_IDS, labels=_IDS).loss.backward()
        opt.step()
        opt.zero_grad()


def _trained(precision: str = "bf16", before_prepare=lambda model: None):
    """A prepared tiny GPT-2 after two AdamW steps (its bf16 masters hold more than their bf16 copies), and a plain
    GPT-2 holding the same (fp32) values."""
    model = _gpt2()
    before_prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(chunk_size_numel=4096, precision=precision))
    _train(model, opt)
    plain = _gpt2()
    plain.load_state_dict(model.state_dict())
    return model, opt, plain


def _differ(plain, model) -> list[str]:
    expected, got = plain.state_dict(), model.state_dict()
    return [k for k in expected if not torch.equal(expected[k], got[k])]


def _refuse(*args):
    raise ValueError("refused by a user's load pre-hook")


def test_a_size_mismatch_raises_pytorchs_error_and_loads_what_pytorch_loads(single_rank_group):
    model, opt, plain = _trained()
    given = {"transformer.h.0.ln_1.weight": torch.ones(5), "transformer.h.0.ln_1.bias": torch.randn(32)}
    for m in (plain, model):
        with pytest.raises(RuntimeError, match="size mismatch for transformer.h.0.ln_1.weight"):
            m.load_state_dict(given, strict=False)
    assert _differ(plain, model) == []  # the mismatched weight keeps its master, the bias is loaded
    _train(model, opt, 1)


def test_a_load_refused_by_a_hook_that_runs_before_hf_elixirs(single_rank_group):
    """The refusing pre-hook is registered before ``prepare`` on a module without parameters of its own: the module
    loaded just before it (``transformer.h.1.ln_1``) is loaded, compute copy and masters, as in plain PyTorch."""
    model, opt, plain = _trained(before_prepare=lambda m: m.transformer.h[1].attn.register_load_state_dict_pre_hook(
        _refuse))
    plain.transformer.h[1].attn.register_load_state_dict_pre_hook(_refuse)
    new = {k: v + 1 for k, v in plain.state_dict().items()}
    for m in (plain, model):
        with pytest.raises(ValueError, match="refused"):
            m.load_state_dict(new)
    assert _differ(plain, model) == []


def test_a_direct_module_load_that_raises_is_finished_by_the_next_load(single_rank_group):
    """``nn.Module.load_state_dict(model, sd)`` bypasses the prepared model's own ``load_state_dict``: when it raises,
    the next load (or ``state_dict``) finishes it, so what it wrote reaches the masters as in plain PyTorch."""
    model, opt, plain = _trained()
    new = {k: v + 1 for k, v in plain.state_dict().items()}
    key = "transformer.h.1.mlp.c_fc.bias"
    for m in (plain, model):
        handle = m.transformer.h[1].attn.c_attn.register_load_state_dict_pre_hook(_refuse)
        with pytest.raises(ValueError, match="refused"):
            torch.nn.Module.load_state_dict(m, new)
        handle.remove()
        m.load_state_dict({key: new[key] * 3}, strict=False)
    assert _differ(plain, model) == []
    _train(model, opt, 1)



def test_a_submodules_load_state_dict_reaches_the_masters(single_rank_group):
    """``model.transformer.h[1].mlp.load_state_dict(sd)`` (a load rooted below the prepared model: none of the
    root's hooks run) writes the bf16 compute copy and, as in plain PyTorch, the fp32 masters the next step reads."""
    model, opt, plain = _trained()
    given = {k: v + 1 for k, v in plain.transformer.h[1].mlp.state_dict().items()}
    for m in (plain, model):
        m.transformer.h[1].mlp.load_state_dict(given)
    assert _differ(plain, model) == []
    _train(model, opt, 1)



@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_checkpoint_of_another_dtype_loads_its_values_as_plain_pytorch_does(single_rank_group, dtype):
    """An fp16 (or float64) checkpoint into a bf16 model: the fp32 masters take the values PyTorch's fp32 parameters
    take (fp16 ones exactly), not the values rounded to bf16 first ([Note: fp32 loads] in _exports.py)."""
    model, opt, plain = _trained()
    given = {k: v.to(dtype) for k, v in plain.state_dict().items()}
    for m in (plain, model):
        m.load_state_dict(given)
    assert _differ(plain, model) == []
    _train(model, opt, 1)



def test_a_load_with_assign_is_refused_before_it_replaces_a_parameter(single_rank_group):
    model, opt, plain = _trained()
    new = {k: v + 1 for k, v in plain.state_dict().items()}
    for target in (model, model.transformer.h[0]):
        given = new if target is model else {k[len("transformer.h.0."):]: v for k, v in new.items()
                                             if k.startswith("transformer.h.0.")}
        with pytest.raises(ValueError, match="assign=True"):
            target.load_state_dict(given, assign=True)
        assert _differ(plain, model) == []
    _train(model, opt, 1)  # every parameter is still the chunks' own



def test_a_strict_load_with_missing_keys_raises_after_loading_as_pytorch_does(single_rank_group):
    """PyTorch copies, runs the post-hooks (where the load finishes), then raises for the missing keys."""
    model, opt, plain = _trained()
    key = "transformer.h.1.mlp.c_fc.bias"
    given = {key: torch.randn(128, generator=torch.Generator().manual_seed(2)).half()}
    for m in (plain, model):
        with pytest.raises(RuntimeError, match="Missing key"):
            m.load_state_dict(given)
    assert _differ(plain, model) == []
    _train(model, opt, 1)


def _tensor_parallel_case(rank: int, world_size: int) -> dict:
    from hf_elixir.chunk import strict
    from hf_elixir.parallel import build_mesh, load_full_state_dict, parallelize
    from tests.parallel_harness import make_batch, make_model

    model = make_model("gpt2")
    config = hf_elixir.ElixirConfig(tensor_parallel_size=2, chunk_size_numel=4096, precision="bf16")
    parallelize(model, config, build_mesh(config))
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    for step in range(2):
        opt.backward(model(**make_batch("gpt2", step, 0)).loss)
        opt.step()
        opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    key = "transformer.h.1.mlp.c_fc.weight"  # a column-parallel slice on each rank
    value = torch.randn(before[key].shape, generator=torch.Generator().manual_seed(3))
    model.load_state_dict({key: value}, strict=False)
    after = model.state_dict()
    out = {"loaded": torch.equal(after[key], value),
           "others": [k for k in before if k != key and not torch.equal(before[k], after[k])]}
    handle = model.transformer.h[1].attn.c_attn.register_load_state_dict_pre_hook(_refuse)
    try:
        load_full_state_dict(model, {k: v + 1 for k, v in after.items()})
    except ValueError as error:
        out["raised"] = str(error)
    handle.remove()
    out["sanctions_open"] = getattr(strict._local, "depth", 0)
    return out


def test_a_tensor_parallel_partial_load_and_a_refused_load_full_state_dict():
    """Two gloo ranks, TP=2, bf16: a partial load of one sliced parameter keeps every other master bit for bit, and
    ``hf_elixir.parallel.load_full_state_dict`` (which loads this rank's parts past ``model.load_state_dict``)
    refused part-way ends its copy sanction on both ranks."""
    from tests._dist import run_distributed

    for out in run_distributed(_tensor_parallel_case, 2, timeout_s=240):
        assert out["loaded"] and out["others"] == [], out
        assert out["raised"] == "refused by a user's load pre-hook" and out["sanctions_open"] == 0, out


def _sharded(precision: str):
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = hf_elixir.ElixirConfig(chunk_size_numel=4096, precision=precision, default_placement="sharded")
    return hf_elixir.prepare(model, opt, config)


def _rank_train(model, opt, rank: int, steps: range):
    for step in steps:
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))
        opt.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()


def _sharded_case(rank: int, world_size: int, precision: str) -> dict:
    """A partial load (one matrix, and the tied embedding under ``lm_head.weight`` only, a bf16 value) against the
    same run loading the whole state with those values, after the load and after two more steps; then a load
    refused part-way and a submodule's load against plain PyTorch."""
    (a, a_opt), (b, b_opt) = _sharded(precision), _sharded(precision)
    for model, opt in ((a, a_opt), (b, b_opt)):
        _rank_train(model, opt, rank, range(2))
    before = {k: v.clone() for k, v in a.state_dict().items()}
    key = "transformer.h.1.mlp.c_fc.weight"
    given = {key: torch.randn(before[key].shape, generator=torch.Generator().manual_seed(3)),
             "lm_head.weight": torch.randn(128, 32, generator=torch.Generator().manual_seed(4)).bfloat16()}
    a.load_state_dict(given, strict=False)
    whole = dict(before, **given)
    whole["transformer.wte.weight"] = whole["lm_head.weight"] = given["lm_head.weight"].float()
    b.load_state_dict(whole)
    got = a.state_dict()
    out = {"others": [k for k in before if k not in whole or not torch.equal(got[k], whole[k])],
           "loaded": _differ_dicts(whole, b.state_dict())}
    for model, opt in ((a, a_opt), (b, b_opt)):
        _rank_train(model, opt, rank, range(2, 4))
    out["trained"] = _differ_dicts(a.state_dict(), b.state_dict())
    plain = _gpt2()
    plain.load_state_dict(a.state_dict())
    new = {k: v + 1 for k, v in plain.state_dict().items()}
    mlp = {k: v * 2 for k, v in plain.transformer.h[0].mlp.state_dict().items()}
    for m in (plain, a):
        m.transformer.h[1].attn.c_attn.register_load_state_dict_pre_hook(_refuse)
        with pytest.raises(ValueError, match="refused"):
            m.load_state_dict(new)
        m.transformer.h[0].mlp.load_state_dict(mlp)
    out["refused_and_submodule"] = _differ(plain, a)
    _rank_train(a, a_opt, rank, range(4, 5))
    return out


def _differ_dicts(expected: dict, got: dict) -> list[str]:
    return [k for k in expected if not torch.equal(expected[k], got[k])]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_partial_refused_and_submodule_loads_on_two_sharded_ranks(precision):
    from tests._dist import run_distributed

    for out in run_distributed(_sharded_case, 2, precision, timeout_s=240):
        assert out == {"others": [], "loaded": [], "trained": [], "refused_and_submodule": []}, out


def _disk_resume_case(rank: int, world_size: int, directory: str) -> dict:
    """bf16 parameter shards, masters, moments and gradients in the disk tier's file: a run that loads another's
    ``opt.state_dict()`` then ``model.state_dict()`` (a fresh model, another seed, a step of its own first) after two
    of its five steps and takes the last three is bit for bit the uninterrupted run; nothing stays resident after
    either load."""
    import os

    from tests.test_disk_tier_params import STEPS, _prepare, _step

    runs = []
    for name in ("run", "resumed"):
        path = os.path.join(directory, f"{name}{rank}")
        os.makedirs(path)
        runs.append(_prepare(path, world_size, seed=0 if name == "run" else 7, precision="bf16"))
    (model, opt), (resumed, resumed_opt) = runs
    for step in range(2):
        _step(model, opt, step, rank, world_size)
    saved = model.state_dict(), opt.state_dict()
    _step(resumed, resumed_opt, 9, rank, world_size)
    resident = []
    for load, state in ((resumed_opt.load_state_dict, saved[1]), (resumed.load_state_dict, saved[0])):
        load(state)
        resident.append(resumed_opt._disk.file.resident_bytes())
    for step in range(2, STEPS):
        _step(model, opt, step, rank, world_size)
        _step(resumed, resumed_opt, step, rank, world_size)
    want, got = model.state_dict(), resumed.state_dict()
    opt._disk.close()
    resumed_opt._disk.close()
    return {"resident": resident, "differ": _differ_dicts(want, got)}


def test_a_disk_tier_resume_on_two_ranks_is_the_uninterrupted_run(tmp_path):
    from tests._dist import run_distributed

    for out in run_distributed(_disk_resume_case, 2, str(tmp_path), timeout_s=240):
        assert out == {"resident": [0, 0], "differ": []}, out
