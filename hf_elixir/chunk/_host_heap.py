"""The C heap under torch's CPU tensors: a fixed mmap threshold for the simulated device, and a trim
after ``prepare``.

[Note: host heap] torch allocates CPU tensors with ``posix_memalign`` from glibc's ``malloc``. glibc
serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` (returned to the system by
``free``) and smaller ones from its heaps, whose freed memory stays in the process (resident, counted
in RSS) until a later request reuses it. The threshold starts at 128 KiB and is *dynamic*: freeing an
mmapped block raises it to that block's size (up to 32 MiB). So after the first chunk-sized buffer is
freed, every later chunk buffer, gradient buffer and activation of that size comes from the heap; the
heap's free ranges get split by smaller live tensors (activations; the host optimizer's moments
before they moved into the host blocks, [Note: host optimizer state] in ``hf_elixir/optim/_host_state.py``) and a later
chunk-sized request no longer fits any of them, so the heap grows. On CPU, where the simulated device
pool ([Note: simulated device pool] in ``memory.py``) is host memory and unshards, reshards, gradient
buffers and activations allocate and free chunk-sized buffers every step, that is most of a rank's
host memory: measured on ``benchmarks/host_memory.py``'s GPT-2 (23M parameters, 16.5 MiB chunks, 2
ranks), 266-316 MiB per rank of freed heap stayed resident after 3 steps, next to 238 MiB of live
tensors (RSS growth 536 MiB per rank); with the threshold fixed at 1 MiB the free heap was 30 MiB and
the peak growth 338 MiB. A device's own allocator does not behave this way: what a byte-budgeted pool
frees is reusable for the next chunk, so the budget bounds it (docs/design/rules.md: the simulation is as
strict as the hardware).

Hence, at the end of a successful ``prepare`` (:func:`after_prepare`), when the compute device is the
CPU and some chunk is not resident (its buffers come and go every step), :func:`fix_mmap_threshold`
sets ``M_MMAP_THRESHOLD`` (``mallopt``, which also turns the dynamic adjustment off: what the
``MALLOC_MMAP_THRESHOLD_`` environment variable does at start-up) to half the smallest buffer such a
chunk allocates in the pool (its shard: staging, reduce-scatter output; its unsharded copy and gradient
buffer are larger), at least :data:`MIN_MMAP_THRESHOLD_BYTES`
and at most glibc's limit :data:`MAX_MMAP_THRESHOLD_BYTES`. The pool's buffers, and tensors of at least
half their size, then leave the process when freed; smaller tensors stay on the heap as before. Cost:
a fresh mapping and its page faults per such buffer. Measured on that GPT-2 at 1 rank with a 25% budget
(process CPU time per step, 1 thread): 0.32 s with glibc's dynamic threshold, 0.38 s with the 4 MiB this
rule gives, 0.44 s with 1 MiB (which also maps most activations, for about 50 MiB less peak). All
resident, nothing is set (4 MiB would cost nothing measurable there, 1 MiB 0.30 -> 0.39 s). Each
``prepare`` on CPU sets the threshold from its own chunks (the model prepared last decides). A user who
set ``MALLOC_MMAP_THRESHOLD_`` keeps their setting. After ``prepare`` (any device) :func:`trim` calls
``malloc_trim(0)`` once: the model's original parameter storage, freed when the parameters became views
into chunks, goes back to the system instead of staying in the heap. Both are no-ops where the C
library is not glibc.

Source: glibc ``mallopt(3)`` (``M_MMAP_THRESHOLD``: "the lower limit for memory allocation requests that
are satisfied using mmap"; the dynamic threshold since glibc 2.8), ``malloc_trim(3)``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

__all__ = ["MAX_MMAP_THRESHOLD_BYTES", "MIN_MMAP_THRESHOLD_BYTES", "after_prepare", "fix_mmap_threshold",
           "mmap_threshold_bytes", "trim"]

logger = logging.getLogger(__name__)

MIN_MMAP_THRESHOLD_BYTES = 1 << 20
MAX_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
_M_MMAP_THRESHOLD = -3  # <malloc.h>
_ENV = "MALLOC_MMAP_THRESHOLD_"

_threshold_bytes: int | None = None  # what this process's fix_mmap_threshold set, None: not set


@functools.cache
def _glibc():
    """The process's glibc (``None`` on musl, macOS, Windows)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def mmap_threshold_bytes() -> int | None:
    """The threshold :func:`fix_mmap_threshold` set in this process (``None``: not set)."""
    return _threshold_bytes


def fix_mmap_threshold(smallest_buffer_bytes: int) -> bool:
    """Fix glibc's mmap threshold at half ``smallest_buffer_bytes``, so that those buffers are mapped, not
    taken from the heap (see [Note: host heap]).

    Args:
        smallest_buffer_bytes: the smallest buffer the simulated device pool allocates and frees each
            step (the threshold, half of it, is clamped to ``[MIN_MMAP_THRESHOLD_BYTES,
            MAX_MMAP_THRESHOLD_BYTES]``).

    Returns:
        whether the threshold is now set from this call (``False``: the user set
        ``MALLOC_MMAP_THRESHOLD_``, or the C library is not glibc).
    """
    global _threshold_bytes
    threshold = min(max(int(smallest_buffer_bytes) // 2, MIN_MMAP_THRESHOLD_BYTES), MAX_MMAP_THRESHOLD_BYTES)
    if _ENV in os.environ:
        return False
    libc = _glibc()
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, threshold):
        return False
    _threshold_bytes = threshold
    logger.debug("hf_elixir: glibc M_MMAP_THRESHOLD fixed at %d bytes (simulated device on CPU)", threshold)
    return True


def trim() -> bool:
    """Return the free memory of glibc's heaps to the system (``malloc_trim(0)``).

    Returns:
        whether glibc released any memory (``False`` also where the C library is not glibc).
    """
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def after_prepare(manager) -> None:
    """The end of a successful ``prepare`` (a failed one leaves the process as it was): on CPU, with some
    chunk not resident, :func:`fix_mmap_threshold` from its smallest pool buffer (its shard); then
    :func:`trim`.

    Args:
        manager: the prepared model's :class:`~hf_elixir.chunk.manager.ChunkManager`.
    """
    churning = [c.shard_bytes for c in manager.chunks if not c.resident]
    if manager.compute_device.type == "cpu" and churning:
        fix_mmap_threshold(min(churning))
    trim()
