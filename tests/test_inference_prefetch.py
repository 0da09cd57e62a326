"""Forward steps ([Note: forward steps] in ``hf_elixir/chunk/_steps.py``): a model prepared without an optimizer
rotates its access trace at the end of each top-level forward, so the second and later forwards evict by Belady
over the forward before and issue all-gathers ahead of their use (two gloo ranks, sharded chunks, a model-data
budget), with the plain model's outputs; a forward whose module order differs from the previous one is still
right and its gathers still pair across ranks; ``generate`` gives the plain model's tokens. A training run's evaluation forwards under ``torch.no_grad()``
record into a trace of their own and leave the training step's trace as it was.

Gathers issued ahead are counted (``step_num_prefetched_gathers``, per forward without an optimizer), not timed.
"""

from __future__ import annotations

import torch

import hf_elixir
from tests._dist import run_distributed
from tests._models import batch, rel_l2, tiny_model

CHUNK = 8192
ROWS_PER_RANK = 2
FORWARDS = 4
GENERATED = 6  # new tokens: forwards of ``generate``
EXTRA_BYTES = 2 * CHUNK * 2  # above the smallest budget: room for a gather ahead at some accesses
STEP_KEYS = ("step_num_prefetched_gathers", "step_num_blocking_gathers", "step_allgather_bytes",
             "step_num_onloads", "step_device_peak_bytes")


def _inputs(step: int, rank: int) -> dict:
    return {"input_ids": batch("gpt2", step, 2 * ROWS_PER_RANK)["input_ids"][rank * ROWS_PER_RANK:
                                                                           (rank + 1) * ROWS_PER_RANK]}


def _reversed_blocks(model) -> None:
    """Run the transformer blocks in the other order (another module order, the same on every rank)."""
    model.transformer.h = torch.nn.ModuleList(list(model.transformer.h)[::-1])


def _inference_worker(rank: int, world_size: int) -> dict:
    out = {}
    for depth in (0, 2):
        model = tiny_model("gpt2")
        config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded", prefetch_depth=depth)
        budget = hf_elixir.min_device_budget_bytes(model, None, config, world_size=world_size) + EXTRA_BYTES
        config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, default_placement="sharded", prefetch_depth=depth,
                                        device_memory_budget_bytes=budget, budget_covers_activations=False)
        model, _ = hf_elixir.prepare(model, None, config)
        model.eval()
        steps, logits = [], []
        for step in range(FORWARDS + 3):
            if step == FORWARDS:  # one forward in another order, then the usual order again
                _reversed_blocks(model)
            with torch.no_grad():
                logits.append(model(**_inputs(step, rank)).logits.clone())
            if step == FORWARDS:
                _reversed_blocks(model)
            stats = hf_elixir.memory_stats(model)
            steps.append({k: stats[k] for k in STEP_KEYS})
        out[depth] = {"steps": steps, "logits": logits, "budget": budget,
                      "peak": hf_elixir.memory_stats(model)["device_peak_bytes"]}
        if depth:  # generate: each step's forward is predicted by the one before (the prompt's, then the tokens')
            hf_elixir.reset_memory_stats(model)
            with torch.no_grad():
                out["generated"] = model.generate(_inputs(0, rank)["input_ids"], max_new_tokens=GENERATED,
                                                  do_sample=False, pad_token_id=0)
            out["generate_stats"] = hf_elixir.memory_stats(model)
    return out


def _reference_logits(rank: int) -> list[torch.Tensor]:
    model = tiny_model("gpt2").eval()
    logits = []
    for step in range(FORWARDS + 3):
        if step == FORWARDS:
            _reversed_blocks(model)
        with torch.no_grad():
            logits.append(model(**_inputs(step, rank)).logits)
        if step == FORWARDS:
            _reversed_blocks(model)
    return logits


def test_forwards_without_optimizer_gather_ahead_by_the_previous_forward_at_two_ranks():
    results = run_distributed(_inference_worker, 2, timeout_s=120)
    for rank, r in enumerate(results):
        reference = _reference_logits(rank)
        for depth, run in ((depth, r[depth]) for depth in (0, 2)):
            for step, (got, want) in enumerate(zip(run["logits"], reference)):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"rank {rank} depth {depth} step {step}")
            assert run["peak"] <= run["budget"], (rank, depth, run["peak"], run["budget"])
        off, on = r[0]["steps"], r[2]["steps"]
        assert on[0]["step_num_prefetched_gathers"] == 0, on[0]  # the first forward has no previous order
        for step in range(1, FORWARDS):  # the later ones (same order): gathers issued ahead, the same gathers
            assert on[step]["step_num_prefetched_gathers"] > 0, (rank, step, on[step])
            assert off[step]["step_num_prefetched_gathers"] == 0, off[step]
            assert (on[step]["step_num_prefetched_gathers"] + on[step]["step_num_blocking_gathers"]
                    == off[step]["step_num_blocking_gathers"]), (rank, step, on[step], off[step])
            assert on[step]["step_allgather_bytes"] == off[step]["step_allgather_bytes"]
            assert on[step]["step_device_peak_bytes"] <= r[2]["budget"]
        # the forward in another order, and the one after it (predicted by that one): right outputs (above), the
        # gathers paired across ranks (no hang, the ranks' counts equal below); two forwards later the steady counts
        counts = [{k: v for k, v in s.items() if k != "step_device_peak_bytes"} for s in on]  # a running peak
        assert counts[FORWARDS + 2] == counts[FORWARDS - 1], (rank, on)
        assert counts[FORWARDS] != counts[FORWARDS - 1], (rank, on)  # the other order did change what happened
    assert results[0][2]["steps"] == results[1][2]["steps"], "ranks decided differently"
    assert results[0]["generate_stats"]["num_prefetched_gathers"] == results[1]["generate_stats"][
        "num_prefetched_gathers"]
    for rank, r in enumerate(results):
        reference = tiny_model("gpt2").eval()
        with torch.no_grad():
            expected = reference.generate(_inputs(0, rank)["input_ids"], max_new_tokens=GENERATED, do_sample=False,
                                          pad_token_id=0)
        assert torch.equal(r["generated"], expected), rank
        # every forward but the first issues gathers ahead (here 2 of 5 per forward, 10 of 32 in all)
        assert r["generate_stats"]["num_prefetched_gathers"] >= GENERATED - 1, r["generate_stats"]


