"""Chunks between the disk and the devices through a bounded set of host buffers.

``buffer_count`` buffers of ``buffer_size`` bytes each are made once; every chunk read or
written takes one for as long as it is on its way (file -> buffer -> device, or device ->
buffer -> file) and gives it back, so at most ``buffer_count`` chunks are in flight and the
host memory the tier adds is ``buffer_count * buffer_size`` bytes, whatever the model size.
The chunks move on ``buffer_count`` threads of plain positional file I/O (``readinto`` and
``os.pwrite``; docs/offload.md says why, with measurements).
"""

from __future__ import annotations

import contextlib
import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from zerojax.nvme.handles import chunk_name, chunk_shape
from zerojax.nvme.store import read_chunk, write_chunk


class Buffers:
    """``count`` host buffers of ``size`` bytes, lent out one at a time."""

    def __init__(self, count: int, size: int):
        self.size = size
        self._free: queue.Queue = queue.Queue()
        for _ in range(count):
            self._free.put(np.empty(size, np.uint8))

    @contextlib.contextmanager
    def take(self, nbytes: int):
        if nbytes > self.size:
            raise ValueError(f"a chunk of {nbytes:,} bytes does not fit a buffer of {self.size:,} (NVMe.buffer_size).")
        buf = self._free.get()
        try:
            yield buf[:nbytes]
        finally:
            self._free.put(buf)


class Streamer:
    """Reads and writes the chunks of leaves on a pool of threads, through :class:`Buffers`."""

    def __init__(self, count: int, size: int):
        self.buffers = Buffers(count, size)
        self._pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="zerojax-nvme")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def read(self, directory: str, leaf: int, shape: tuple, dtype: Any, sharding: Any) -> list[Future]:
        """One future per chunk of ``leaf`` this process holds, each giving ``[(device, array)]``."""
        by_index: dict[str, tuple] = {}
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            name = chunk_name(leaf, index, shape)
            by_index.setdefault(name, (index, []))[1].append(device)
        return [
            self._pool.submit(
                self._read_one, os.path.join(directory, name + ".bin"), chunk_shape(index, shape), dtype, devices
            )
            for name, (index, devices) in by_index.items()
        ]

    def _read_one(self, path: str, shape: tuple, dtype: Any, devices: list) -> list:
        dtype = np.dtype(dtype)
        with self.buffers.take(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize) as buf:
            if all(d.platform == "cpu" for d in devices):
                # The CPU backend's device memory is host memory, and it keeps a 64-byte aligned
                # numpy array's memory as the device buffer (even with may_alias=False): the
                # chunk is read straight into new aligned memory that becomes the device array,
                # no copy (the buffer's slot still bounds the reads in flight). A second device
                # holding the same chunk gets a copy, never the same memory.
                out = _aligned_empty(shape, dtype)
                read_chunk(path, out)
                arrays = [
                    jax.device_put(out if k == 0 else out.copy(), d, may_alias=True) for k, d in enumerate(devices)
                ]
            else:
                view = buf.view(dtype).reshape(shape)
                read_chunk(path, view)
                arrays = [jax.device_put(view, d, may_alias=False) for d in devices]
            jax.block_until_ready(arrays)  # the buffer is free again only once copied
        return list(zip(devices, arrays))

    def write(self, directory: str, leaf: int, x: jax.Array) -> list[Future]:
        """One future per chunk of ``x`` this process holds (one file per distinct shard)."""
        seen: dict[str, Any] = {}
        for shard in x.addressable_shards:
            seen.setdefault(chunk_name(leaf, shard.index, x.shape), shard)
        return [
            self._pool.submit(self._write_one, os.path.join(directory, name + ".bin"), shard)
            for name, shard in seen.items()
        ]

    def _write_one(self, path: str, shard: Any) -> None:
        src = np.asarray(shard.data)
        with self.buffers.take(src.nbytes) as buf:
            buf[:] = src.reshape(-1).view(np.uint8)
            write_chunk(path, buf)


def _aligned_empty(shape: tuple, dtype: np.dtype, align: int = 64) -> np.ndarray:
    """A new array whose data starts on an ``align``-byte boundary (numpy's large allocations
    start 16 bytes into a page, and XLA:CPU copies an array it cannot keep as its buffer)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = -raw.ctypes.data % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def assemble(shape: tuple, sharding: Any, futures: list[Future]) -> jax.Array:
    """The global array from the chunks :meth:`Streamer.read` is bringing."""
    placed = dict(pair for f in futures for pair in f.result())
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [placed[d] for d in sharding.addressable_devices_indices_map(shape)]
    )
