"""The disk's sequential bandwidth under an NVMe tier's path, measured once per process.

The NVMe tier (:mod:`zerojax.nvme`) reads each step's optimizer state and writes the next
version, so its cost per step is ``bytes / read rate + bytes / write rate`` per process.
:func:`measure_disk` writes a file under the path in chunks, syncs it, drops it from the page
cache (``posix_fadvise(DONTNEED)``, so the read comes from the disk, not from memory) and
reads it back, timing each; the file is removed after.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class DiskRates:
    """Sequential bytes per second of one process's disk: ``read`` and ``write``.

    Example:
      >>> from zerojax.tuning import DiskRates
      >>> DiskRates(read=6e9, write=3e9).seconds(3e9)  # read 3 GB and write it back
      1.5
      >>> DiskRates(read=0, write=1e9)
      Traceback (most recent call last):
      ...
      ValueError: DiskRates.read must be a positive number of bytes per second, got 0.
    """

    read: float
    write: float

    def __post_init__(self) -> None:
        for name in ("read", "write"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"DiskRates.{name} must be a positive number of bytes per second, got {value!r}.")

    def seconds(self, nbytes: float) -> float:
        """Seconds to read ``nbytes`` and write them back (one step of the tier, per process)."""
        return nbytes / self.read + nbytes / self.write


def measure_disk(path: str, size: int = 256 * MIB, chunk: int = 16 * MIB) -> DiskRates:
    """The sequential read and write rates of the disk under ``path`` (a directory that
    exists), with a ``size``-byte file in ``chunk``-byte calls; cached per (path, size).

    Example:
      >>> import tempfile
      >>> from zerojax.tuning import measure_disk
      >>> rates = measure_disk(tempfile.gettempdir(), size=8 << 20)
      >>> rates.read > 0 and rates.write > 0
      True
    """
    if not os.path.isdir(path):
        raise ValueError(f"measure_disk: {path!r} is not a directory; give the NVMe tier's path (it must exist).")
    if size < chunk or size % chunk:
        chunk = min(size, chunk) or 1
        size = size - size % chunk
    return _measure(os.path.realpath(path), int(size), int(chunk))


@functools.cache
def _measure(path: str, size: int, chunk: int) -> DiskRates:
    name = os.path.join(path, f".zerojax-disk-probe-{os.getpid()}")
    block = os.urandom(chunk)
    fd = os.open(name, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
    try:
        t0 = time.perf_counter()
        for offset in range(0, size, chunk):
            os.pwrite(fd, block, offset)
        os.fsync(fd)
        write = size / (time.perf_counter() - t0)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache
        buf = bytearray(chunk)
        t0 = time.perf_counter()
        for offset in range(0, size, chunk):
            os.preadv(fd, [buf], offset)
        read = size / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(name)
    return DiskRates(read=read, write=write)
