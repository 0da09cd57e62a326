"""``torch.optim`` step hooks and learning rates set at ``step()`` time ([Note: step hooks] in
hf_elixir/optim/_step_hooks.py): a global pre/post hook, pre/post hooks on the ``ElixirOptimizer`` and on the user's
optimizer each run exactly once per ``step()``, with the optimizer they belong to (never the inner optimizer, never
on the host lane's thread), and hooks that change the lr, together with a ``LambdaLR``, give plain PyTorch's result
on every path: all on the device, host optimizer state stepped in ``step()``, the host lane on (speculation with the
old lr rolled back), and the same-pass host step (bf16)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import hf_elixir
from tests._models import batch, float_state, rel_l2, tiny_model, two_groups

STEPS = 6
ROWS = 2
CHUNK = 4096


def _lr_changes(step: int) -> tuple[float, float]:
    """The factors the global pre hook and the optimizer's pre hook apply to every group's lr at ``step``
    (1.0: unchanged, so the host lane's speculation with the scheduler's lr stands on steps 2 and 4)."""
    return (0.9 if step % 2 else 1.0), (0.7 if step % 3 == 0 else 1.0)


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))


@contextlib.contextmanager
def _hooks(opt, user_opt, log: list, step_of: list[int]):
    """Register the test's hooks: global pre (scales lr) and post, ``opt``'s pre (scales lr) and post,
    ``user_opt``'s pre and post (record only). Each records ``(kind, optimizer argument, thread)``."""
    def record(kind, scale_index=None):
        def hook(optimizer, args, kwargs):
            log.append((kind, optimizer, threading.current_thread() is threading.main_thread()))
            if scale_index is not None:
                factor = _lr_changes(step_of[0])[scale_index]
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * factor
        return hook
    handles = [register_optimizer_step_pre_hook(record("global_pre", 0)),
               register_optimizer_step_post_hook(record("global_post")),
               opt.register_step_pre_hook(record("pre", 1)), opt.register_step_post_hook(record("post")),
               user_opt.register_step_pre_hook(record("user_pre")),
               user_opt.register_step_post_hook(record("user_post"))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _reference() -> tuple[dict[str, torch.Tensor], list]:
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    sched = _schedule(opt)
    log, step_of, per_step = [], [0], []
    with _hooks(opt, opt, log, step_of):
        for step in range(STEPS):
            step_of[0] = step
            model(**batch("gpt2", step, ROWS)).loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            per_step.append([(kind, optimizer is opt) for kind, optimizer, _ in log])
            log.clear()
    return float_state(model), per_step


def _elixir(precision: str = "fp32", hooks: bool = True, **config):
    """Train tiny GPT-2 under hf_elixir with the hooks (``hooks=False``: the same lr changes made by the loop
    right before ``step()``, no hooks); returns the state, the per-step hook log, the lane's counts and the
    same-pass steps."""
    model = tiny_model("gpt2")
    user_opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, user_opt, hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, precision=precision, **config))
    sched = _schedule(opt)
    log, step_of, per_step = [], [0], []
    with _hooks(opt, user_opt, log, step_of) if hooks else contextlib.nullcontext():
        for step in range(STEPS):
            step_of[0] = step
            opt.backward(model(**batch("gpt2", step, ROWS)).loss)
            if not hooks:
                for factor in _lr_changes(step):
                    for group in opt.param_groups:
                        group["lr"] = group["lr"] * factor
            opt.step()
            opt.zero_grad()
            sched.step()
            per_step.append(list(log))
            log.clear()
    lane = opt._lane
    return {"state": float_state(model), "log": per_step, "model": model, "opt": opt, "user_opt": user_opt,
            "lane": (lane.num_speculated, lane.num_rolled_back) if lane is not None else None,
            "same_pass": opt.num_same_pass_steps}


