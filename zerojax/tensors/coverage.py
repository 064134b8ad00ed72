"""Coverage of an export: which parameter writes each element of each tensor.

:func:`cover` checks that the parameters' expressions write every element of every tensor
exactly once, and names the regions a second parameter only reads (:class:`Duplicate`: a tied
head read from the embedding), which an export writes once and checks equal.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from zerojax.tensors import boxes
from zerojax.tensors.boxes import Box
from zerojax.tensors.expressions import Expr


@dataclasses.dataclass(frozen=True)
class Duplicate:
    """A region of a tensor that ``param`` reads and ``writer`` writes (a tied head read
    from the embedding): exported once, from ``writer``, and checked equal to ``param``."""

    param: str
    tensor: str
    box: Box
    writer: str


def cover(exprs: dict[str, Expr], tensors: dict[str, tuple[int, ...]]) -> list[Duplicate]:
    """Checks that the parameters' expressions write every element of every tensor exactly
    once (fused parts and concatenations each writing their own extent), and returns the
    regions that a second parameter reads whole from one writer (see :class:`Duplicate`).
    Raises ``ValueError`` naming each overlap (with both parameters and the elements) and
    each gap (with the elements no parameter writes)."""
    regions: dict[str, list[tuple[int, str, Box]]] = {}
    for order, (p, e) in enumerate(exprs.items()):
        for t, b in e.boxes(boxes.full(tuple(e.shape))):
            regions.setdefault(t, []).append((order, p, b))
    errors, dups = [], []
    for t, shape in tensors.items():
        writers: list[tuple[str, Box]] = []
        for _, p, b in sorted(regions.get(t, []), key=lambda r: (-boxes.box_size(r[2]), r[0])):
            if boxes.box_size(b) == 0:
                continue
            hits = [(wp, wb) for wp, wb in writers if boxes.intersect(b, wb) is not None]
            if not hits:
                writers.append((p, b))
            elif len(hits) == 1 and boxes.intersect(b, hits[0][1]) == tuple(b):
                dups.append(Duplicate(p, t, tuple(b), hits[0][0]))
            else:
                wp, wb = hits[0]
                errors.append(
                    f"parameters {wp!r} and {p!r} both write elements {_fmt(boxes.intersect(b, wb))} of "
                    f"tensor {t!r} {list(shape)}, where one reads only part of what the other writes: "
                    "parts and concatenations must not overlap"
                )
        size = int(np.prod(shape, dtype=np.int64))
        if sum(boxes.box_size(b) for _, b in writers) != size:
            gap = _gap(tuple(shape), [b for _, b in writers])
            where = (
                f"elements {_fmt(gap)}"
                if gap is not None
                else f"{size - sum(boxes.box_size(b) for _, b in writers)} elements"
            )
            errors.append(
                f"{where} of tensor {t!r} {list(shape)} are written by no parameter: its parts "
                "(part / concat) leave a gap"
            )
    if errors:
        raise ValueError("; ".join(errors) + ".")
    return dups


def _fmt(box: Box | None) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in (box or ())) + "]"


def _gap(shape: tuple[int, ...], written: list[Box], limit: int = 100_000) -> Box | None:
    """A box of elements no box of ``written`` (disjoint) holds: one cell of the grid their
    edges cut ``shape`` into (None when the grid is too large to search)."""
    cuts = [sorted({0, n} | {x for b in written for x in b[d]}) for d, n in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > limit:
        return None
    for cell in itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts]):
        if not any(boxes.intersect(cell, b) == cell for b in written):
            return tuple(cell)
    return None
