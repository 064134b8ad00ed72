"""Megatron-LM's sequence parallelism on the tensor axis (arXiv 2205.05198).

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

Left to itself, XLA's partitioner may keep each row-parallel all-reduce whole and slice it
afterwards (the CPU backend does: it has no reduce-scatter creation pass), holding the whole
activation per layer. :func:`column_parallel` and :func:`row_parallel` write Megatron's
collectives out, as a ``shard_map`` manual over the tensor axis around the matmul:

.. code-block:: python

    h = zj.nn.column_parallel(ln2(x), fc.kernel, fc.bias)     # all-gather S, then x @ W[:, cols]
    x = x + zj.nn.row_parallel(gelu(h), out.kernel, out.bias)  # x @ W[rows, :], reduce-scatter onto S

so that a device holds the gathered sequence only inside the column-parallel matmul, forward
and backward (its backward gathers it again rather than keeping it), and the row-parallel
output is born split along the sequence.

Where the mesh in context has no tensor axis (one device, a data-only mesh, a context mesh)
the annotation is the identity, so the same model runs anywhere. A model that does not
annotate trains as before, its residual stream whole on each tensor shard.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._jaxpr import settings

__all__ = ["column_parallel", "row_parallel", "sequence_parallel", "tensor_parallel", "tensor_size"]


def tensor_size(axis: str = "tensor") -> int:
    """Devices of the tensor axis of the mesh in context (1 where it has none, or where
    that axis is manual there: inside a ``shard_map`` over it a value is already one
    shard's)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or axis not in getattr(mesh, "axis_names", ()) or axis in settings.manual_axes(mesh):
        return 1
    return int(dict(mesh.shape)[axis])


def sequence_parallel(x: jax.Array, *, dim: int = 1, axis: str = "tensor", context_axis: str = "context") -> jax.Array:
    """``x`` with its dimension ``dim`` (the sequence of a ``[batch, seq, ...]`` activation)
    split over the tensor axis ``axis`` of the mesh in context; the identity where there is
    none. The value is unchanged: only where it lives. On a mesh that also splits the
    sequence over a context axis (``zj.make_mesh(context=C, tensor=T)``), the sequence is
    split over both (``C x T`` chunks); the other dimensions keep their splits.

    Args:
      x: an activation, e.g. the residual stream ``[batch, seq, d_model]``.
      dim: the dimension to split (negative counts from the end).
      axis: the tensor axis's name (``ZeroConfig.axes.tensor``).
      context_axis: the context axis's name (``ZeroConfig.axes.context``).

    Raises:
      ValueError: ``dim`` is not a dimension of ``x``, or the tensor (and context) axis does
        not divide its length (the error lists the lengths that fit).

    Example:
      >>> import jax.numpy as jnp, zerojax as zj
      >>> x = jnp.ones((2, 8, 4))
      >>> zj.nn.sequence_parallel(x) is x   # no tensor axis in context: nothing to split
      True
    """
    return _split(x, dim, axis, "sequence_parallel", "a sequence length", context_axis)


def tensor_parallel(x: jax.Array, *, dim: int = -1, axis: str = "tensor") -> jax.Array:
    """``x`` with its dimension ``dim`` (the features of a column-parallel matmul's output,
    or its heads) split over the tensor axis; the identity where there is none.

    Beside :func:`sequence_parallel` it pins where the sequence is gathered: with the
    residual stream split along the sequence and nothing said of the matmul's output, XLA's
    partitioner may keep the sequence split and gather the *weight* over the tensor axis
    instead (data parallelism over the sequence, every tensor shard holding whole weights
    and every head), which is exact but undoes tensor parallelism. Marking the output of
    each column-parallel matmul (q, k, v by heads, the MLP's hidden features) makes it
    gather the activation, as Megatron does. The other dimensions keep their splits (the
    sequence its split over a context axis).

    Example:
      >>> import jax.numpy as jnp, zerojax as zj
      >>> h = jnp.ones((2, 8, 16))
      >>> zj.nn.tensor_parallel(h) is h   # no tensor axis in context
      True
    """
    return _split(x, dim, axis, "tensor_parallel", "a size")


def _split(x: jax.Array, dim: int, axis: str, name: str, what: str, context_axis: str | None = None) -> jax.Array:
    """``x`` constrained to ``dim`` over ``axis`` (over ``context_axis`` x ``axis`` where the
    mesh splits ``dim`` over a context axis too), every other dimension left as the
    partitioner has it (a constraint of ``None`` there would gather the batch or the
    sequence over the data or context axes)."""
    ndim = getattr(x, "ndim", None)
    if ndim is None:
        raise TypeError(f"{name} takes an array, got {type(x).__name__}.")
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{name}(dim={dim!r}): x has shape {tuple(x.shape)}, no dimension {dim!r}.")
    t = tensor_size(axis)
    if t == 1:
        return x
    dim %= ndim
    c = tensor_size(context_axis) if context_axis is not None else 1
    where = (context_axis, axis) if c > 1 else axis
    _divides(
        name,
        x,
        dim,
        c * t,
        " x ".join((context_axis, axis)) if c > 1 else axis,
        what,
        hint=", or leave this value unsplit",
    )
    spec = [P.UNCONSTRAINED] * ndim
    spec[dim] = where
    return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), P(*spec)))


