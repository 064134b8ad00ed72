"""Attention over a sequence split across a context axis: Ulysses and ring attention.

:func:`dot_product_attention` has ``jax.nn.dot_product_attention``'s signature (and takes
the extra keywords Flax NNX's ``MultiHeadAttention`` passes its ``attention_fn``), plus
``segment_ids`` for packed sequences. Off a context mesh (no ``"context"`` axis, or one of
size 1) it calls JAX's function, with two inputs JAX's function does not take written as
the boolean mask they mean: Flax's 0/1 masks (see :func:`dot_product_attention` for the
rule) and segment ids. On one, the sequence dimension (axis 1) of ``query``, ``key`` and
``value`` is split over the ``C`` devices of the axis, and:

* ``method="ulysses"`` (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a
  head split (each device: the whole sequence, ``N/C`` query heads and ``K/C`` key/value
  heads; GQA's key/value heads are repeated up to the query heads where ``K`` does not
  divide by ``C``), attention runs locally, and an all-to-all turns the result back: 4
  all-to-alls of ``B·S·H·D/C`` elements per device. Needs ``C`` to divide the query heads.
* ``method="ring"``: each device keeps its query chunk and the key/value chunks travel
  round the ring (``C - 1`` collective-permutes of K and of V), merged with an online
  softmax; any head count. Causal attention leaves out the chunks the causal mask hides;
  with ``layout="balanced"`` (see :mod:`zerojax.context.layout`) it costs every device the same.
* ``method="auto"``: Ulysses where ``C`` divides the query heads, else ring.
* ``method="xla"``: JAX's function on the global arrays, partitioned by XLA (it gathers
  the sequence: correct, not memory-saving).

Masks (``mask``, ``bias``, causal, sequence lengths, local windows, segment ids) are
applied by global position, so every method gives JAX's result, the rows JAX answers with
an average (every key masked) and with NaN (every key's bias ``-inf`` and none masked)
included. Inside zerojax's train step (manual over the data axes, the context axis
automatic) and under ``jax.set_mesh(mesh)`` in a plain ``jax.jit`` alike, the kernels run
as a ``shard_map`` manual over the context axis alone; inside a user's ``shard_map`` that
is already manual over it, on the local chunks.

The local attention takes the keys a chunk of ``block_size`` at a time. Each chunk's
partial result is ``(acc, max, sum)``: ``Σ exp(x - max)·v`` and ``Σ exp(x - max)`` over its
keys, ``x`` the logits after masking. A masked logit is JAX's fill, ``-0.7 ·
finfo(float32).max`` (so a row whose every key is masked averages every value, as JAX's
does); a bias of ``-inf`` stays ``-inf``. A chunk whose keys are all ``-inf`` for a row has
``max = -inf`` and weighs nothing (its exponentials are taken against 0, never against
``-inf``); a chunk the causal mask hides from every row is not computed but merged as what
it is, every logit the fill: ``max`` the fill, ``Σ v`` and its key count (:func:`_unseen`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax._jaxpr import check, settings
from zerojax.context.layout import KERNEL_SCOPE, Layout, axis_of, resolve
from zerojax.sharding.mesh import context_size

METHODS = ("auto", "ulysses", "ring", "xla")
# jax.nn.dot_product_attention's fill for masked logits (finite, so that a fully masked row
# averages every value, as JAX's does); the kernels' logits are float32.
_FILL = -0.7 * float(np.finfo(np.float32).max)


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    segment_ids=None,
    key_value_segment_ids=None,
    method: str = "auto",
    layout: Layout | str | None = None,
    axis: str | None = None,
    mesh: Any = None,
    block_size: int = 512,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Any = None,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Any = None,
    attn_weights_value_einsum: Any = None,
) -> jax.Array:
    """Scaled dot-product attention, ``[B, T, N, H]`` queries over ``[B, S, K, H]`` keys and
    values (``N`` a multiple of ``K``: grouped-query attention), as
    ``jax.nn.dot_product_attention``; on a mesh with a context axis, Ulysses or ring
    attention over it (see the module docstring).

    Masks. ``mask`` is boolean (True: attend), as JAX's. Flax's masks are 0/1 numbers
    (``nn.make_attention_mask`` and ``nn.make_causal_mask`` give float32, and Flax's attention
    layers pass them on), so a mask of numbers is taken where every value is 0 or 1. Any other
    value means it is not such a mask, most likely an additive one (0 where kept, ``-inf``
    where masked, as PyTorch's), which read as 0/1 would mask what it keeps. A concrete mask's
    values are checked, and such a mask is refused with a ``ValueError`` naming them. Under
    ``jax.jit`` the values are not known while tracing, and refusing every traced number mask
    would refuse Flax's layers; so each query row whose mask holds a value other than 0 and 1
    is made NaN (the output and the gradients through it), at the cost of one pass over the
    mask and one over the queries: a wrong mask gives a NaN loss, never a plausible number.
    (An additive mask's rows that mask nothing, all 0, read as rows that mask every key; its
    other rows still make the NaNs.) An additive mask goes in ``bias=``.

    A row whose every key is masked (by ``mask``, causality, lengths, windows or segments) is
    the mean of every value, as JAX's. A row whose every key has a ``bias`` of ``-inf`` with
    none masked is NaN, as JAX's (with ``finfo.min`` instead of ``-inf`` it is the mean of the
    values); where some of its keys are masked it is the mean of those keys' values, as JAX's.

    Args beyond JAX's:
      segment_ids: ``int[B, T]``, for packed sequences: each query attends only to the keys
        of its own segment (document), ``segment_ids[b, t] == key_value_segment_ids[b, s]``,
        on top of every other mask; causality and windows stay by position in the packed
        row. Positions that restart per document are the model's (``docs/long_context.md``).
        On a context mesh they are a sequence-indexed input like the tokens (in the
        balanced layout, in its order). Off one they become the boolean mask they mean
        (``[B, 1, T, S]``, beside ``mask``) for JAX's function.
      key_value_segment_ids: ``int[B, S]``, the keys' segment ids (default: ``segment_ids``,
        which needs ``S == T``).
      method: ``"auto"``, ``"ulysses"``, ``"ring"`` or ``"xla"``.
      layout: how the sequence is split over the context axis: a
        :class:`zerojax.context.Layout` (the one the train step hands the loss with
        ``with_layout=True``), ``"contiguous"``, ``"balanced"``, or None (contiguous); the
        arrays' sequence dimensions are in that layout's order.
      axis: the context axis's name (default: the ``layout``'s own, which the step's layout
        names, else ``"context"``). An ``axis`` other than the layout's is refused, as are a
        layout over more devices than the mesh gives its axis and ``layout="balanced"``
        without an axis on a mesh with no ``"context"`` axis: the kernel never guesses.
      mesh: the mesh (default: the one in context, ``jax.sharding.get_abstract_mesh()``).
      block_size: keys per chunk of the local attention: each device computes its logits
        a chunk at a time, rematerialised in backward, so its memory is linear in the
        sequence. Every chunk has ``block_size`` keys (all the local keys where fewer): where
        it does not divide their number the last chunk ends at the last key, overlapping the
        one before, and the keys it repeats are left out of it exactly.
      broadcast_dropout ... attn_weights_value_einsum: what Flax's attention layers pass an
        ``attention_fn`` (NNX's ``MultiHeadAttention``; linen's passes only the keywords the
        function names, so they are named here): ``dtype`` casts the inputs, ``precision``
        goes to the matmuls, softmax is always fp32; attention dropout and custom einsums
        are refused rather than silently left out.

    Inside a ``shard_map`` already manual over ``axis`` (a user's own), the arrays are this
    device's: ``query``, ``key``, ``value`` and the segment ids are its chunks of the sequence
    (``[B, T/C, ...]``, in the layout's order), ``mask`` and ``bias`` are given whole (their
    query and key dimensions 1 or the global ``T`` and ``S``, the same on every device), and
    the lengths are global positions.

    Example:
      >>> import jax, jax.numpy as jnp, zerojax as zj
      >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
      >>> out = zj.nn.dot_product_attention(q, q, q, is_causal=True)   # no context mesh: JAX's
      >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, q, q, is_causal=True)))
      True
    """
    query, key, value, precision = _flax_arguments(
        query,
        key,
        value,
        dict(
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            precision=precision,
            qk_attn_weights_einsum=qk_attn_weights_einsum,
            attn_weights_value_einsum=attn_weights_value_einsum,
        ),
    )
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    scale = _scale(scale)
    given = mesh
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    axis = axis_of(layout, axis, mesh)
    c = context_size(mesh, axis)
    lay = resolve(layout, c, axis)
    if lay.moves:  # a step checks the loss's order for it by reading the program
        check.require(
            f"zj.nn.dot_product_attention with the {lay.kind!r} layout",
            "Use the contiguous layout (ZeroConfig(context={'layout': 'contiguous'}); layout=None here).",
        )
    layout = lay.kind
    local = c > 1 and axis in _manual_axes()
    if c > 1 and method == "xla":
        _check_xla(layout, local, axis)
    mask, query = _boolean_mask(mask, query)
    if c == 1 or method == "xla":
        return _jax_attention(
            query,
            key,
            value,
            bias,
            mask,
            segment_ids,
            key_value_segment_ids,
            scale=scale,
            is_causal=is_causal,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size,
            implementation=implementation,
            return_residual=return_residual,
        )
    _check_kernel_arguments(return_residual, implementation, method)
    q, k, v = _check_arrays(query, key, value)
    b, tl, n, h = q.shape
    sl, kh = k.shape[1], k.shape[2]
    t, s = (tl * c, sl * c) if local else (tl, sl)  # the global lengths
    here = f" (this device's {tl} x {c} devices of {axis!r})" if local else ""
    lay.check(t, f"the query's sequence length{here}", in_loss=True)
    lay.check(s, f"the key's sequence length{here}", in_loss=True)
    if is_causal and t != s:
        raise ValueError(f"is_causal with query length {t} and key length {s}: causal attention needs one sequence.")
    method = _kernel(method, n, c, axis)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (keys per chunk), got {block_size!r}.")
    whole = (
        (
            f" Inside a shard_map manual over {axis!r} the query, key and value are this device's chunks and a "
            f"mask or bias is given whole (query and key dimensions 1 or the global {t} and {s})."
        )
        if local
        else ""
    )
    mask = _rank4(mask, "mask", (b, n, t, s), whole)
    bias = _rank4(bias, "bias", (b, n, t, s), whole)
    lengths = [
        jnp.full((b,), t if i == 0 else s, jnp.int32) if x is None else jnp.asarray(x, jnp.int32)
        for i, x in enumerate((query_seq_lengths, key_value_seq_lengths))
    ]
    segments = _segment_ids(segment_ids, key_value_segment_ids, b, tl, sl, here)
    window = (
        None
        if local_window_size is None
        else (
            (local_window_size, local_window_size) if isinstance(local_window_size, int) else tuple(local_window_size)
        )
    )
    scale = jnp.asarray(1.0 / math.sqrt(h), jnp.float32) if scale is None else scale
    spec = _Spec(
        c=c,
        axis=axis,
        layout=layout,
        t=t,
        s=s,
        n=n,
        kh=kh,
        causal=bool(is_causal),
        window=window,
        zero_padded_rows=query_seq_lengths is not None,
        precision=precision,
        mesh=given,
        block=block_size,
        local=local,
    )
    with jax.named_scope(f"{KERNEL_SCOPE}{layout}"):  # the layout it was traced with, in the program
        return (_ulysses if method == "ulysses" else _ring)(spec, q, k, v, mask, bias, scale, lengths, segments)


def chunked_attention(
    query, key, value, *, is_causal: bool = False, scale: float | None = None, block_size: int = 512
) -> jax.Array:
    """One device's attention as the context kernels compute it locally: keys a chunk of
    ``block_size`` at a time, merged with an online softmax in a rematerialised scan, so that
    neither forward nor backward holds more than one chunk's logits. ``[B, T, N, H]`` queries
    over ``[B, S, K, H]`` keys and values; JAX's result to rounding. (What a ring or Ulysses
    step costs each device, measured alone on one chip by ``experiments/gpu_throughput.py``.)

    Example:
      >>> import jax, jax.numpy as jnp, zerojax as zj
      >>> q = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
      >>> out = zj.context.attention.chunked_attention(q, q, q, is_causal=True, block_size=16)
      >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, q, q, is_causal=True), atol=1e-5))
      True
    """
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    if is_causal and t != s:
        raise ValueError(f"is_causal with query length {t} and key length {s}: causal attention needs one sequence.")
    spec = _Spec(
        c=1,
        axis=None,
        layout="contiguous",
        t=t,
        s=s,
        n=n,
        kh=kh,
        causal=bool(is_causal),
        window=None,
        zero_padded_rows=False,
        precision=None,
        mesh=None,
        block=block_size,
        local=False,
    )
    rows = _Side(jnp.arange(t), jnp.full((b,), t, jnp.int32))
    cols = _Side(jnp.arange(s), jnp.full((b,), s, jnp.int32))
    scale = _scale(scale)
    scale = jnp.asarray(1.0 / math.sqrt(h), jnp.float32) if scale is None else scale
    return _finish(spec, _attend(spec, q, rows, k, v, cols, None, None, scale), rows, q.dtype)


# ----------------------------------------------------------------------------------------------
# Arguments.


def _flax_arguments(query, key, value, kw: dict):
    for name in ("qk_attn_weights_einsum", "attn_weights_value_einsum"):
        if kw[name] is not None:
            raise ValueError(
                f"{name} (a custom einsum of Flax's attention) is not supported by "
                "zj.nn.dot_product_attention; leave it unset."
            )
    if kw.get("dropout_rate", 0.0) and not kw.get("deterministic", False):
        raise ValueError(
            f"attention dropout (dropout_rate={kw['dropout_rate']}) is not supported by "
            "zj.nn.dot_product_attention; set MultiHeadAttention(dropout_rate=0.0) or deterministic=True."
        )
    dtype = kw.get("dtype")
    if dtype is not None:
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    return query, key, value, kw.get("precision")


def _scale(scale):
    """``scale`` as a scalar array (None stays None: ``1/sqrt(head_dim)``). A number, or a
    scalar array, traced too (a learned temperature: the kernels take it as an operand and
    differentiate it); anything else is refused."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.number, np.ndarray, jax.Array)):
        raise TypeError(
            f"scale must be a number or a scalar array (e.g. a learned temperature), got {type(scale).__name__}: "
            f"{scale!r}."
        )
    x = scale if _is_traced(scale) else jnp.asarray(scale)
    if x.size != 1:
        raise ValueError(
            f"scale must be a scalar (it multiplies every logit), got shape {x.shape}; a per-head or per-key "
            f"scale goes into the queries or keys (or bias=)."
        )
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"scale must be a real number, got dtype {x.dtype}.")
    x = x.reshape(())
    return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


