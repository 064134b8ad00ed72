"""One device's attention, keys a chunk at a time, merged with an online softmax: the local
computation of every context kernel (:mod:`zerojax.context.kernels`) and of
:func:`zerojax.context.attention.chunked_attention`, with its own VJP (float32 throughout,
the inputs' dtype once at the end)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.context.kernel_spec import KernelSpec

FILL = -0.7 * float(np.finfo(np.float32).max)  # a hidden logit: far below any real one, finite


class Side(NamedTuple):
    """What masks one side of the logits (the query rows or the key columns) token by token:
    global positions ``int32[L]``, the sequences' lengths ``int32[B]`` (positions at or past
    them are padding) and segment ids ``int32[B, L]`` (None: none)."""

    pos: Any
    length: Any
    seg: Any = None

    def part(self, start, size: int) -> Side:
        """Tokens ``[start, start + size)``."""
        cut = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)
        return Side(cut(self.pos, 0), self.length, None if self.seg is None else cut(self.seg, 1))


def _valid(spec: KernelSpec, rows: Side, cols: Side):
    """``[B, 1, 1, Tq, Sk]`` boolean: the logits the causal / window / length / segment masks
    keep, by global position."""
    qpos, kpos = rows.pos[:, None], cols.pos[None, :]
    keep = (qpos[None] < rows.length[:, None, None]) & (kpos[None] < cols.length[:, None, None])
    if spec.causal:
        keep = keep & (qpos >= kpos)[None]
    if spec.window is not None:
        left, right = spec.window
        keep = keep & ((qpos <= kpos + left) & (qpos >= kpos - right))[None]
    if rows.seg is not None:
        keep = keep & (rows.seg[:, :, None] == cols.seg[:, None, :])
    return keep[:, None, None]


def _grouped(x, kh: int):
    """``[B, N|1, ...]`` -> ``[B, K|1, G|1, ...]`` (query heads grouped by key/value head)."""
    if x is None:
        return None
    return x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], kh, x.shape[1] // kh, *x.shape[2:])


def _logits(spec: KernelSpec, q, rows: Side, k, cols: Side, mask, bias, exists, scale, raw: bool = False):
    """Masked, scaled logits ``[B, K, G, T, S]`` (fp32), what the masks keep, and the queries
    grouped by key/value head ``[B, T, K, G, H]`` (and with ``raw``, the unscaled, unmasked
    ``q·k``). A masked logit is JAX's fill; a key that ``exists`` (``bool[S]``, None: all)
    leaves out is ``-inf``, whatever the masks say."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    qk = jnp.einsum(
        "btkgh,bskh->bkgts",
        qg,
        k,
        preferred_element_type=jnp.promote_types(q.dtype, jnp.float32),
        precision=spec.precision,
    )
    logits = qk * scale.astype(qk.dtype)
    if bias is not None:
        logits = (logits + _grouped(bias, kh)).astype(logits.dtype)
    keep = _valid(spec, rows, cols)
    if mask is not None:
        keep = keep & _grouped(mask, kh)
    logits = jnp.where(keep, logits, jnp.asarray(FILL, logits.dtype)).astype(jnp.float32)
    if exists is not None:
        logits = jnp.where(exists, logits, -jnp.inf)
    return (logits, keep, qg, qk.astype(jnp.float32)) if raw else (logits, keep, qg)


def _stabiliser(m):
    """What a row's exponentials are taken against: its maximum logit, or 0 where that is
    ``-inf`` (every logit ``-inf``: then each ``exp(x - 0)`` is 0, where ``x - max`` is NaN)."""
    return jnp.where(m == -jnp.inf, jnp.zeros_like(m), m)


