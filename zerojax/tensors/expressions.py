"""Expressions: a parameter as a rearrangement of checkpoint tensors, read and written by box.

An :class:`Expr` is what a weight-map spec (:mod:`zerojax.tensors.specs`) builds for one
parameter: a :class:`Tensor` of the checkpoint under :class:`Transpose`, :class:`Reshape`,
:class:`Pad`, :class:`Concat` and :class:`Part`. It reads any box of the parameter from the few
boxes of the tensors it covers (:meth:`Expr.read`) and writes a box back into them
(:meth:`Expr.write`): a device's shard is read from, and exported to, exactly its own bytes.
Every expression is a rearrangement (each element of the parameter is one element of one
tensor), so the same expression serves loading and exporting.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from zerojax.tensors import boxes
from zerojax.tensors.boxes import Box


class Expr:
    """A rearrangement of checkpoint tensors with a ``shape`` and (on-disk) ``dtype``."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, box: Box, io) -> np.ndarray:
        raise NotImplementedError

    def write(self, box: Box, values: np.ndarray, io) -> None:
        raise NotImplementedError

    def boxes(self, box: Box) -> list[tuple[str, Box]]:
        """The ``(tensor, box)`` regions a write of ``box`` touches (for the whole
        parameter: its extent in the checkpoint)."""
        raise NotImplementedError

    def tensors(self) -> list[Tensor]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Tensor(Expr):
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, box, io):
        return io.read_box(self.name, box)

    def write(self, box, values, io):
        io.write_box(self.name, box, values)

    def boxes(self, box):
        return [(self.name, tuple(box))]

    def tensors(self):
        return [self]

    def describe(self):
        return f"{self.name} {list(self.shape)}"


class _Of(Expr):
    """An expression of one ``child``: its dtype and tensors."""

    child: Expr

    @property
    def dtype(self):
        return self.child.dtype

    def tensors(self):
        return self.child.tensors()


class _Resized(_Of):
    """``child`` with dimension ``axis`` of another ``size``."""

    axis: int
    size: int

    @property
    def shape(self):
        s = list(self.child.shape)
        s[self.axis] = self.size
        return tuple(s)


@dataclasses.dataclass(frozen=True)
class Transpose(_Of):
    child: Expr
    perm: tuple[int, ...]

    @property
    def shape(self):
        return tuple(self.child.shape[p] for p in self.perm)

    def _child_box(self, box):
        out = [None] * len(self.perm)
        for i, p in enumerate(self.perm):
            out[p] = box[i]
        return tuple(out)

    def read(self, box, io):
        return np.ascontiguousarray(self.child.read(self._child_box(box), io).transpose(self.perm))

    def write(self, box, values, io):
        self.child.write(self._child_box(box), np.asarray(values).transpose(np.argsort(self.perm)), io)

    def boxes(self, box):
        return self.child.boxes(self._child_box(box))

    def describe(self):
        return f"transpose({self.child.describe()})"


def _groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Runs of dimensions of ``a`` and ``b`` (same size) with equal products, in order."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        i0, j0, pa, pb = i, j, a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa, i = pa * a[i], i + 1
            else:
                pb, j = pb * b[j], j + 1
        out.append(((i0, i), (j0, j)))
    if not out:
        return [((0, len(a)), (0, len(b)))]
    (i0, _), (j0, _) = out[-1]
    out[-1] = ((i0, len(a)), (j0, len(b)))  # trailing size-1 dimensions join the last run
    return out


