"""Attention over a sequence split across a context axis: Ulysses and ring attention.

:func:`dot_product_attention` has ``jax.nn.dot_product_attention``'s signature (and takes
the extra keywords Flax NNX's ``MultiHeadAttention`` passes its ``attention_fn``). Off a
context mesh (no ``"context"`` axis, or one of size 1) it *is* JAX's function. On one, the
sequence dimension (axis 1) of ``query``, ``key`` and ``value`` is split over the ``C``
devices of the axis, and:

* ``method="ulysses"`` (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a
  head split (each device: the whole sequence, ``N/C`` query heads and ``K/C`` key/value
  heads; GQA's key/value heads are repeated up to the query heads where ``K`` does not
  divide by ``C``), attention runs locally, and an all-to-all turns the result back: 4
  all-to-alls of ``B·S·H·D/C`` elements per device. Needs ``C`` to divide the query heads.
* ``method="ring"``: each device keeps its query chunk and the key/value chunks travel
  round the ring (``C - 1`` collective-permutes of K and of V), merged with an online
  softmax; any head count. With ``layout="balanced"`` (see :mod:`zerojax.nn.context`)
  causal attention costs every device the same.
* ``method="auto"``: Ulysses where ``C`` divides the query heads, else ring.
* ``method="xla"``: JAX's function on the global arrays, partitioned by XLA (it gathers
  the sequence: correct, not memory-saving).

Masks (``mask``, ``bias``, causal, sequence lengths, local windows) are applied by global
position, so every method gives JAX's result. Inside zerojax's train step (manual over the
data axes, the context axis automatic) and under ``jax.set_mesh(mesh)`` in a plain
``jax.jit`` alike, the kernels run as a ``shard_map`` manual over the context axis alone.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax.nn import context as ctx
from zerojax.sharding import jax_compat
from zerojax.sharding.mesh import context_size

METHODS = ("auto", "ulysses", "ring", "xla")
CONTEXT_AXIS = "context"


def _large_negative(dtype) -> jax.Array:
    # jax.nn.dot_product_attention's fill for masked logits (finite, so a fully masked row
    # averages every value, as JAX's does).
    return jnp.asarray(-0.7 * min(float(jnp.finfo(dtype).max), float(jnp.finfo(np.float32).max)), dtype)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None, implementation: str | None = None,
                          return_residual: bool = False, method: str = "auto", layout: str | None = None,
                          axis: str = CONTEXT_AXIS, mesh: Any = None, block_size: int = 512,
                          broadcast_dropout: bool = True, dropout_rng: Any = None, dropout_rate: float = 0.0,
                          deterministic: bool = False, dtype: Any = None, precision: Any = None, module: Any = None,
                          promote_dtype: Any = None, force_fp32_for_softmax: bool = False,
                          qk_attn_weights_einsum: Any = None, attn_weights_value_einsum: Any = None) -> jax.Array:
    """Scaled dot-product attention, ``[B, T, N, H]`` queries over ``[B, S, K, H]`` keys and
    values (``N`` a multiple of ``K``: grouped-query attention), as
    ``jax.nn.dot_product_attention``; on a mesh with a context axis, Ulysses or ring
    attention over it (see the module docstring).

    Args beyond JAX's:
      method: ``"auto"``, ``"ulysses"``, ``"ring"`` or ``"xla"``.
      layout: how the sequence is split over the context axis, ``"contiguous"`` or
        ``"balanced"`` (:mod:`zerojax.nn.context`); the arrays' sequence dimensions are in
        that layout's order. None: the train step's ``ZeroConfig.context_layout`` inside
        one, else contiguous.
      axis: the context axis's name.
      mesh: the mesh (default: the one in context, ``jax.sharding.get_abstract_mesh()``).
      block_size: keys per chunk of the local attention: each device computes its logits
        a chunk at a time, rematerialised in backward, so its memory is linear in the
        sequence (a divisor of the local key length; the largest not above this).
      broadcast_dropout ... attn_weights_value_einsum: what Flax's attention layers pass an
        ``attention_fn`` (NNX's ``MultiHeadAttention``; linen's passes only the keywords the
        function names, so they are named here): ``dtype`` casts the inputs, ``precision``
        goes to the matmuls, softmax is always fp32; attention dropout and custom einsums
        are refused rather than silently left out.

    Example:
      >>> import jax, jax.numpy as jnp, zerojax as zj
      >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
      >>> out = zj.nn.dot_product_attention(q, q, q, is_causal=True)   # no context mesh: JAX's
      >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, q, q, is_causal=True)))
      True
    """
    query, key, value, precision = _flax_arguments(query, key, value, dict(
        dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype, precision=precision,
        qk_attn_weights_einsum=qk_attn_weights_einsum, attn_weights_value_einsum=attn_weights_value_einsum))
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    given = mesh
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    c = context_size(mesh, axis)
    ctx._mark_aware()
    layout = ctx.current() if layout is None else layout
    if c > 1 and method == "xla" and layout != "contiguous":
        raise ValueError(f"method='xla' is JAX's function, which reads masks, causality and lengths by index; in "
                         f"the {layout!r} layout the indices are not the positions. Use method='ring' or "
                         f"'ulysses', or the contiguous layout.")
    if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
        mask = jnp.asarray(mask)
        if not (jnp.issubdtype(mask.dtype, jnp.floating) or jnp.issubdtype(mask.dtype, jnp.integer)):
            raise TypeError(f"mask must be boolean (True: attend) or 0/1 numbers as Flax's masks are, got {mask.dtype}.")
        mask = mask != 0  # Flax's masks (nn.make_causal_mask, nn.make_attention_mask) are 0/1 floats
    if c == 1 or method == "xla":
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
            implementation=implementation, return_residual=return_residual)
    if return_residual:
        raise ValueError("dot_product_attention(return_residual=True) is not available on a context mesh; call it "
                         "with method='xla' for JAX's function.")
    if implementation not in (None, "xla"):
        raise ValueError(f"implementation={implementation!r} is JAX's kernel choice; on a context mesh zerojax's "
                         f"kernels run (method={method!r}). Pass implementation=None.")
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"on a context mesh query, key and value are [batch, seq, heads, head_dim]; got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}.")
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    if v.shape[:3] != k.shape[:3] or k.shape[0] != b or k.shape[3] != h or n % kh:
        raise ValueError(f"query {q.shape}, key {k.shape} and value {v.shape} do not fit: key and value need "
                         f"query's batch and head_dim, one another's length and heads, and heads dividing {n}.")
    ctx.check(t, c, layout, "the query's sequence length")
    ctx.check(s, c, layout, "the key's sequence length")
    if is_causal and t != s:
        raise ValueError(f"is_causal with query length {t} and key length {s}: causal attention needs one sequence.")
    if method == "auto":
        method = "ulysses" if n % c == 0 else "ring"
    if method == "ulysses" and n % c:
        raise ValueError(f"Ulysses attention splits the {n} query heads over the {c} devices of {axis!r}, which do "
                         f"not divide them. Use method='ring' (any head count), or a context size dividing {n}.")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (keys per chunk), got {block_size!r}.")
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    window = None if local_window_size is None else (
        (local_window_size, local_window_size) if isinstance(local_window_size, int) else tuple(local_window_size))
    mask = _rank4(mask, "mask", (b, n, t, s))
    bias = _rank4(bias, "bias", (b, n, t, s))
    lengths = [jnp.full((b,), t if i == 0 else s, jnp.int32) if x is None else jnp.asarray(x, jnp.int32)
               for i, x in enumerate((query_seq_lengths, key_value_seq_lengths))]
    spec = _Spec(c=c, axis=axis, layout=layout, t=t, s=s, n=n, kh=kh, scale=scale, causal=bool(is_causal),
                 window=window, zero_padded_rows=query_seq_lengths is not None, precision=precision, mesh=given,
                 block=block_size)
    if method == "ulysses":
        return _ulysses(spec, q, k, v, mask, bias, lengths)
    return _ring(spec, q, k, v, mask, bias, lengths)


def chunked_attention(query, key, value, *, is_causal: bool = False, scale: float | None = None,
                      block_size: int = 512) -> jax.Array:
    """One device's attention as the context kernels compute it locally: keys a chunk of
    ``block_size`` at a time, merged with an online softmax in a rematerialised scan, so that
    neither forward nor backward holds more than one chunk's logits. ``[B, T, N, H]`` queries
    over ``[B, S, K, H]`` keys and values; JAX's result to rounding. (What a ring or Ulysses
    step costs each device, measured alone on one chip by ``experiments/gpu_throughput.py``.)

    Example:
      >>> import jax, jax.numpy as jnp, zerojax as zj
      >>> q = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
      >>> out = zj.nn.attention.chunked_attention(q, q, q, is_causal=True, block_size=16)
      >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, q, q, is_causal=True), atol=1e-5))
      True
    """
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    if is_causal and t != s:
        raise ValueError(f"is_causal with query length {t} and key length {s}: causal attention needs one sequence.")
    spec = _Spec(c=1, axis=None, layout="contiguous", t=t, s=s, n=n, kh=kh,
                 scale=1.0 / math.sqrt(h) if scale is None else float(scale), causal=bool(is_causal), window=None,
                 zero_padded_rows=False, precision=None, mesh=None, block=block_size)
    qpos, kpos = jnp.arange(t), jnp.arange(s)
    qlen, kvlen = jnp.full((b,), t, jnp.int32), jnp.full((b,), s, jnp.int32)
    acc, m, l = _attend(spec, q, k, v, qpos, kpos, qlen, kvlen, None, None)
    return _finish(spec, acc, m, l, qpos, qlen, q.dtype)


def _flax_arguments(query, key, value, kw: dict):
    for name in ("qk_attn_weights_einsum", "attn_weights_value_einsum"):
        if kw[name] is not None:
            raise ValueError(f"{name} (a custom einsum of Flax's attention) is not supported by "
                             "zj.nn.dot_product_attention; leave it unset.")
    if kw.get("dropout_rate", 0.0) and not kw.get("deterministic", False):
        raise ValueError(f"attention dropout (dropout_rate={kw['dropout_rate']}) is not supported by "
                         "zj.nn.dot_product_attention; set MultiHeadAttention(dropout_rate=0.0) or deterministic=True.")
    dtype = kw.get("dtype")
    if dtype is not None:
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    return query, key, value, kw.get("precision")


def _rank4(x, name: str, full: tuple[int, ...]):
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name} has shape {x.shape}; it must broadcast to [batch, heads, q_len, kv_len] {full}.")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    for d, (a, f) in enumerate(zip(x.shape, full)):
        if a not in (1, f):
            raise ValueError(f"{name} has shape {x.shape}, which does not broadcast to [batch, heads, q_len, kv_len] "
                             f"{full} (dimension {d}).")
    return x


class _Spec:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _valid(spec: _Spec, qpos, kpos, qlen, kvlen):
    """``[B, 1, 1, Tq, Sk]`` boolean: the logits the causal / window / length masks keep,
    by global position."""
    keep = (qpos[None, :, None] < qlen[:, None, None]) & (kpos[None, None, :] < kvlen[:, None, None])
    if spec.causal:
        keep = keep & (qpos[:, None] >= kpos[None, :])[None]
    if spec.window is not None:
        left, right = spec.window
        keep = keep & ((qpos[:, None] <= kpos[None, :] + left) & (qpos[:, None] >= kpos[None, :] - right))[None]
    return keep[:, None, None]


def _grouped(x, kh: int):
    """``[B, N|1, ...]`` -> ``[B, K|1, G|1, ...]`` (query heads grouped by key/value head)."""
    if x is None:
        return None
    return x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], kh, x.shape[1] // kh, *x.shape[2:])


def _logits(spec: _Spec, q, k, keep, mask, bias):
    """Masked, scaled logits ``[B, K, G, T, S]`` (fp32), what the masks keep, and the queries
    grouped by key/value head ``[B, T, K, G, H]``."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.promote_types(q.dtype, jnp.float32),
                        precision=spec.precision)
    logits = logits * jnp.asarray(spec.scale, logits.dtype)
    if bias is not None:
        logits = (logits + _grouped(bias, kh)).astype(logits.dtype)
    keep = keep if mask is None else keep & _grouped(mask, kh)
    return jnp.where(keep, logits, _large_negative(logits.dtype)).astype(jnp.float32), keep, qg


