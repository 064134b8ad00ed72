"""Boxes of an array (a start and stop per dimension) and the contiguous runs of elements
they cover in C order: how a device's shard of a tensor maps to byte ranges of a file.

A box is a tuple of ``(start, stop)`` pairs, one per dimension. :func:`runs` lists the flat
ranges a box covers, in the box's own C order (so the box's values, flattened, are the runs
concatenated); :func:`flat_boxes` is the inverse direction: a flat range as the few boxes
that cover it, in order. Both let a reader touch exactly the bytes a shard needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

Box = tuple[tuple[int, int], ...]


def full(shape: tuple[int, ...]) -> Box:
    """The box of the whole array."""
    return tuple((0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    return math.prod(box_shape(box))


def from_index(index: tuple, shape: tuple[int, ...]) -> Box:
    """A sharding's index (a tuple of slices, as ``addressable_devices_indices_map`` gives)
    as a box of ``shape``."""
    out = []
    for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"a shard index with step {step} is not a box")
        out.append((start, stop))
    return tuple(out)


def runs(shape: tuple[int, ...], box: Box) -> tuple[np.ndarray, int]:
    """The flat ranges of ``box`` in an array of ``shape`` (C order): ``(starts, length)``,
    every run ``length`` elements long, in the order of the box's own flattening."""
    if not shape:
        return np.zeros(1, np.int64), 1
    if box_size(box) == 0:
        return np.zeros(0, np.int64), 0
    # The innermost dimensions the box covers whole merge into one run with the first
    # partial dimension to their left.
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    length = (box[k][1] - box[k][0]) * strides[k]
    starts = np.zeros((), np.int64) + box[k][0] * strides[k]
    for i in range(k - 1, -1, -1):
        idx = np.arange(box[i][0], box[i][1], dtype=np.int64) * strides[i]
        starts = idx.reshape((-1,) + (1,) * starts.ndim) + starts
    return starts.reshape(-1), length


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> Iterator[Box]:
    """Boxes of ``shape`` covering the flat range ``[a, b)`` in order: their values,
    each flattened and concatenated, are the range. At most ``2 * ndim - 1`` boxes."""
    if a >= b:
        return
    if not shape:
        yield ()
        return
    if len(shape) == 1:
        yield ((a, b),)
        return
    inner = math.prod(shape[1:])
    r0, o0 = divmod(a, inner)
    r1, o1 = divmod(b, inner)
    if r0 == r1:
        for bx in flat_boxes(shape[1:], o0, o1):
            yield ((r0, r0 + 1),) + bx
        return
    if o0:
        for bx in flat_boxes(shape[1:], o0, inner):
            yield ((r0, r0 + 1),) + bx
        r0 += 1
    if r1 > r0:
        yield ((r0, r1),) + full(shape[1:])
    if o1:
        for bx in flat_boxes(shape[1:], 0, o1):
            yield ((r1, r1 + 1),) + bx


def pieces(box: Box, itemsize: int, limit: int) -> Iterator[Box]:
    """``box`` cut along its outermost dimensions into boxes of at most ``limit`` bytes
    (a single element row can exceed it: its last dimension is cut too), in C order."""
    if box_size(box) * itemsize <= limit or not box:
        yield box
        return
    # d, the first dimension of more than one index, is read after the loop.
    for d, (a, b) in enumerate(box):  # noqa: B007
        if b - a > 1:
            break
    else:
        yield box
        return
    row = box_size(box[d + 1 :]) * itemsize if d + 1 < len(box) else itemsize
    step = max(1, limit // max(row, 1))
    for s in range(a, b, step):
        sub = box[:d] + ((s, min(b, s + step)),) + box[d + 1 :]
        if step == 1 and row > limit:
            yield from pieces(sub, itemsize, limit)
        else:
            yield sub


def intersect(box: Box, other: Box) -> Box | None:
    """The overlap of two boxes, or None."""
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, other))
    return None if any(a >= b for a, b in out) else out


def shift(box: Box, origin: tuple[int, ...]) -> Box:
    """``box`` relative to ``origin`` (subtracts it)."""
    return tuple((a - o, b - o) for (a, b), o in zip(box, origin))


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)
