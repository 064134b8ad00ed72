"""Sequence layouts over a context axis, by kind name: the arithmetic of
:class:`zerojax.context.Layout` for the attention kernels, and :func:`global_positions`.

See :mod:`zerojax.context.layout`: ``"contiguous"`` (device ``i`` holds positions
``[i·S/C, (i+1)·S/C)``) and ``"balanced"`` (``2C`` chunks, device ``i`` holds chunks ``i`` and
``2C-1-i``). The layout is a value the train step hands the loss
(``make_train_step(..., with_layout=True)``); nothing here reads it from ambient state.
"""

from __future__ import annotations

import jax
import numpy as np

from zerojax.context.layout import KINDS as LAYOUTS
from zerojax.context.layout import Layout, resolve


def check(seq_len: int, c: int, layout: str, what: str = "sequence length", *, in_loss: bool = False) -> None:
    """Refuses a ``seq_len`` that the layout cannot split over ``c`` devices, listing the
    lengths near it that fit (see :meth:`Layout.check`)."""
    Layout(layout, c).check(seq_len, what, in_loss=in_loss)


def order(seq_len: int, c: int, layout: str = "balanced") -> np.ndarray:
    """The permutation that lays a sequence out for ``layout`` (:meth:`Layout.order`).

    Example:
      >>> order(8, 2).tolist()    # chunks of 2: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2
      [0, 1, 6, 7, 2, 3, 4, 5]
    """
    return Layout(layout, c).order(seq_len)


def positions(seq_len: int, c: int, layout: str) -> np.ndarray:
    """``[c, seq_len // c]``: the global positions device ``i`` holds, in its order."""
    return Layout(layout, c).device_positions(seq_len)


def inverse(seq_len: int, c: int, layout: str = "balanced") -> np.ndarray:
    """The permutation that undoes :func:`order`."""
    return Layout(layout, c).inverse(seq_len)


def permute(x, dim: int, c: int):
    """``x`` with dimension ``dim`` in the balanced layout's order over ``c`` devices."""
    return Layout("balanced", c).permute(x, dim)


def global_positions(seq_len: int, layout: Layout | str | None = None, axis: str = "context"):
    """``int32[seq_len]``: the global position of each index of a sequence laid out in
    ``layout`` (the one the step hands the loss: ``make_train_step(..., with_layout=True)``),
    ``jnp.arange(seq_len)`` for the contiguous layout (None) or off a context mesh. Use it
    where a model builds positions (RoPE, learned position embeddings, masks).

    Example:
      >>> import zerojax as zj
      >>> zj.nn.global_positions(4).tolist()      # contiguous: 0, 1, 2, 3
      [0, 1, 2, 3]
    """
    from zerojax.sharding.mesh import context_size  # zerojax.sharding imports this module

    c = context_size(jax.sharding.get_abstract_mesh(), axis)
    return resolve(layout, c).positions(seq_len)


__all__ = ["LAYOUTS", "Layout", "check", "global_positions", "inverse", "order", "permute", "positions"]