def _block(spec: _Spec, q, k, v, keep, mask, bias):
    """One block of attention, unnormalised: ``(acc [B,T,K,G,H], max [B,K,G,T], sum [B,K,G,T])``."""
    logits, _, _ = _logits(spec, q, k, keep, mask, bias)
    m = logits.max(axis=-1)
    p = jnp.exp(logits - m[..., None])
    acc = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                     precision=spec.precision)
    return acc, m, p.sum(axis=-1)


def _merge(a, b):
    """Two unnormalised partial attentions over disjoint keys, as one (online softmax)."""
    (acc, m, l), (acc2, m2, l2) = a, b
    new = jnp.maximum(m, m2)
    w, w2 = jnp.exp(m - new), jnp.exp(m2 - new)
    return (acc * jnp.moveaxis(w, -1, 1)[..., None] + acc2 * jnp.moveaxis(w2, -1, 1)[..., None], new, l * w + l2 * w2)


def _columns(x, start, size):
    """Key columns ``[start, start + size)`` of a mask or bias (whole where it broadcasts)."""
    if x is None or x.shape[3] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=3)


def _chunk_size(s: int, block: int) -> int:
    """The largest divisor of ``s`` not above ``block``."""
    return next(c for c in range(min(block, s), 0, -1) if s % c == 0)


