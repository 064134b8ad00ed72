"""Blockwise int8 gradient reductions (ZeRO++'s qgZ).

With ``ZeroConfig(collectives={"reduce_dtype": "int8"})`` a gradient crosses devices as int8 plus one fp32
scale per block, and every sum is taken in fp32 on the device that owns the result:

* :func:`reduce_scatter_int8`: each device splits its fp32 gradient into the N pieces the
  N devices own, quantizes each piece blockwise (:func:`zerojax.sharding.quantize.quantize`,
  blocks of ``block`` elements within the piece), and an all-to-all hands every device
  its piece from each device; it dequantizes the N pieces and sums them in fp32. One
  quantization per element and hop, never a quantized partial sum re-quantized (what a
  reduce-scatter of int8 values along a ring would do).
* :func:`all_reduce_int8`: the same exchange over a flat, padded view, then the fp32 sum
  of each piece is quantized again and all-gathered (two roundings): used for leaves
  whose gradient stays whole on every device and for the second hop of a hybrid mesh
  (the shard summed across replica groups).

An element's error per rounding is at most half its block's scale (the block's largest
magnitude / 254); the reduction adds N such errors. Bytes per device: ``Ψ`` int8 plus
``4 Ψ / block`` of scales, against ``4 Ψ`` for an fp32 reduce-scatter (about 0.25×).

A non-finite gradient is not hidden: its block's scale is inf or NaN, so the whole block
dequantizes to non-finite values and dynamic loss scaling skips the step, as it would
with an fp32 reduction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.sharding.leaf_layout import LeafLayout
from zerojax.sharding.quantize import dequantize, quantize


def pack(q: jax.Array, scale: jax.Array) -> jax.Array:
    """int8 values ``(..., m)`` and their fp32 scales ``(..., b)`` as one int8 buffer
    ``(..., m + 4 b)`` (the scales' bytes), so that one collective moves both."""
    raw = jax.lax.bitcast_convert_type(scale, jnp.int8)  # (..., b, 4)
    return jnp.concatenate([q, raw.reshape(*raw.shape[:-2], -1)], axis=-1)


def unpack(buf: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """The inverse of :func:`pack` for ``m`` values."""
    raw = buf[..., m:]
    return buf[..., :m], jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], -1, 4), jnp.float32)


def _dequantized(buf: jax.Array, m: int, block: int) -> jax.Array:
    q, scale = unpack(buf, m)
    return jax.vmap(lambda q, s: dequantize(q, s, block, jnp.float32))(q, scale)


def exchange_sum(pieces: jax.Array, axis: str, block: int) -> jax.Array:
    """Inside ``shard_map`` over ``axis`` (N devices): ``pieces`` is ``(N, m)`` fp32, piece
    ``j`` destined for device ``j``. Returns the fp32 sum, over devices, of the piece
    destined here, moved as blockwise int8 with its scales through one all-to-all."""
    m = pieces.shape[1]
    buf = pack(*jax.vmap(lambda p: quantize(p, block))(pieces))
    return _dequantized(jax.lax.all_to_all(buf, axis, 0, 0), m, block).sum(0)


def reduce_scatter_int8(layout: LeafLayout, full: jax.Array, axis: str, n: int, block: int) -> jax.Array:
    """This device's shard of ``layout``'s storage of the sum over ``axis`` of ``full``
    (fp32), the same shape and sharding as ``layout.scatter``'s."""
    if layout.kind == "replicated":
        return all_reduce_int8(full, axis, n, block)
    storage = layout.to_storage(full.astype(jnp.float32))
    k = layout.split_axis
    rows = jnp.moveaxis(storage, k, 0)  # (n * c, *rest): device j owns rows j*c .. (j+1)*c
    piece_shape = (rows.shape[0] // n, *rows.shape[1:])
    summed = exchange_sum(rows.reshape(n, -1), axis, block)
    return jnp.moveaxis(summed.reshape(piece_shape), 0, k)


def all_reduce_int8(x: jax.Array, axis: str, n: int, block: int) -> jax.Array:
    """The sum over ``axis`` (``n`` devices) of ``x`` (fp32, any shape) on every device:
    int8 all-to-all and fp32 sums of one piece each, then an int8 all-gather of the sums."""
    flat = x.astype(jnp.float32).reshape(-1)
    pad = -flat.shape[0] % n
    piece = exchange_sum(jnp.pad(flat, (0, pad)).reshape(n, -1), axis, block)
    gathered = jax.lax.all_gather(pack(*quantize(piece, block)), axis)  # (n, m + 4 b)
    whole = _dequantized(gathered, piece.shape[0], block).reshape(-1)
    return whole[: flat.shape[0]].reshape(x.shape)