def _manual_axes() -> frozenset[str]:
    """The mesh axes the code being traced is manual over (inside a ``shard_map``)."""
    return settings.manual_axes(jax.sharding.get_abstract_mesh())


def _check_xla(layout: str, local: bool, axis: str) -> None:
    if local:
        raise ValueError(
            f"method='xla' is JAX's function on the arrays it is given; inside a shard_map manual over "
            f"{axis!r} they are this device's chunks, so it would attend within the chunk. Use "
            f"method='ring' or 'ulysses'."
        )
    if layout != "contiguous":
        raise ValueError(
            f"method='xla' is JAX's function, which reads masks, causality and lengths by index; in "
            f"the {layout!r} layout the indices are not the positions. Use method='ring' or "
            f"'ulysses', or the contiguous layout."
        )


def _check_kernel_arguments(return_residual: bool, implementation, method: str) -> None:
    if return_residual:
        raise ValueError(
            "dot_product_attention(return_residual=True) is not available on a context mesh; call it "
            "with method='xla' for JAX's function."
        )
    if implementation not in (None, "xla"):
        raise ValueError(
            f"implementation={implementation!r} is JAX's kernel choice; on a context mesh zerojax's "
            f"kernels run (method={method!r}). Pass implementation=None."
        )


def _check_arrays(query, key, value):
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"on a context mesh query, key and value are [batch, seq, heads, head_dim]; got shapes "
            f"{q.shape}, {k.shape}, {v.shape}."
        )
    n, kh = q.shape[2], k.shape[2]
    if v.shape[:3] != k.shape[:3] or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or n % kh:
        raise ValueError(
            f"query {q.shape}, key {k.shape} and value {v.shape} do not fit: key and value need "
            f"query's batch and head_dim, one another's length and heads, and heads dividing {n}."
        )
    return q, k, v