@dataclasses.dataclass(frozen=True)
class Reshape(_Of):
    """``child`` in another shape (C order). A box reads, per run of dimensions that
    reshape into each other, the child's bounding box of its flat range, then takes the
    box's elements from it: one child read per box."""

    child: Expr
    shape: tuple[int, ...]

    def __post_init__(self):
        if math.prod(self.shape) != math.prod(self.child.shape):
            raise ValueError(
                f"{self.child.describe()} ({math.prod(self.child.shape)} elements) does not reshape to "
                f"{list(self.shape)} ({math.prod(self.shape)} elements)."
            )

    def _plan(self, box):
        cshape, child_box, takes = self.child.shape, [], []
        for (c0, c1), (t0, t1) in _groups(cshape, self.shape):
            tshape, tbox = self.shape[t0:t1], box[t0:t1]
            starts, length = boxes.runs(tshape, tbox)
            flat = (starts[:, None] + np.arange(length, dtype=np.int64)[None, :]).reshape(-1)
            lo, hi = (int(flat[0]), int(flat[-1]) + 1) if flat.size else (0, 0)
            csub = cshape[c0:c1]
            inner = math.prod(csub[1:]) if len(csub) > 1 else 1
            r0, r1 = lo // inner, -(-hi // inner)
            child_box += [(r0, r1)] + [(0, n) for n in csub[1:]]
            takes.append(flat - r0 * inner)
        return tuple(child_box), takes

    def read(self, box, io):
        child_box, takes = self._plan(box)
        groups = _groups(self.child.shape, self.shape)
        x = self.child.read(child_box, io)
        x = x.reshape([math.prod(boxes.box_shape(child_box[c0:c1])) for (c0, c1), _ in groups])
        for g, idx in enumerate(takes):
            if not (idx.size == x.shape[g] and (idx.size == 0 or (idx[0] == 0 and np.all(np.diff(idx) == 1)))):
                x = np.take(x, idx, axis=g)
        return x.reshape(boxes.box_shape(box))

    def write(self, box, values, io):
        # Writes must not touch elements outside the box (other processes write them), so a
        # box is written as the child boxes of its contiguous runs.
        starts, length = boxes.runs(self.shape, box)
        flat = np.asarray(values).reshape(-1)
        if self._single(box):
            child_box, _ = self._plan(box)
            self.child.write(child_box, flat.reshape(boxes.box_shape(child_box)), io)
            return
        for j, s in enumerate(starts.tolist()):
            part, pos = flat[j * length : (j + 1) * length], 0
            for cb in boxes.flat_boxes(self.child.shape, s, s + length):
                n = boxes.box_size(cb)
                self.child.write(cb, part[pos : pos + n].reshape(boxes.box_shape(cb)), io)
                pos += n

    def _single(self, box) -> bool:
        """Whether ``box`` is exactly one child box (no overlap to drop)."""
        child_box, _ = self._plan(box)
        return boxes.box_size(child_box) == boxes.box_size(box)

    def boxes(self, box):
        if self._single(box):
            return self.child.boxes(self._plan(box)[0])
        starts, length = boxes.runs(self.shape, box)
        return [
            tb
            for s in starts.tolist()
            for cb in boxes.flat_boxes(self.child.shape, s, s + length)
            for tb in self.child.boxes(cb)
        ]

    def describe(self):
        return f"reshape({self.child.describe()}, {list(self.shape)})"


@dataclasses.dataclass(frozen=True)
class Pad(_Resized):
    """``child`` zero-padded at the end of ``axis`` to ``size`` (ZeRO's storage padding)."""

    child: Expr
    axis: int
    size: int

    def read(self, box, io):
        out = np.zeros(boxes.box_shape(box), self.dtype)
        inside = boxes.intersect(box, boxes.full(self.child.shape))
        if inside is not None:
            out[boxes.slices(boxes.shift(inside, [a for a, _ in box]))] = self.child.read(inside, io)
        return out

    def write(self, box, values, io):
        inside = boxes.intersect(box, boxes.full(self.child.shape))
        if inside is not None:
            self.child.write(inside, np.asarray(values)[boxes.slices(boxes.shift(inside, [a for a, _ in box]))], io)

    def boxes(self, box):
        inside = boxes.intersect(box, boxes.full(self.child.shape))
        return [] if inside is None else self.child.boxes(inside)

    def describe(self):
        return self.child.describe()