def _block(spec: KernelSpec, q, rows: Side, k, v, cols: Side, mask, bias, exists, scale):
    """One chunk of keys, unnormalised: ``(acc [B,T,K,G,H], max [B,K,G,T], sum [B,K,G,T])``.
    The max is the softmax's stabiliser, on which the normalised result does not depend: it
    carries no gradient (as in ``jax.nn.softmax``; :func:`_flash_bwd` differentiates at a
    fixed max), and the max's derivative, which counts the logits equal to it, is never
    taken (a recomputed logit may differ from the max in the last bit, and that count's
    division by zero once made NaN gradients)."""
    logits, _, _ = _logits(spec, q, rows, k, cols, mask, bias, exists, scale)
    m = jax.lax.stop_gradient(logits.max(axis=-1))
    p = jnp.exp(logits - _stabiliser(m)[..., None])
    acc = jnp.einsum(
        "bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=spec.precision
    )
    return acc, m, p.sum(axis=-1)


def merge(a, b):
    """Two unnormalised partial attentions over disjoint keys, as one (online softmax). A
    part whose max is ``-inf`` (no key but ``-inf`` ones) weighs nothing; both ``-inf``: the
    merged part is empty too, and the row's result NaN, as JAX's."""
    (acc, m, l), (acc2, m2, l2) = a, b
    m, m2 = jax.lax.stop_gradient(m), jax.lax.stop_gradient(m2)
    new = jnp.maximum(m, m2)
    ref = _stabiliser(new)
    w, w2 = jnp.exp(m - ref), jnp.exp(m2 - ref)
    return (acc * jnp.moveaxis(w, -1, 1)[..., None] + acc2 * jnp.moveaxis(w2, -1, 1)[..., None], new, l * w + l2 * w2)


def unseen(v, rows: int, groups: int):
    """The partial attention of ``rows`` query rows over keys every one of them has masked
    (a chunk the causal mask hides), without computing a logit: each is the fill, so the
    part is ``(Σ v, fill, key count)``. A row that sees some key elsewhere weighs it at
    ``exp(fill - max) = 0``; a row that sees none (masked by lengths, windows, ``mask`` or
    segments) counts it in full, and gets the mean of every value, as JAX's."""
    b, s, kh, h = v.shape
    acc = jnp.broadcast_to(v.astype(jnp.float32).sum(axis=1)[:, None, :, None, :], (b, rows, kh, groups, h))
    like = jnp.moveaxis(acc[..., 0], 1, -1)  # [B, K, G, rows], derived from v (varying where v is)
    return acc, jnp.full_like(like, FILL), jnp.full_like(like, float(s))


def stack_rows(a, b):
    """Two partial attentions of consecutive query rows over the same keys, as one."""
    return (jnp.concatenate([a[0], b[0]], axis=1), *(jnp.concatenate([x, y], axis=-1) for x, y in zip(a[1:], b[1:])))


def rows_of(x, start: int, size: int):
    """Query rows ``[start, start + size)`` of a mask or bias (whole where it broadcasts)."""
    if x is None or x.shape[2] == 1:
        return x
    return x[:, :, start : start + size]


def columns(x, start, size):
    """Key columns ``[start, start + size)`` of a mask or bias (whole where it broadcasts)."""
    if x is None or x.shape[3] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=3)