def _kernel(method: str, n: int, c: int, axis: str) -> str:
    """``"ulysses"`` or ``"ring"``: ``method``, or the one ``"auto"`` picks for ``n`` query heads."""
    if method == "auto":
        return "ulysses" if n % c == 0 else "ring"
    if method == "ulysses" and n % c:
        raise ValueError(
            f"Ulysses attention splits the {n} query heads over the {c} devices of {axis!r}, which do "
            f"not divide them. Use method='ring' (any head count), or a context size dividing {n}."
        )
    return method


def _is_traced(x) -> bool:
    return settings.is_tracer(x)


def _boolean_mask(mask, query):
    """``(mask, query)`` with ``mask`` boolean: Flax's 0/1 numbers taken as True / False. A
    concrete mask with any other value is refused; a traced one makes NaN of the query rows
    whose mask holds one (the rule in :func:`dot_product_attention`'s docstring)."""
    if mask is None:
        return None, query
    traced = _is_traced(mask)
    mask = mask if traced else jnp.asarray(mask)
    if mask.dtype == jnp.bool_:
        return mask, query
    if not (jnp.issubdtype(mask.dtype, jnp.floating) or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise TypeError(
            f"mask must be boolean (True: attend) or Flax's 0/1 numbers, got {mask.dtype}; an additive "
            f"mask (0 where kept, -inf where masked) goes in bias=."
        )
    if not traced:
        values = np.asarray(mask)
        odd = np.unique(values[(values != 0) & (values != 1)])
        if odd.size:
            shown = ", ".join(str(x) for x in odd[:4]) + (", ..." if odd.size > 4 else "")
            raise ValueError(
                f"mask holds values other than 0 and 1 ({shown}): a mask is boolean (True: attend), or "
                f"Flax's 0/1 numbers (nn.make_attention_mask, nn.make_causal_mask). An additive mask "
                f"(0 where kept, -inf where masked) goes in bias=."
            )
        return mask != 0, query
    odd = _as_rank4((mask != 0) & (mask != 1)).any(axis=-1)  # [B|1, N|1, T|1]: rows holding another value
    q = jnp.asarray(query)
    q4 = q.reshape((1,) * (4 - q.ndim) + q.shape)
    poison = jnp.where(jnp.moveaxis(odd, 1, 2)[..., None], jnp.nan, 0).astype(q.dtype)  # [B|1, T|1, N|1, 1]
    return mask != 0, (q4 + poison).reshape(q.shape)  # an addition: the NaN reaches the gradients too


def _as_rank4(x):
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _rank4(x, name: str, full: tuple[int, ...], hint: str = ""):
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(
            f"{name} has shape {x.shape}; it must broadcast to [batch, heads, q_len, kv_len] {full}." + hint
        )
    x = _as_rank4(x)
    for d, (a, f) in enumerate(zip(x.shape, full)):
        if a not in (1, f):
            raise ValueError(
                f"{name} has shape {x.shape}, which does not broadcast to [batch, heads, q_len, kv_len] "
                f"{full} (dimension {d}).{hint}"
            )
    return x


def _segment_ids(segment_ids, key_value_segment_ids, b: int, t: int, s: int, here: str = ""):
    """``(query ids, key ids)``, ``int32[B, T]`` and ``int32[B, S]``, or ``(None, None)``."""
    if segment_ids is None:
        if key_value_segment_ids is not None:
            raise ValueError(
                "key_value_segment_ids without segment_ids: pass the queries' segment_ids too (each "
                "query attends to the keys of its own segment)."
            )
        return None, None
    qseg = _ids(segment_ids, "segment_ids", (b, t), here)
    if key_value_segment_ids is None:
        if s != t:
            raise ValueError(
                f"segment_ids {qseg.shape} are the queries'; the keys' length {s} is not theirs ({t}): "
                f"pass key_value_segment_ids, [batch, {s}]."
            )
        return qseg, qseg
    return qseg, _ids(key_value_segment_ids, "key_value_segment_ids", (b, s), here)


def _ids(x, name: str, shape: tuple[int, int], here: str):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"{name} must be integers (a segment id per token), got {x.dtype}; pass {name}=ids.astype(jnp.int32)."
        )
    if x.shape != shape:
        raise ValueError(f"{name} has shape {x.shape}; it must be [batch, length] {shape}{here}.")
    return x.astype(jnp.int32)


