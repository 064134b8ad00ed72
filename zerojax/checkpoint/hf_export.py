"""Weights out in Hugging Face's layout, written in parallel by the processes that hold them.

``zj.export_weights(state, out_dir, map=..., layout="hf")`` writes ``model-0000k-of-0000n
.safetensors`` files of at most ``max_shard_size`` each and ``model.safetensors.index.json``
(one ``model.safetensors`` when everything fits one file), each tensor named, transposed,
reshaped and unstacked by the map's inverse. Every process writes the bytes of the shards
its devices hold (one writer per distinct shard: the replica with ``replica_id == 0``)
straight to their offsets in the files, whose headers process 0 wrote first: no file is
assembled in any one process's memory, and a process holds one shard piece at a time.
The output folder must be one that every process sees (as checkpoint folders are).

Atomic: the files are written under ``.partial`` names, checked (header, offsets, size)
and renamed only when every process has finished; the index is written last, after an
older index in the folder was removed first. A killed export leaves ``.partial`` files and
no index, never a set that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any, Callable, Iterable

import jax
import ml_dtypes
import numpy as np

from zerojax.checkpoint import boxes
from zerojax.checkpoint import tensor_map as tm
from zerojax.checkpoint.safetensors_files import INDEX, SINGLE, StoredTensor, TensorWriter, dtype_code
from zerojax.checkpoint.weights import storage_expr
from zerojax.sharding.layout import LeafLayout

LAYOUTS = ("file", "hf")
LORA = ("merge", "adapters", "keep")
PIECE_BYTES = 64 * 2**20  # the largest piece of a shard cast and written at once
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors\Z")


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5,000,000,000 bytes (decimal, as Hugging Face counts), ``"512MiB"`` ->
    binary, an int as bytes."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m or isinstance(size, bool):
        raise ValueError(f"max_shard_size must be bytes (an int) or a size like '5GB' / '500MiB', got {size!r}.")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    out = int(float(m.group(1)) * scale)
    if out <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}.")
    return out


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def plan_files(tensors: dict[str, tuple[tuple[int, ...], np.dtype]], max_bytes: int) -> list[list[str]]:
    """Tensors (in natural name order: ``layers.2`` before ``layers.10``) into files of at
    most ``max_bytes`` each (a tensor larger than that gets a file of its own), as
    ``save_pretrained`` does."""
    files, current, size = [], [], 0
    for name in sorted(tensors, key=_natural):
        shape, dtype = tensors[name]
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if current and size + n > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        files.append(current)
    return files


def _header(names, tensors, metadata) -> tuple[bytes, dict[str, int]]:
    header: dict = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    offsets, offset = {}, 0
    for name in names:
        shape, dtype = tensors[name]
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
        offsets[name] = offset
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, {k: v + 8 + len(blob) for k, v in offsets.items()}


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def write_checkpoint(out: str, tensors: dict[str, tuple[tuple[int, ...], np.dtype]], produce: Callable, *,
                     layout: str, max_bytes: int, metadata: dict) -> dict[str, str]:
    """Writes ``tensors`` (``{name: (shape, dtype)}``) to ``out`` (a file for ``layout=
    "file"``, a folder for ``"hf"``); ``produce(writer)`` writes this process's boxes.
    Returns ``{tensor name: file name}``."""
    if layout == "file":
        folder, groups, names = os.path.dirname(os.path.abspath(out)), [sorted(tensors, key=_natural)], [
            os.path.basename(out)]
    else:
        folder, groups = os.path.abspath(out), plan_files(tensors, max_bytes)
        names = [SINGLE] if len(groups) == 1 else [
            f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    partial = [os.path.join(folder, f".{n}.partial") for n in names]
    headers, places = [], {}
    for path, group in zip(partial, groups):
        head, offsets = _header(group, tensors, metadata)
        headers.append(head)
        for name in group:
            shape, dtype = tensors[name]
            places[name] = StoredTensor(name, path, np.dtype(dtype), tuple(shape), offsets[name])
    sizes = [len(h) + sum(places[n].nbytes for n in g) for h, g in zip(headers, groups)]
    main = jax.process_index() == 0
    if main:
        os.makedirs(folder, exist_ok=True)
        if layout == "hf" and os.path.exists(os.path.join(folder, INDEX)):
            os.remove(os.path.join(folder, INDEX))  # an old index must not vouch for new files
        for path, head, size in zip(partial, headers, sizes):
            with open(path, "wb") as f:
                f.write(head)
                f.truncate(size)
    _barrier("zerojax-export-headers")
    try:
        with TensorWriter(places) as writer:
            produce(writer)
        _barrier("zerojax-export-data")
        if main:
            for path, group, size in zip(partial, groups, sizes):
                _check(path, group, tensors, size)
            for path, name in zip(partial, names):
                os.replace(path, os.path.join(folder, name))
            weight_map = {t: n for n, g in zip(names, groups) for t in g}
            if layout == "hf":
                if len(names) > 1:
                    total = sum(places[t].nbytes for t in tensors)
                    _write_json(os.path.join(folder, INDEX), {"metadata": {"total_size": total},
                                                               "weight_map": dict(sorted(weight_map.items()))})
                for stale in os.listdir(folder):
                    if (_SHARD.match(stale) and stale not in names) or (len(names) == 1 and stale == INDEX):
                        os.remove(os.path.join(folder, stale))
        _barrier("zerojax-export-done")
    finally:
        if main:
            for path in partial:
                if os.path.exists(path):
                    os.remove(path)
    return {t: n for n, g in zip(names, groups) for t in g}


def _check(path: str, names: list[str], tensors, size: int) -> None:
    from zerojax.checkpoint.safetensors_files import read_header

    if os.path.getsize(path) != size:
        raise ValueError(f"exported file {path!r} has {os.path.getsize(path)} bytes, expected {size}.")
    got, _ = read_header(path)
    if list(got) != list(names) or any(got[n].shape != tuple(tensors[n][0]) for n in names):
        raise ValueError(f"exported file {path!r} lists tensors {list(got)}, expected {names}.")


def _write_json(path: str, doc: dict) -> None:
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# LoRA adapters folded into their kernels.


class LowRankAdd(tm.Expr):
    """Writes ``child`` as ``kernel + a @ b`` (an ``nnx.LoRALinear``'s merged kernel);
    ``a``: ``[..., in, r]``, ``b``: ``[..., r, out]``, held whole (adapters are small)."""

    def __init__(self, child: tm.Expr, a: np.ndarray, b: np.ndarray):
        self.child, self.a, self.b = child, a, b
        self.shape, self.dtype = child.shape, child.dtype

    def write(self, box, values, io):
        lead, (i0, i1), (o0, o1) = box[:-2], box[-2], box[-1]
        lead_sl = boxes.slices(lead)
        delta = np.matmul(self.a[lead_sl + (slice(i0, i1), slice(None))].astype(np.float32),
                          self.b[lead_sl + (slice(None), slice(o0, o1))].astype(np.float32))
        self.child.write(box, (np.asarray(values, np.float32) + delta), io)

    def tensors(self):
        return self.child.tensors()

    def describe(self):
        return f"merged({self.child.describe()})"


def lora_triples(names: list[str]) -> dict[str, tuple[str, str]]:
    """``{kernel name: (lora_a name, lora_b name)}`` for ``nnx.LoRALinear`` parameters."""
    present = set(names)
    out = {}
    for n in names:
        if n.endswith(".lora.lora_a"):
            base = n[: -len(".lora.lora_a")]
            if f"{base}.kernel" in present and f"{base}.lora.lora_b" in present:
                out[f"{base}.kernel"] = (n, f"{base}.lora.lora_b")
    return out


# ----------------------------------------------------------------------------------------------
# Exporting a live state.


def export_state(state: Any, out: str | os.PathLike, *, map: tm.WeightMap | None = None, layout: str = "hf",
                 dtype: str = "float32", max_shard_size: int | str = "5GB", lora: str = "merge",
                 metadata: dict | None = None) -> dict[str, tuple[int, ...]]:
    """See :func:`zerojax.export_weights` (a state as its source)."""
    from zerojax.checkpoint.export import EXPORT_DTYPES, _cast, tensor_names
    from zerojax.state import ZeroState, check_alive

    if not isinstance(state, ZeroState):
        raise TypeError(f"export_state takes a zj.init_state state, got {type(state).__name__}.")
    check_alive(state, "export_weights")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}.")
    if lora not in LORA:
        raise ValueError(f"lora must be one of {LORA}, got {lora!r}.")
    max_bytes = parse_size(max_shard_size)
    wmap = map if map is not None else tm.IDENTITY
    if not isinstance(wmap, tm.WeightMap):
        raise TypeError(f"map must be a zj.WeightMap, got {type(wmap).__name__}.")
    out = os.fspath(out)
    if layout == "file" and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise FileNotFoundError(f"the folder for {out!r} does not exist; create it first.")

    plan = state.plan
    names = tensor_names(list(plan.paths))
    leaves = _leaves(state)
    triples = lora_triples(names)
    adapters = {n for ab in triples.values() for n in ab}
    if lora == "merge":
        chosen = [n for n in names if n not in adapters]
    elif lora == "adapters":
        if not adapters:
            raise ValueError("lora='adapters' exports the LoRA adapters, but the state has none "
                             "(no nnx.LoRALinear parameters '*.lora.lora_a' / '*.lora.lora_b').")
        chosen = [n for n in names if n in adapters]
    else:
        chosen = list(names)
    shapes = {n: leaves[n][1].shape for n in chosen}
    target = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    out_dtype = {n: target if _is_float(leaves[n][1].dtype) else np.dtype(leaves[n][1].dtype) for n in chosen}
    try:
        inferred = tm.infer_tensors(wmap, shapes)
    except ValueError as e:
        raise ValueError(f"the map cannot export this state: {e}") from None
    tensors = {t: (s, None) for t, s in inferred.items()}
    # A tensor's dtype: the dtype of the parameter(s) written into it.
    res = tm.resolve(wmap, shapes, {t: (s, np.dtype(np.float32)) for t, s in inferred.items()})
    problems = res.problems()
    if problems:
        raise ValueError("the map cannot export this state: " + ". ".join(problems) + ".")
    for n, expr in res.exprs.items():
        for t in expr.tensors():
            tensors[t.name] = (tensors[t.name][0], out_dtype[n])
    _check_cover(res.exprs, inferred)
    merged = {}
    if lora == "merge" and triples:
        full = _gather(state, [ab for k, ab in triples.items()])
        merged = {k: (full[a], full[b]) for k, (a, b) in triples.items()}
    meta = {"format": "pt"} if layout == "hf" else {"format": "zerojax"}
    meta.update(metadata or {})

    def produce(writer):
        for n in chosen:
            arr, layout_n = leaves[n]
            expr, sink = res.exprs[n], writer
            if n in merged:  # kernel + a @ b in fp32, cast (and range-checked) as it is written
                expr, sink = LowRankAdd(expr, *merged[n]), _Casting(writer, n, out_dtype[n])
            sexpr = storage_expr(expr, layout_n)
            for shard in arr.addressable_shards:
                if shard.replica_id != 0:  # one writer per distinct shard, over all processes
                    continue
                box = boxes.from_index(shard.index, tuple(arr.shape))
                host = np.asarray(shard.data)
                for piece in boxes.pieces(box, 4, PIECE_BYTES):
                    values = host[boxes.slices(boxes.shift(piece, [a for a, _ in box]))]
                    if n in merged:
                        values = values.astype(np.float32)
                    elif _is_float(values.dtype):
                        values = _cast(n, values, out_dtype[n])
                    sexpr.write(piece, values, sink)

    write_checkpoint(out, tensors, produce, layout=layout, max_bytes=max_bytes, metadata=meta)
    return {t: tuple(s) for t, (s, _) in sorted(tensors.items(), key=lambda kv: _natural(kv[0]))}


class _Casting:
    """A writer that casts (with the float16 range check) what a merge computed in fp32."""

    def __init__(self, writer, name, dtype):
        self.writer, self.name, self.dtype = writer, name, dtype

    def write_box(self, tensor, box, values):
        from zerojax.checkpoint.export import _cast

        self.writer.write_box(tensor, box, _cast(self.name, np.asarray(values), self.dtype))


def _is_float(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating) or np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)


def _check_cover(exprs: dict[str, tm.Expr], tensors: dict[str, tuple[int, ...]]) -> None:
    """Every element of every exported tensor is written by exactly one parameter (counts)."""
    written: dict[str, int] = {}
    for expr in exprs.values():
        for t in expr.tensors():
            written[t.name] = written.get(t.name, 0) + int(np.prod(t.shape, dtype=np.int64))
    for t, shape in tensors.items():
        size = int(np.prod(shape, dtype=np.int64))
        if written.get(t, 0) != size:
            raise ValueError(f"the map writes {written.get(t, 0)} elements of tensor {t!r}, which has {size} "
                             f"({list(shape)}): its parts (part / concat) must cover it exactly once.")


def _leaves(state) -> dict[str, tuple[jax.Array, LeafLayout]]:
    """``{name: (array, layout of the array)}`` for every parameter of ``state``."""
    from zerojax.checkpoint.export import tensor_names

    plan = state.plan
    names = tensor_names(list(plan.paths))
    from_master = state.master is not None
    train = jax.tree.leaves(state.master if from_master else state.params)
    frozen = jax.tree.leaves(state.frozen) if state.frozen is not None else []
    layouts = [l if from_master else l.replicated() for l in plan.master_layouts]
    pairs = plan.join(list(zip(train, layouts)), list(zip(frozen, plan.frozen_layouts)))
    return dict(zip(names, pairs))


def _gather(state, pairs: Iterable[tuple[str, str]]) -> dict[str, np.ndarray]:
    """The named parameters whole, on every process (for small ones: LoRA adapters)."""
    leaves = _leaves(state)
    wanted = sorted({n for ab in pairs for n in ab})
    arrays = [leaves[n][0] for n in wanted]
    layouts = [leaves[n][1] for n in wanted]
    rep = state.plan.replicated
    full = jax.jit(lambda xs: [l.from_storage(x).astype(np.float32) for l, x in zip(layouts, xs)],
                   out_shardings=[rep] * len(arrays))(arrays)
    return {n: np.asarray(x.addressable_data(0)) for n, x in zip(wanted, full)}
