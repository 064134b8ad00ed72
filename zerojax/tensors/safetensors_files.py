"""Safetensors files, read and written by byte range: the one place that knows the format.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and data offsets (and an optional ``__metadata__`` of strings), padded
with spaces to a multiple of 8, then the tensors' bytes in C order. Reading a box of a
tensor here is one ``pread`` per contiguous run of it (:func:`zerojax.tensors.boxes.runs`)
straight into the output array: no memory map (its touched pages would count against the
process), no whole tensor, and every byte read is counted (:attr:`TensorFiles.bytes_read`),
so a test can check that a process read exactly its own shards. Writing is the mirror
image: :func:`header` lays out a file from shapes alone, and :class:`TensorWriter` writes a
box of a tensor with one ``pwrite`` per run, so that several processes fill one file.
:func:`check_file` reads a written file's header back against what it should hold.

Hugging Face's sharded format is ``model.safetensors.index.json`` (``{"metadata":
{"total_size": ...}, "weight_map": {tensor name: file name}}``) beside the files it names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from zerojax.tensors import boxes
from zerojax.tensors.casts import as_dtype

# safetensors' dtype codes: the one table.
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors\Z")


def dtype_code(dtype) -> str:
    """safetensors' code for a numpy dtype (``float32`` -> ``F32``)."""
    d = as_dtype(dtype)
    if d not in CODES:
        raise ValueError(f"dtype {d} has no safetensors code; use one of {sorted(str(x) for x in CODES)}.")
    return CODES[d]


def nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * as_dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: its file, dtype, shape and the absolute offset of its bytes."""

    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def read_header(path: str) -> tuple[dict[str, StoredTensor], dict]:
    """The tensors of one safetensors file and its ``__metadata__``; ``ValueError`` naming
    the file for anything that is not a well-formed safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path!r} is not a safetensors file: it has {size} bytes, fewer than a header.")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(
                f"{path!r} is not a safetensors file: its header length {n} exceeds the file ({size} bytes)."
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path!r} is not a safetensors file: its header is not JSON ({e}).") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path!r} is not a safetensors file: its header is not a JSON object.")
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, e in header.items():
        try:
            dtype, shape, (begin, end) = DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{path!r}: the header entry of tensor {name!r} ({e!r}) is not a safetensors entry "
                f"(known dtypes: {', '.join(DTYPES)})."
            ) from None
        t = StoredTensor(name, path, dtype, shape, 8 + n + int(begin))
        if end - begin != t.nbytes or 8 + n + end > size:
            raise ValueError(
                f"{path!r}: tensor {name!r} {e['dtype']}{list(shape)} has data offsets {[begin, end]}, "
                f"which do not hold its {t.nbytes} bytes inside the file ({size} bytes)."
            )
        out[name] = t
    return out, meta


def header(
    names: list[str], tensors: Mapping[str, tuple], metadata: Mapping | None = None
) -> tuple[bytes, dict[str, int]]:
    """The head of a safetensors file holding ``names`` (in that order; ``tensors``:
    ``{name: (shape, dtype)}``) and ``metadata`` (values as strings): ``(bytes, {name:
    absolute offset of its data})``. The file's size is ``len(bytes)`` plus the tensors' bytes."""
    head: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    offsets, offset = {}, 0
    for name in names:
        shape, dtype = tensors[name]
        n = nbytes(shape, dtype)
        head[name] = {
            "dtype": dtype_code(dtype),
            "shape": [int(d) for d in shape],
            "data_offsets": [offset, offset + n],
        }
        offsets[name] = offset
        offset += n
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, {k: v + 8 + len(blob) for k, v in offsets.items()}


def check_file(path: str, names: list[str], tensors: Mapping[str, tuple]) -> None:
    """Reads back the header of the safetensors file ``path`` and checks that it lists
    exactly ``names`` in order, each with its shape and dtype (``tensors``: ``{name: (shape,
    dtype)}``), contiguous from the data's start, and that the file holds exactly those bytes;
    raises ``ValueError`` saying what is wrong."""
    got, _ = read_header(path)
    if list(got) != list(names):
        raise ValueError(f"{path!r} lists tensors {list(got)}, expected {list(names)}.")
    start = min((t.offset for t in got.values()), default=os.path.getsize(path))
    offset = start
    for name in names:
        t, (shape, dtype) = got[name], tensors[name]
        if t.shape != tuple(shape) or t.dtype != as_dtype(dtype) or t.offset != offset:
            raise ValueError(
                f"{path!r}: tensor {name!r} is {t.dtype}{list(t.shape)} at byte {t.offset}; expected "
                f"{as_dtype(dtype)}{list(shape)} at byte {offset}."
            )
        offset += t.nbytes
    if os.path.getsize(path) != offset:
        raise ValueError(f"{path!r} has {os.path.getsize(path)} bytes; its header describes {offset}.")


def stored_dtypes(path: str | os.PathLike) -> dict[str, str]:
    """``{tensor name: dtype it was stored in by the run}`` of a file ``export_weights``
    wrote (frozen parameters narrower than the file's dtype hold that dtype's rounding)."""
    return json.loads(read_header(os.fspath(path))[1].get("stored_dtypes", "{}"))


