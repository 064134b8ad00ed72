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
it is, every logit the fill: ``max`` the fill, ``Σ v`` and its key count (:func:`unseen`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._jaxpr import check, settings
from zerojax.context import kernels
from zerojax.context.flash import Side, attend, finish
from zerojax.context.kernel_spec import KernelSpec
from zerojax.context.layout import KERNEL_SCOPE, Layout, axis_of, resolve
from zerojax.sharding.mesh import context_size

METHODS = ("auto", "ulysses", "ring", "xla")
# jax.nn.dot_product_attention's fill for masked logits (finite, so that a fully masked row
# averages every value, as JAX's does); the kernels' logits are float32.


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
    spec = KernelSpec(
        layout=lay,
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
        return (kernels.ulysses if method == "ulysses" else kernels.ring)(
            spec, q, k, v, mask, bias, scale, lengths, segments
        )


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
    spec = KernelSpec(
        layout=Layout("contiguous", 1),
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
    rows = Side(jnp.arange(t), jnp.full((b,), t, jnp.int32))
    cols = Side(jnp.arange(s), jnp.full((b,), s, jnp.int32))
    scale = _scale(scale)
    scale = jnp.asarray(1.0 / math.sqrt(h), jnp.float32) if scale is None else scale
    return finish(spec, attend(spec, q, rows, k, v, cols, None, None, scale), rows, q.dtype)


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
