"""Consolidated weights from a checkpoint: one ``.safetensors`` file, loadable without
zerojax (the ``zero_to_fp32.py`` equivalent).

The file holds each parameter's fp32 master (or its bf16 rounding) under a dotted name
(``layers.w``, ``blocks.linear.kernel``), in the parameter's own shape. It is written on
the host one leaf at a time, by process 0.
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


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Writes ``tensors`` in the safetensors format (atomically: temp file, then rename)."""
    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    for name, x in tensors.items():
        dtype = _ST_DTYPES[np.dtype(x.dtype).name]
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [offset, offset + x.nbytes]}
        offset += x.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x).tobytes())
    os.replace(tmp, path)


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
    mngr = _manager(directory, create=False)
    meta = canonical.Meta.from_json(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    item = {"master": {str(i): 0 for i in range(len(meta.layouts))}}
    args = {"master": {str(i): ocp.RestoreArgs(restore_type=np.ndarray) for i in range(len(meta.layouts))}}
    arrays = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True)))["state"]["master"]
    target = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {}
    for i, path in enumerate(meta.paths):
        layout = meta.layout(i)
        x = np.asarray(arrays[str(i)])
        full = x[..., : layout.inner_size].reshape(layout.shape)
        tensors[leaf_name(path)] = full.astype(target)
    if jax.process_index() == 0:
        write_safetensors(out, tensors, {"format": "zerojax", "step": step, "source_stage": meta.stage,
                                         "source_devices": meta.n})
    return {k: v.shape for k, v in tensors.items()}
