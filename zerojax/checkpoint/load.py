"""Loading exported weights back into a model's parameter tree.

:func:`zerojax.export_weights` (``zerojax export``) writes one ``.safetensors`` file whose
tensors are named by their parameter paths (``blocks.linear.kernel``; see
:func:`zerojax.checkpoint.export.tensor_names`). :func:`load_weights` reads such a file into
the structure of a tree you already have (an ``nnx.State`` from ``nnx.split(model,
nnx.Param)``, a linen ``params`` dict, any pytree of arrays or ``jax.ShapeDtypeStruct``),
matching each leaf to the tensor of its name.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.checkpoint.export import tensor_names


def load_weights(path: str | os.PathLike, like: Any) -> Any:
    """The weights of the safetensors file ``path`` in the structure of ``like``.

    Each leaf of ``like`` takes the tensor named by its path, as ``export_weights`` names
    them (``['blocks']['linear']['kernel'].value`` -> ``blocks.linear.kernel``), cast to
    the leaf's dtype (a bf16 leaf gets the bf16 rounding of an fp32 tensor). A ``jax.Array``
    leaf (or a ``jax.ShapeDtypeStruct`` with a sharding) gives an array placed with its
    sharding, a numpy leaf a numpy array, any other leaf a ``jax.Array``. Returns a tree of
    the same structure as ``like``: an ``nnx.State`` for an ``nnx.State``, which
    ``nnx.update(model, loaded)`` or ``nnx.merge(graphdef, loaded)`` puts into a model.

    Raises ``ValueError`` naming every tensor ``like`` needs and the file lacks, every
    tensor of the file ``like`` has no leaf for, and every shape that differs;
    ``FileNotFoundError`` for a missing file.

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
    from safetensors import SafetensorError, safe_open

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path is the .safetensors file to read, got {type(path).__name__} {path!r}.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file {os.fspath(path)!r} does not exist.")
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    if not flat:
        raise ValueError("like has no leaves; pass the model's parameter tree (e.g. nnx.split(model, nnx.Param)[1]).")
    names = tensor_names([jax.tree_util.keystr(p) for p, _ in flat])
    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            _check_match(os.fspath(path), names, [leaf for _, leaf in flat], stored)
            leaves = [_place(f.get_tensor(name), leaf) for name, (_, leaf) in zip(names, flat)]
    except SafetensorError as e:
        raise ValueError(f"{os.fspath(path)!r} is not a readable safetensors file: {e}") from None
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _check_match(path: str, names: list[str], leaves: list[Any], stored: dict[str, tuple[int, ...]]) -> None:
    """Raises one ``ValueError`` listing every missing tensor, extra tensor and shape mismatch."""
    problems = []
    missing = [n for n in names if n not in stored]
    extra = sorted(set(stored) - set(names))
    if missing:
        problems.append(f"missing from the file ({len(missing)}): {', '.join(missing)}")
    if extra:
        problems.append(f"in the file but not in like ({len(extra)}): {', '.join(extra)}")
    shapes = [f"{n} {stored[n]} in the file, {tuple(np.shape(leaf))} in like"
              for n, leaf in zip(names, leaves) if n in stored and stored[n] != tuple(np.shape(leaf))]
    if shapes:
        problems.append(f"shapes differ ({len(shapes)}): {'; '.join(shapes)}")
    if problems:
        raise ValueError(f"{path!r} does not match the parameter tree given as like: " + ". ".join(problems)
                         + ". Pass like= the model the file was exported from.")


def _place(x: np.ndarray, leaf: Any) -> Any:
    """``x`` in ``leaf``'s dtype: numpy for a numpy leaf, else a jax.Array placed as ``leaf``."""
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    x = x.astype(dtype, copy=False)
    if isinstance(leaf, (np.ndarray, np.generic)):
        return x
    sharding = getattr(leaf, "sharding", None)
    return jax.device_put(x, sharding) if sharding is not None else jnp.asarray(x)
