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
  steps; :meth:`DiskFile.ready` waits for it. The mapping is ``MADV_RANDOM``: a fault brings in its page, not a
  read-around, so nothing past a region is read. Two kinds of region:

  - a *huge* region (from :data:`HUGE_MIN_BYTES`; its offset and size padded to :data:`HUGE_BYTES`, the 2 MiB PMD
    size) is ``MADV_HUGEPAGE`` too: a fault there reads its whole aligned huge block into one large page-cache
    folio, whatever ``MADV_RANDOM`` says (the kernel's rule for huge-page mappings), and never more. The reader
    populates the region from :data:`READ_DEPTH` threads at once, each taking every ``READ_DEPTH``-th block (that
    many reads in flight). The padding keeps a block from holding two regions' bytes. Needs Linux 5.18+ with
    transparent huge pages (:data:`HUGE_PAGES`); else no region is huge.
  - a smaller one is read by ``posix_fadvise(WILLNEED)`` and ``preadv`` through the file's own descriptor
    (``POSIX_FADV_RANDOM``), in :data:`READ_BLOCK_BYTES` blocks into one scratch buffer (the kernel queues the
    range's reads at once and the ``preadv`` waits for them), then populated (no IO; where the kernel lacks
    ``MADV_POPULATE_*``, a touch of every page).

  The populate maps a region writable (``MADV_POPULATE_WRITE``: the step writes all of it) or, for a reader that
  only reads it (``write=False``: a parameter shard's onload, a master's upload), readable (``MADV_POPULATE_READ``).
  A write fault of a shared file mapping marks its page (folio) dirty, so populating a region that is only read
  writable made its write-back write all of it again (measured: each onload wrote its parameter shard back whole);
  read faults leave the pages clean, and the write-back of a clean region writes nothing, it only drops it.
  Only a huge region is populated readable: a read fault also maps the cached pages around it (the kernel's
  fault-around, 64 KiB-aligned windows), which for a small region are another region's, and a page mapped while
  that region's write-back runs is not evicted (measured: 1-6 pages left resident after a step, now and then);
  huge regions are 2 MiB-aligned, so no window crosses one. A small region is mapped writable (write faults map
  one page).

  Measured on the test VM (benchmarks/RESULTS.md has the rates): under ``MADV_NORMAL`` the kernel's readahead (the
  device's ``read_ahead_kb``, 8 MiB there) read up to 134 MB past 16 MB regions, unasked and unaccounted; 4 KiB
  faults under ``MADV_RANDOM`` read at 0.07-0.15 GB/s; the ``preadv`` path at 0.7-0.8 GB/s, spending 40% of it
  in populate (a ``page_mkwrite`` per 4 KiB page); a huge region at 1.4-2.5 GB/s (one fault and one
  ``page_mkwrite`` a folio), and the large folios also write back at 1.3-1.4 GB/s where 4 KiB pages went at 0.1.
* **write back.** :meth:`DiskFile.write_back` (writer threads) writes a stepped region to the file
  (``msync(MS_SYNC)``), unmaps its pages (``MADV_DONTNEED``: for a shared file mapping this drops only the
  page-table entries, the page cache keeps the data) and evicts them (``posix_fadvise(DONTNEED)``, which drops
  clean pages). At most ``window`` regions are in flight: the next write-back waits for the oldest, so the
  dirty pages a step holds are bounded (the bounded staging buffer is those pages). A region is never read
  ahead while its own write-back is in flight (its future is waited first). A write racing a write-back (a
  ``load_state_dict`` between steps) loses nothing: unmapping a dirty shared page marks the cached page dirty.

Direct IO (``O_DIRECT``) is not used: it bypasses exactly the page cache the mapping reads, and
``benchmarks/disk_tier.py`` measures it beside buffered IO (``dd iflag=direct`` read the tier's file slower than
the tier did: benchmarks/RESULTS.md).

The file is ``posix_fallocate``d at creation (no space: a ``ValueError`` naming ``offload_dir`` and
``disk_budget_bytes``), removed by :meth:`DiskFile.close`, at garbage collection and at interpreter exit
(``weakref.finalize``; in a ``multiprocessing`` child, which exits without atexit handlers, its finalizers); a file left by a killed process (no exit handler runs under SIGKILL) is removed by the
next :class:`DiskFile` of the same rank in that directory once its pid is gone. A checkpoint never points at
this file: ``save_checkpoint`` reads the tensors and writes its own safetensors files.

Source: ZeRO-Infinity (arXiv 2104.07857) section 6, NVMe offload with prefetch and bounded pinned buffers;
``mmap(2)``, ``msync(2)``, ``madvise(2)``, ``posix_fadvise(2)``, ``mincore(2)``, ``cachestat(2)``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import errno
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

__all__ = ["DiskFile", "HUGE_BYTES", "HUGE_MIN_BYTES", "PAGE_BYTES", "READ_BLOCK_BYTES", "disk_file_name",
           "region_nbytes", "scratch_bytes"]

logger = logging.getLogger(__name__)

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_ALIGN_BYTES = 64  # tensors inside a region: one cache line
_MS_SYNC, _MADV_RANDOM, _MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 4, 1, 4, 14, 22, 23
#: bytes a read-ahead reads per ``preadv`` (its scratch buffer, host memory the tier keeps: [Note: disk tier])
READ_BLOCK_BYTES = 8 << 20


def _pmd_bytes() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


#: the huge-page block a huge region's fault reads at once (the PMD size: 2 MiB on x86-64), and its alignment
HUGE_BYTES = _pmd_bytes()
#: regions of at least this many bytes are huge regions (their padding to HUGE_BYTES is under a third of them)
HUGE_MIN_BYTES = 2 * HUGE_BYTES
#: huge blocks a read of a huge region has in flight (measured on the test VM: 2 MiB faults one at a time read at
#: about half the rate of 4 at once)
READ_DEPTH = 4


def _huge_pages() -> bool:
    """Whether huge regions can be read by huge-block faults: a kernel with transparent huge pages (the sysfs
    directory) from Linux 5.18, where a file fault in a ``MADV_HUGEPAGE`` mapping reads its aligned PMD block
    (``do_sync_mmap_readahead`` in mm/filemap.c); before it such a fault under ``MADV_RANDOM`` reads one page."""
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (os.path.isdir("/sys/kernel/mm/transparent_hugepage") and release is not None
            and (int(release[1]), int(release[2])) >= (5, 18))


#: whether huge regions are read by huge-block faults (else every region by ``preadv``)
HUGE_PAGES = _huge_pages()
_FALLOC_KEEP_SIZE, _FALLOC_PUNCH_HOLE = 1, 2  # <linux/falloc.h>


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("msync", "madvise", "mincore"):
        getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p if name == "mincore"
                                        else ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                                     "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # the same number on every architecture (added in Linux 6.5)
_cachestat_missing = [False]


def _cachestat_bytes(fd: int, offset: int, nbytes: int) -> int | None:
    """Page-cache bytes of ``[offset, offset + nbytes)`` of ``fd`` by ``cachestat(2)``; ``None`` where the kernel
    has no such call (before 6.5, or a seccomp filter refuses it)."""
    if _cachestat_missing[0]:
        return None
    stat = _Cachestat()
    if _libc().syscall(_SYS_CACHESTAT, fd, ctypes.byref(_CachestatRange(offset, nbytes)), ctypes.byref(stat), 0):
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM):  # no such call here: mincore from now on
            _cachestat_missing[0] = True
            return None
        raise OSError(err, f"cachestat of fd {fd} failed")
    return stat.nr_cache * PAGE_BYTES