def test_one_rank_forward_steps_rotate_the_trace_and_evict_by_belady():
    """On CPU at one rank: each forward's counters land in ``step_*``, the trace rotates at each forward's end,
    and the later forwards (Belady over the one before) onload no more than the first (recency), with the plain
    model's logits; a local onload ahead is not issued off CUDA (it would overlap nothing)."""
    model = tiny_model("gpt2")
    config = hf_elixir.ElixirConfig(chunk_size_numel=4096, default_placement="sharded", prefetch_depth=2)
    budget = hf_elixir.min_device_budget_bytes(model, None, config) + 4096 * 4
    config = hf_elixir.ElixirConfig(chunk_size_numel=4096, default_placement="sharded", prefetch_depth=2,
                                    device_memory_budget_bytes=budget, budget_covers_activations=False)
    model, _ = hf_elixir.prepare(model, None, config)
    manager = hf_elixir.get_state(model).manager
    reference = tiny_model("gpt2").eval()
    model.eval()
    onloads, traces = [], []
    for step in range(3):
        with torch.no_grad():
            got = model(**_inputs(step, 0)).logits
            want = reference(**_inputs(step, 0)).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        stats = hf_elixir.memory_stats(model)
        onloads.append(stats["step_num_onloads"])
        assert stats["step_num_prefetches"] == 0 and stats["step_device_peak_bytes"] <= budget
        assert manager.trace == [] and manager.prev_forward_ends == [len(manager.prev_trace)]
        traces.append(list(manager.prev_trace))
    assert traces[0] == traces[1] == traces[2] and len(traces[0]) > len(manager.chunks)
    assert onloads[1] == onloads[2] < onloads[0], onloads  # here 10 < 13: Belady beats recency


def _train_with_eval(evaluate: bool):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    config = hf_elixir.ElixirConfig(chunk_size_numel=4096, default_placement="sharded", prefetch_depth=2)
    budget = hf_elixir.min_device_budget_bytes(model, opt, config) + 4 * 4096 * 4
    config = hf_elixir.ElixirConfig(chunk_size_numel=4096, default_placement="sharded", prefetch_depth=2,
                                    device_memory_budget_bytes=budget, budget_covers_activations=False)
    model, opt = hf_elixir.prepare(model, opt, config)
    manager = hf_elixir.get_state(model).manager
    traces, evals = [], []
    for step in range(3):
        if evaluate and step:  # Trainer.evaluate between steps
            model.eval()
            with torch.no_grad():
                evals.append(model(**batch("gpt2", 100 + step, 2)).loss.item())
            model.train()
            assert manager.trace == [], "an evaluation forward recorded into the training step's trace"
        opt.backward(model(**batch("gpt2", step, 2)).loss)
        opt.step()
        opt.zero_grad()
        traces.append((list(manager.prev_trace), list(manager.prev_forward_ends), list(manager.prev_backward_ends)))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, traces, evals


def test_evaluation_forwards_leave_the_training_trace_alone():
    state, traces, _ = _train_with_eval(False)
    state_eval, traces_eval, evals = _train_with_eval(True)
    assert traces_eval == traces  # each step's order, phase ends included, as without the evaluations
    assert rel_l2(state_eval, state) == 0.0  # evaluation changes nothing in training
    reference = tiny_model("gpt2")
    opt = torch.optim.AdamW(reference.parameters(), lr=5e-3)
    for step in range(3):
        if step:
            reference.eval()
            with torch.no_grad():
                assert abs(reference(**batch("gpt2", 100 + step, 2)).loss.item() - evals[step - 1]) < 1e-5
            reference.train()
        reference(**batch("gpt2", step, 2)).loss.backward()
        opt.step()
        opt.zero_grad()
    assert rel_l2(state, {k: v.detach() for k, v in reference.state_dict().items()}) < 1e-5
