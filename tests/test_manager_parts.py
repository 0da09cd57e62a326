"""The chunk manager's parts as objects with explicit interfaces: the in-flight reduce window
(``chunk/_reduce_window.py``) and the one listener interface through which the manager tells its optimizer the
step's events (``chunk/_listener.py``)."""

import torch

import hf_elixir
from hf_elixir.chunk._listener import ChunkStepListener
from hf_elixir.chunk._reduce_window import FLAGS_IN_FLIGHT, ReduceWindow
from hf_elixir.chunk.memory import MemoryCounters
from hf_elixir.runtime._state import get_state

from _models import batch, tiny_model


class _Chunk:
    def __init__(self, resident: bool) -> None:
        self.resident, self.full_alias = resident, False


def test_the_reduce_window_finishes_in_issue_order_and_counts_only_collectives_holding_a_buffer():
    counters = MemoryCounters()
    window = ReduceWindow(counters, async_op=True)
    done = []
    window.issue(3, lambda: done.append(3), timed=False, in_place=True)  # holds no buffer
    window.issue(5, lambda: done.append(5), timed=True)
    window.issue(FLAGS_IN_FLIGHT, lambda: done.append("flags"), timed=True)
    window.issue(7, lambda: done.append(7), timed=False)
    assert window.in_flight() == {3, 5, FLAGS_IN_FLIGHT, 7} and window
    window.shrink_to(3)  # three hold a buffer: nothing to finish
    assert done == []
    window.shrink_to(2)  # the oldest go first, in-place or not, until two holding a buffer are left
    assert done == [3, 5]
    window.shrink_to(2)
    assert done == [3, 5]
    window.finish_through(FLAGS_IN_FLIGHT)
    assert done == [3, 5, "flags"] and window.in_flight() == {7}
    window.drain()
    assert done == [3, 5, "flags", 7] and not window
    assert counters.reduce_wait_s >= 0.0
    assert window.limit([_Chunk(True), _Chunk(True)]) is None  # everything stays on the device: no limit
    assert window.limit([_Chunk(True), _Chunk(False)]) == window.max_pending == 2
    window.host_steps_in_backward = True
    assert window.limit([_Chunk(True)]) == 2


class _Recording(ChunkStepListener):
    """Forwards every event to the optimizer, counting them."""

    def __init__(self, inner) -> None:
        self.inner, self.events = inner, []

    @property
    def takes_offloaded_grads(self) -> bool:
        return self.inner.takes_offloaded_grads

    def __getattribute__(self, name):
        if name in ChunkStepListener.__dict__ and not name.startswith("_") and name != "takes_offloaded_grads":
            inner = object.__getattribute__(self, "inner")
            events = object.__getattribute__(self, "events")

            def call(*args):
                events.append(name)
                return getattr(inner, name)(*args)
            return call
        return object.__getattribute__(self, name)


def _train(listen: bool, offload: bool) -> tuple[list[float], list[str]]:
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(offload_optimizer=offload))
    manager = get_state(model).manager
    assert manager.listener is opt
    recording = None
    if listen:
        recording = manager.listener = _Recording(opt)
    losses = []
    for step in range(2):
        loss = model(**batch("gpt2", step, 2, 8)).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, (recording.events if recording else [])


def test_the_optimizer_hears_the_step_through_the_listener_and_training_is_unchanged():
    for offload in (False, True):
        plain, _ = _train(listen=False, offload=offload)
        heard, events = _train(listen=True, offload=offload)
        assert heard == plain
        assert events.count("before_backward") == 2 and events.count("on_zero_grad") == 2
        assert events.count("hyper_code") == 2  # once per backward, riding the flags' all-reduce
        assert events.count("on_grad_progress") > 0
        assert "host_fence" in events  # before every read of a shard (the host lane, if any, ends its work)
        assert ("on_grad_offloaded" in events) == offload


def test_a_manager_without_an_optimizer_hears_nothing():
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig())
    assert type(get_state(model).manager.listener) is ChunkStepListener