def _attend(spec: _Spec, q, k, v, qpos, kpos, qlen, kvlen, mask, bias):
    """``q`` over the keys ``k`` / ``v`` (global positions ``qpos``, ``kpos``), unnormalised:
    ``(acc, max, sum)``, in chunks of at most ``spec.block`` keys. Forward and backward each
    hold one chunk's logits at a time, and backward keeps only the inputs and the row maxima
    (flash attention's backward: each chunk's logits recomputed, ``dq`` summed over chunks,
    ``dk`` and ``dv`` chunk by chunk), so memory is linear in the sequence. Masks and bias
    hold all key columns; each chunk slices its own. With a bias (whose gradient is
    quadratic anyway) it is JAX's autodiff of the chunked scan."""
    if bias is not None:
        return _attend_autodiff(spec, q, k, v, qpos, kpos, qlen, kvlen, mask, bias)
    return _flash(spec, q, k, v, qpos, kpos, qlen, kvlen, mask)


def _flash_forward(spec: _Spec, q, k, v, qpos, kpos, qlen, kvlen, mask):
    s = k.shape[1]
    blk = _chunk_size(s, spec.block)

    def chunk(j):
        start = j * blk
        kj, vj = (jax.lax.dynamic_slice_in_dim(x, start, blk, axis=1) for x in (k, v))
        return _block(spec, q, kj, vj, _valid(spec, qpos, jax.lax.dynamic_slice_in_dim(kpos, start, blk), qlen, kvlen),
                      _columns(mask, start, blk), None)

    first = chunk(0)
    if blk == s:
        return first
    out, _ = jax.lax.scan(lambda carry, j: (_merge(carry, chunk(j)), None), first, jnp.arange(1, s // blk))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec: _Spec, q, k, v, qpos, kpos, qlen, kvlen, mask):
    return _flash_forward(spec, q, k, v, qpos, kpos, qlen, kvlen, mask)


def _flash_fwd(spec, q, k, v, qpos, kpos, qlen, kvlen, mask):
    out = _flash_forward(spec, q, k, v, qpos, kpos, qlen, kvlen, mask)
    return out, (q, k, v, qpos, kpos, qlen, kvlen, mask, out[1])


def _flash_bwd(spec, res, cotangents):
    """The row maxima are the softmax's stabiliser: the normalised result does not depend on
    them, so their cotangent is dropped and ``acc = Σ exp(x - m)·v``, ``sum = Σ exp(x - m)``
    are differentiated at fixed ``m``."""
    q, k, v, qpos, kpos, qlen, kvlen, mask, m = res
    d_acc, _, d_l = cotangents
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    blk = _chunk_size(s, spec.block)
    d_acc = d_acc.astype(jnp.float32)  # [B, T, K, G, H]

    def chunk(dq, j):
        start = j * blk
        kj, vj = (jax.lax.dynamic_slice_in_dim(x, start, blk, axis=1) for x in (k, v))
        keep = _valid(spec, qpos, jax.lax.dynamic_slice_in_dim(kpos, start, blk), qlen, kvlen)
        logits, keep, qg = _logits(spec, q, kj, keep, _columns(mask, start, blk), None)
        p = jnp.exp(logits - m[..., None])  # [B, K, G, T, blk]
        dv = jnp.einsum("bkgts,btkgh->bskh", p, d_acc, precision=spec.precision)
        dp = jnp.einsum("btkgh,bskh->bkgts", d_acc, vj.astype(jnp.float32), precision=spec.precision) + d_l[..., None]
        dx = jnp.where(keep, p * dp, 0.0) * spec.scale
        dq = dq + jnp.einsum("bkgts,bskh->btkgh", dx, kj.astype(jnp.float32), precision=spec.precision)
        dk = jnp.einsum("bkgts,btkgh->bskh", dx, qg.astype(jnp.float32), precision=spec.precision)
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(chunk, jnp.zeros((b, t, kh, n // kh, h), jnp.float32), jnp.arange(s // blk))
    # [chunks, B, blk, K, H] -> [B, S, K, H]
    dk, dv = (jnp.moveaxis(x, 0, 1).reshape(b, s, kh, h) for x in (dk, dv))
    return (dq.reshape(b, t, n, h).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _attend_autodiff(spec: _Spec, q, k, v, qpos, kpos, qlen, kvlen, mask, bias):
    """:func:`_attend` with a bias: JAX's autodiff of a ``lax.scan`` over key chunks whose
    step is rematerialised (no chunk's logits are kept, but backward keeps the scan's carry,
    ``[B, T, N, H]``, for every chunk: memory grows as ``T·S/block``)."""
    s = k.shape[1]
    blk = _chunk_size(s, spec.block)

    def chunk(j):
        start = j * blk
        kj, vj = (jax.lax.dynamic_slice_in_dim(x, start, blk, axis=1) for x in (k, v))
        keep = _valid(spec, qpos, jax.lax.dynamic_slice_in_dim(kpos, start, blk), qlen, kvlen)
        return _block(spec, q, kj, vj, keep, _columns(mask, start, blk), _columns(bias, start, blk))

    if blk == s:  # one chunk: rematerialised too, so that backward keeps no logits
        return jax.checkpoint(chunk)(0)

    @jax.checkpoint
    def step(carry, j):
        return _merge(carry, chunk(j)), None

    first = jax.checkpoint(chunk)(0)
    out, _ = jax.lax.scan(step, first, jnp.arange(1, s // blk))
    return out


def _finish(spec: _Spec, acc, m, l, qpos, qlen, dtype):
    b, t = acc.shape[:2]
    out = acc / jnp.moveaxis(l, -1, 1)[..., None]
    out = out.reshape(b, t, -1, acc.shape[-1]).astype(dtype)
    if spec.zero_padded_rows:  # JAX zeroes the rows past query_seq_lengths
        out = out * (qpos[None, :] < qlen[:, None])[:, :, None, None].astype(out.dtype)
    return out


def _shard_map(spec: _Spec, body, in_specs, out_specs):
    am = jax.sharding.get_abstract_mesh()
    if spec.axis in jax_compat.manual_axes(am):  # already inside a shard_map manual over it
        return body
    kw = {} if spec.mesh is None else {"mesh": spec.mesh}
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names={spec.axis}, check_vma=False, **kw)


# ----------------------------------------------------------------------------------------------
# Ulysses: all-to-all from sequence-split to head-split and back.


def _ulysses(spec: _Spec, q, k, v, mask, bias, lengths):
    c, axis = spec.c, spec.axis
    if spec.kh % c:  # GQA with fewer key/value heads than devices: repeat them up to the query heads
        rep = spec.n // spec.kh
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    pos = jnp.asarray(ctx.order(spec.t, c, spec.layout))
    kpos = jnp.asarray(ctx.order(spec.s, c, spec.layout))

    def heads_spec(x):  # a mask or bias: its head dimension split with the heads, else whole
        return None if x is None else (P(None, axis) if x.shape[1] > 1 else P())

    def body(q, k, v, mask, bias, qlen, kvlen):
        q, k, v = (jax.lax.all_to_all(x, axis, 2, 1, tiled=True) for x in (q, k, v))
        acc, m, l = _attend(spec, q, k, v, pos, kpos, qlen, kvlen, mask, bias)
        out = _finish(spec, acc, m, l, pos, qlen, q.dtype)
        return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)

    seq = P(None, axis)
    run = _shard_map(spec, body, (seq, seq, seq, heads_spec(mask), heads_spec(bias), P(), P()), seq)
    return run(q, k, v, mask, bias, *lengths)


# ----------------------------------------------------------------------------------------------
# Ring: key/value chunks passed round the context axis, merged with an online softmax.


def _ring(spec: _Spec, q, k, v, mask, bias, lengths):
    c, axis = spec.c, spec.axis
    qpos_all = jnp.asarray(ctx.positions(spec.t, c, spec.layout))
    kpos_all = jnp.asarray(ctx.positions(spec.s, c, spec.layout))
    sc = spec.s // c
    perm = [(j, (j + 1) % c) for j in range(c)]

    def rows_spec(x):  # a mask or bias: its query rows split with the queries, key columns whole
        return None if x is None else P(None, None, axis if x.shape[2] > 1 else None)

    def body(q, k, v, mask, bias, qlen, kvlen):
        i = jax.lax.axis_index(axis)
        qpos = qpos_all[i]

        def attend(k, v, src):  # over the chunk of the device ``src`` (this device's at step 0)
            return _attend(spec, q, k, v, qpos, kpos_all[src], qlen, kvlen, _columns(mask, src * sc, sc),
                           _columns(bias, src * sc, sc))

        def full(out, k, v, src):
            return _merge(out, attend(k, v, src))

        update = full
        if _skips(spec, mask):
            # A sequence of no keys makes every logit of its rows masked, and JAX then
            # averages every value: only there is each block computed.
            some_keys = jnp.all(kvlen > 0)
            # Rematerialised: otherwise the switch hands each branch's residuals (the queries
            # among them) out per ring step, and the scan stacks them C times.
            update = jax.checkpoint(functools.partial(_causal_update, spec, q, qpos, kpos_all, qlen, kvlen, bias, i,
                                                      some_keys))

        def step(carry, s):  # a scan, not a Python loop: backward then runs the steps in turn
            out, k, v = carry
            k, v = jax.lax.ppermute(k, axis, perm), jax.lax.ppermute(v, axis, perm)
            return (update(out, k, v, (i - s) % c), k, v), None

        (out, _, _), _ = jax.lax.scan(step, (attend(k, v, i), k, v), jnp.arange(1, c))
        return _finish(spec, *out, qpos, qlen, q.dtype)

    seq = P(None, axis)
    run = _shard_map(spec, body, (seq, seq, seq, rows_spec(mask), rows_spec(bias), P(), P()), seq)
    return run(q, k, v, mask, bias, *lengths)


def _skips(spec: _Spec, mask) -> bool:
    """Whether the ring leaves out the key chunks causal attention masks whole: causal, and
    no ``mask`` (whose rows could be wholly masked, which JAX answers with the mean of every
    value; lengths and ``bias`` are fine)."""
    return spec.causal and mask is None


def _causal_update(spec: _Spec, q, qpos, kpos_all, qlen, kvlen, bias, i, some_keys, out, k, v, src):
    """A ring step of causal attention from device ``i`` over the keys of device ``src``
    (``src != i``), computing only the part the causal mask keeps.

    Contiguous layout: every key of ``src`` precedes every query of ``i`` when ``src < i``
    (the whole chunk), and follows it when ``src > i`` (nothing to do): device ``C - 1`` works
    on every step, device 0 on none. Balanced layout (device ``i`` holds chunks ``i`` and
    ``2C - 1 - i``): when ``src < i`` every query sees the early half of ``src``'s keys and none
    of its late half; when ``src > i`` the late half of the queries sees all of them and the
    early half none. Either way half a chunk's logits, on every device and every step.

    Each branch returns the chunk's unnormalised partial attention (a skipped part as one that
    weighs nothing), merged into ``out`` after the switch.
    """
    sc, t = k.shape[1], q.shape[1]
    acc0, m0, l0 = out
    nothing = lambda rows: (jnp.zeros((acc0.shape[0], rows) + acc0.shape[2:], acc0.dtype),
                            jnp.full(m0.shape[:-1] + (rows,), _large_negative(m0.dtype), m0.dtype),
                            jnp.zeros(l0.shape[:-1] + (rows,), l0.dtype))
    whole = lambda k, v, src: _attend(spec, q, k, v, qpos, kpos_all[src], qlen, kvlen, None, _columns(bias, src * sc, sc))
    if spec.layout == "contiguous":
        branches = [whole, lambda k, v, src: nothing(t)]
        branch = jnp.where(some_keys & (src > i), 1, 0)
    else:
        th, sh = t // 2, sc // 2

        def early(k, v, src):
            return _attend(spec, q, k[:, :sh], v[:, :sh], qpos, kpos_all[src][:sh], qlen, kvlen, None,
                           _columns(bias, src * sc, sh))

        def late(k, v, src):
            rows = bias if bias is None or bias.shape[2] == 1 else bias[:, :, th:]
            part = _attend(spec, q[:, th:], k, v, qpos[th:], kpos_all[src], qlen, kvlen, None,
                           _columns(rows, src * sc, sc))
            pad = nothing(th)
            return (jnp.concatenate([pad[0], part[0]], axis=1),
                    *(jnp.concatenate([a, b], axis=-1) for a, b in zip(pad[1:], part[1:])))

        branches = [whole, early, late]
        branch = jnp.where(some_keys, jnp.where(src < i, 1, 2), 0)
    return _merge(out, jax.lax.switch(branch, branches, k, v, src))
