"""The collectives of ZeRO with explicit dtypes, for use inside ``shard_map``.

* :func:`reduce_grad` sums a gradient over the data axis (all-reduce, or reduce-scatter
  into this device's shard) in the reduce dtype and divides by the number of devices.
  With replica groups (hybrid sharding) the shard is then summed over the replica axis
  (an all-reduce of Ψ/(N/R) elements across groups; a replicated gradient is all-reduced
  over both axes at once).
  Every device's gradient enters it at the full loss scale (DeepSpeed's semantics); the
  division by N happens after the sum, in fp32, except for a float16 reduction, where it
  happens before the sum, as DeepSpeed's reduce-scatter does, so that the sum cannot
  overflow where the gradients themselves do not. An ``"int8"`` reduction (ZeRO++'s qgZ)
  moves blockwise int8 and sums in fp32 (:mod:`zerojax.sharding.int8_reduce`).
* :func:`gather_values` all-gathers a parameter shard in the compute dtype (half the bytes
  of fp32 for bf16/fp16), or as blockwise int8.

Which of them a use of a parameter runs, in forward and in backward, is said by its
:class:`zerojax.sharding.param_sources.ParamSource`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.sharding import int8_reduce
from zerojax.sharding.leaf_layout import LeafLayout
from zerojax.sharding.quantize import gather_int8


def reduce_grad(
    g: jax.Array,
    axis: str,
    n: int,
    reduce_dtype,
    layout: LeafLayout | None = None,
    replica: str | None = None,
    block: int | None = None,
) -> jax.Array:
    """fp32 mean of ``g`` over the ``n`` devices of ``axis`` (and ``replica``, when given):
    replicated (``layout=None``, or a replicated layout: all-reduce) or this device's shard of ``layout``'s storage
    (reduce-scatter within the group, then all-reduce of the shard across groups).
    ``reduce_dtype="int8"`` moves blockwise int8 with ``block`` elements per fp32 scale
    (:mod:`zerojax.sharding.int8_reduce`), one quantized hop per axis."""
    if layout is not None and layout.tp:  # each tensor shard on its own: never over the tensor axis
        return layout.on_tensor_shards(
            lambda l, x: reduce_grad(x, axis, n, reduce_dtype, None if l.kind == "replicated" else l, replica, block),
            g,
            whole=False,
        )
    if reduce_dtype == "int8":
        return _reduce_int8(g, axis, n, layout, replica, block)
    predivide = jnp.dtype(reduce_dtype) == jnp.float16
    x = g.astype(jnp.float32)
    if predivide:
        x = x / n
    x = x.astype(reduce_dtype)
    if layout is None:
        summed = jax.lax.psum(x, (replica, axis) if replica else axis)
    else:
        summed = layout.scatter(x, axis)
        if replica:
            summed = jax.lax.psum(summed, replica)
    summed = summed.astype(jnp.float32)
    return summed if predivide else summed / n


def _reduce_int8(
    g: jax.Array, axis: str, n: int, layout: LeafLayout | None, replica: str | None, block: int | None
) -> jax.Array:
    if not block:
        raise ValueError("reduce_dtype='int8' needs a block size (ZeroConfig.collectives.reduce_block_size).")
    x = g.astype(jnp.float32)
    if layout is None:
        summed = int8_reduce.all_reduce_int8(x, axis, jax.lax.axis_size(axis), block)
    else:
        summed = int8_reduce.reduce_scatter_int8(layout, x, axis, jax.lax.axis_size(axis), block)
    if replica:  # hybrid mesh: the group's sum, then across groups (ZeRO++'s hierarchical exchange)
        summed = int8_reduce.all_reduce_int8(summed, replica, jax.lax.axis_size(replica), block)
    return summed / n


def gather_values(
    layout: LeafLayout, axis: str, shard: jax.Array, compute_dtype, quant_block: int | None = None
) -> jax.Array:
    """The full leaf in ``compute_dtype`` from this device's shard: cast, then all-gathered;
    or, with ``quant_block``, all-gathered as blockwise int8 (:mod:`zerojax.sharding.quantize`)."""
    if layout.tp and layout.kind != "replicated":  # each tensor shard on its own
        return layout.on_tensor_shards(
            lambda l, s: gather_values(l, axis, s, compute_dtype, quant_block), shard, whole=True
        )
    if quant_block:
        return gather_int8(layout, shard, axis, quant_block, compute_dtype)
    return layout.gather(shard.astype(compute_dtype), axis)
