"""The same-pass host Adam/AdamW step ([Note: same-pass host step] in hf_elixir/optim/_same_pass.py): host optimizer
chunks with a staging buffer are stepped block by block by PyTorch's fused CPU kernel and each block is cast into
the staging buffer while in cache. Checked: bitwise parity with ``torch.optim`` fused Adam/AdamW on the views
(odd sizes crossing block boundaries, two param groups, AMSGrad, maximize, skipped views); bitwise parity of
training with the step-then-cast path (host lane on and off, clipping rollbacks, an fp16 overflow skip, 2 ranks,
a checkpoint round trip); that the blocked path really ran and the separate cast did not; parity with plain
PyTorch; the fallbacks."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hf_elixir
from hf_elixir.optim import _same_pass
from hf_elixir.optim._same_pass import ALIGN_NUMEL, SamePassTable, ViewTensors, step_and_cast
from hf_elixir.optim.optimizer import ElixirOptimizer
from tests._dist import run_distributed
from tests._models import low_precision_reference, rank_batch, rel_l2, tiny_model, two_groups

ROWS = 2
CHUNK = 4096
BLOCK = 320  # small blocks: every chunk of tiny GPT-2 has boundaries inside views
MAX_NORM = 1.6  # tiny GPT-2's gradient norm falls from ~2.9 to ~1.3: early steps clip, later ones do not


# -- the kernel walk, against torch.optim ------------------------------------------------------------------
SIZES = [5, 1000, 3, 777, 64, 2049, 1]
GAP = 3  # elements between views (padding / frozen), cast but never stepped


def _spans() -> tuple[list[tuple[int, int]], int]:
    spans, cursor = [], GAP
    for size in SIZES:
        spans.append((cursor, cursor + size))
        cursor += size + (GAP if len(spans) % 2 else 0)
    return spans, cursor + GAP


def test_table_blocks_cover_the_shard_and_cut_views_on_aligned_offsets():
    spans, numel = _spans()
    table = SamePassTable.build(spans, numel, 256)
    assert table.bounds[0] == 0 and table.bounds[-1] == numel and list(table.bounds) == sorted(set(table.bounds))
    assert max(b - a for a, b in zip(table.bounds, table.bounds[1:])) < 256 + ALIGN_NUMEL
    covered = {i: [] for i in range(len(spans))}
    for (b0, b1), segments in zip(zip(table.bounds, table.bounds[1:]), table.segments):
        for seg in segments:
            lo, hi = spans[seg.view]
            assert b0 <= lo + seg.start < lo + seg.stop <= b1
            assert seg.start % ALIGN_NUMEL == 0 or seg.start == 0
            covered[seg.view].append((seg.start, seg.stop))
    for i, (lo, hi) in enumerate(spans):  # each view exactly once, in order
        parts = covered[i]
        assert parts[0][0] == 0 and parts[-1][1] == hi - lo
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    assert len(SamePassTable.build(spans, numel, 1 << 20).segments) == 1


@pytest.mark.parametrize("cls, options", [(torch.optim.AdamW, {}), (torch.optim.Adam, {}),
                                          (torch.optim.AdamW, {"amsgrad": True}),
                                          (torch.optim.Adam, {"maximize": True, "amsgrad": True})])
def test_blocks_match_the_fused_optimizer_bitwise(cls, options):
    """Four steps of two param groups (weight decay 0.1 / 0.0); view 2 has no gradient in step 2. Parameters,
    moments and step counts are bitwise those of ``cls(fused=True)`` on separate tensors, the staging buffer is
    the master cast to bf16, and the gaps are cast but unchanged."""
    spans, numel = _spans()
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    start = master.clone()
    staging = torch.empty(numel, dtype=torch.bfloat16)
    ours = [torch.nn.Parameter(master[lo:hi]) for lo, hi in spans]
    ref = [torch.nn.Parameter(master[lo:hi].clone()) for lo, hi in spans]

    def groups(params):
        return [{"params": params[0::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0}]
    reference = cls(groups(ref), lr=1e-2, fused=True, **options)
    mine = cls(groups(ours), lr=1e-2, fused=True, **options)  # only its param groups (hyperparameters) are used
    group_of = [mine.param_groups[i % 2] for i in range(len(spans))]
    amsgrad = options.get("amsgrad", False)
    states = [{key: torch.zeros(hi - lo) for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
              for lo, hi in spans]
    steps = [torch.tensor(0.0) for _ in spans]
    table = SamePassTable.build(spans, numel, 256)
    for step in range(4):
        grads = torch.randn(numel, generator=gen)
        skipped = {2} if step == 2 else set()
        views = []
        for i, ((lo, hi), p, r) in enumerate(zip(spans, ours, ref)):
            r.grad = None if i in skipped else grads[lo:hi].clone()
            views.append(None if i in skipped else ViewTensors(
                p.detach(), grads[lo:hi], states[i]["exp_avg"], states[i]["exp_avg_sq"],
                states[i]["max_exp_avg_sq"] if amsgrad else None, steps[i], group_of[i]))
        reference.step()
        step_and_cast(table, views, master, staging)
        for i, r in enumerate(ref):
            ref_state = reference.state[r]
            assert torch.equal(ours[i].detach(), r.detach()), (step, i)
            assert torch.equal(steps[i], ref_state["step"]), (step, i)
            for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
                assert torch.equal(states[i][key], ref_state[key]), (step, i, key)
        assert torch.equal(staging, master.to(torch.bfloat16))
        inside = torch.zeros(numel, dtype=torch.bool)
        for lo, hi in spans:
            inside[lo:hi] = True
        assert torch.equal(master[~inside], start[~inside])


# -- inside ElixirOptimizer --------------------------------------------------------------------------------
@contextlib.contextmanager
def _patched(same_pass: bool, casts: list[int] | None = None):
    """Small blocks; ``same_pass=False``: the step-then-cast path (what the runtime did before); ``casts``
    records the chunk ids ``stage_refresh`` (the separate cast) ran for."""
    saved = (_same_pass.BLOCK_NUMEL, ElixirOptimizer._same_pass_chunks, ElixirOptimizer.stage_refresh)
    _same_pass.BLOCK_NUMEL = BLOCK
    if not same_pass:
        ElixirOptimizer._same_pass_chunks = lambda self, params_per_group: {}
    if casts is not None:
        def spy(self, cid):
            if cid in self._refresh_staging:
                casts.append(cid)
            return saved[2](self, cid)
        ElixirOptimizer.stage_refresh = spy
    try:
        yield
    finally:
        _same_pass.BLOCK_NUMEL, ElixirOptimizer._same_pass_chunks, ElixirOptimizer.stage_refresh = saved


def _uploaded_cast(opt) -> list[int]:
    return sorted(opt._refresh_staging)


def _train(same_pass: bool, *, rank: int = 0, world_size: int = 1, steps: int = 4, precision: str = "bf16",
           overlap: bool = False, max_norm: float | None = None, inf_step: int | None = None,
           make_optimizer=None, resume_at: int | None = None):
    """Train tiny GPT-2 with host optimizer state and an LR schedule; returns the model state, the optimizer's state dict, the
    masters, the same-pass count, the chunks with staging, the separate casts run, and per step whether every
    staging buffer held its master cast to the compute dtype."""
    casts: list[int] = []
    with _patched(same_pass, casts):
        def prepare():
            model = tiny_model("gpt2")
            opt = (make_optimizer or (lambda m: torch.optim.AdamW(two_groups(m), lr=5e-3)))(model)
            return hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
                chunk_size_numel=CHUNK, offload_optimizer=True, precision=precision,
                overlap_host_optimizer=overlap))
        def schedule(opt, done=0):  # the lr changes every step: read from the param groups at each step
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * (s + done)))
        model, opt = prepare()
        sched = schedule(opt)
        staged_ok, lane_counts, skipped_unchanged = [], [0, 0], None
        for step in range(steps):
            if step == resume_at:  # a checkpoint round trip: a fresh model and optimizer load the state
                saved = opt.state_dict()
                if opt._lane is not None:
                    lane_counts = [lane_counts[0] + opt._lane.num_speculated,
                                   lane_counts[1] + opt._lane.num_rolled_back]
                model, opt = prepare()
                opt.load_state_dict(saved)
                sched = schedule(opt, step)
            before = {k: v.clone() for k, v in opt.masters.items()} if step == inf_step else None
            loss = model(**rank_batch("gpt2", step, rank, world_size, ROWS)).loss
            if step == inf_step:
                loss = loss * float("inf")  # injected fp16 overflow
            opt.backward(loss)
            if max_norm is not None:
                opt.clip_grad_norm(max_norm)
            opt.step()
            opt.zero_grad()
            sched.step()
            staged_ok.append(all(torch.equal(opt._refresh_staging[cid], opt.masters[cid].to(c.dtype))
                                 for cid, c in ((cid, opt.manager.chunks[cid]) for cid in opt._refresh_staging)))
            if before is not None:
                skipped_unchanged = all(torch.equal(v, before[k]) for k, v in opt.masters.items())
        if opt._lane is not None:
            lane_counts = [lane_counts[0] + opt._lane.num_speculated, lane_counts[1] + opt._lane.num_rolled_back]
        state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        return {"state": state, "optim": opt.state_dict(), "masters": {k: v.clone() for k, v in opt.masters.items()},
                "num_same_pass": opt.num_same_pass_steps, "staged": _uploaded_cast(opt), "casts": casts,
                "staged_ok": staged_ok, "lane": lane_counts, "skipped_unchanged": skipped_unchanged}


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a["masters"].keys() == b["masters"].keys()
    for cid, master in a["masters"].items():
        assert torch.equal(master, b["masters"][cid]), f"master of chunk {cid}"
    for name, value in a["state"].items():
        assert torch.equal(value, b["state"][name]), name
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for name, entry in a["optim"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["optim"]["state"][name][key]), (name, key)


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "host-lane"])
def test_same_pass_matches_step_then_cast_bitwise(single_rank_group, overlap):
    """bf16 compute, fp32 masters on the host, two param groups, clipping (the lane's early steps roll back and
    are redone in ``step()``, later ones stand). The same-pass run ran for every chunk with staging in every step,
    never ran the separate cast for them, kept each staging buffer equal to its master in bf16, and ended
    bitwise where the step-then-cast run ended (masters, moments, step counts, model)."""
    steps = 6 if overlap else 4
    fused = _train(True, steps=steps, overlap=overlap, max_norm=MAX_NORM)
    plain = _train(False, steps=steps, overlap=overlap, max_norm=MAX_NORM)
    assert fused["staged"] and fused["num_same_pass"] >= len(fused["staged"]) * steps
    assert not set(fused["casts"]) & set(fused["staged"]), "the separate cast ran for a same-pass chunk"
    assert plain["num_same_pass"] == 0 and set(plain["casts"]) == set(plain["staged"])
    assert all(fused["staged_ok"]) and all(plain["staged_ok"])
    if overlap:
        speculated, rolled_back = fused["lane"]
        assert 0 < rolled_back < speculated, fused["lane"]
    _assert_bitwise(fused, plain)


def test_fp16_overflow_skip_is_exact(single_rank_group):
    """fp16 with the host lane: the overflow step (2) is skipped (masters unchanged) and rolled back, and the
    result is bitwise the step-then-cast one."""
    fused = _train(True, steps=4, precision="fp16", overlap=True, inf_step=2)
    plain = _train(False, steps=4, precision="fp16", overlap=True, inf_step=2)
    assert fused["skipped_unchanged"] and plain["skipped_unchanged"]
    assert fused["num_same_pass"] > 0 and all(fused["staged_ok"])
    _assert_bitwise(fused, plain)


def test_checkpoint_round_trip_is_exact(single_rank_group):
    """State dict after 2 steps, loaded into a fresh model and optimizer, 2 more steps: bitwise the 4 steps of
    one run (step counts and moments read and written through the same-pass step's slices)."""
    straight = _train(True, steps=4)
    resumed = _train(True, steps=4, resume_at=2)
    assert resumed["num_same_pass"] > 0
    _assert_bitwise(straight, resumed)


def _reference_masters(steps: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: fp32 masters stepped by AdamW (the same LR schedule) from the gradients of a bf16 copy cast from them."""
    masters, _ = low_precision_reference(steps, ROWS, torch.bfloat16, schedule=lambda s: 1.0 / (1.0 + 0.3 * s))
    return {n: p.detach().clone() for n, p in masters.named_parameters()}


def test_parity_with_plain_pytorch(single_rank_group):
    """4 same-pass steps against plain PyTorch (fp32 masters stepped by AdamW from the gradients of a bf16 copy
    cast from them): the masters (``state_dict()['state'][name]['master']``) and the bf16 model agree to bf16's
    rounding (the gradients differ in bf16 rounding: the tied embedding's two uses are summed in another
    order), the tolerance of ``tests/test_overlapped_refresh.py``; the exact check against the unblocked step is
    ``test_same_pass_matches_step_then_cast_bitwise``."""
    fused = _train(True, steps=4)
    assert fused["num_same_pass"] > 0
    ours = {name: entry["master"] for name, entry in fused["optim"]["state"].items()}
    ref = _reference_masters(4)
    assert set(ours) == set(ref)
    assert rel_l2(ours, ref) < 1e-2, rel_l2(ours, ref)
    model = {k: v.to(torch.bfloat16).float() for k, v in ref.items()}
    assert rel_l2(fused["state"], model) < 1e-2, rel_l2(fused["state"], model)


def _two_ranks(rank: int, world_size: int):
    fused = _train(True, rank=rank, world_size=world_size, steps=3)
    plain = _train(False, rank=rank, world_size=world_size, steps=3)
    _assert_bitwise(fused, plain)
    return fused["num_same_pass"], len(fused["staged"]), all(fused["staged_ok"]), set(fused["casts"]) & set(
        fused["staged"])


def test_two_ranks_same_pass_matches_step_then_cast():
    """Shards that start inside a parameter (rank 1): still bitwise, every chunk with staging stepped in one pass."""
    for count, staged, ok, cast_twice in run_distributed(_two_ranks, 2, timeout_s=300):
        assert staged and count == staged * 3 and ok and not cast_twice


@pytest.mark.parametrize("what", ["foreach", "fused-false", "sgd", "fp32"])
def test_falls_back_to_step_then_cast(single_rank_group, what):
    """Not run by the fused Adam kernel (user-set ``foreach`` / ``fused=False``, SGD) or no staging (fp32
    compute): stepped as before, then the separate cast where there is staging; the same result as the old path."""
    makers = {"foreach": lambda m: torch.optim.AdamW(two_groups(m), lr=5e-3, foreach=True),
              "fused-false": lambda m: torch.optim.AdamW(two_groups(m), lr=5e-3, fused=False),
              "sgd": lambda m: torch.optim.SGD(two_groups(m), lr=5e-2, momentum=0.9),
              "fp32": None}
    precision = "fp32" if what == "fp32" else "bf16"
    fused = _train(True, steps=2, precision=precision, make_optimizer=makers[what])
    plain = _train(False, steps=2, precision=precision, make_optimizer=makers[what])
    assert fused["num_same_pass"] == 0
    assert set(fused["casts"]) == set(fused["staged"]) and (what == "fp32") == (not fused["staged"])
    _assert_bitwise(fused, plain)


def test_benchmark_runs_end_to_end(tmp_path):
    """``benchmarks/host_adam.py`` on a small chunk: every variant timed, the fractions reported."""
    import json

    from benchmarks import host_adam

    out = tmp_path / "host_adam.json"
    assert host_adam.main(["--rounds", "2", "--hidden", "64", "--blocks", "256,4096", "--threads", "1",
                           "--diagnose", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert set(result["seconds"]) == {"step", "step+cast", "same-pass 256", "same-pass 4096", "blocked, no cast 256",
                                      "blocked, no cast 4096"}
    assert result["numel"] == 12 * 64 * 64 + 13 * 64 and result["best"].startswith("same-pass")