def _jax_attention(query, key, value, bias, mask, segment_ids, key_value_segment_ids, **kw):
    """``jax.nn.dot_product_attention``, segment ids given as the boolean mask they mean."""
    if segment_ids is not None or key_value_segment_ids is not None:
        q, k = jnp.asarray(query), jnp.asarray(key)
        if q.ndim != 4 or k.ndim != 4:
            raise ValueError(
                f"segment_ids need batched [batch, seq, heads, head_dim] queries and keys; got shapes "
                f"{q.shape} and {k.shape}."
            )
        qseg, kseg = _segment_ids(segment_ids, key_value_segment_ids, q.shape[0], q.shape[1], k.shape[1])
        same = qseg[:, None, :, None] == kseg[:, None, None, :]  # [B, 1, T, S]
        mask = same if mask is None else _as_rank4(mask) & same
    return jax.nn.dot_product_attention(query, key, value, bias, mask, **kw)


class _Spec:
    def __init__(self, **kw):
        self.__dict__.update(kw)


# ----------------------------------------------------------------------------------------------
# The local attention: keys a chunk at a time, merged with an online softmax.


class _Side(NamedTuple):
    """What masks one side of the logits (the query rows or the key columns) token by token:
    global positions ``int32[L]``, the sequences' lengths ``int32[B]`` (positions at or past
    them are padding) and segment ids ``int32[B, L]`` (None: none)."""

    pos: Any
    length: Any
    seg: Any = None

    def part(self, start, size: int) -> _Side:
        """Tokens ``[start, start + size)``."""
        cut = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)
        return _Side(cut(self.pos, 0), self.length, None if self.seg is None else cut(self.seg, 1))


