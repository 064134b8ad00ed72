"""Pretrained weights read straight into their shards.

:class:`Weights` names a checkpoint (one ``.safetensors`` file, or Hugging Face's sharded
layout: ``model.safetensors.index.json`` and the files it names) and a
:class:`~zerojax.tensors.weight_map.WeightMap` from the model's parameters to its tensors.
:func:`place` builds one array of any sharding from it: each process reads, for each
distinct shard its own devices hold, exactly the bytes of that shard (through the map's
transposes, reshapes and stacks, and ZeRO's storage layout with its padding), in pieces of
at most ``Weights.buffer_mib``, and puts it on those devices before reading the next. No
process reads a tensor it holds no part of, and none holds more on the host than one shard
and one piece.

``zj.init_state(abstract_params, tx, ..., weights=zj.Weights(path, map))`` builds a state
this way (the masters and frozen weights in their ZeRO layout, the optimizer state from
them); ``zj.load_weights(path, like)`` gives a parameter tree in the shardings of ``like``.

Every parameter comes from the checkpoint unless ``Weights.optional`` names it: a parameter
the map does not name, or whose tensors the checkpoint lacks, is an error on every path
(abstract parameters, an init function, concrete parameters, ``load_weights``), all of them
in one ``ValueError`` before anything is placed. Parameters meant to start from their
initial values (LoRA adapters on a base checkpoint, a new head) are said explicitly:
``zj.Weights(path, map, optional=("*.lora.*",))``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import gc
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from zerojax.sharding.leaf_layout import LeafLayout
from zerojax.tensors import boxes, weight_map
from zerojax.tensors.casts import cast, check_cast, narrows_range
from zerojax.tensors.expressions import Expr, Pad, Reshape
from zerojax.tensors.safetensors_files import TensorFiles, resolve_path
from zerojax.tensors.weight_map import IDENTITY, WeightMap

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Weights:
    """Weights to load: a checkpoint ``path`` and the ``map`` from parameters to its tensors.

    Attributes:
      path: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory
        holding either (Hugging Face's ``save_pretrained`` output).
      map: a :class:`~zerojax.tensors.weight_map.WeightMap` (default: each parameter is
        the tensor of its own dotted name, as ``zerojax export`` writes them), e.g.
        ``zj.maps.llama_map()``.
      buffer_mib: the largest piece read at once (MiB): a shard larger than this is read in
        pieces into its host array.
      optional: ``fnmatch`` patterns of parameter names (``"*.lora.*"``, ``"head.*"``) that
        may be absent from the map or the checkpoint: those absent are taken from the init
        function or the concrete parameters given to ``init_state`` (or from ``like`` in
        ``load_weights``). Every other parameter must be read from the checkpoint. Refused
        with abstract parameters, which have no values to take.

    Example:
      >>> import os, tempfile, numpy as np, optax, jax, zerojax as zj
      >>> from safetensors.numpy import save_file
      >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
      >>> save_file({"lm_head.weight": np.arange(24, dtype=np.float32).reshape(6, 4)}, path)
      >>> src = zj.Weights(path, zj.maps.WeightMap({"head": zj.maps.transpose("lm_head.weight")}))
      >>> like = {"head": jax.ShapeDtypeStruct((4, 6), np.float32)}
      >>> state = zj.init_state(like, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3),
      ...                       weights=src)
      >>> zj.gather_params(state)["head"][1].tolist()
      [1.0, 5.0, 9.0, 13.0, 17.0, 21.0]
    """

    path: str
    map: WeightMap = IDENTITY
    buffer_mib: float = 64.0
    optional: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        resolve_path(self.path)  # FileNotFoundError / TypeError for a path that is not there
        object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.map, WeightMap):
            raise TypeError(
                f"Weights.map must be a zj.maps.WeightMap, got {type(self.map).__name__}; build one with "
                "zj.maps.WeightMap({parameter name: tensor name or spec})."
            )
        if not (isinstance(self.buffer_mib, (int, float)) and self.buffer_mib > 0):
            raise ValueError(f"Weights.buffer_mib must be a positive number of MiB, got {self.buffer_mib!r}.")
        optional = (self.optional,) if isinstance(self.optional, str) else tuple(self.optional)
        bad = [p for p in optional if not isinstance(p, str) or not p]
        if bad:
            raise TypeError(
                f"Weights.optional is fnmatch patterns of parameter names (e.g. ('*.lora.*',)), got {bad[0]!r}."
            )
        object.__setattr__(self, "optional", optional)

    def is_optional(self, name: str) -> bool:
        """Whether parameter ``name`` may be absent (an ``optional`` pattern matches it)."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.optional)

    @property
    def buffer_bytes(self) -> int:
        return max(1, int(self.buffer_mib * MIB))

    def open(self) -> TensorFiles:
        return TensorFiles(self.path)


def as_weights(source: Any) -> Weights:
    """A :class:`Weights` from itself or a path (identity map)."""
    if isinstance(source, Weights):
        return source
    if isinstance(source, (str, os.PathLike)):
        return Weights(os.fspath(source))
    raise TypeError(
        f"weights are a zj.Weights(path, map) or a path to a .safetensors file or folder, "
        f"got {type(source).__name__} {source!r}."
    )


