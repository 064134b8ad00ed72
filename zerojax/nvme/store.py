"""One process's optimizer state on disk: versioned chunk files, a manifest, a lock.

Layout under ``NVMe.path``::

    process_{i}/LOCK               flock'ed by the run using the directory (holds its pid)
    process_{i}/MANIFEST.json      {"version": v, "chunks": {name: {"shape", "dtype"}}}
    process_{i}/v{v}/{name}.bin    one chunk (one shard of one leaf), raw bytes, C order

A step writes every chunk of the new state into ``v{v+1}/`` (each fsync'ed), then writes
the manifest to a temporary file, fsyncs it and switches it in with ``os.replace`` (atomic
on POSIX), and only then deletes ``v{v}/``. A process killed at any point leaves a manifest
naming a complete version: the old one until the switch, the new one after it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil

import numpy as np

MANIFEST = "MANIFEST.json"


class Store:
    """The directory ``root/process_{process}`` of one run, locked for as long as it is open."""

    def __init__(self, root: str, process: int):
        root = os.fspath(root)
        if not os.path.isdir(root):
            raise ValueError(
                f"NVMe.path {root!r} is not an existing directory. Create it (on the NVMe drive) before the first "
                "step, or point NVMe.path at one."
            )
        self.dir = os.path.join(root, f"process_{process}")
        os.makedirs(self.dir, exist_ok=True)
        self._lock_file = open(os.path.join(self.dir, "LOCK"), "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "unknown"
            self._lock_file.close()
            raise ValueError(
                f"NVMe.path {self.dir!r} is in use by another run (pid {holder}): two runs on one directory would "
                "overwrite each other's optimizer state. Give this run its own NVMe.path, or end the other run."
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()

    def close(self) -> None:
        """Releases the lock (the files stay)."""
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    # -- reading -------------------------------------------------------------------------

    def manifest(self) -> dict | None:
        """The committed manifest, or None before the first commit."""
        return read_manifest(self.dir)

    def version_dir(self, version: int) -> str:
        return os.path.join(self.dir, f"v{version}")

    # -- writing -------------------------------------------------------------------------

    def check_room(self, needed: int) -> None:
        """Refuses a disk without ``needed`` free bytes, naming the path and the bytes."""
        free = shutil.disk_usage(self.dir).free
        if free < needed:
            raise ValueError(
                f"NVMe.path {self.dir!r} has {free:,} bytes free, but the optimizer state needs {needed:,} bytes "
                "there (two versions of this process's shards: the last committed one and the one being written). "
                "Free space on that disk or point NVMe.path at a larger one."
            )

    def begin(self, version: int) -> str:
        """An empty directory for ``version``'s chunks (a leftover of a killed step is cleared)."""
        d = self.version_dir(version)
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        return d

    def commit(self, version: int, chunks: dict[str, dict]) -> None:
        """Makes ``version`` the state (its chunks already written and fsync'ed), then deletes every other version."""
        _fsync_dir(self.version_dir(version))
        tmp = os.path.join(self.dir, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"version": version, "chunks": chunks}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.dir, MANIFEST))
        _fsync_dir(self.dir)
        for name in os.listdir(self.dir):
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) != version:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)


def read_manifest(directory: str) -> dict | None:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_chunk(path: str, data: memoryview) -> None:
    """Writes ``data`` to a new file at ``path`` and fsyncs it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
        os.fsync(fd)
    finally:
        os.close(fd)


READ_BLOCK = 1 << 20  # bytes per read call: 1 MiB reads ran 1.4x the rate of 8 MiB ones here


def read_chunk(path: str, out: np.ndarray) -> None:
    """Fills ``out`` (a contiguous byte view) from the file at ``path``, which must hold exactly
    that many bytes, in ``READ_BLOCK`` pieces (the copy out of the page cache stays in the
    CPU's caches: measured 3.4 against 2.4 GB/s for 8 MiB reads with 4 threads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            got = os.preadv(fd, [view[done : done + READ_BLOCK]], done)
            if not got:
                raise ValueError(f"{path} holds {done} bytes, expected {len(view)}: the NVMe state is damaged.")
            done += got
        if os.pread(fd, 1, done):
            raise ValueError(f"{path} holds more than {len(view)} bytes: the NVMe state is damaged.")
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