def _valid(spec: _Spec, rows: _Side, cols: _Side):
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


def _logits(spec: _Spec, q, rows: _Side, k, cols: _Side, mask, bias, exists, scale, raw: bool = False):
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
    logits = jnp.where(keep, logits, jnp.asarray(_FILL, logits.dtype)).astype(jnp.float32)
    if exists is not None:
        logits = jnp.where(exists, logits, -jnp.inf)
    return (logits, keep, qg, qk.astype(jnp.float32)) if raw else (logits, keep, qg)


def _stabiliser(m):
    """What a row's exponentials are taken against: its maximum logit, or 0 where that is
    ``-inf`` (every logit ``-inf``: then each ``exp(x - 0)`` is 0, where ``x - max`` is NaN)."""
    return jnp.where(m == -jnp.inf, jnp.zeros_like(m), m)


def _block(spec: _Spec, q, rows: _Side, k, v, cols: _Side, mask, bias, exists, scale):
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


def _merge(a, b):
    """Two unnormalised partial attentions over disjoint keys, as one (online softmax). A
    part whose max is ``-inf`` (no key but ``-inf`` ones) weighs nothing; both ``-inf``: the
    merged part is empty too, and the row's result NaN, as JAX's."""
    (acc, m, l), (acc2, m2, l2) = a, b
    m, m2 = jax.lax.stop_gradient(m), jax.lax.stop_gradient(m2)
    new = jnp.maximum(m, m2)
    ref = _stabiliser(new)
    w, w2 = jnp.exp(m - ref), jnp.exp(m2 - ref)
    return (acc * jnp.moveaxis(w, -1, 1)[..., None] + acc2 * jnp.moveaxis(w2, -1, 1)[..., None], new, l * w + l2 * w2)


