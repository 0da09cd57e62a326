"""An unchanged accelerate loop under a tensor-parallel (Llama) or expert-parallel (Mixtral) Elixir config is
parallelized by the route itself ([Note: parallelized by the integration] in ``hf_elixir/integrations/_takeover.py``):
the optimizer the script built on the original parameters steps the rewritten ones, training matches plain PyTorch
on the global batch at 2 gloo ranks, and rank 0 logs one line saying that hf_elixir took over. An unchanged
``Trainer`` script launched with ``recipes/llama/elixir.yaml`` or ``recipes/mixtral/elixir.yaml`` at 2 processes
trains as the stock Trainer in one process: the same losses and saved weights."""

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


# recipe: (model, rows per process routed, rows of the one-process reference, the took-over line's model and mesh).
# tensor parallel: the two processes are one row reading one process's batches; expert parallel: two data-parallel
# rows, each with its own batch, so the reference reads both rows' batches in one
_TRAINER_CASES = {"llama": ("gpt2", 2, 2, "GPT2LMHeadModel", "(tp=2, ep=1, dp=1)"),
                  "mixtral": ("mixtral", 2, 4, "MixtralForCausalLM", "(tp=1, ep=2")}


def _final_weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "final" / "model.safetensors"))


@pytest.mark.parametrize("recipe", sorted(_TRAINER_CASES))
def test_an_unchanged_trainer_script_under_a_tensor_or_expert_parallel_yaml_trains_as_the_stock_trainer(
        tmp_path, recipe):
    """``accelerate launch --config_file recipes/<recipe>/elixir.yaml run_trainer.py`` (a stock Trainer script) at 2
    processes: the route parallelizes the model (``tensor_parallel_size: 2`` for Llama's, ``expert_parallel_size: 2``
    for Mixtral's) before the Trainer builds its optimizer and data loaders, and the losses and saved weights equal
    the stock Trainer in one process on the same global batch; the took-over line shows at the default log level,
    once."""
    from tests.test_launch import REPO, SCRIPTS, _field, _launch, _yaml_without_elixir

    model, rows, reference_rows, model_class, mesh = _TRAINER_CASES[recipe]
    script = [str(SCRIPTS / "run_trainer.py"), "--model", model, "--save"]
    routed = _launch(tmp_path, 2, [*script, str(tmp_path / "routed"), "--batch", str(rows)], via="accelerate",
                     config=REPO / "recipes" / recipe / "elixir.yaml")
    reference = _launch(tmp_path, 1, [*script, str(tmp_path / "stock"), "--batch", str(reference_rows)],
                        via="accelerate", config=_yaml_without_elixir(tmp_path))
    assert _field(routed, "TRAINED_MODEL_CLASS") == [model_class] * 2, routed[-3000:]
    got, expected = [float(x) for x in _field(routed, "FINAL_LOSS")], float(_field(reference, "FINAL_LOSS")[0])
    assert got == pytest.approx([expected] * 2, rel=1e-5), (got, expected)
    weights, stock = _final_weights(tmp_path / "routed"), _final_weights(tmp_path / "stock")
    assert sorted(weights) == sorted(stock)
    num = sum(float((weights[k].double() - stock[k].double()).norm() ** 2) for k in stock)
    assert (num / sum(float(v.double().norm() ** 2) for v in stock.values())) ** 0.5 < 1e-5
    took_over = [line for line in routed.splitlines() if f"hf_elixir took over {model_class} (trained)" in line]
    assert len(took_over) == 1 and mesh in took_over[0], routed[-3000:]
