"""Loading exported weights back into a model's parameter tree.

:func:`zerojax.export_weights` (``zerojax export``) writes one ``.safetensors`` file whose
tensors are named by their parameter paths (``blocks.linear.kernel``; see
:func:`zerojax.tensors.names.tensor_names`), or Hugging Face's sharded format through a
map. :func:`load_weights` reads either (or any Hugging Face checkpoint, with a map) into
the structure of a tree you already have (an ``nnx.State`` from ``nnx.split(model,
nnx.Param)``, a linen ``params`` dict, any pytree of arrays or ``jax.ShapeDtypeStruct``),
matching each leaf to the tensor of its name.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.tensors import boxes
from zerojax.tensors.casts import check_cast
from zerojax.tensors.names import tensor_names
from zerojax.tensors.processes import Processes
from zerojax.tensors.weights import as_weights, check_ranges, place, read_box, resolve


def load_weights(path: Any, like: Any) -> Any:
    """The weights of a checkpoint in the structure of ``like``.

    ``path`` is a ``.safetensors`` file, a Hugging Face sharded checkpoint (its folder or
    ``model.safetensors.index.json``), or a :class:`zerojax.Weights` with the map from
    parameter names to tensors (default: each leaf is the tensor named by its path, as
    ``export_weights`` names them: ``['blocks']['linear']['kernel'].value`` ->
    ``blocks.linear.kernel``). Each leaf is cast to its dtype (a bf16 leaf gets the bf16
    rounding of an fp32 tensor; a float16 leaf refuses values beyond float16's range). A
    ``jax.Array`` leaf, or a ``jax.ShapeDtypeStruct`` with a sharding, gives an array placed
    with that sharding, each process reading only the bytes of the shards its devices hold;
    a numpy leaf gives a numpy array, any other leaf a ``jax.Array``. Returns a tree of the
    same structure as ``like``: an ``nnx.State`` for an ``nnx.State``, which
    ``nnx.update(model, loaded)`` or ``nnx.merge(graphdef, loaded)`` puts into a model.

    To train from the weights, ``zj.init_state(..., weights=zj.Weights(path, map))`` reads
    them straight into the ZeRO layout instead (no full parameter tree at any point).

    Raises ``ValueError`` naming every tensor ``like`` needs and the checkpoint lacks, every
    tensor of the checkpoint ``like`` has no leaf for, and every shape that differs, before
    reading any; ``FileNotFoundError`` for a missing file (or one an index names). The leaves
    that ``zj.Weights(..., optional=patterns)`` names may be absent: they are returned as
    ``like`` gives them, which must then hold values (not ``jax.ShapeDtypeStruct``). In a
    multi-process job a range error in one process's shards raises on every process.

    Example:
      >>> import os, tempfile, numpy as np
      >>> from safetensors.numpy import save_file
      >>> import zerojax as zj
      >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
      >>> save_file({"dense.kernel": np.full((2, 3), 0.5, np.float32)}, path)
      >>> loaded = zj.load_weights(path, like={"dense": {"kernel": np.zeros((2, 3), np.float16)}})
      >>> loaded["dense"]["kernel"].dtype, float(loaded["dense"]["kernel"].sum())
      (dtype('float16'), 3.0)
    """
    weights = as_weights(path)
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    if not flat:
        raise ValueError("like has no leaves; pass the model's parameter tree (e.g. nnx.split(model, nnx.Param)[1]).")
    names = tensor_names([jax.tree_util.keystr(p) for p, _ in flat])
    leaves = [leaf for _, leaf in flat]
    # A leaf placed over other processes' devices makes the call collective: agree on it.
    collective = any(not getattr(getattr(x, "sharding", None), "is_fully_addressable", True) for x in leaves)
    group = Processes("load_weights") if collective else None
    with weights.open() as files:
        exprs, absent = resolve(
            weights, files, {n: tuple(np.shape(x)) for n, x in zip(names, leaves)}, initial=True, what="like"
        )
        given = dict(zip(names, leaves))
        abstract = [n for n in absent if isinstance(given[n], jax.ShapeDtypeStruct)]
        if abstract:
            raise ValueError(
                f"{weights.path!r} lacks the optional parameters {', '.join(abstract)}, and like gives "
                "them as jax.ShapeDtypeStruct, without values to take instead; pass arrays for them in "
                "like, or load them from a checkpoint that has them."
            )
        items = [
            (n, exprs[n], None, getattr(x, "sharding", None), _dtype(x)) for n, x in zip(names, leaves) if n in exprs
        ]
        for n, expr, _, _, dtype in items:
            check_cast(n, expr.dtype, dtype)
        ranged = [it for it in items if it[3] is not None]
        if group is None:
            check_ranges(ranged, files, weights.buffer_bytes)
        else:
            error = None
            try:
                check_ranges(ranged, files, weights.buffer_bytes, group.alive)
            except Exception as e:  # noqa: BLE001 (agreed by every process, then raised)
                error = e
            group.agree("ranges", error, when="before placing any array")
        loaded = {
            name: _load(name, expr, sharding, dtype, given[name], files, weights.buffer_bytes)
            for name, expr, _, sharding, dtype in items
        }
    return jax.tree_util.tree_unflatten(treedef, [loaded.get(n, given[n]) for n in names])


def _dtype(leaf: Any):
    return leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _load(name, expr, sharding, dtype, leaf, files, limit):
    """One leaf: placed shard by shard with its sharding, else read whole."""
    if sharding is not None and not isinstance(leaf, (np.ndarray, np.generic)):
        return place(name, expr, None, sharding, dtype, files, limit)
    x = read_box(name, expr, boxes.full(tuple(expr.shape)), dtype, files, limit)
    return x if isinstance(leaf, (np.ndarray, np.generic)) else jnp.asarray(x)
