"""Sequence parallelism on the tensor axis (Megatron-LM's, arXiv 2205.05198).

Tensor parallelism splits the matmuls of attention and the MLP over a tensor axis, but the
activations between them (the residual stream, LayerNorm, dropout) stay whole on every
tensor shard: at a fixed global batch a data group of ``N/T`` devices holds ``T`` times the
rows, and those activations grow with ``T``. A model that marks its residual stream with
:func:`sequence_parallel` has them split along the sequence over the tensor axis instead:

.. code-block:: python

    x = zj.nn.sequence_parallel(x + attention(ln1(x)))   # [batch, seq, d]: seq over "tensor"

XLA's partitioner (the tensor axis stays automatic in the train step) then gathers the
sequence before each column-parallel matmul and turns each row-parallel matmul's all-reduce
into a reduce-scatter onto the sequence split: the same bytes on the wire as the
all-reduce (a reduce-scatter and an all-gather are each half of one), and the activations
outside the matmuls at 1/T per device.

Where the mesh in context has no tensor axis (one device, a data-only mesh, a context mesh)
the annotation is the identity, so the same model runs anywhere. A model that does not
annotate trains as before, its residual stream whole on each tensor shard.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["sequence_parallel", "tensor_parallel", "tensor_size"]


def tensor_size(axis: str = "tensor") -> int:
    """Devices of the tensor axis of the mesh in context (1 where it has none, or where
    that axis is manual there: inside a ``shard_map`` over it a value is already one
    shard's)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or axis not in getattr(mesh, "axis_names", ()) or axis in getattr(mesh, "manual_axes", ()):
        return 1
    return int(dict(mesh.shape)[axis])


def sequence_parallel(x: jax.Array, *, dim: int = 1, axis: str = "tensor") -> jax.Array:
    """``x`` with its dimension ``dim`` (the sequence of a ``[batch, seq, ...]`` activation)
    split over the tensor axis ``axis`` of the mesh in context; the identity where there is
    none. The value is unchanged: only where it lives.

    Args:
      x: an activation, e.g. the residual stream ``[batch, seq, d_model]``.
      dim: the dimension to split (negative counts from the end).
      axis: the tensor axis's name (``ZeroConfig.tensor_axis``).

    Raises:
      ValueError: ``dim`` is not a dimension of ``x``, or the tensor axis does not divide its
        length (the error lists the lengths that fit).

    Example:
      >>> import jax.numpy as jnp, zerojax as zj
      >>> x = jnp.ones((2, 8, 4))
      >>> zj.nn.sequence_parallel(x) is x   # no tensor axis in context: nothing to split
      True
    """
    return _split(x, dim, axis, "sequence_parallel", "a sequence length")


def tensor_parallel(x: jax.Array, *, dim: int = -1, axis: str = "tensor") -> jax.Array:
    """``x`` with its dimension ``dim`` (the features of a column-parallel matmul's output,
    or its heads) split over the tensor axis; the identity where there is none.

    Beside :func:`sequence_parallel` it pins where the sequence is gathered: with the
    residual stream split along the sequence and nothing said of the matmul's output, XLA's
    partitioner may keep the sequence split and gather the *weight* over the tensor axis
    instead (data parallelism over the sequence, every tensor shard holding whole weights
    and every head), which is exact but undoes tensor parallelism. Marking the output of
    each column-parallel matmul (q, k, v by heads, the MLP's hidden features) makes it
    gather the activation, as Megatron does.

    Example:
      >>> import jax.numpy as jnp, zerojax as zj
      >>> h = jnp.ones((2, 8, 16))
      >>> zj.nn.tensor_parallel(h) is h   # no tensor axis in context
      True
    """
    return _split(x, dim, axis, "tensor_parallel", "a size")


def _split(x: jax.Array, dim: int, axis: str, name: str, what: str) -> jax.Array:
    ndim = getattr(x, "ndim", None)
    if ndim is None:
        raise TypeError(f"{name} takes an array, got {type(x).__name__}.")
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{name}(dim={dim!r}): x has shape {tuple(x.shape)}, no dimension {dim!r}.")
    t = tensor_size(axis)
    if t == 1:
        return x
    dim %= ndim
    length = x.shape[dim]
    if length % t:
        fits = sorted({(length // t) * t, (length // t + 1) * t} - {0})
        raise ValueError(f"{name}: dimension {dim} of x (shape {tuple(x.shape)}) has length {length}, which the "
                         f"tensor axis {axis!r} of {t} devices does not divide; use {what} of "
                         f"{' or '.join(map(str, fits))} (a multiple of {t}), or leave this value unsplit.")
    spec = [None] * ndim
    spec[dim] = axis
    return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), P(*spec)))