def _chunking(s: int, block: int) -> tuple[int, int]:
    """``(keys per chunk, chunks)`` for ``s`` keys: ``block`` keys (all ``s`` where fewer)."""
    size = min(block, s)
    return size, -(-s // size)


def _key_chunk(j, size: int, k, v, cols: Side, mask, bias):
    """Chunk ``j`` of ``size`` keys: ``(k, v, cols, mask, bias, exists)``. Where ``size`` does
    not divide the key count the last chunk ends at the last key, overlapping the one before,
    and ``exists`` (else None) leaves out the keys it repeats (logits ``-inf``: they weigh
    nothing, even in a row that sees no key)."""
    s = k.shape[1]
    if s % size == 0:
        start, exists = j * size, None
    else:
        start = jnp.minimum(j * size, s - size)
        exists = start + jnp.arange(size) >= j * size
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
    return cut(k), cut(v), cols.part(start, size), columns(mask, start, size), columns(bias, start, size), exists


def _unchunk(x, s: int):
    """Per-chunk key gradients ``[chunks, B, size, K, H]`` -> ``[B, s, K, H]`` (the last chunk's
    repeated keys dropped: their gradients are zero)."""
    count, b, size = x.shape[:3]
    x = jnp.moveaxis(x, 0, 1)
    if count * size == s:
        return x.reshape(b, s, *x.shape[3:])
    head = x[:, :-1].reshape(b, (count - 1) * size, *x.shape[3:])
    return jnp.concatenate([head, x[:, -1, count * size - s :]], axis=1)


def attend(spec: KernelSpec, q, rows: Side, k, v, cols: Side, mask, bias, scale):
    """``q`` over the keys ``k`` / ``v`` (masked by ``rows`` and ``cols``), unnormalised:
    ``(acc, max, sum)``, in chunks of ``spec.block`` keys. Forward and backward each
    hold one chunk's logits at a time, and backward keeps only the inputs and the row maxima
    (flash attention's backward: each chunk's logits recomputed, ``dq`` summed over chunks,
    ``dk``, ``dv`` and the bias's gradient chunk by chunk, all in float32), so memory is
    linear in the sequence (but for a bias's gradient, which is the bias's size). Masks and
    bias hold all key columns; each chunk slices its own. ``scale`` is a scalar array (a
    traced one too: a learned temperature), differentiated as the rest."""
    if spec.local:
        # Inside a user's shard_map that checks varying axes, the custom VJP's gradients of
        # a scale or bias the queries vary over must vary too: they enter as varying (an
        # addition of 0), whose transpose sums their gradients over the axis.
        zero = lambda x: None if x is None else x + jnp.zeros_like(q, shape=(), dtype=x.dtype)
        bias, scale = zero(bias), zero(scale)
    return _flash(spec, q, k, v, bias, scale, rows, cols, mask)


def _flash_forward(spec: KernelSpec, q, k, v, bias, scale, rows: Side, cols: Side, mask):
    size, count = _chunking(k.shape[1], spec.block)

    def chunk(j):
        kj, vj, cj, mj, bj, exists = _key_chunk(j, size, k, v, cols, mask, bias)
        return _block(spec, q, rows, kj, vj, cj, mj, bj, exists, scale)

    first = chunk(0)
    if count == 1:
        return first
    out, _ = jax.lax.scan(lambda carry, j: (merge(carry, chunk(j)), None), first, jnp.arange(1, count))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec: KernelSpec, q, k, v, bias, scale, rows: Side, cols: Side, mask):
    return _flash_forward(spec, q, k, v, bias, scale, rows, cols, mask)


def _flash_fwd(spec, q, k, v, bias, scale, rows, cols, mask):
    out = _flash_forward(spec, q, k, v, bias, scale, rows, cols, mask)
    return out, (q, k, v, bias, scale, rows, cols, mask, out[1])


