"""An unchanged accelerate loop under a tensor-parallel (Llama) or expert-parallel (Mixtral) Elixir config is
parallelized by the route itself ([Note: parallelized by the integration] in ``hf_elixir/integrations/_takeover.py``):
the optimizer the script built on the original parameters steps the rewritten ones, training matches plain PyTorch
on the global batch at 2 gloo ranks, and rank 0 logs one line saying that hf_elixir took over."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

from tests._dist import run_distributed
from tests._models import VOCAB, batch

STEPS, ROWS = 3, 2


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4,
                                                                      num_experts_per_tok=2))


def _routed_loop(rank: int, world_size: int, kind: str) -> dict:
    import accelerate

    import hf_elixir
    from hf_elixir.integrations import _route
    from hf_elixir.parallel import gather_full_state_dict

    sizes = {"tensor_parallel_size": 2} if kind == "llama" else {"expert_parallel_size": 2}
    _route._STATE.update(config=hf_elixir.ElixirConfig(**sizes), source="elixir.yaml (accelerate launch)")
    accelerate.Accelerator.prepare = _route._routed_prepare(accelerate.Accelerator.prepare)  # as the launch does
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hf_elixir.takeover").addHandler(handler)
    logging.getLogger("hf_elixir.takeover").setLevel(logging.INFO)
    accelerator = accelerate.Accelerator(cpu=True)
    model = _model(kind)
    plain = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain_opt, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    # tensor parallel: the two ranks are one data-parallel row and compute on one batch; expert parallel: each its own
    rows = 1 if kind == "llama" else world_size
    for step in range(STEPS):
        full = batch("llama", step, ROWS * rows)
        mine = full if kind == "llama" else {k: v[rank * ROWS:(rank + 1) * ROWS] for k, v in full.items()}
        accelerator.backward(model(**mine).loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        plain(**full).loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        plain_opt.step()
        for _ in range(accelerator.num_processes):  # accelerate steps a prepared scheduler once per process
            plain_sched.step()
        plain_opt.zero_grad()
    full_state = gather_full_state_dict(model, rank0_only=False)
    reference = plain.state_dict()
    num = sum(float((full_state[k].double() - reference[k].double()).norm() ** 2) for k in reference)
    den = sum(float(reference[k].double().norm() ** 2) for k in reference)
    return {"rel": (num / den) ** 0.5, "lines": lines, "keys_match": sorted(full_state) == sorted(reference),
            "parallel": hf_elixir.parallel.get_parallel_state(model) is not None}


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_an_unchanged_loop_under_a_tensor_or_expert_parallel_config_is_parallelized_by_the_route(kind):
    results = run_distributed(_routed_loop, 2, kind, timeout_s=240)
    for rank, r in enumerate(results):
        assert r["parallel"] and r["keys_match"]
        assert r["rel"] < 1e-5, r["rel"]
        took_over = [line for line in r["lines"] if line.startswith("hf_elixir took over")]
        assert len(took_over) == (1 if rank == 0 else 0), r["lines"]
    line = results[0]["lines"][-1]
    mesh = "(tp=2, ep=1, dp=1)" if kind == "llama" else "(tp=1, ep=2"
    assert f"{'LlamaForCausalLM' if kind == 'llama' else 'MixtralForCausalLM'} (trained)" in line
    assert "from elixir.yaml (accelerate launch): placements" in line and mesh in line and "device budget" in line


def test_an_unchanged_trainer_script_under_the_llama_tensor_parallel_yaml_trains_as_the_stock_trainer(tmp_path):
    """``accelerate launch --config_file recipes/llama/elixir.yaml run_trainer.py`` (tensor_parallel_size: 2, a stock
    Trainer script): the route parallelizes the model before the Trainer builds its optimizer and data loaders, the
    two processes are one tensor-parallel row reading one process's batches, and the losses equal the stock Trainer
    in one process; the took-over line shows at the default log level, once."""
    from tests.test_launch import REPO, SCRIPTS, _field, _launch, _yaml_without_elixir

    script = [str(SCRIPTS / "run_trainer.py"), str(tmp_path / "out")]
    routed = _launch(tmp_path, 2, script, via="accelerate", config=REPO / "recipes" / "llama" / "elixir.yaml")
    reference = _launch(tmp_path, 1, script, via="accelerate", config=_yaml_without_elixir(tmp_path))
    assert _field(routed, "TRAINED_MODEL_CLASS") == ["GPT2LMHeadModel"] * 2, routed[-3000:]
    got, expected = [float(x) for x in _field(routed, "FINAL_LOSS")], float(_field(reference, "FINAL_LOSS")[0])
    assert got == pytest.approx([expected] * 2, rel=1e-5), (got, expected)
    took_over = [line for line in routed.splitlines() if "hf_elixir took over GPT2LMHeadModel (trained)" in line]
    assert len(took_over) == 1 and "(tp=2, ep=1, dp=1)" in took_over[0], routed[-3000:]
