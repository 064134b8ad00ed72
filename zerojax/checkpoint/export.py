"""Consolidated weights from a checkpoint: one ``.safetensors`` file, loadable without
zerojax (the ``zero_to_fp32.py`` equivalent).

The file holds each parameter's fp32 master (or its bf16 / fp16 rounding) under a dotted name
(``layers.w``, ``blocks.linear.kernel``), in the parameter's own shape. Process 0 reads
the checkpoint one leaf at a time and streams each into the file, so the host holds one
full leaf at a time; other processes read nothing. Two parameter paths that would get the
same name (``['a']['b']`` and ``['a.b']``) are refused before anything is written.
:func:`zerojax.load_weights` reads such a file back into a model's parameter tree.
"""

from __future__ import annotations

import json
import os
import re
import struct

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint import canonical
from zerojax.checkpoint.io import _manager, checkpoint_steps
from zerojax.report.progress import progress

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


# One key of a ``jax.tree_util.keystr`` path: a dict key (``['w']``, the repr of a str), another
# key or sequence index (``[0]``), or an attribute (``.value``).
_KEY = re.compile(r"""\[(?P<q>['"])(?P<str>.*?)(?P=q)\]|\[(?P<other>[^\]]*)\]|\.(?P<attr>[A-Za-z_]\w*)""")


def path_keys(path: str) -> list[tuple[str, str]]:
    """A ``keystr`` path as ``(kind, name)`` keys, kind ``"key"`` (dict key or index) or
    ``"attr"`` (attribute); raises on a path it cannot read."""
    keys, pos = [], 0
    for m in _KEY.finditer(path):
        if m.start() != pos:
            break
        pos = m.end()
        if m.group("attr") is not None:
            keys.append(("attr", m.group("attr")))
        else:
            keys.append(("key", m.group("str") if m.group("q") else m.group("other")))
    if pos != len(path):
        raise ValueError(f"cannot read the parameter path {path!r} (at character {pos}).")
    return keys


def leaf_name(path: str) -> str:
    """``"['layers']['w']"`` / ``"['blocks']['linear']['kernel'].value"`` -> ``"layers.w"`` /
    ``"blocks.linear.kernel"``: the keys joined by dots, without a trailing ``.value``
    attribute (a flax.nnx Variable's value). A dict key named ``"value"`` stays:
    ``"['attn']['value']"`` -> ``"attn.value"``."""
    if path == "<root>":  # a single array as the whole parameter tree
        return path
    keys = path_keys(path)
    if keys and keys[-1] == ("attr", "value"):
        keys = keys[:-1]
    return ".".join(name for _, name in keys)


def tensor_names(paths: list[str]) -> list[str]:
    """Dotted names for parameter paths; raises when two paths map to the same name."""
    names, seen = [], {}
    for path in paths:
        name = leaf_name(path)
        if name in seen:
            raise ValueError(
                f"parameter paths {seen[name]} and {path} both become the tensor name {name!r} in "
                "a safetensors file; rename one of them (e.g. avoid '.' inside dict keys).")
        seen[name] = path
        names.append(name)
    return names


def _header(shapes: dict[str, tuple[int, ...]], dtype: str, metadata: dict) -> bytes:
    header: dict = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    offset, itemsize = 0, np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).itemsize
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8)


