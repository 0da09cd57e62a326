"""Test set-up: CPU only, no hub access, Triton in interpreter mode (set before any @triton.jit runs),
strict device simulation on (collectives over host memory and uncounted host<->device copies raise,
[Note: strict device] in hf_elixir/chunk/strict.py; spawned ranks inherit it through the environment), and a
hardware cache of this session's own (``HF_ELIXIR_CACHE_DIR``: a fresh temporary folder, removed at exit), so
that no test reads rates another session or the user's own runs measured; a test may still point it elsewhere
with ``monkeypatch.setenv``."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_ELIXIR_STRICT_DEVICE"] = "1"
_CACHE_DIR = tempfile.mkdtemp(prefix="hf_elixir_test_cache_")
os.environ["HF_ELIXIR_CACHE_DIR"] = _CACHE_DIR  # spawned ranks inherit it
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)


import pytest  # noqa: E402


@pytest.fixture
def single_rank_group(monkeypatch):
    """A one-rank gloo process group on a free port (torch.distributed APIs without spawning); the
    ``MASTER_ADDR`` / ``MASTER_PORT`` it sets are undone after the test."""
    import torch.distributed as dist

    from tests._dist import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    """Reset Accelerate's process-wide singletons after each test, as Accelerate's own ``AccelerateTestCase``
    does in its ``tearDown``: ``AcceleratorState`` keeps the first ``mixed_precision`` it was given (a
    ``Trainer(bf16=True)`` leaves ``bf16``), and a later ``Accelerator(cpu=True)`` in the same process takes it
    instead of ``"no"``. This is Accelerate's documented singleton behaviour (plain Trainer + Accelerator do the
    same without hf_elixir), so the reset belongs to the tests. Only when a test has imported accelerate."""
    yield
    import sys

    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture(autouse=True)
def _no_copy_sanction_left():
    """A test leaves no ``strict.host_copies()`` sanction open ([Note: strict device]): one left open (a load
    that raised before its post-hook, say) would let every later uncounted copy in this worker pass, and an
    unrelated test would fail for it. Fails the test that left it, and closes it."""
    yield
    from hf_elixir.chunk import strict

    depth = getattr(strict._local, "depth", 0)
    if depth:
        strict._local.depth = 0
        pytest.fail(f"this test left {depth} strict.host_copies() sanction(s) open")
