"""The disk tier's file: one rank's chunk states in a file-backed shared mapping, read ahead and written back.

[Note: disk tier] A rank's disk-held tensors (the fp32 masters and element-wise optimizer states of the host
optimizer chunks that do not fit ``ElixirConfig.host_memory_budget_bytes``, then their fp32 gradient shards and
parameter host shards; which ones is the optimizer's choice, ``hf_elixir/optim/_disk_state.py``, and the pages of the
last two are scheduled by ``_disk_pages.py``) live in ONE file per rank under ``ElixirConfig.offload_dir``,
``hf_elixir-rank{r}-pid{p}-{token}.bin``, mapped with ``torch.UntypedStorage.from_file(path, shared=True,
nbytes)`` (an ``mmap(MAP_SHARED)`` of the file, made by torch). Each tensor is an fp32 tensor over that storage
(``Tensor.set_``), so every reader and writer of masters and states (the inner ``torch.optim`` step, state
dicts, checkpoints, the refresh of compute copies) works on it unchanged: the file's page cache is the one
copy, and no home-made file format exists (the bytes are the tensors' own, at offsets this object knows).

Each chunk owns one page-aligned *region* of the file for its master and states, and one each for its gradient
shard and parameter shard where those are on disk. Host memory is what the
kernel keeps of the file, and the tier bounds it in the step's order (the optimizer steps chunks in a known
order, so the schedule is exact, not a guess):

* **read ahead.** :meth:`DiskFile.prefetch` (one reader thread) reads a region in while the previous chunk
  steps: ``posix_fadvise(WILLNEED)`` and ``preadv`` through the file's own descriptor, in :data:`READ_BLOCK_BYTES`
  blocks into one scratch buffer (the kernel queues the range's reads at once and the ``preadv`` waits for them;
  the descriptor is ``POSIX_FADV_RANDOM``, so nothing past the range is read), then ``MADV_POPULATE_WRITE`` (maps
  it writable in one call, no IO; where the kernel lacks it, a touch of every page); :meth:`DiskFile.ready` waits
  for it. The mapping is ``MADV_RANDOM``: a fault (a read outside the schedule: a state dict) brings in its page,
  not a read-around. Measured on the test VM: under ``MADV_NORMAL`` with ``WILLNEED`` + populate alone, the
  kernel's readahead (the device's ``read_ahead_kb``, 8 MiB there) read up to 134 MB past 16 MB regions, unasked
  and unaccounted; ``WILLNEED`` + populate under ``MADV_RANDOM`` read at 0.09 GB/s (populate raced the queued
  reads with its own 4 KiB ones); this path's rate is in benchmarks/RESULTS.md.
* **write back.** :meth:`DiskFile.write_back` (writer threads) writes a stepped region to the file
  (``msync(MS_SYNC)``), unmaps its pages (``MADV_DONTNEED``: for a shared file mapping this drops only the
  page-table entries, the page cache keeps the data) and evicts them (``posix_fadvise(DONTNEED)``, which drops
  clean pages). At most ``window`` regions are in flight: the next write-back waits for the oldest, so the
  dirty pages a step holds are bounded (the bounded staging buffer is those pages). A region is never read
  ahead while its own write-back is in flight (its future is waited first). A write racing a write-back (a
  ``load_state_dict`` between steps) loses nothing: unmapping a dirty shared page marks the cached page dirty.

Direct IO (``O_DIRECT``) is not used: it bypasses exactly the page cache the mapping reads, and
``benchmarks/disk_tier.py`` measures it beside buffered IO (see benchmarks/RESULTS.md).

The file is ``posix_fallocate``d at creation (no space: a ``ValueError`` naming ``offload_dir`` and
``disk_budget_bytes``), removed by :meth:`DiskFile.close`, at garbage collection and at interpreter exit
(``weakref.finalize``; in a ``multiprocessing`` child, which exits without atexit handlers, its finalizers); a file left by a killed process (no exit handler runs under SIGKILL) is removed by the
next :class:`DiskFile` of the same rank in that directory once its pid is gone. A checkpoint never points at
this file: ``save_checkpoint`` reads the tensors and writes its own safetensors files.

Source: ZeRO-Infinity (arXiv 2104.07857) section 6, NVMe offload with prefetch and bounded pinned buffers;
``mmap(2)``, ``msync(2)``, ``madvise(2)``, ``posix_fadvise(2)``, ``mincore(2)``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import functools
import glob
import logging
import multiprocessing.util
import os
import re
import secrets
import threading
import weakref
from collections.abc import Hashable

import torch

__all__ = ["DiskFile", "PAGE_BYTES", "READ_BLOCK_BYTES", "disk_file_name"]

logger = logging.getLogger(__name__)

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_ALIGN_BYTES = 64  # tensors inside a region: one cache line
_MS_SYNC, _MADV_RANDOM, _MADV_DONTNEED, _MADV_POPULATE_WRITE = 4, 1, 4, 23
#: bytes a read-ahead reads per ``preadv`` (its scratch buffer, host memory the tier keeps: [Note: disk tier])
READ_BLOCK_BYTES = 8 << 20
_FALLOC_KEEP_SIZE, _FALLOC_PUNCH_HOLE = 1, 2  # <linux/falloc.h>


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("msync", "madvise", "mincore"):
        getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p if name == "mincore"
                                        else ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


def disk_file_name(rank: int, pid: int | None = None) -> str:
    """The file name prefix of rank ``rank``'s disk tier (``hf_elixir-rank{r}-pid{p}-``)."""
    return f"hf_elixir-rank{rank}-pid{os.getpid() if pid is None else pid}-"


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(directory: str, rank: int) -> None:
    """Remove this rank's files left in ``directory`` by processes that are gone (killed: no exit handler ran)."""
    for path in glob.glob(os.path.join(directory, f"hf_elixir-rank{rank}-pid*-*.bin")):
        match = re.search(r"-pid(\d+)-", os.path.basename(path))
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            logger.info("hf_elixir: removing %s, left by a process that is gone", path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _close(path: str, fd: int, pools: list) -> None:
    for pool in pools:
        pool.shutdown(wait=True)
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class DiskFile:
    """One rank's disk-tier file ([Note: disk tier]): page-aligned regions of fp32 tensors, read ahead and
    written back per region.

    Args:
        directory: ``ElixirConfig.offload_dir``.
        rank: this process's rank (in the file name).
        regions: region key (a chunk id, or ``(kind, chunk id)`` for a chunk's parameter or gradient shard, [Note:
            disk parameters] in ``_disk_pages.py``) -> ``[(tensor key, numel)]`` or ``[(tensor key, numel,
            dtype)]`` (default fp32) laid out in that region, in order.
        budget_bytes: ``ElixirConfig.disk_budget_bytes`` (``None``: the free space).
        window: the most regions written back at once.

    Raises:
        ValueError: the file does not fit the budget or the free space (naming the fields and the fix).
    """

    def __init__(self, directory: str | os.PathLike, rank: int, regions: dict[Hashable, list[tuple]],
                 budget_bytes: int | None = None, window: int = 2) -> None:
        directory = os.path.expanduser(os.fspath(directory))
        _remove_stale(directory, rank)
        self.regions: dict[Hashable, tuple[int, int]] = {}  # region key -> (offset, nbytes), both page-aligned
        offsets: dict[tuple[Hashable, str], tuple[int, int, torch.dtype]] = {}
        cursor = 0
        for region, entries in regions.items():
            start = cursor
            for key, numel, *dtype in entries:
                dtype = dtype[0] if dtype else torch.float32
                offsets[(region, key)] = (cursor, numel, dtype)
                cursor += _round_up(numel * dtype.itemsize, _ALIGN_BYTES)
            cursor = _round_up(cursor, PAGE_BYTES)
            self.regions[region] = (start, cursor - start)
        self.nbytes = max(cursor, PAGE_BYTES)
        self._check_space(directory, budget_bytes)
        self.path = os.path.join(directory, disk_file_name(rank) + secrets.token_hex(4) + ".bin")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(self._fd, 0, self.nbytes)
        except OSError as err:
            os.close(self._fd)
            os.unlink(self.path)
            raise ValueError(f"ElixirConfig.offload_dir={directory!r}: cannot reserve {self.nbytes} bytes for the "
                             f"disk tier ({err.strerror}); free space there or give another offload_dir") from None
        # the kernel reads no further than a region asks ([Note: disk tier]: read ahead)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.storage = torch.UntypedStorage.from_file(self.path, shared=True, nbytes=self.nbytes)
        self._base = self.storage.data_ptr()
        _libc().madvise(self._base, self.nbytes, _MADV_RANDOM)
        # the reader thread's scratch buffer (what ``preadv`` copies is not kept)
        self._scratch = bytearray(min([READ_BLOCK_BYTES] + [n for _, n in self.regions.values() if n] or [PAGE_BYTES]))
        self.tensors = {key: torch.empty(0, dtype=dtype).set_(self.storage, off // dtype.itemsize, (numel,))
                        for key, (off, numel, dtype) in offsets.items()}
        # the optimizer's host lane (a worker thread) and the main thread's onloads both schedule regions
        self._lock = threading.RLock()
        self.window = max(int(window), 1)
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf_elixir_disk_read")
        self._writer = concurrent.futures.ThreadPoolExecutor(self.window, thread_name_prefix="hf_elixir_disk_write")
        self._reads: dict[Hashable, concurrent.futures.Future] = {}
        self._writes: collections.OrderedDict[Hashable, concurrent.futures.Future] = collections.OrderedDict()
        self.bytes_read = self.bytes_written = 0
        self._finalizer = weakref.finalize(self, _close, self.path, self._fd, [self._reader, self._writer])
        # a multiprocessing child leaves by os._exit (no atexit): its own finalizers run the same (once-only) close
        multiprocessing.util.Finalize(self, self._finalizer, exitpriority=10)
        logger.info("hf_elixir: disk tier file %s (%d bytes, %d regions)", self.path, self.nbytes, len(self.regions))

    def _check_space(self, directory: str, budget_bytes: int | None) -> None:
        free = os.statvfs(directory)
        free_bytes = free.f_bavail * free.f_frsize
        if budget_bytes is not None and self.nbytes > budget_bytes:
            raise ValueError(f"ElixirConfig.disk_budget_bytes={budget_bytes} is below the {self.nbytes} bytes this "
                             "rank's optimizer state (and gradient and parameter shards) needs on disk; raise "
                             "disk_budget_bytes (or host_memory_budget_bytes, so less goes to disk)")
        if self.nbytes > free_bytes:
            raise ValueError(f"ElixirConfig.offload_dir={directory!r} has {free_bytes} bytes free, below the "
                             f"{self.nbytes} bytes this rank's disk tier needs; free space there, give "
                             "an offload_dir on a larger disk, or raise host_memory_budget_bytes")

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` views this file's mapping."""
        return self._base <= tensor.data_ptr() < self._base + self.nbytes

    def tensor(self, region: Hashable, key: str) -> torch.Tensor | None:
        """The fp32 tensor ``key`` of ``region`` (a view of the mapped file), or ``None`` if not laid out."""
        return self.tensors.get((region, key))

    # -- read ahead / write back ------------------------------------------------------------------
    def _read(self, region: Hashable) -> None:
        offset, nbytes = self.regions[region]
        os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_WILLNEED)  # its reads queued at once, exactly it
        scratch = memoryview(self._scratch)
        for start in range(offset, offset + nbytes, len(scratch)):  # ... and waited for
            os.preadv(self._fd, [scratch[:min(len(scratch), offset + nbytes - start)]], start)
        if _libc().madvise(self._base + offset, nbytes, _MADV_POPULATE_WRITE) != 0:  # kernel < 5.14
            pages = torch.empty(0, dtype=torch.uint8).set_(self.storage, offset, (nbytes // PAGE_BYTES,),
                                                           (PAGE_BYTES,))
            pages.add_(0)  # touch every page writable (x + 0: the values stay)
        self.bytes_read += nbytes

    def _write(self, region: Hashable) -> None:
        offset, nbytes = self.regions[region]
        libc = _libc()
        if libc.msync(self._base + offset, nbytes, _MS_SYNC) != 0:
            raise OSError(ctypes.get_errno(), f"msync of {self.path} failed")
        libc.madvise(self._base + offset, nbytes, _MADV_DONTNEED)
        os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        self.bytes_written += nbytes

    def prefetch(self, region: Hashable) -> None:
        """Start reading ``region`` in (after its own write-back, if one is in flight)."""
        with self._lock:
            if region in self._reads:
                return
            pending = self._writes.pop(region, None)
            if pending is not None:
                pending.result()
            self._reads[region] = self._reader.submit(self._read, region)

    def ready(self, region: Hashable) -> None:
        """Wait until ``region`` is read in (reading it now if nobody asked)."""
        with self._lock:
            self.prefetch(region)
            future = self._reads.pop(region)
        future.result()

    def write_back(self, region: Hashable) -> None:
        """Start writing ``region`` back and evicting it; first wait for the oldest write-backs so that at most
        ``window`` are in flight. A read ahead or a write-back of ``region`` still in flight is waited first."""
        with self._lock:
            for earlier in (self._reads.pop(region, None), self._writes.pop(region, None)):
                if earlier is not None:
                    earlier.result()
            while len(self._writes) >= self.window:
                self._writes.popitem(last=False)[1].result()
            self._writes[region] = self._writer.submit(self._write, region)

    def pending_reads(self) -> list:
        """Regions read ahead and not yet taken by :meth:`ready`."""
        with self._lock:
            return list(self._reads)

    def settle(self) -> None:
        """Wait for every read and write-back in flight."""
        with self._lock:
            for future in list(self._reads.values()) + list(self._writes.values()):
                future.result()
            self._reads.clear()
            self._writes.clear()

    def zero(self, region: Hashable) -> bool:
        """Make ``region`` read as zeros without IO: punch its blocks out (``fallocate(PUNCH_HOLE)``, which also drops
        its pages from memory) and reserve them again (``posix_fallocate``: unwritten blocks, read as zeros, so the
        space stays the file's). ``False`` where the file system cannot punch holes (the caller writes zeros)."""
        with self._lock:
            for earlier in (self._reads.pop(region, None), self._writes.pop(region, None)):
                if earlier is not None:
                    earlier.result()
            offset, nbytes = self.regions[region]
            if _libc().fallocate(self._fd, _FALLOC_PUNCH_HOLE | _FALLOC_KEEP_SIZE, offset, nbytes) != 0:
                return False
            os.posix_fallocate(self._fd, offset, nbytes)
            return True

    def evict_all(self) -> None:
        """Write back and evict every region (after a write outside the step: a state load)."""
        self.settle()
        for region in self.regions:
            self._write(region)

    def resident_bytes(self, region: Hashable | None = None) -> int:
        """Bytes of the file (or of ``region``) that are in host memory now (``mincore``: page cache pages of the
        mapping)."""
        offset, nbytes = (0, self.nbytes) if region is None else self.regions[region]
        pages = nbytes // PAGE_BYTES
        if not pages:
            return 0
        vec = (ctypes.c_ubyte * pages)()
        if _libc().mincore(self._base + offset, nbytes, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(b & 1 for b in vec) * PAGE_BYTES

    def close(self) -> None:
        """Wait for the IO in flight, then remove the file (the mapping goes when the last tensor does)."""
        try:
            self.settle()
        finally:
            self._finalizer()