def write_safetensors(path: str | os.PathLike, tensors, dtype: str, shapes: dict[str, tuple[int, ...]],
                      metadata: dict | None = None) -> None:
    """Writes the safetensors file ``path`` (atomically: temp file, then rename) from
    ``tensors``, an iterable of ``(name, array)`` in the order of ``shapes``, consumed one
    at a time. Each array is checked against its header entry as it is written, and the
    header is read back from the finished file and checked against its size before the
    file is renamed into place: a file that would not load is never left at ``path``."""
    blob = _header(shapes, dtype, metadata or {})
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    want = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            expected = iter(shapes.items())
            for name, x in tensors:
                x = np.asarray(x, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
                want_name, want_shape = next(expected, (None, None))
                if name != want_name or tuple(x.shape) != tuple(want_shape) or x.dtype != want:
                    raise ValueError(f"writing {os.fspath(path)!r}: got tensor {name!r} {x.shape} {x.dtype} where "
                                     f"the header has {want_name!r} {want_shape} {want}.")
                f.write(x.tobytes())
            missing = [n for n, _ in expected]
            if missing:
                raise ValueError(f"writing {os.fspath(path)!r}: no data came for tensors {missing}.")
        check_safetensors(tmp, shapes)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_safetensors(path: str | os.PathLike, shapes: dict[str, tuple[int, ...]]) -> None:
    """Reads back the header of the safetensors file ``path`` and checks that it lists the
    tensors of ``shapes``, each with the bytes its shape and dtype need, contiguous, and
    that the file holds exactly those bytes; raises ``ValueError`` saying what is wrong."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    itemsize = {v: np.dtype(ml_dtypes.bfloat16 if k == "bfloat16" else k).itemsize for k, v in _ST_DTYPES.items()}
    if list(header) != list(shapes):
        raise ValueError(f"{os.fspath(path)!r} lists tensors {list(header)}, expected {list(shapes)}.")
    offset = 0
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        nbytes = int(np.prod(entry["shape"], dtype=np.int64)) * itemsize[entry["dtype"]]
        if tuple(entry["shape"]) != tuple(shapes[name]) or begin != offset or end - begin != nbytes:
            raise ValueError(f"{os.fspath(path)!r}: tensor {name!r} has shape {entry['shape']} and data offsets "
                             f"{[begin, end]}; expected shape {list(shapes[name])} at [{offset}, {offset + nbytes}].")
        offset = end
    if size != 8 + n + offset:
        raise ValueError(f"{os.fspath(path)!r} has {size} bytes; its header describes {8 + n + offset} "
                         f"({offset} bytes of tensor data).")


def stored_dtypes(path: str | os.PathLike) -> dict[str, str]:
    """``{tensor name: dtype it was stored in by the run}`` of a file ``export_weights``
    wrote (frozen parameters narrower than the file's dtype hold that dtype's rounding)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(json.loads(f.read(n)).get("__metadata__", {}).get("stored_dtypes", "{}"))


def export_weights(directory: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
                   dtype: str = "float32", show_progress: bool | None = False) -> dict[str, tuple[int, ...]]:
    """Writes checkpoint ``step`` (default: latest) of ``directory`` to ``out`` as full
    weights in ``dtype`` (float32, bfloat16 or float16); returns ``{name: shape}``.
    A float16 export refuses a parameter with finite values beyond float16's range
    (65504) rather than write them as inf; bfloat16 has float32's range.

    Trainable parameters are written from their fp32 masters; frozen ones as the run
    stored them (``ZeroConfig.frozen_dtype``: in a bf16 run with the default "compute",
    the bf16 rounding of the weights given). The file's metadata ``stored_dtypes`` (JSON)
    names each tensor's stored dtype; :func:`stored_dtypes` reads it back.

    Load it into a model's parameter tree with :func:`zerojax.load_weights`, or with
    ``safetensors.numpy.load_file(out)`` (or torch / flax loaders). ``show_progress``: a
    progress bar over the tensors on stderr (``None``: on a terminal only, as the
    ``zerojax export`` command does).
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}.")
    _check_paths(directory, out)
    steps = checkpoint_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {os.fspath(directory)!r}: it has no complete saved step.")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {os.fspath(directory)!r}; it has steps {steps}.")
    mngr = _manager(directory)
    meta = canonical.Meta.from_json(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    names = tensor_names(list(meta.paths))
    shapes = {name: meta.layout(i).shape for i, name in enumerate(names)}
    if jax.process_index() != 0:
        return shapes
    target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)

    frozen = {i: j for j, i in enumerate(i for i in range(len(names)) if not meta.is_trainable(i))}

    def leaves():
        for i, name in progress(list(enumerate(names)), "export", unit="tensor",
                                disable=None if show_progress is None else not show_progress):
            key = str(i)
            # Trainable parameters: their fp32 masters; frozen ones: as the run stored them.
            group, layout = ("frozen", meta.frozen_layout(frozen[i])) if i in frozen else ("master", meta.layout(i))
            arrays = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item={group: {key: 0}},
                restore_args={group: {key: ocp.RestoreArgs(restore_type=np.ndarray)}},
                partial_restore=True)))["state"][group]
            yield name, _cast(name, layout.from_storage(np.asarray(arrays[key])), target)

    # What each tensor was stored as: float32 masters, frozen parameters as the run kept them
    # (ZeroConfig.frozen_dtype: the compute dtype's rounding where "compute" narrowed them).
    stored = {name: (meta.frozen_layout(frozen[i]).dtype if i in frozen else "float32") for i, name in enumerate(names)}
    write_safetensors(out, leaves(), dtype, shapes, {"format": "zerojax", "step": step,
                                                     "source_stage": meta.stage, "source_devices": meta.n,
                                                     "stored_dtypes": json.dumps(stored)})
    return shapes


def _check_paths(directory, out: str | os.PathLike) -> None:
    """Refuses a checkpoint directory or an output folder that does not exist, saying which."""
    if isinstance(directory, (str, os.PathLike)):
        if not os.path.exists(directory):
            raise FileNotFoundError(f"checkpoint directory {os.fspath(directory)!r} does not exist.")
        if not os.path.isdir(directory):
            raise NotADirectoryError(f"checkpoint directory {os.fspath(directory)!r} is not a directory.")
    folder = os.path.dirname(os.path.abspath(os.fspath(out)))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"the folder {folder!r} for the output file does not exist; create it first.")


def _cast(name: str, x: np.ndarray, target) -> np.ndarray:
    """``x`` in ``target``; refuses finite values that ``target`` (float16) would make inf."""
    with np.errstate(over="ignore"):
        y = x.astype(target)
    if np.dtype(target) == np.float16 and not np.array_equal(np.isfinite(x), np.isfinite(y)):
        raise ValueError(f"tensor {name!r} has values up to {float(np.nanmax(np.abs(x[np.isfinite(x)]))):.4g}, beyond "
                         "float16's range (65504); export it in bfloat16 or float32.")
    return y