def resolve_path(path: str | os.PathLike) -> tuple[str, list[str]]:
    """``(kind, files)`` for a checkpoint path: a ``.safetensors`` file (``"file"``), an
    index JSON (``"index"``), or a directory holding ``model.safetensors.index.json`` or
    ``model.safetensors`` (or exactly one ``.safetensors`` file)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a checkpoint path is a str or os.PathLike, got {type(path).__name__} {path!r}.")
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX)):
            if os.path.isfile(os.path.join(path, SINGLE)):
                # Readers disagree on which one a folder means (transformers takes the file).
                raise ValueError(
                    f"{path!r} holds both {SINGLE} and {INDEX}, two checkpoints: pass the one to "
                    "read (its path), or remove the stale one."
                )
            return resolve_path(os.path.join(path, INDEX))
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if SINGLE in files:
            return "file", [os.path.join(path, SINGLE)]
        if len(files) == 1:
            return "file", [os.path.join(path, files[0])]
        raise FileNotFoundError(
            f"{path!r} holds neither {INDEX} nor {SINGLE}"
            + (
                f" but {len(files)} .safetensors files ({', '.join(files)}); pass the one to read, or write an index"
                if files
                else ""
            )
            + "."
        )
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights file {path!r} does not exist.")
    if path.endswith(".json"):
        return "index", [path]
    return "file", [path]


class TensorFiles:
    """The tensors of a checkpoint (one file, or an index and its files), read by box.

    Example:
      >>> import os, tempfile, numpy as np
      >>> from safetensors.numpy import save_file
      >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
      >>> save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, path)
      >>> with TensorFiles(path) as f:
      ...     f.read_box("w", ((1, 3), (1, 3))).tolist(), f.bytes_read
      ([[5.0, 6.0], [9.0, 10.0]], 16)
    """

    def __init__(self, path: str | os.PathLike | None, tensors: Mapping[str, StoredTensor] | None = None):
        self.metadata: dict = {}
        self.tensors: dict[str, StoredTensor] = dict(tensors or {})
        self.path = None if path is None else os.fspath(path)
        if path is not None:
            kind, files = resolve_path(path)
            if kind == "file":
                self.tensors, self.metadata = read_header(files[0])
            else:
                self._read_index(files[0])
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

    # Bytes read by every TensorFiles of this process (for tests of what a process reads).
    process_bytes_read = 0

    def _read_index(self, index: str) -> None:
        try:
            with open(index) as f:
                doc = json.load(f)
            weight_map = doc["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index!r} is not a safetensors index (a JSON object with a 'weight_map'): {e}") from None
        self.metadata = doc.get("metadata") or {}
        folder = os.path.dirname(os.path.abspath(index))
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise FileNotFoundError(
                f"the index {index!r} names {len(missing)} file(s) that are not in {folder!r}: {', '.join(missing)}."
            )
        headers = {f: read_header(os.path.join(folder, f))[0] for f in files}
        absent = [f"{name} (in {file})" for name, file in weight_map.items() if name not in headers[file]]
        if absent:
            raise ValueError(
                f"the index {index!r} lists {len(absent)} tensor(s) their files do not hold: "
                f"{', '.join(absent[:20])}" + (" ..." if len(absent) > 20 else "") + "."
            )
        self.tensors = {name: headers[file][name] for name, file in weight_map.items()}

    # Reading.
    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, file: str) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def read_box(self, name: str, box: boxes.Box) -> np.ndarray:
        """The values of tensor ``name`` in ``box``, in the file's dtype: one read per
        contiguous run, into the returned array."""
        t = self.tensors[name]
        out = np.empty(boxes.box_shape(box), t.dtype)
        starts, length = boxes.runs(t.shape, box)
        if out.size == 0:
            return out
        buf = memoryview(out.reshape(-1).view(np.uint8))
        isz, fd, nbytes = t.dtype.itemsize, self._fd(t.file), length * t.dtype.itemsize
        for j, s in enumerate(starts.tolist()):
            _pread_into(fd, buf[j * nbytes : (j + 1) * nbytes], t.offset + s * isz, t.file)
        self.bytes_read += out.nbytes
        TensorFiles.process_bytes_read += out.nbytes
        return out


def _pread_into(fd: int, buf: memoryview, offset: int, file: str) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"{file!r} ended at byte {offset + done} inside a tensor: the file is truncated.")
        done += n


class TensorWriter:
    """Writes boxes of tensors into safetensors files whose headers are already written
    (every process of an export writes its own boxes into the same files)."""

    process_bytes_written = 0

    def __init__(self, places: dict[str, StoredTensor]):
        self.places = places
        self.bytes_written = 0
        self._fds: dict[str, int] = {}

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()

    def write_box(self, name: str, box: boxes.Box, values: np.ndarray) -> None:
        """Writes ``values`` (already in the tensor's dtype: casts are the caller's, checked)
        at ``box`` of tensor ``name``."""
        t = self.places[name]
        values = np.asarray(values, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
        if values.shape != boxes.box_shape(box) or values.dtype != t.dtype:
            raise ValueError(
                f"writing tensor {name!r} ({t.dtype}): values {values.dtype}{list(values.shape)} for box {box}."
            )
        if t.file not in self._fds:
            self._fds[t.file] = os.open(t.file, os.O_WRONLY)
        fd = self._fds[t.file]
        starts, length = boxes.runs(t.shape, box)
        if values.size == 0:
            return
        buf = memoryview(values.reshape(-1).view(np.uint8))
        isz, nbytes = t.dtype.itemsize, length * t.dtype.itemsize
        for j, s in enumerate(starts.tolist()):
            chunk, off = buf[j * nbytes : (j + 1) * nbytes], t.offset + s * isz
            while len(chunk):
                n = os.pwritev(fd, [chunk], off)
                chunk, off = chunk[n:], off + n
        self.bytes_written += values.nbytes
        TensorWriter.process_bytes_written += values.nbytes
