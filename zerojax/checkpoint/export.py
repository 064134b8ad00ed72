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
from typing import Any

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


def export_weights(source: Any, out: str | os.PathLike, *, step: int | None = None,
                   dtype: str = "float32", show_progress: bool | None = False, layout: str = "file",
                   map: Any = None, max_shard_size: int | str = "5GB",
                   lora: str = "merge") -> dict[str, tuple[int, ...]]:
    """Writes the weights of ``source`` to ``out`` in ``dtype`` (float32, bfloat16 or
    float16); returns ``{tensor name: shape}``. A float16 export refuses a parameter with
    finite values beyond float16's range (65504) rather than write them as inf; bfloat16
    has float32's range.

    ``source``: a checkpoint directory (step ``step``, default the latest), or a live
    ``ZeroState``. From a state every process writes the shards its own devices hold,
    straight into the files (:mod:`zerojax.checkpoint.hf_export`); from a directory process
    0 reads one parameter at a time.

    ``layout="file"``: one ``.safetensors`` file at ``out``. ``layout="hf"``: Hugging Face's
    sharded layout in the folder ``out`` (``model-0000k-of-0000n.safetensors`` of at most
    ``max_shard_size``, ``"5GB"`` or bytes, and ``model.safetensors.index.json``).
    ``map``: a :class:`zerojax.WeightMap` naming, transposing and unstacking the parameters
    into the checkpoint's tensors (the map that loads them: ``zj.maps.llama_map()``); default:
    each parameter under its own dotted name. ``lora``: ``"merge"`` (default: each
    ``nnx.LoRALinear`` kernel written as ``kernel + lora_a @ lora_b``, adapters left out: a
    plain model any loader reads), ``"adapters"`` (the adapters alone, by the map's names
    for them), or ``"keep"`` (every parameter as it is).

    Trainable parameters are written from their fp32 masters; frozen ones as the run
    stored them (``ZeroConfig.frozen_dtype``: in a bf16 run with the default "compute",
    the bf16 rounding of the weights given). The file's metadata ``stored_dtypes`` (JSON)
    names each tensor's stored dtype; :func:`stored_dtypes` reads it back.

    Load it into a model's parameter tree with :func:`zerojax.load_weights`, or with
    ``safetensors.numpy.load_file(out)`` (or torch / flax loaders). ``show_progress``: a
    progress bar over the tensors on stderr (``None``: on a terminal only, as the
    ``zerojax export`` command does).
    """
    from zerojax.state import ZeroState

    if isinstance(source, ZeroState):
        if step is not None:
            raise ValueError("step= picks a step of a checkpoint directory; a state is exported as it is.")
        from zerojax.checkpoint.hf_export import export_state

        return export_state(source, out, map=map, layout=layout, dtype=dtype, max_shard_size=max_shard_size,
                            lora=lora)
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}.")
    directory = source
    if layout != "file" or map is not None or lora != "merge":
        return _export_mapped(directory, out, step=step, dtype=dtype, layout=layout, map=map,
                              max_shard_size=max_shard_size, lora=lora, show_progress=show_progress)
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


def _restore_leaf(mngr, meta, step: int, i: int, frozen: dict[int, int]) -> np.ndarray:
    """Parameter ``i`` of a checkpoint, whole: its fp32 master, or a frozen one as stored."""
    key = str(i)
    group, layout = ("frozen", meta.frozen_layout(frozen[i])) if i in frozen else ("master", meta.layout(i))
    arrays = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item={group: {key: 0}}, restore_args={group: {key: ocp.RestoreArgs(restore_type=np.ndarray)}},
        partial_restore=True)))["state"][group]
    return layout.from_storage(np.asarray(arrays[key]))


def _export_mapped(directory, out, *, step, dtype, layout, map, max_shard_size, lora, show_progress):
    """A checkpoint directory through a map / into Hugging Face's layout: process 0 reads
    one parameter at a time and writes it through the map's inverse."""
    from zerojax.checkpoint import boxes
    from zerojax.checkpoint import hf_export as hx
    from zerojax.checkpoint import tensor_map as tm

    if layout not in hx.LAYOUTS:
        raise ValueError(f"layout must be one of {hx.LAYOUTS}, got {layout!r}.")
    if lora not in hx.LORA:
        raise ValueError(f"lora must be one of {hx.LORA}, got {lora!r}.")
    wmap = tm.IDENTITY if map is None else map
    if not isinstance(wmap, tm.WeightMap):
        raise TypeError(f"map must be a zj.WeightMap, got {type(wmap).__name__}.")
    max_bytes = hx.parse_size(max_shard_size)
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
    index = {n: i for i, n in enumerate(names)}
    frozen = {i: j for j, i in enumerate(i for i in range(len(names)) if not meta.is_trainable(i))}
    triples = hx.lora_triples(names)
    adapters = {n for ab in triples.values() for n in ab}
    chosen = [n for n in names if (n not in adapters if lora == "merge" else n in adapters if lora == "adapters"
                                   else True)]
    if lora == "adapters" and not adapters:
        raise ValueError("lora='adapters' exports the LoRA adapters, but the checkpoint has none.")
    shapes = {n: meta.layout(index[n]).shape for n in chosen}
    target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    inferred = tm.infer_tensors(wmap, shapes)
    res = tm.resolve(wmap, shapes, {t: (s, np.dtype(np.float32)) for t, s in inferred.items()})
    if res.problems():
        raise ValueError("the map cannot export this checkpoint: " + ". ".join(res.problems()) + ".")
    hx._check_cover(res.exprs, inferred)
    tensors = {t: (s, np.dtype(target)) for t, s in inferred.items()}
    if jax.process_index() != 0:
        hx._barrier("zerojax-export-headers")
        hx._barrier("zerojax-export-data")
        hx._barrier("zerojax-export-done")
        return {t: tuple(s) for t, (s, _) in tensors.items()}
    merged = {k: tuple(_restore_leaf(mngr, meta, step, index[x], frozen).astype(np.float32) for x in ab)
              for k, ab in triples.items()} if lora == "merge" else {}

    def produce(writer):
        for n in progress(chosen, "export", unit="tensor", disable=None if show_progress is None else not show_progress):
            x = _restore_leaf(mngr, meta, step, index[n], frozen)
            if n in merged:
                a, b = merged[n]
                x = x.astype(np.float32) + np.matmul(a, b)
            res.exprs[n].write(boxes.full(x.shape), _cast(n, x, target), writer)

    hx.write_checkpoint(os.fspath(out), tensors, produce, layout=layout, max_bytes=max_bytes,
                        metadata={"format": "pt"} if layout == "hf" else {"format": "zerojax", "step": step})
    return {t: tuple(s) for t, (s, _) in tensors.items()}


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
