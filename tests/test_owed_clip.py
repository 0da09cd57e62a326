"""The clip factor ``clip_grad_norm`` owes host gradients until the step ([Note: owed clip factor] in
hf_elixir/optim/_clip.py) is part of their value for a second clip, a later backward and ``zero_grad``.

With optimizer states on the host, each of these used to train silently differently from plain PyTorch: two
clips before a step (the second returned the unclipped norm and clipped the host gradients twice: 1.3%
parameter difference after 3 steps), a clip after every micro-batch (the first factor also scaled the later
micro-batches' gradients: 9.7%), and a clip followed by ``zero_grad`` without a step, skipping a batch (the
factor scaled the next step's host gradients: 4.2%; under fp16 the next step's gradients were not unscaled)."""

from __future__ import annotations

import pytest
import torch

import hf_elixir
from tests._models import batch, float_state, rel_l2, tiny_model, two_groups

CHUNK = 8192
MAX_NORM = 0.3  # below every step's gradient norm: every clip clips


def _clip(model, opt):
    if isinstance(opt, hf_elixir.ElixirOptimizer):
        return float(opt.clip_grad_norm(MAX_NORM))
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))


def _train(model, opt, pattern: str) -> list[float]:
    norms = []
    for s in range(3):
        micro = 2 if pattern == "clip every micro-batch" else 1
        for m in range(micro):
            (model(**batch("gpt2", 2 * s + m, 2)).loss / micro).backward()
            norms.append(_clip(model, opt))
        if pattern == "clip twice":
            norms.append(_clip(model, opt))
        if pattern == "clip, then skip the step" and s == 1:
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("pattern", ["clip twice", "clip every micro-batch", "clip, then skip the step"])
def test_clips_before_a_step_match_pytorch_with_host_optimizer_states(pattern):
    ref = tiny_model("gpt2")
    ref_norms = _train(ref, torch.optim.AdamW(two_groups(ref), lr=5e-3), pattern)
    model = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(two_groups(model), lr=5e-3), hf_elixir.ElixirConfig(
        chunk_size_numel=CHUNK, offload_optimizer=True))
    norms = _train(model, opt, pattern)
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < 1e-5, (norms, ref_norms)
    assert rel_l2(float_state(model), float_state(ref)) < 1e-5


def test_fp16_clip_then_skip_leaves_the_next_step_unscaled_as_usual():
    """fp16: a clip (which unscales) followed by ``zero_grad`` and no step; the run must equal one that skipped
    the same step without clipping it (the next step's gradients used to stay scaled by the loss scale)."""
    states = []
    for clip_skipped in (True, False):
        model = tiny_model("gpt2")
        model, opt = hf_elixir.prepare(model, torch.optim.AdamW(two_groups(model), lr=5e-3), hf_elixir.ElixirConfig(
            chunk_size_numel=CHUNK, precision="fp16"))
        for s in range(3):
            opt.backward(model(**batch("gpt2", s, 2)).loss)
            if s == 1:
                if clip_skipped:
                    opt.clip_grad_norm(MAX_NORM)
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
        states.append(float_state(model))
    assert rel_l2(states[0], states[1]) == 0.0
