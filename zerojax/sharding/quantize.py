"""Blockwise int8 weight gathers (ZeRO++'s qwZ).

With ``ZeroConfig(collectives={"gather_dtype": "int8"})`` stage 3 gathers each parameter as int8 plus one
fp32 scale per block: each device quantizes its own shard (flattened, in blocks of
``quant_block_size`` elements; symmetric, scale = the block's largest magnitude / 127),
all-gathers the int8 values and the scales, and dequantizes every device's part to the
compute dtype. An element's error is at most half its block's scale, the block's largest
magnitude / 254. A shard moves ``L`` bytes plus 4 per block instead of ``4L`` (fp32) or
``2L`` (bf16): 0.25× the fp32 traffic plus the scales.

The gradient is that of the dequantized weights (straight through the rounding) and is
reduce-scattered in ``reduce_dtype`` as without quantization; the fp32 masters never see
the rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.sharding.leaf_layout import LeafLayout

QMAX = 127.0


def _blocks(flat: jax.Array, block: int) -> jax.Array:
    pad = -flat.shape[0] % block
    return jnp.pad(flat, (0, pad)).reshape(-1, block)


def quantize(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """``x`` (any shape) as int8 of the same shape and one fp32 scale per block of
    ``block`` elements of ``x`` flattened (the last block may be short)."""
    flat = x.astype(jnp.float32).reshape(-1)
    blocks = _blocks(flat, block)
    peak = jnp.max(jnp.abs(blocks), axis=1)
    scale = jnp.where(peak == 0, 1.0, peak / QMAX)  # a NaN or inf stays in its block: not hidden
    q = jnp.clip(jnp.round(blocks / scale[:, None]), -QMAX, QMAX).astype(jnp.int8)
    return q.reshape(-1)[: flat.shape[0]].reshape(x.shape), scale


def dequantize(q: jax.Array, scale: jax.Array, block: int, dtype) -> jax.Array:
    """The inverse of :func:`quantize` (up to its rounding), in ``dtype``."""
    flat = q.reshape(-1)
    per_element = jnp.repeat(scale, block)[: flat.shape[0]]
    return (flat.astype(jnp.float32) * per_element).astype(dtype).reshape(q.shape)


def gather_int8(layout: LeafLayout, shard: jax.Array, axis: str, block: int, dtype) -> jax.Array:
    """Inside ``shard_map`` over ``axis``: the full array in ``dtype`` from this device's
    shard, moved as int8 plus scales (the same result as ``layout.gather`` of the
    dequantized shards)."""
    if layout.kind == "replicated":
        return shard.astype(dtype)
    q, scale = quantize(shard, block)
    qs = jax.lax.all_gather(q, axis)  # (n, *shard shape), int8
    scales = jax.lax.all_gather(scale, axis)  # (n, blocks)
    parts = jax.vmap(lambda q, s: dequantize(q, s, block, dtype))(qs, scales)
    k = layout.split_axis
    storage = jnp.moveaxis(parts, 0, k).reshape(layout.storage_shape)
    return layout.from_storage(storage)