def _unseen(v, rows: int, groups: int):
    """The partial attention of ``rows`` query rows over keys every one of them has masked
    (a chunk the causal mask hides), without computing a logit: each is the fill, so the
    part is ``(Σ v, fill, key count)``. A row that sees some key elsewhere weighs it at
    ``exp(fill - max) = 0``; a row that sees none (masked by lengths, windows, ``mask`` or
    segments) counts it in full, and gets the mean of every value, as JAX's."""
    b, s, kh, h = v.shape
    acc = jnp.broadcast_to(v.astype(jnp.float32).sum(axis=1)[:, None, :, None, :], (b, rows, kh, groups, h))
    like = jnp.moveaxis(acc[..., 0], 1, -1)  # [B, K, G, rows], derived from v (varying where v is)
    return acc, jnp.full_like(like, _FILL), jnp.full_like(like, float(s))


def _stack_rows(a, b):
    """Two partial attentions of consecutive query rows over the same keys, as one."""
    return (jnp.concatenate([a[0], b[0]], axis=1), *(jnp.concatenate([x, y], axis=-1) for x, y in zip(a[1:], b[1:])))


def _rows(x, start: int, size: int):
    """Query rows ``[start, start + size)`` of a mask or bias (whole where it broadcasts)."""
    if x is None or x.shape[2] == 1:
        return x
    return x[:, :, start : start + size]


def _columns(x, start, size):
    """Key columns ``[start, start + size)`` of a mask or bias (whole where it broadcasts)."""
    if x is None or x.shape[3] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=3)


def _chunking(s: int, block: int) -> tuple[int, int]:
    """``(keys per chunk, chunks)`` for ``s`` keys: ``block`` keys (all ``s`` where fewer)."""
    size = min(block, s)
    return size, -(-s // size)


def _key_chunk(j, size: int, k, v, cols: _Side, mask, bias):
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
    return cut(k), cut(v), cols.part(start, size), _columns(mask, start, size), _columns(bias, start, size), exists


def _unchunk(x, s: int):
    """Per-chunk key gradients ``[chunks, B, size, K, H]`` -> ``[B, s, K, H]`` (the last chunk's
    repeated keys dropped: their gradients are zero)."""
    count, b, size = x.shape[:3]
    x = jnp.moveaxis(x, 0, 1)
    if count * size == s:
        return x.reshape(b, s, *x.shape[3:])
    head = x[:, :-1].reshape(b, (count - 1) * size, *x.shape[3:])
    return jnp.concatenate([head, x[:, -1, count * size - s :]], axis=1)


def _attend(spec: _Spec, q, rows: _Side, k, v, cols: _Side, mask, bias, scale):
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


def _flash_forward(spec: _Spec, q, k, v, bias, scale, rows: _Side, cols: _Side, mask):
    size, count = _chunking(k.shape[1], spec.block)

    def chunk(j):
        kj, vj, cj, mj, bj, exists = _key_chunk(j, size, k, v, cols, mask, bias)
        return _block(spec, q, rows, kj, vj, cj, mj, bj, exists, scale)

    first = chunk(0)
    if count == 1:
        return first
    out, _ = jax.lax.scan(lambda carry, j: (_merge(carry, chunk(j)), None), first, jnp.arange(1, count))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec: _Spec, q, k, v, bias, scale, rows: _Side, cols: _Side, mask):
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