def disk_file_name(rank: int, pid: int | None = None) -> str:
    """The file name prefix of rank ``rank``'s disk tier (``hf_elixir-rank{r}-pid{p}-``)."""
    return f"hf_elixir-rank{rank}-pid{os.getpid() if pid is None else pid}-"


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def region_nbytes(entries: list[tuple]) -> int:
    """File bytes of a region laid out with ``entries`` (``(key, numel[, dtype])``, fp32 by default): its tensors
    each 64-byte aligned, the region page-aligned, or ``HUGE_BYTES``-aligned from ``HUGE_MIN_BYTES`` (a huge region:
    [Note: disk tier]). These are the bytes a read of it brings into host memory."""
    used = _round_up(sum(_round_up(e[1] * (e[2].itemsize if len(e) > 2 else 4), _ALIGN_BYTES) for e in entries),
                     PAGE_BYTES)
    return _round_up(used, HUGE_BYTES) if HUGE_PAGES and used >= HUGE_MIN_BYTES else used


def scratch_bytes(region_bytes: list[int], huge: bool = HUGE_PAGES) -> int:
    """The reader's scratch buffer for regions of ``region_bytes`` (bytes): at most ``READ_BLOCK_BYTES``, sized by
    the largest region read by ``preadv`` (every region if ``huge`` is false, else those under ``HUGE_MIN_BYTES``)."""
    small = [n for n in region_bytes if n and (not huge or n < HUGE_MIN_BYTES)]
    return min(READ_BLOCK_BYTES, max(small)) if small else 0


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
            entries = [(key, numel, dtype[0] if dtype else torch.float32) for key, numel, *dtype in entries]
            nbytes = region_nbytes(entries)
            at = start = _round_up(cursor, HUGE_BYTES if HUGE_PAGES and nbytes >= HUGE_MIN_BYTES else PAGE_BYTES)
            for key, numel, dtype in entries:
                offsets[(region, key)] = (at, numel, dtype)
                at += _round_up(numel * dtype.itemsize, _ALIGN_BYTES)
            self.regions[region] = (start, nbytes)
            cursor = start + nbytes
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
        # regions from HUGE_MIN_BYTES fault in HUGE_BYTES-aligned blocks ([Note: disk tier]: read ahead); where the
        # kernel has no transparent huge pages (EINVAL) they are read as the small ones are
        self._huge = HUGE_PAGES and all(_libc().madvise(self._base + off, n, _MADV_HUGEPAGE) == 0
                                        for off, n in self.regions.values() if n >= HUGE_MIN_BYTES)
        if HUGE_PAGES and not self._huge:
            logger.warning("hf_elixir: MADV_HUGEPAGE refused on %s; its large regions are read by preadv", self.path)
        # the reader thread's scratch buffer for the regions read by ``preadv`` (what it copies is not kept)
        self._scratch = bytearray(scratch_bytes([n for _, n in self.regions.values()], self._huge))
        self.tensors = {key: torch.empty(0, dtype=dtype).set_(self.storage, off // dtype.itemsize, (numel,))
                        for key, (off, numel, dtype) in offsets.items()}
        # the optimizer's host lane (a worker thread) and the main thread's onloads both schedule regions
        self._lock = threading.RLock()
        self.window = max(int(window), 1)
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf_elixir_disk_read")
        self._faulters = concurrent.futures.ThreadPoolExecutor(READ_DEPTH, thread_name_prefix="hf_elixir_disk_fault")
        self._writer = concurrent.futures.ThreadPoolExecutor(self.window, thread_name_prefix="hf_elixir_disk_write")
        self._reads: dict[Hashable, concurrent.futures.Future] = {}
        self._writable: dict[Hashable, bool] = {}  # region read ahead -> whether it is mapped writable
        self._writes: collections.OrderedDict[Hashable, concurrent.futures.Future] = collections.OrderedDict()
        self.bytes_read = self.bytes_written = 0
        self._finalizer = weakref.finalize(self, _close, self.path, self._fd, [self._reader, self._faulters, self._writer])
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
    def _read(self, region: Hashable, write: bool) -> None:
        offset, nbytes = self.regions[region]
        if nbytes and not (self._huge and nbytes >= HUGE_MIN_BYTES):  # (a huge region: the populate's faults read it)
            os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_WILLNEED)  # its reads queued at once, exactly it
            scratch = memoryview(self._scratch)
            for start in range(offset, offset + nbytes, len(scratch)):  # ... and waited for
                os.preadv(self._fd, [scratch[:min(len(scratch), offset + nbytes - start)]], start)
            self._populate(offset, nbytes, True)  # (writable: a read fault maps neighbours' pages: [Note: disk tier])
        else:  # READ_DEPTH faulters, each populating every READ_DEPTH-th huge block: that many reads in flight
            list(self._faulters.map(lambda k: [self._populate(at, HUGE_BYTES, write) for at in range(
                offset + k * HUGE_BYTES, offset + nbytes, READ_DEPTH * HUGE_BYTES)], range(READ_DEPTH)))
        self.bytes_read += nbytes

    def _populate(self, offset: int, nbytes: int, write: bool) -> None:
        """Map ``[offset, offset + nbytes)`` writable (``MADV_POPULATE_WRITE``: dirty) or readable
        (``MADV_POPULATE_READ``: clean); a fault of a page not in memory reads it, its huge block in a huge region."""
        if _libc().madvise(self._base + offset, nbytes, _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ):
            pages = torch.empty(0, dtype=torch.uint8).set_(self.storage, offset, (nbytes // PAGE_BYTES,),
                                                           (PAGE_BYTES,))  # kernel < 5.14: touch every page
            if write:
                pages.add_(0)  # (x + 0: the values stay)
            else:
                pages.sum()

    def _write(self, region: Hashable) -> None:
        offset, nbytes = self.regions[region]
        libc = _libc()
        if libc.msync(self._base + offset, nbytes, _MS_SYNC) != 0:
            raise OSError(ctypes.get_errno(), f"msync of {self.path} failed")
        libc.madvise(self._base + offset, nbytes, _MADV_DONTNEED)
        os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        self.bytes_written += nbytes

    def prefetch(self, region: Hashable, write: bool = True) -> None:
        """Start reading ``region`` in (after its own write-back, if one is in flight), mapped writable, or only
        readable with ``write=False`` (its pages stay clean: [Note: disk tier])."""
        with self._lock:
            if region in self._reads:
                return
            pending = self._writes.pop(region, None)
            if pending is not None:
                pending.result()
            self._reads[region] = self._reader.submit(self._read, region, write)
            self._writable[region] = write

    def ready(self, region: Hashable, write: bool = True) -> None:
        """Wait until ``region`` is read in (reading it now if nobody asked), mapped writable unless ``write`` is
        false (a region read ahead readable only is then mapped writable: no IO)."""
        with self._lock:
            self.prefetch(region, write)
            future = self._reads.pop(region)
            remap = write and not self._writable.pop(region)
        future.result()
        if remap:
            self._populate(*self.regions[region], True)

    def write_back(self, region: Hashable) -> None:
        """Start writing ``region`` back and evicting it; first wait for the oldest write-backs so that at most
        ``window`` are in flight. A read ahead or a write-back of ``region`` still in flight is waited first."""
        with self._lock:
            self._writable.pop(region, None)
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
            self._writable.clear()
            self._writes.clear()

    def zero(self, region: Hashable) -> bool:
        """Make ``region`` read as zeros without IO: punch its blocks out (``fallocate(PUNCH_HOLE)``, which also drops
        its pages from memory) and reserve them again (``posix_fallocate``: unwritten blocks, read as zeros, so the
        space stays the file's). ``False`` where the file system cannot punch holes (the caller writes zeros)."""
        with self._lock:
            self._writable.pop(region, None)
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
        """Bytes of the file (or of ``region``) that are in host memory now: its page-cache pages, counted per folio
        by ``cachestat(2)`` (Linux 6.5+; a huge block is one folio), else per page by ``mincore(2)`` on the
        mapping (a shared file mapping's pages are the page cache's)."""
        offset, nbytes = (0, self.nbytes) if region is None else self.regions[region]
        if not nbytes // PAGE_BYTES:
            return 0
        cached = _cachestat_bytes(self._fd, offset, nbytes)
        return cached if cached is not None else self.mincore_bytes(offset, nbytes)

    def mincore_bytes(self, offset: int, nbytes: int) -> int:
        """Bytes of ``[offset, offset + nbytes)`` of the file in memory by ``mincore`` (one byte per page)."""
        pages = nbytes // PAGE_BYTES
        vec = (ctypes.c_ubyte * pages)()
        if _libc().mincore(self._base + offset, pages * PAGE_BYTES, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        # (bit 0 of each byte: the page is resident; counted by torch, not a Python loop over the pages)
        return int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum()) * PAGE_BYTES

    def close(self) -> None:
        """Wait for the IO in flight, then remove the file (the mapping goes when the last tensor does)."""
        try:
            self.settle()
        finally:
            self._finalizer()
