"""How a sequence is laid out over a context axis of ``C`` devices.

``"contiguous"``: device ``i`` holds positions ``[i·S/C, (i+1)·S/C)``, what
``PartitionSpec(None, "context")`` on the sequence dimension gives. ``"balanced"``: the
sequence is cut into ``2C`` chunks and device ``i`` holds chunks ``i`` and ``2C-1-i`` (one
early, one late), so that under causal attention every device has the same work
(ring attention's load balancing, as in Megatron's and torchtitan's context parallelism).
In the balanced layout every sequence-indexed input (tokens, targets, positions, masks) is
permuted by :func:`order` before it is split, and the kernels read the positions they hold
from :func:`positions`.

Inside a train or eval step with ``ZeroConfig(context_layout="balanced")`` the step does the
permuting: each batch leaf's sequence dimension arrives in the loss in :func:`order`'s order,
``zj.nn.dot_product_attention`` takes the layout from the step, and :func:`global_positions`
gives the positions of that order (where a model would write ``jnp.arange(T)``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "balanced")


def check(seq_len: int, c: int, layout: str, what: str = "sequence length") -> None:
    """Refuses a ``seq_len`` that the layout cannot split over ``c`` devices, listing the
    lengths near it that fit."""
    if layout not in LAYOUTS:
        raise ValueError(f"context layout must be one of {LAYOUTS}, got {layout!r}.")
    unit = c if layout == "contiguous" else 2 * c
    if seq_len % unit:
        near = sorted({max(unit, seq_len // unit * unit), (seq_len // unit + 1) * unit})
        why = (f"{c} context devices" if layout == "contiguous"
               else f"2 x {c} chunks (the balanced layout gives each of the {c} context devices two)")
        raise ValueError(f"{what} {seq_len} does not split into {why}: use a multiple of {unit} "
                         f"(e.g. {' or '.join(map(str, near))}), or pad the sequence to one.")


def order(seq_len: int, c: int, layout: str = "balanced") -> np.ndarray:
    """The permutation that lays a sequence out for ``layout``: ``x[:, order]`` split into
    ``c`` contiguous parts gives each device its positions.

    Example:
      >>> order(8, 2).tolist()    # chunks of 2: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2
      [0, 1, 6, 7, 2, 3, 4, 5]
    """
    check(seq_len, c, layout)
    if layout == "contiguous":
        return np.arange(seq_len)
    chunks = np.arange(seq_len).reshape(2 * c, seq_len // (2 * c))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * c - 1 - i]]) for i in range(c)])


def positions(seq_len: int, c: int, layout: str) -> np.ndarray:
    """``[c, seq_len // c]``: the global positions device ``i`` holds, in its order."""
    return order(seq_len, c, layout).reshape(c, seq_len // c)


def inverse(seq_len: int, c: int, layout: str = "balanced") -> np.ndarray:
    """The permutation that undoes :func:`order`."""
    return np.argsort(order(seq_len, c, layout))


class _Scope:
    """A step's trace: its layout, and whether the loss asked for anything that knows it."""

    def __init__(self, layout: str):
        self.layout = layout
        self.aware = 0  # calls of zj.nn.dot_product_attention


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("zerojax_context_layout", default=None)


@contextlib.contextmanager
def tracing(layout: str) -> Iterator[_Scope]:
    """The layout a step traces its loss under (what the kernels and
    :func:`global_positions` read)."""
    if layout not in LAYOUTS:
        raise ValueError(f"context layout must be one of {LAYOUTS}, got {layout!r}.")
    scope = _Scope(layout)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def current() -> str:
    """The layout of the step being traced (``"contiguous"`` outside one)."""
    scope = _SCOPE.get()
    return "contiguous" if scope is None else scope.layout


def _mark_aware() -> None:
    scope = _SCOPE.get()
    if scope is not None:
        scope.aware += 1


def global_positions(seq_len: int, axis: str = "context"):
    """``int32[seq_len]``: the global position of each index of a sequence as the loss sees it,
    ``jnp.arange(seq_len)`` except in a step with ``context_layout="balanced"`` on a context
    mesh, where it is :func:`order`'s permutation. Use it where a model builds positions
    (RoPE, learned position embeddings, masks) with ``jnp.arange``.

    Example:
      >>> import zerojax as zj
      >>> zj.nn.global_positions(4).tolist()      # no context mesh: 0, 1, 2, 3
      [0, 1, 2, 3]
    """
    from zerojax.sharding.mesh import context_size  # zerojax.sharding imports this module

    c = context_size(jax.sharding.get_abstract_mesh(), axis)
    return jnp.asarray(order(seq_len, c, current()) if c > 1 else np.arange(seq_len), jnp.int32)


def permute(x, dim: int, c: int):
    """``x`` with dimension ``dim`` in the balanced layout's order over ``c`` devices: cut into
    ``2c`` chunks, chunk ``i`` and ``2c - 1 - i`` side by side (as ``jnp.take(x, order(...))``,
    written as slices and a reverse so that XLA moves whole chunks)."""
    n = x.shape[dim]
    check(n, c, "balanced", f"sequence length (dimension {dim})")
    chunks = x.reshape(x.shape[:dim] + (2 * c, n // (2 * c)) + x.shape[dim + 1:])
    early = jax.lax.slice_in_dim(chunks, 0, c, axis=dim)
    late = jnp.flip(jax.lax.slice_in_dim(chunks, c, 2 * c, axis=dim), axis=dim)
    return jnp.stack([early, late], axis=dim + 1).reshape(x.shape)