def resolve(
    weights: Weights,
    files: TensorFiles,
    params: dict[str, tuple[int, ...]],
    *,
    initial: bool = False,
    what: str = "the model",
) -> tuple[dict[str, Expr], list[str]]:
    """``(each parameter's expression, the absent optional parameters)``; one ``ValueError``
    listing every problem. ``initial``: whether absent parameters have values to take (an
    init function, concrete parameters); without, ``Weights.optional`` is refused."""
    if weights.optional and not initial:
        raise ValueError(
            f"zj.Weights(optional={weights.optional!r}) takes parameters the checkpoint lacks from "
            "the init function or the values given, but the parameters given are abstract "
            "(jax.ShapeDtypeStruct): there is nothing to take them from. Pass an init function or "
            "concrete parameters, or drop optional= so that every parameter is read."
        )
    res = weight_map.resolve(weights.map, params, {n: (t.shape, t.dtype) for n, t in files.tensors.items()})
    problems = res.problems(weights.is_optional)
    if problems:
        hint = (
            " Parameters meant to start from their initial values (LoRA adapters, a new head) are named "
            "with zj.Weights(path, map, optional=('*.lora.*', ...)), which takes them from the init "
            "function or the values given."
            if res.unmapped or res.missing
            else ""
        )
        raise ValueError(
            f"{weights.path!r} does not match {what}: "
            + ". ".join(problems)
            + ". Pass the map written for this checkpoint (zj.Weights(path, map)), or add the "
            "names to WeightMap(ignore=...) for tensors no parameter reads." + hint
        )
    absent = res.absent(weights.is_optional)
    return res.exprs, absent


def storage_expr(expr: Expr, layout: LeafLayout | None) -> Expr:
    """The storage array of ``layout`` (its grid, flattening and padding) over a
    parameter's expression: what :meth:`LeafLayout.to_storage` does to the array."""
    if layout is None or layout.kind == "replicated":
        return expr
    g = layout.grid
    e = Reshape(expr, g) if tuple(g) != tuple(expr.shape) else expr
    if layout.kind == "dim":
        size = layout.n * layout.chunk
        return Pad(e, layout.dim, size) if size != g[layout.dim] else e
    flat = g[: layout.lead] + (int(np.prod(g[layout.lead :], dtype=np.int64)),)
    e = Reshape(e, flat) if flat != tuple(e.shape) else e
    size = layout.n * layout.chunk
    return Pad(e, layout.lead, size) if size != flat[-1] else e


def owned_boxes(shape: tuple[int, ...], sharding) -> dict[boxes.Box, list]:
    """The distinct boxes this process's devices hold of an array of ``shape`` placed with
    ``sharding``, each with its devices."""
    out: dict[boxes.Box, list] = {}
    for device, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
        out.setdefault(boxes.from_index(index, tuple(shape)), []).append(device)
    return out


def read_box(name: str, expr: Expr, box: boxes.Box, dtype: Any, files: TensorFiles, limit: int) -> np.ndarray:
    """``box`` of ``expr`` in ``dtype``, read in pieces of at most ``limit`` bytes."""
    out = np.empty(boxes.box_shape(box), dtype)
    origin = [a for a, _ in box]
    for piece in boxes.pieces(box, max(expr.dtype.itemsize, np.dtype(dtype).itemsize), limit):
        out[boxes.slices(boxes.shift(piece, origin))] = _cast(name, expr.read(piece, files), dtype)
    return out


def place(
    name: str, expr: Expr, layout: LeafLayout | None, sharding, dtype: Any, files: TensorFiles, limit: int
) -> jax.Array:
    """A ``jax.Array`` of ``expr`` in ``layout``'s storage placed with ``sharding``, each
    process reading only the shards its devices hold, one at a time."""
    expr = storage_expr(expr, layout)
    shape = tuple(expr.shape)
    check_cast(name, expr.dtype, dtype)
    arrays = []
    for box, devices in owned_boxes(shape, sharding).items():
        host = read_box(name, expr, box, dtype, files, limit)
        placed = [jax.device_put(host, d) for d in devices]
        jax.block_until_ready(placed)
        arrays += placed
        _release(host.nbytes, limit)
        del host, placed
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


_unreleased = [0]


def _release(nbytes: int, limit: int) -> None:
    """Frees placed host copies once they add up to a read buffer: ``jax.device_put`` of a
    numpy array leaves it in a reference cycle (jax 0.10 and 0.12 on the CPU), so without a
    collection every shard's host copy outlives its transfer until the garbage collector
    runs. A full collection costs milliseconds: it runs once per ``limit`` bytes placed."""
    _unreleased[0] += nbytes
    if _unreleased[0] >= limit:
        _unreleased[0] = 0
        gc.collect()


def _cast(name: str, x: np.ndarray, dtype: Any) -> np.ndarray:
    return cast(
        f"parameter {name!r} (read from the checkpoint)",
        x,
        dtype,
        fix="store it in a wider dtype (ZeroConfig(frozen_dtype='param'), or float32 / bfloat16 parameters).",
    )


def check_ranges(items, files: TensorFiles, limit: int, alive: Callable[[], None] = lambda: None) -> None:
    """Reads this process's shards of the parameters whose cast could overflow (float32
    tensors into float16 storage) and refuses them before anything is placed.
    ``items``: ``(name, expr, layout, sharding, dtype)``; ``alive`` is called per piece read
    (:meth:`zerojax.tensors.processes.Processes.alive`)."""
    for name, expr, layout, sharding, dtype in items:
        if not narrows_range(expr.dtype, dtype):
            continue
        expr = storage_expr(expr, layout)
        for box in owned_boxes(tuple(expr.shape), sharding):
            for piece in boxes.pieces(box, expr.dtype.itemsize, limit):
                alive()
                _cast(name, expr.read(piece, files), dtype)