def _finish(spec: _Spec, part, rows: _Side, dtype):
    """A partial attention normalised, ``[B, T, N, H]`` (NaN in a row whose every logit is
    ``-inf``, as JAX's)."""
    acc, _, l = part
    b, t = acc.shape[:2]
    out = acc / jnp.moveaxis(l, -1, 1)[..., None]
    out = out.reshape(b, t, -1, acc.shape[-1]).astype(dtype)
    if spec.zero_padded_rows:  # JAX zeroes the rows past query_seq_lengths
        out = out * (rows.pos[None, :] < rows.length[:, None])[:, :, None, None].astype(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Running over the context axis.


def _run(spec: _Spec, body, args: tuple, in_specs: tuple, out_specs, whole: tuple[int, ...] = ()):
    """``body(*args)`` manual over the context axis, each argument split by its spec. Inside a
    ``shard_map`` already manual over it the arguments are this device's already, but for
    those given whole (the indices ``whole``: a mask, a bias), cut here as their spec says."""
    if spec.local:
        return body(*(_part(x, p, spec) if i in whole else x for i, (x, p) in enumerate(zip(args, in_specs))))
    kw = {} if spec.mesh is None else {"mesh": spec.mesh}
    run = jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names={spec.axis}, check_vma=False, **kw)
    args = [_wide(x, p, spec.axis) for x, p in zip(args, in_specs)]
    if not any(_is_traced(x) for x in args):
        # Called eagerly: jax 0.10 refuses an eager shard_map manual over some of the mesh's
        # axes ("out_specs refers to 'data'"); compiled, it runs.
        run = jax.jit(run)
    return run(*args)


def _wide(x, pspec, axis: str):
    """A float input narrower than float32 that the context axis does not split (a bias that
    broadcasts over the split dimension), as float32. Its gradient is summed over the axis
    by ``shard_map``'s transpose, and XLA's CPU compiler aborts on a bfloat16 all-reduce in a
    ``shard_map`` manual over some of the mesh's axes (``Invalid binary instruction opcode
    copy`` in its all-reduce promotion: the reducer ends in a sharding constraint; jax 0.10
    and 0.12). The kernels add a bias to float32 logits, so the value is the same."""
    if x is None or axis in tuple(pspec) or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize >= 4:
        return x
    return x.astype(jnp.float32)


def _part(x, pspec, spec: _Spec):
    """This device's part of ``x``, as ``pspec`` splits it over the context axis."""
    if x is None:
        return None
    for d, name in enumerate(pspec):
        if name == spec.axis:
            size = x.shape[d] // spec.c
            return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(spec.axis) * size, size, axis=d)
    return x


def _gathered(x, axis: str):
    """Segment ids ``[B, L/C]`` -> the whole sequence's ``[B, L]`` (in the layout's order)."""
    return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _seq_spec(x, axis: str):
    return None if x is None else P(None, axis)


# ----------------------------------------------------------------------------------------------
# Ulysses: all-to-all from sequence-split to head-split and back.


def _ulysses(spec: _Spec, q, k, v, mask, bias, scale, lengths, segments):
    c, axis = spec.c, spec.axis
    if spec.kh % c:  # GQA with fewer key/value heads than devices: repeat them up to the query heads
        rep = spec.n // spec.kh
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    pos = jnp.asarray(Layout(spec.layout, c).order(spec.t))
    kpos = jnp.asarray(Layout(spec.layout, c).order(spec.s))

    def heads_spec(x):  # a mask or bias: its head dimension split with the heads, else whole
        return None if x is None else (P(None, axis) if x.shape[1] > 1 else P())

    def body(q, k, v, mask, bias, scale, qlen, kvlen, qseg, kseg):
        q, k, v = (jax.lax.all_to_all(x, axis, 2, 1, tiled=True) for x in (q, k, v))
        rows, cols = _Side(pos, qlen, _gathered(qseg, axis)), _Side(kpos, kvlen, _gathered(kseg, axis))
        out = _finish(spec, _attend(spec, q, rows, k, v, cols, mask, bias, scale), rows, q.dtype)
        return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)

    seq = P(None, axis)
    in_specs = (seq, seq, seq, heads_spec(mask), heads_spec(bias), P(), P(), P()) + tuple(
        _seq_spec(x, axis) for x in segments
    )
    return _run(spec, body, (q, k, v, mask, bias, scale, *lengths, *segments), in_specs, seq, whole=(3, 4))


# ----------------------------------------------------------------------------------------------
# Ring: key/value chunks passed round the context axis, merged with an online softmax.