PATHS = {"device": dict(offload_optimizer=False),
         "host": dict(offload_optimizer=True, overlap_host_optimizer=False),
         "host-lane": dict(offload_optimizer=True, overlap_host_optimizer=True)}


@pytest.mark.parametrize("path", list(PATHS))
def test_hooks_fire_once_per_step_and_lr_changes_match_pytorch(single_rank_group, path):
    """fp32. Before the fix the inner optimizer's step ran the global hooks again with itself as ``optimizer``
    (the lane: once per chunk, on its thread), so the global hook's lr change hit the views twice: 1e-2 relative
    off PyTorch (2.4e-2 with the lane), and the user optimizer's own hooks never ran."""
    ref, ref_log = _reference()
    run = _elixir(**PATHS[path])
    opt, user_opt = run["opt"], run["user_opt"]
    expected = [("global_pre", opt), ("pre", opt), ("user_pre", user_opt),
                ("user_post", user_opt), ("post", opt), ("global_post", opt)]
    for step, calls in enumerate(run["log"]):
        assert [(kind, who) for kind, who, _ in calls] == expected, (step, [(k, type(o).__name__) for k, o, _ in calls])
        assert all(main for _, _, main in calls), f"step {step}: a hook ran off the main thread"
    assert all(len(calls) == 6 and all(mine for _, mine in calls) for calls in ref_log), ref_log
    if path == "host-lane":
        speculated, rolled_back = run["lane"]
        # steps whose hooks changed the lr roll back; steps 2 and 4 (no change) stand
        assert 0 < rolled_back < speculated, run["lane"]
    rel = rel_l2(run["state"], ref)
    assert rel < 1e-5, f"{path}: param rel L2 {rel:.2e} vs plain PyTorch"


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "host-lane"])
def test_same_pass_step_takes_the_hooks_lr(single_rank_group, overlap):
    """bf16, host optimizer state with staging: the same-pass host step ([Note: same-pass host step]) runs with
    the lr the hooks set, exactly: the run with hooks is bitwise the run whose loop sets the same lr values
    itself before ``step()``; and the hooks fire once per step."""
    config = dict(offload_optimizer=True, overlap_host_optimizer=overlap)
    hooked = _elixir("bf16", **config)
    direct = _elixir("bf16", hooks=False, **config)
    assert hooked["same_pass"] >= STEPS and direct["same_pass"] == hooked["same_pass"]
    assert all(len(calls) == 6 for calls in hooked["log"]), [len(c) for c in hooked["log"]]
    if overlap:
        speculated, rolled_back = hooked["lane"]
        assert 0 < rolled_back < speculated and hooked["lane"] == direct["lane"], (hooked["lane"], direct["lane"])
    for name, value in hooked["state"].items():
        assert torch.equal(value, direct["state"][name]), name


def test_removed_hooks_stop_and_pre_hook_may_replace_args(single_rank_group):
    """``handle.remove()`` works on the ``ElixirOptimizer``'s hooks; a pre hook returning ``(args, kwargs)``
    replaces them (torch's contract), and one returning anything else raises torch's error."""
    run = _elixir(offload_optimizer=False)
    model, opt = run["model"], run["opt"]
    calls = []
    handle = opt.register_step_pre_hook(lambda o, a, k: calls.append(1))
    opt.backward(model(**batch("gpt2", STEPS, ROWS)).loss)
    opt.step()
    handle.remove()
    opt.step()
    assert calls == [1]
    seen = []
    handle = opt.register_step_pre_hook(lambda o, a, k: ((o,), {"closure": None}))
    post = opt.register_step_post_hook(lambda o, a, k: seen.append((a, k)))
    opt.step()
    handle.remove()
    post.remove()
    assert seen == [((opt,), {"closure": None})], seen  # torch's contract: args hold the optimizer itself
    handle = opt.register_step_pre_hook(lambda o, a, k: "nonsense")
    with pytest.raises(RuntimeError, match="must return None or a tuple"):
        opt.step()
    handle.remove()
