"""How a sequence is laid out over a context axis of ``C`` devices.

``"contiguous"``: device ``i`` holds positions ``[i·S/C, (i+1)·S/C)``, what
``PartitionSpec(None, "context")`` on the sequence dimension gives. ``"balanced"``: the
sequence is cut into ``2C`` chunks and device ``i`` holds chunks ``i`` and ``2C-1-i`` (one
early, one late), so that under causal attention every device has the same work
(ring attention's load balancing, as in Megatron's and torchtitan's context parallelism).
In the balanced layout every sequence-indexed input (tokens, targets, positions, masks) is
permuted by :func:`order` before it is split, and the kernels read the positions they hold
from :func:`positions`.
"""

from __future__ import annotations

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