def _ring(spec: _Spec, q, k, v, mask, bias, scale, lengths, segments):
    c, axis = spec.c, spec.axis
    qpos_all = jnp.asarray(Layout(spec.layout, c).device_positions(spec.t))
    kpos_all = jnp.asarray(Layout(spec.layout, c).device_positions(spec.s))
    sc = spec.s // c
    perm = [(j, (j + 1) % c) for j in range(c)]

    def rows_spec(x):  # a mask or bias: its query rows split with the queries, key columns whole
        return None if x is None else P(None, None, axis if x.shape[2] > 1 else None)

    def body(q, k, v, mask, bias, scale, qlen, kvlen, qseg, kseg):
        i = jax.lax.axis_index(axis)
        rows = _Side(qpos_all[i], qlen, qseg)
        kseg_all = _gathered(kseg, axis)

        def cols(src):  # the keys of device ``src``
            seg = None if kseg_all is None else jax.lax.dynamic_slice_in_dim(kseg_all, src * sc, sc, axis=1)
            return _Side(kpos_all[src], kvlen, seg)

        def attend(k, v, src):  # over the chunk of the device ``src`` (this device's at step 0)
            return _attend(
                spec, q, rows, k, v, cols(src), _columns(mask, src * sc, sc), _columns(bias, src * sc, sc), scale
            )

        def update(out, k, v, src):
            return _merge(out, attend(k, v, src))

        if spec.causal:
            # Rematerialised: otherwise the switch hands each branch's residuals (the queries
            # among them) out per ring step, and the scan stacks them C times.
            update = jax.checkpoint(functools.partial(_causal_update, spec, q, rows, cols, mask, bias, scale, i))

        def step(carry, s):  # a scan, not a Python loop: backward then runs the steps in turn
            out, k, v = carry
            k, v = jax.lax.ppermute(k, axis, perm), jax.lax.ppermute(v, axis, perm)
            return (update(out, k, v, (i - s) % c), k, v), None

        (out, _, _), _ = jax.lax.scan(step, (attend(k, v, i), k, v), jnp.arange(1, c))
        return _finish(spec, out, rows, q.dtype)

    seq = P(None, axis)
    in_specs = (seq, seq, seq, rows_spec(mask), rows_spec(bias), P(), P(), P()) + tuple(
        _seq_spec(x, axis) for x in segments
    )
    return _run(spec, body, (q, k, v, mask, bias, scale, *lengths, *segments), in_specs, seq, whole=(3, 4))


def _causal_update(spec: _Spec, q, rows: _Side, cols, mask, bias, scale, i, out, k, v, src):
    """A ring step of causal attention from device ``i`` over the keys of device ``src``
    (``src != i``), computing only the logits the causal mask does not hide from every row.

    Contiguous layout: every key of ``src`` precedes every query of ``i`` when ``src < i``
    (the whole chunk), and follows it when ``src > i`` (no logit): device ``C - 1`` works on
    every step, device 0 on none. Balanced layout (device ``i`` holds chunks ``i`` and
    ``2C - 1 - i``): when ``src < i`` every query sees the early half of ``src``'s keys and none
    of its late half; when ``src > i`` the late half of the queries sees all of them and the
    early half none. Either way half a chunk's logits, on every device and every step.

    What the causal mask hides from every row is merged as :func:`_unseen` (its logits are
    all the fill), so a row that sees no key at all, for whatever reason, still gets the
    mean of every value, as JAX's. Each branch returns the chunk's partial attention,
    merged into ``out`` after the switch.
    """
    sc, t = k.shape[1], q.shape[1]
    g = q.shape[2] // k.shape[2]
    keys = cols(src)
    cut = lambda x, size: _columns(x, src * sc, size)  # a mask's or bias's first ``size`` columns of the chunk
    if spec.layout == "contiguous":

        def seen(k, v):
            return _attend(spec, q, rows, k, v, keys, cut(mask, sc), cut(bias, sc), scale)

        branches = [seen, lambda k, v: _unseen(v, t, g)]
        branch = jnp.where(src > i, 1, 0)
    else:
        th, sh = t // 2, sc // 2

        def early(k, v):
            part = _attend(spec, q, rows, k[:, :sh], v[:, :sh], keys.part(0, sh), cut(mask, sh), cut(bias, sh), scale)
            return _merge(part, _unseen(v[:, sh:], t, g))

        def late(k, v):
            part = _attend(
                spec,
                q[:, th:],
                rows.part(th, t - th),
                k,
                v,
                keys,
                cut(_rows(mask, th, t - th), sc),
                cut(_rows(bias, th, t - th), sc),
                scale,
            )
            return _stack_rows(_unseen(v, th, g), part)

        branches = [early, late]
        branch = jnp.where(src < i, 0, 1)
    return _merge(out, jax.lax.switch(branch, branches, k, v))