@dataclasses.dataclass(frozen=True)
class Concat(Expr):
    """``children`` joined along ``axis`` (``stack=True``: each child is one index of a new
    ``axis``)."""

    children: tuple[Expr, ...]
    axis: int
    stack: bool = False

    def __post_init__(self):
        if not self.children:
            raise ValueError(f"a {'stack' if self.stack else 'concat'} of no tensors has no shape.")
        first = self.children[0]
        for c in self.children[1:]:
            if self.stack:
                fits = tuple(c.shape) == tuple(first.shape)
            else:
                fits = len(c.shape) == len(first.shape) and all(
                    a == b for d, (a, b) in enumerate(zip(c.shape, first.shape)) if d != self.axis
                )
            if not fits:
                raise ValueError(
                    f"{'stack' if self.stack else f'concat along axis {self.axis}'} of tensors whose shapes "
                    f"differ{'' if self.stack else ' off that axis'}: {first.describe()} and {c.describe()}."
                )

    @property
    def shape(self):
        s = list(self.children[0].shape)
        if self.stack:
            s.insert(self.axis, len(self.children))
        else:
            s[self.axis] = sum(c.shape[self.axis] for c in self.children)
        return tuple(s)

    @property
    def dtype(self):
        return np.result_type(*[c.dtype for c in self.children])

    def _parts(self, box):
        """``(child, child box, slice of the box along axis)`` for each child in the box."""
        a, b = box[self.axis]
        pos = 0
        for c in self.children:
            n = 1 if self.stack else c.shape[self.axis]
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                if self.stack:
                    cbox = box[: self.axis] + box[self.axis + 1 :]
                else:
                    cbox = box[: self.axis] + ((lo - pos, hi - pos),) + box[self.axis + 1 :]
                yield c, cbox, slice(lo - a, hi - a)
            pos += n

    def read(self, box, io):
        out = np.empty(boxes.box_shape(box), self.dtype)
        for c, cbox, sl in self._parts(box):
            v = c.read(cbox, io)
            out[(slice(None),) * self.axis + (sl,)] = v[(slice(None),) * self.axis + (None,)] if self.stack else v
        return out

    def write(self, box, values, io):
        values = np.asarray(values)
        for c, cbox, sl in self._parts(box):
            v = values[(slice(None),) * self.axis + (sl,)]
            c.write(cbox, v.reshape(boxes.box_shape(cbox)) if self.stack else v, io)

    def boxes(self, box):
        return [tb for c, cbox, _ in self._parts(box) for tb in c.boxes(cbox)]

    def tensors(self):
        return [t for c in self.children for t in c.tensors()]

    def describe(self):
        inner = self.children[0].describe() + (f", ... ({len(self.children)})" if len(self.children) > 1 else "")
        return f"{'stack' if self.stack else 'concat'}({inner})"


@dataclasses.dataclass(frozen=True)
class Part(_Resized):
    """``child[start:start+size]`` along ``axis`` (one of the parts of a fused tensor)."""

    child: Expr
    axis: int
    start: int
    size: int

    def __post_init__(self):
        if not (0 <= self.axis < len(self.child.shape) and self.start + self.size <= self.child.shape[self.axis]):
            raise ValueError(
                f"part(axis={self.axis}, start={self.start}) of extent {self.size} runs past "
                f"{self.child.describe()}: the tensor needs at least {self.start + self.size} there."
            )

    def _child_box(self, box):
        a, b = box[self.axis]
        return box[: self.axis] + ((a + self.start, b + self.start),) + box[self.axis + 1 :]

    def read(self, box, io):
        return self.child.read(self._child_box(box), io)

    def write(self, box, values, io):
        self.child.write(self._child_box(box), values, io)

    def boxes(self, box):
        return self.child.boxes(self._child_box(box))

    def describe(self):
        return f"part({self.child.describe()}, axis {self.axis}, from {self.start})"
