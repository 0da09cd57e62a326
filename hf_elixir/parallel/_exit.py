"""The gloo process group ended at interpreter exit, before Python finalizes (``prepare`` registers it).

[Note: gloo group at exit] A stock script (a ``Trainer`` script, a plain accelerate loop) returns without
``destroy_process_group``; accelerate destroys the group only in ``accelerator.end_training()``. The gloo group
then lives into interpreter finalization, and so do its worker threads (``pt_gloo_runloop``). A worker drops its
reference to a finished collective's work *after* the caller's ``wait()`` has returned; when that work holds
tensors that Python made (the ``Trainer``'s last all-gather of its logged scalars, an async all-gather or
reduce-scatter of a chunk), the drop takes the GIL to release their Python objects. If the main thread has
begun ``Py_FinalizeEx`` by then (the worker was descheduled for a few milliseconds: a loaded 2-core CI machine),
CPython ends the worker thread inside ``take_gil`` (``PyThread_exit_thread``), the forced unwind meets a
``noexcept`` C++ frame, and the process dies with ``terminate called without an active exception`` (SIGABRT)
after training finished; torchrun then reports the run failed. Seen on
``tests/test_launch.py::test_a_stock_trainer_script_trains_under_elixir[accelerate-2]`` about one launch in
eight under load (core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` -> ``TensorImpl::decref_pyobject``
-> ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``, main thread in ``Py_FinalizeEx``'s collection).

So the first ``prepare`` of a process under a gloo default group registers an ``atexit`` hook that does what
``accelerator.end_training()`` does, if the script has not: ``destroy_process_group()``; then (also after the
script's own ``end_training()``, which unregisters the group but leaves the object alive) one garbage
collection, which frees the prepared models' chunks (they hold the group and sit in reference cycles once the
script's ``main`` has returned) and with them the group. Its C++ destructor joins the worker threads with the
GIL released (torch's binding), so a worker still owing a release gets the GIL and finishes before finalization
starts. Freeing the group is the only way: ``shutdown()`` and ``abort()`` of a gloo group leave its threads
running. The hook is local (no collective: ranks may exit at different points, one of them on an exception)
and runs after every ``atexit`` hook registered later than the first ``prepare`` (``atexit`` is last in, first
out). NCCL groups are left to the script (their teardown may be collective). Not covered yet: a group still
referenced at exit (a module-level model; and a plain ``hf_elixir.prepare`` loop, where something made in
``prepare`` outside Python's view keeps the group alive after the model is freed) keeps its threads until
finalization.
"""

from __future__ import annotations

import atexit
import gc
import logging

import torch.distributed as dist

__all__ = ["end_gloo_group_at_exit"]

logger = logging.getLogger(__name__)

_STATE = {"registered": False}


def end_gloo_group_at_exit() -> None:
    """Register (once per process) the ``atexit`` hook of [Note: gloo group at exit]; nothing when no default
    process group exists or its backend is not gloo alone."""
    if _STATE["registered"] or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() != "gloo":
        return
    _STATE["registered"] = True
    atexit.register(_end_gloo_group)


def _end_gloo_group() -> None:
    """The hook: destroy the default gloo group and collect, so the group is freed and its worker threads are
    joined now."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() != "gloo":
            return  # the script made another group since
        try:
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - at exit: say why, never turn a finished run into a failure
            logger.warning("hf_elixir: could not destroy the gloo process group at exit: %r", err)
            return
    # also when the script destroyed it (end_training): the group object lives on in the prepared models' reference
    # cycles, its threads with it, until this collection
    gc.collect()