def column_parallel(x: jax.Array, kernel: Any, bias: Any = None, *, dim: int = 1, axis: str = "tensor") -> Any:
    """``x @ kernel + bias`` for ``x`` split along its sequence over the tensor axis and
    ``kernel`` (``[in, out]``) split by columns: the sequence is all-gathered, each tensor
    shard computes its columns, and the result is ``[..., out]`` with ``out`` split over the
    tensor axis (Megatron-LM's column-parallel linear with sequence parallelism).

    ``kernel`` (and ``bias``) may be a tuple of kernels (biases) that read the same input,
    such as attention's q, k and v projections: the sequence is gathered once for all of
    them and a tuple of outputs is returned.

    Backward gathers the sequence again rather than keeping the gathered input, and
    reduce-scatters the input's gradient onto the sequence split. Off a tensor axis it is
    the plain matmul.

    Args:
      x: ``[batch, seq, ..., in]``; ``dim`` is the sequence dimension.
      kernel: ``[in, out]`` (or a tuple of them); ``bias``: ``[out]``, None, or a tuple
        matching ``kernel``.
      axis: the tensor axis's name.

    Example:
      >>> import jax.numpy as jnp, zerojax as zj
      >>> x, w, b = jnp.ones((2, 8, 4)), jnp.ones((4, 6)), jnp.arange(6.0)
      >>> zj.nn.column_parallel(x, w, b)[0, 0]   # no tensor axis in context: x @ w + b
      Array([4., 5., 6., 7., 8., 9.], dtype=float32)
      >>> q, k = zj.nn.column_parallel(x, (w, 2 * w))
      >>> float(k[0, 0, 0])
      8.0
    """
    many = isinstance(kernel, (tuple, list))
    kernels = tuple(kernel) if many else (kernel,)
    if bias is None:
        biases = (None,) * len(kernels)
    else:
        biases = tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    if not kernels:
        raise ValueError("column_parallel: no kernel given; pass a [in, out] kernel or a tuple of them.")
    if len(biases) != len(kernels):
        raise ValueError(
            f"column_parallel: {len(kernels)} kernels but {len(biases)} biases; give one bias (or None) per kernel."
        )
    dim = [_check_matmul("column_parallel", x, w, b, dim) for w, b in zip(kernels, biases)][0]
    t = tensor_size(axis)
    if t == 1:
        out = tuple(_dense(x, w, b) for w, b in zip(kernels, biases))
        return out if many else out[0]
    _divides("column_parallel", x, dim, t, axis, "a sequence length")
    for w in kernels:
        _divides("column_parallel", w, 1, t, axis, "a number of output features", arg="kernel")
    seq = _spec(x.ndim, dim, axis)
    cols = _spec(x.ndim, x.ndim - 1, axis)
    has = tuple(b is not None for b in biases)
    given = tuple(b for b in biases if b is not None)

    def body(x, ws, bs):
        it = iter(bs)
        return _gathered_matmul(x, ws, tuple(next(it) if h else None for h in has), dim, axis)

    run = jax.shard_map(
        body,
        in_specs=(seq, (P(None, axis),) * len(kernels), (P(axis),) * len(given)),
        out_specs=(cols,) * len(kernels),
        axis_names={axis},
        check_vma=False,
    )
    out = run(x, kernels, given)
    return out if many else out[0]


