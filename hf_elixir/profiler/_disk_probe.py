"""The disk's sequential write and read rates, timed on a temporary file in the folder the disk tier would use
(``hf-elixir probe --disk-dir PATH``), and their place in the per-machine hardware cache.

[Note: disk probe]
What is timed is what the disk tier does with a chunk: large sequential writes made durable (``os.fsync`` inside
the timed region, so the page cache does not flatter the write), then sequential reads of the same bytes from the
device, not from memory. Reads avoid the page cache where the system allows it: ``O_DIRECT`` with page-aligned
buffers (an anonymous ``mmap``) where the file system accepts it, else ``posix_fadvise(POSIX_FADV_DONTNEED)``
after the fsync (clean pages are dropped), else plain reads (``method`` says which: a ``"cached"`` read rate is a
memory rate, not the disk's). The file is a few hundred MB at most (``size_bytes``), written from incompressible
bytes, and deleted afterwards. Each rate is the best of ``repeats`` passes, as the other probes take the fastest.

Compare with ``dd if=/dev/zero of=F bs=8M count=N oflag=direct conv=fsync`` and ``dd if=F of=/dev/null bs=8M
iflag=direct`` on the same file system.
"""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DiskRates", "cache_key", "measure_disk"]

#: bytes per write / read call (a multiple of every common logical block size, as O_DIRECT needs)
BLOCK_BYTES = 8 * 2**20


@dataclass(frozen=True)
class DiskRates:
    """Sequential rates of the disk holding ``directory`` (bytes per second), the file size timed and how reads
    avoided the page cache (``"direct"``, ``"fadvise"`` or ``"cached"``; [Note: disk probe])."""

    directory: str
    write_bytes_per_s: float
    read_bytes_per_s: float
    size_bytes: int
    method: str

    def to_cache(self) -> dict:
        return {"disk_dir": self.directory, "disk_write_bytes_per_s": self.write_bytes_per_s,
                "disk_read_bytes_per_s": self.read_bytes_per_s, "disk_probe_bytes": self.size_bytes,
                "disk_read_method": self.method}


def cache_key() -> str:
    """This machine's disk entry in the hardware cache (``hostname|disk``)."""
    return f"{socket.gethostname()}|disk"


def check_directory(directory: str | os.PathLike, flag: str = "--disk-dir", size_bytes: int | None = None,
                    size_flag: str = "--disk-size") -> Path:
    """``directory`` as a writable folder, with room for a ``size_bytes`` probe file when given.

    Raises:
        ValueError: it does not exist, is not a folder, is not writable, or ``size_bytes`` is more than half the
            space free there (naming ``flag`` / ``size_flag``, the value and the fix).
    """
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{flag} {directory}: not an existing folder; create it, or give a folder on the disk to "
                         "measure")
    try:  # os.access says yes to root on a read-only file system (/proc): try what the probe will do
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {directory}: not writable ({err.strerror}); give a folder you can write to on the "
                         "disk to measure") from None
    free = shutil.disk_usage(path).free
    if size_bytes is not None and size_bytes > free // 2:  # the probe must never fill a shared disk
        raise ValueError(f"{size_flag} {size_bytes} bytes is more than half the {free} bytes free in {directory}; "
                         "give a smaller size, e.g. 256MiB (the default), or free space there")
    return path


def _write(path: str, size_bytes: int, block: memoryview) -> float:
    """Seconds to write ``size_bytes`` from ``block`` and fsync them."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        left = size_bytes
        while left > 0:
            left -= os.write(fd, block[:min(left, len(block))])
        os.fsync(fd)
        return max(time.perf_counter() - start, 1e-9)
    finally:
        os.close(fd)


def _drop_cache(path: str) -> bool:
    """Drop ``path``'s clean pages from the page cache where the system can (``posix_fadvise``)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _read(path: str, size_bytes: int, direct: bool) -> float:
    """Seconds to read the file into a page-aligned buffer (``O_DIRECT`` when ``direct``)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    buffer = mmap.mmap(-1, BLOCK_BYTES)  # page-aligned, as O_DIRECT requires
    try:
        start = time.perf_counter()
        done = 0
        while done < size_bytes:
            got = os.readv(fd, [buffer])
            if got <= 0:
                break
            done += got
        return max(time.perf_counter() - start, 1e-9)
    finally:
        buffer.close()
        os.close(fd)


def measure_disk(directory: str | os.PathLike, size_bytes: int = 256 * 2**20, repeats: int = 2) -> DiskRates:
    """Time sequential fsync'd writes and uncached reads of a ``size_bytes`` temporary file in ``directory``
    ([Note: disk probe]); the file is removed afterwards.

    Args:
        directory: a folder on the disk to measure (where ``ElixirConfig.offload_dir`` would point).
        size_bytes: the file's size (rounded up to whole 4 KiB pages; default 256 MiB; larger is steadier).
        repeats: passes; each rate is the best.

    Raises:
        ValueError: ``directory`` is not a writable folder, ``size_bytes`` / ``repeats`` below 1, or ``size_bytes``
            more than half the space free there.
    """
    if size_bytes < 1 or repeats < 1:
        raise ValueError(f"measure_disk(size_bytes={size_bytes}, repeats={repeats}): both must be >= 1")
    path = check_directory(directory, size_bytes=size_bytes, size_flag="measure_disk(size_bytes=...)")
    size_bytes = -(-size_bytes // 4096) * 4096  # whole pages: O_DIRECT reads whole blocks
    block = memoryview(os.urandom(min(BLOCK_BYTES, size_bytes)))  # incompressible
    fd, name = tempfile.mkstemp(prefix="hf_elixir_disk_probe_", dir=path)
    os.close(fd)
    method = "direct" if hasattr(os, "O_DIRECT") else "fadvise"
    write_s = read_s = float("inf")
    try:
        for _ in range(repeats):
            write_s = min(write_s, _write(name, size_bytes, block))
            if method == "direct":
                try:
                    read_s = min(read_s, _read(name, size_bytes, direct=True))
                    continue
                except OSError:  # the file system refuses O_DIRECT (tmpfs, some overlays)
                    method = "fadvise"
            if method == "fadvise" and not _drop_cache(name):
                method = "cached"
            read_s = min(read_s, _read(name, size_bytes, direct=False))
    finally:
        os.unlink(name)
    return DiskRates(str(path.resolve()), size_bytes / write_s, size_bytes / read_s, size_bytes, method)
