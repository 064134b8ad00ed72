"""The two collectives of ZeRO with explicit dtypes, for use inside ``shard_map``.

* :func:`gather` all-gathers a parameter shard in the compute dtype (half the bytes of
  fp32 for bf16/fp16) and, in backward, reduce-scatters the cotangent in the reduce dtype
  before returning it in the shard's own dtype.
* :func:`scatter_grad` is the identity on a resident parameter whose backward
  reduce-scatters the cotangent, in the reduce dtype, into a shard-shaped sink.
"""

from __future__ import annotations

import jax

from zerojax.sharding.layout import LeafLayout


def gather(layout: LeafLayout, axis: str, shard: jax.Array, compute_dtype, reduce_dtype) -> jax.Array:
    """Full leaf in ``compute_dtype`` from this device's shard (see module docstring)."""

    @jax.custom_vjp
    def g(shard):
        return layout.gather(shard.astype(compute_dtype), axis)

    def fwd(shard):
        return g(shard), None

    def bwd(_, ct):
        return (layout.scatter(ct.astype(reduce_dtype), axis).astype(shard.dtype),)

    g.defvjp(fwd, bwd)
    return g(shard)


def scatter_grad(layout: LeafLayout, axis: str, full: jax.Array, sink: jax.Array, reduce_dtype) -> jax.Array:
    """``full``, whose cotangent is reduce-scattered into ``sink``'s shape and dtype."""

    @jax.custom_vjp
    def ident(full, sink):
        return full

    def fwd(full, sink):
        return full, None

    def bwd(_, ct):
        return None, layout.scatter(ct.astype(reduce_dtype), axis).astype(sink.dtype)

    ident.defvjp(fwd, bwd)
    return ident(full, sink)
