"""The collectives of ZeRO with explicit dtypes, for use inside ``shard_map``.

* :func:`reduce_grad` sums a gradient over the data axis (all-reduce, or reduce-scatter
  into this device's shard) in the reduce dtype and divides by the number of devices.
  With replica groups (hybrid sharding) the shard is then summed over the replica axis
  (an all-reduce of Ψ/(N/R) elements across groups; a replicated gradient is all-reduced
  over both axes at once).
  Every device's gradient enters it at the full loss scale (DeepSpeed's semantics); the
  division by N happens after the sum, in fp32, except for a float16 reduction, where it
  happens before the sum, as DeepSpeed's reduce-scatter does, so that the sum cannot
  overflow where the gradients themselves do not.
* :func:`gather` all-gathers a parameter shard in the compute dtype (half the bytes of
  fp32 for bf16/fp16); its backward is :func:`reduce_grad` of the cotangent.
* :func:`scatter_grad` is the identity on a resident parameter whose backward
  reduce-scatters the cotangent into a shard-shaped sink.
* :func:`gather_from_host` gathers a shard kept in host memory (stage 3 with
  ``offload_params``): the shard moves to the device first, and backward reduce-scatters
  the cotangent into a device-resident sink.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.sharding.layout import LeafLayout
from zerojax.sharding.quantize import gather_int8


def reduce_grad(g: jax.Array, axis: str, n: int, reduce_dtype, layout: LeafLayout | None = None,
                replica: str | None = None) -> jax.Array:
    """fp32 mean of ``g`` over the ``n`` devices of ``axis`` (and ``replica``, when given):
    replicated (``layout=None``: all-reduce) or this device's shard of ``layout``'s storage
    (reduce-scatter within the group, then all-reduce of the shard across groups)."""
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


def gather_values(layout: LeafLayout, axis: str, shard: jax.Array, compute_dtype,
                  quant_block: int | None = None) -> jax.Array:
    """The full leaf in ``compute_dtype`` from this device's shard: cast, then all-gathered;
    or, with ``quant_block``, all-gathered as blockwise int8 (:mod:`zerojax.sharding.quantize`)."""
    if quant_block:
        return gather_int8(layout, shard, axis, quant_block, compute_dtype)
    return layout.gather(shard.astype(compute_dtype), axis)


def gather(layout: LeafLayout, axis: str, n: int, shard: jax.Array, compute_dtype, reduce_dtype,
           quant_block: int | None = None, replica: str | None = None) -> jax.Array:
    """Full leaf in ``compute_dtype`` from this device's shard (see module docstring)."""

    @jax.custom_vjp
    def g(shard):
        return gather_values(layout, axis, shard, compute_dtype, quant_block)

    def fwd(shard):
        return g(shard), None

    def bwd(_, ct):
        return (reduce_grad(ct, axis, n, reduce_dtype, layout, replica).astype(shard.dtype),)

    g.defvjp(fwd, bwd)
    return g(shard)


def scatter_grad(layout: LeafLayout, axis: str, n: int, full: jax.Array, sink: jax.Array,
                 reduce_dtype, replica: str | None = None) -> jax.Array:
    """``full``, whose cotangent is reduce-scattered (averaged) into ``sink``'s shape and dtype."""

    @jax.custom_vjp
    def ident(full, sink):
        return full

    def fwd(full, sink):
        return full, None

    def bwd(_, ct):
        return None, reduce_grad(ct, axis, n, reduce_dtype, layout, replica).astype(sink.dtype)

    ident.defvjp(fwd, bwd)
    return ident(full, sink)


def gather_from_host(layout: LeafLayout, axis: str, n: int, host_shard: jax.Array, sink: jax.Array,
                     compute_dtype, reduce_dtype, quant_block: int | None = None,
                     replica: str | None = None) -> jax.Array:
    """Full leaf in ``compute_dtype`` from a shard in host memory; its gradient goes to ``sink``."""

    @jax.custom_vjp
    def g(host_shard, sink):
        shard = jax.device_put(host_shard, jax.memory.Space.Device)
        return gather_values(layout, axis, shard, compute_dtype, quant_block)

    def fwd(host_shard, sink):
        return g(host_shard, sink), None

    def bwd(_, ct):
        return None, reduce_grad(ct, axis, n, reduce_dtype, layout, replica).astype(sink.dtype)

    g.defvjp(fwd, bwd)
    return g(host_shard, sink)
