"""Consolidated weights from a checkpoint: one ``.safetensors`` file, loadable without
zerojax (the ``zero_to_fp32.py`` equivalent).

The file holds each parameter's fp32 master (or its bf16 rounding) under a dotted name
(``layers.w``, ``blocks.linear.kernel``), in the parameter's own shape. Process 0 reads
the checkpoint one leaf at a time and streams each into the file, so the host holds one
full leaf at a time; other processes read nothing. Two parameter paths that would get the
same name (``['a']['b']`` and ``['a.b']``) are refused before anything is written.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint import canonical
from zerojax.checkpoint.io import _manager, checkpoint_steps

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


def leaf_name(path: str) -> str:
    """``"['layers']['w']"`` / ``"['blocks'].linear.kernel.value"`` -> ``"layers.w"`` /
    ``"blocks.linear.kernel"``."""
    parts = [p for p in path.replace("[", ".").replace("]", "").replace("'", "").split(".") if p]
    if parts and parts[-1] == "value":  # flax.nnx Variable values
        parts = parts[:-1]
    return ".".join(parts)


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
    at a time."""
    blob = _header(shapes, dtype, metadata or {})
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for _, x in tensors:
                f.write(np.ascontiguousarray(x).tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def export_weights(directory: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
                   dtype: str = "float32") -> dict[str, tuple[int, ...]]:
    """Writes checkpoint ``step`` (default: latest) of ``directory`` to ``out`` as full
    weights in ``dtype`` (float32 or bfloat16); returns ``{name: shape}``.

    Load it with ``safetensors.numpy.load_file(out)`` (or torch / flax loaders).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}.")
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
    target = np.float32 if dtype == "float32" else ml_dtypes.bfloat16

    def leaves():
        for i, name in enumerate(names):
            key = str(i)
            arrays = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item={"master": {key: 0}},
                restore_args={"master": {key: ocp.RestoreArgs(restore_type=np.ndarray)}},
                partial_restore=True)))["state"]["master"]
            yield name, meta.layout(i).from_storage(np.asarray(arrays[key])).astype(target)

    write_safetensors(out, leaves(), dtype, shapes, {"format": "zerojax", "step": step,
                                                     "source_stage": meta.stage, "source_devices": meta.n})
    return shapes
