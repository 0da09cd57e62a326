"""A short version of benchmarks/checkpoint_kill.py: a rank SIGKILLed at a random line of ``save_checkpoint`` under
TP=2 and under EP=2 (2 gloo ranks, tiny Llama / Mixtral); every resume loads the last complete checkpoint (or the
one being committed) and continues bit for bit as an uninterrupted run. The 10 + 10 kill run is
``python benchmarks/checkpoint_kill.py``."""

from __future__ import annotations

import pytest

from benchmarks.checkpoint_kill import run_kills


@pytest.mark.parametrize("mode,seed", [("tp", 1), ("ep", 2)])
def test_kill_at_random_points_of_the_save_then_resume_exactly(mode, seed):
    summary = run_kills(mode, kills=2, seed=seed, timeout_s=180)
    assert summary["kills"] == 2, summary  # both trials died by SIGKILL inside (or as it returned from) the save
    assert summary["exact"] == summary["resumes"] == 2, summary