def row_parallel(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, dim: int = 1, axis: str = "tensor"
) -> jax.Array:
    """``x @ kernel + bias`` for ``x`` split along its features (``[..., in]``, ``in`` over
    the tensor axis, as a column-parallel output is) and ``kernel`` (``[in, out]``) split by
    rows: each tensor shard's partial product is reduce-scattered onto the sequence split
    (Megatron-LM's row-parallel linear with sequence parallelism). The result is
    ``[batch, seq, ..., out]`` with ``seq`` (dimension ``dim``) split over the tensor axis,
    never whole on a device. Off a tensor axis it is the plain matmul.

    Example:
      >>> import jax.numpy as jnp, zerojax as zj
      >>> x, w = jnp.ones((2, 8, 6)), jnp.ones((6, 4))
      >>> zj.nn.row_parallel(x, w).shape
      (2, 8, 4)
    """
    dim = _check_matmul("row_parallel", x, kernel, bias, dim)
    t = tensor_size(axis)
    if t == 1:
        return _dense(x, kernel, bias)
    _divides("row_parallel", x, dim, t, axis, "a sequence length")
    _divides("row_parallel", kernel, 0, t, axis, "a number of input features", arg="kernel")

    def body(x, w, b):
        y = jax.lax.psum_scatter(_dense(x, w, None), axis, scatter_dimension=dim, tiled=True)
        return y if b is None else y + b

    feats = _spec(x.ndim, x.ndim - 1, axis)
    seq = _spec(x.ndim, dim, axis)
    if bias is None:
        run = jax.shard_map(
            lambda x, w: body(x, w, None),
            in_specs=(feats, P(axis, None)),
            out_specs=seq,
            axis_names={axis},
            check_vma=False,
        )
        return run(x, kernel)
    run = jax.shard_map(body, in_specs=(feats, P(axis, None), P()), out_specs=seq, axis_names={axis}, check_vma=False)
    return run(x, kernel, bias)


def _dense(x, kernel, bias):
    y = jnp.einsum("...i,io->...o", x, kernel)
    return y if bias is None else y + bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gathered_matmul(x, ws, bs, dim, axis):
    whole = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
    return tuple(_dense(whole, w, b) for w, b in zip(ws, bs))


def _gathered_fwd(x, ws, bs, dim, axis):
    return _gathered_matmul(x, ws, bs, dim, axis), (x, ws, bs)


def _gathered_bwd(dim, axis, res, dys):
    x, ws, bs = res
    whole = jax.lax.all_gather(x, axis, axis=dim, tiled=True)  # again, not kept from forward
    dwhole = sum(jnp.einsum("...o,io->...i", dy, w) for dy, w in zip(dys, ws))
    dx = jax.lax.psum_scatter(dwhole, axis, scatter_dimension=dim, tiled=True)
    dws = tuple(jnp.einsum("...i,...o->io", whole, dy).astype(w.dtype) for dy, w in zip(dys, ws))
    dbs = tuple(None if b is None else dy.reshape(-1, dy.shape[-1]).sum(0).astype(b.dtype) for dy, b in zip(dys, bs))
    return dx.astype(x.dtype), dws, dbs


_gathered_matmul.defvjp(_gathered_fwd, _gathered_bwd)


def _check_matmul(name: str, x, kernel, bias, dim: int) -> int:
    for what, v in (("x", x), ("kernel", kernel)):
        if getattr(v, "ndim", None) is None:
            raise TypeError(f"{name}: {what} must be an array, got {type(v).__name__}.")
    if kernel.ndim != 2 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"{name}: kernel must be [in, out] with in = x.shape[-1] = {x.shape[-1]}, got kernel "
            f"shape {tuple(kernel.shape)}."
        )
    if bias is not None and tuple(bias.shape) != (kernel.shape[1],):
        raise ValueError(
            f"{name}: bias must have shape ({kernel.shape[1]},) (the kernel's outputs), got {tuple(bias.shape)}."
        )
    if not isinstance(dim, int) or not -x.ndim <= dim < x.ndim - 1:
        raise ValueError(
            f"{name}(dim={dim!r}): the sequence dimension must be one of x's leading dimensions "
            f"(x has shape {tuple(x.shape)})."
        )
    return dim % x.ndim


def _divides(name: str, x, dim: int, t: int, axis: str, what: str, *, arg: str = "x", hint: str = "") -> None:
    """Refuses a dimension the tensor axis does not divide, naming the lengths that would."""
    length = x.shape[dim]
    if length % t:
        fits = sorted({(length // t) * t, (length // t + 1) * t} - {0})
        raise ValueError(
            f"{name}: dimension {dim} of {arg} (shape {tuple(x.shape)}) has length {length}, which the "
            f"mesh axis {axis!r} ({t} devices) does not divide; use {what} of "
            f"{' or '.join(map(str, fits))} (a multiple of {t}){hint}."
        )


def _spec(ndim: int, dim: int, axis: str) -> P:
    spec = [None] * ndim
    spec[dim] = axis
    return P(*spec)