def _flash_bwd(spec, res, cotangents):
    """The row maxima are the softmax's stabiliser: the normalised result does not depend on
    them, so their cotangent is dropped and ``acc = Σ exp(x - m)·v``, ``sum = Σ exp(x - m)``
    are differentiated at fixed ``m``. Every product and sum is float32 (the inputs' dtype
    only at the end, once): ``exp(x - m)``'s cotangent from ``acc`` and the one from ``sum``
    then cancel where they should (a row that sees one key has logit gradients of 0, as
    JAX's), which a bfloat16 cotangent from ``acc`` beside a float32 one from ``sum`` does not.
    A logit's gradient ``dx`` is the bias's (summed where the bias broadcasts); ``dx · q·k`` is
    the scale's."""
    q, k, v, bias, scale, rows, cols, mask, m = res
    d_acc, _, d_l = cotangents
    b, t, n, h = q.shape
    s = k.shape[1]
    size, count = _chunking(s, spec.block)
    d_acc = d_acc.astype(jnp.float32)  # [B, T, K, G, H]
    ref = _stabiliser(m)[..., None]
    f32 = lambda x: x.astype(jnp.float32)
    keys_broadcast = bias is not None and bias.shape[3] == 1

    def chunk(carry, j):
        dq, dscale, dbias_sum = carry
        kj, vj, cj, mj, bj, exists = _key_chunk(j, size, k, v, cols, mask, bias)
        logits, keep, qg, raw = _logits(spec, q, rows, kj, cj, mj, bj, exists, scale, raw=True)
        p = jnp.exp(logits - ref)  # [B, K, G, T, size]; 0 where a key is left out
        dv = jnp.einsum("bkgts,btkgh->bskh", p, d_acc, precision=spec.precision)
        dp = jnp.einsum("btkgh,bskh->bkgts", d_acc, f32(vj), precision=spec.precision) + d_l[..., None]
        dx = jnp.where(keep, p * dp, 0.0)  # the logits' gradient
        dscale = dscale + jnp.sum(dx * raw)
        ds = dx * f32(scale)
        dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds, f32(kj), precision=spec.precision)
        dk = jnp.einsum("bkgts,btkgh->bskh", ds, f32(qg), precision=spec.precision)
        dbias = None
        if bias is not None:
            dbias = _to_bias(dx.reshape(b, n, t, -1), bias.shape)  # [B|1, N|1, T|1, size|1]
            if keys_broadcast:
                dbias_sum, dbias = dbias_sum + dbias, None
        return (dq, dscale, dbias_sum), (dk, dv, dbias)

    # zeros derived from d_acc: varying over a manual axis where the cotangents are
    zero_bias = jnp.zeros_like(d_acc, shape=bias.shape) if keys_broadcast else None
    carry = (jnp.zeros_like(d_acc), jnp.zeros_like(d_acc, shape=()), zero_bias)
    (dq, dscale, dbias_sum), (dk, dv, dbias) = jax.lax.scan(chunk, carry, jnp.arange(count))
    if bias is not None:
        if not keys_broadcast:  # [chunks, B|1, N|1, T|1, size] -> [B|1, N|1, T|1, S]
            dbias_sum = jnp.moveaxis(_unchunk(jnp.moveaxis(dbias, -1, 2), s), 1, -1)
        dbias_sum = dbias_sum.astype(bias.dtype)
    return (
        dq.reshape(b, t, n, h).astype(q.dtype),
        _unchunk(dk, s).astype(k.dtype),
        _unchunk(dv, s).astype(v.dtype),
        dbias_sum,
        dscale.astype(scale.dtype),
        None,
        None,
        None,
    )


_flash.defvjp(_flash_fwd, _flash_bwd)


def _to_bias(dx, shape: tuple[int, ...]):
    """A logits-shaped gradient ``[B, N, T, S]`` summed over the dimensions a bias of ``shape``
    (rank 4) broadcasts over."""
    dims = tuple(d for d, size in enumerate(shape) if size == 1 and dx.shape[d] != 1)
    return dx.sum(axis=dims, keepdims=True) if dims else dx


def finish(spec: KernelSpec, part, rows: Side, dtype):
    """A partial attention normalised, ``[B, T, N, H]`` (NaN in a row whose every logit is
    ``-inf``, as JAX's)."""
    acc, _, l = part
    b, t = acc.shape[:2]
    out = acc / jnp.moveaxis(l, -1, 1)[..., None]
    out = out.reshape(b, t, -1, acc.shape[-1]).astype(dtype)
    if spec.zero_padded_rows:  # JAX zeroes the rows past query_seq_lengths
        out = out * (rows.pos[None, :] < rows.length[:, None])[:, :, None, None].astype(out.dtype)
    return out
