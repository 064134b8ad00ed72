"""Maps from a model's parameters to a checkpoint's tensors, read and written by box.

A :class:`WeightMap` says, for each parameter (by its dotted name, as
:func:`zerojax.tensors.names.tensor_names` gives it), how it is made of checkpoint tensors:

    >>> from zerojax.tensors import tensor_map as tm
    >>> llama_like = tm.WeightMap({
    ...     "embed.embedding": "model.embed_tokens.weight",                       # as stored
    ...     "blocks.q.kernel": tm.stack(tm.transpose("model.layers.{i}.self_attn.q_proj.weight")),
    ...     "head.kernel": tm.transpose("lm_head.weight"),                        # torch [out, in]
    ... })

A string is a tensor; :func:`transpose` (a torch ``Linear``'s ``[out, in]`` as a Flax
kernel's ``[in, out]``), :func:`stack` (``model.layers.{i}....`` as one scanned leaf, layer
``i`` at index ``i``), :func:`split_dim` / :func:`merge_dims` (head reshapes), :func:`concat`
(a fused q/k/v leaf from separate tensors) and :func:`part` (one of them from a fused tensor)
compose. A key may carry ``{name}`` fields (``"layers_{i}.q.kernel"``) that its spec's names
use too.

Each spec resolves, against the parameter's shape and the checkpoint's tensor shapes, to an
expression (:class:`Expr`) that reads any box of the parameter from the few boxes of the
tensors it covers (:meth:`Expr.read`), and writes a box back into them (:meth:`Expr.write`):
a device's shard is read from, and exported to, exactly its own bytes. Every transform is a
rearrangement (each element of the parameter is one element of one tensor), so the same map
serves loading and exporting.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zerojax.tensors import boxes
from zerojax.tensors.boxes import Box

# ----------------------------------------------------------------------------------------------
# Expressions: a parameter as a rearrangement of tensors, read and written by box.


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


@dataclasses.dataclass(frozen=True)
class Transpose(Expr):
    child: Expr
    perm: tuple[int, ...]

    @property
    def shape(self):
        return tuple(self.child.shape[p] for p in self.perm)

    @property
    def dtype(self):
        return self.child.dtype

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

    def tensors(self):
        return self.child.tensors()

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
class Reshape(Expr):
    """``child`` in another shape (C order). A box reads, per run of dimensions that
    reshape into each other, the child's bounding box of its flat range, then takes the
    box's elements from it: one child read per box."""

    child: Expr
    shape: tuple[int, ...]

    @property
    def dtype(self):
        return self.child.dtype

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

    def tensors(self):
        return self.child.tensors()

    def describe(self):
        return f"reshape({self.child.describe()}, {list(self.shape)})"


@dataclasses.dataclass(frozen=True)
class Pad(Expr):
    """``child`` zero-padded at the end of ``axis`` to ``size`` (ZeRO's storage padding)."""

    child: Expr
    axis: int
    size: int

    @property
    def shape(self):
        s = list(self.child.shape)
        s[self.axis] = self.size
        return tuple(s)

    @property
    def dtype(self):
        return self.child.dtype

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

    def tensors(self):
        return self.child.tensors()

    def describe(self):
        return self.child.describe()


@dataclasses.dataclass(frozen=True)
class Concat(Expr):
    """``children`` joined along ``axis`` (``stack=True``: each child is one index of a new
    ``axis``)."""

    children: tuple[Expr, ...]
    axis: int
    stack: bool = False

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
class Part(Expr):
    """``child[start:start+size]`` along ``axis`` (one of the parts of a fused tensor)."""

    child: Expr
    axis: int
    start: int
    size: int

    @property
    def shape(self):
        s = list(self.child.shape)
        s[self.axis] = self.size
        return tuple(s)

    @property
    def dtype(self):
        return self.child.dtype

    def _child_box(self, box):
        a, b = box[self.axis]
        return box[: self.axis] + ((a + self.start, b + self.start),) + box[self.axis + 1 :]

    def read(self, box, io):
        return self.child.read(self._child_box(box), io)

    def write(self, box, values, io):
        self.child.write(self._child_box(box), values, io)

    def boxes(self, box):
        return self.child.boxes(self._child_box(box))

    def tensors(self):
        return self.child.tensors()

    def describe(self):
        return f"part({self.child.describe()}, axis {self.axis}, from {self.start})"


# ----------------------------------------------------------------------------------------------
# Specs: what a user writes; each builds an Expr for a parameter's shape.


class MissingTensor(KeyError):
    """A spec names a tensor the checkpoint does not have."""


class Shapes:
    """Tensor shapes and dtypes a spec builds against: a checkpoint's (loading) or those
    the parameters imply (exporting, :meth:`Spec.infer`)."""

    def __init__(self, lookup: Callable[[str], tuple[tuple[int, ...], np.dtype]]):
        self.lookup = lookup

    def __call__(self, name: str):
        try:
            return self.lookup(name)
        except KeyError:
            raise MissingTensor(name) from None


@dataclasses.dataclass(frozen=True)
class Spec:
    def build(self, target: tuple, env: dict, shapes: Shapes) -> Expr:
        raise NotImplementedError

    def infer(self, target: tuple, env: dict, out: dict) -> None:
        """Records in ``out`` the shape each named tensor must have for a parameter of
        shape ``target`` (for exports, where no checkpoint says it)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Name(Spec):
    template: str

    def name(self, env: dict) -> str:
        try:
            return self.template.format(**env)
        except (KeyError, IndexError) as e:
            raise ValueError(
                f"tensor name {self.template!r} uses the field {e} that neither its stack() nor its key defines."
            ) from None

    def build(self, target, env, shapes):
        shape, dtype = shapes(self.name(env))
        return Tensor(self.name(env), tuple(shape), np.dtype(dtype))

    def infer(self, target, env, out):
        name = self.name(env)
        prev = out.get(name)
        if prev is not None and any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(prev, target)):
            raise ValueError(f"tensor {name!r} is mapped with shapes {list(prev)} and {list(target)}.")
        if prev is not None:
            target = tuple(_max_dim(a, b) for a, b in zip(prev, target))
        out[name] = tuple(target)


def _max_dim(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a
    if isinstance(a, int) or isinstance(b, int):
        known, bound = (a, b) if isinstance(a, int) else (b, a)
        return known if bound is None or known >= bound[1] else ("min", bound[1])
    return ("min", max(x[1] for x in (a, b) if x is not None)) if (a or b) else None


def _spec(s) -> Spec:
    if isinstance(s, Spec):
        return s
    if isinstance(s, str):
        return Name(s)
    raise TypeError(
        f"a map entry is a tensor name (str) or a spec (transpose, stack, ...), got {type(s).__name__} {s!r}."
    )


@dataclasses.dataclass(frozen=True)
class _Transpose(Spec):
    child: Spec
    perm: tuple[int, ...] | None

    def _perm(self, n):
        return self.perm if self.perm is not None else tuple(range(n - 1, -1, -1))

    def build(self, target, env, shapes):
        perm = self._perm(len(target))
        inv = np.argsort(perm)
        child = self.child.build(tuple(target[i] for i in inv) if len(perm) == len(target) else target, env, shapes)
        if len(child.shape) != len(target):  # a tensor of another rank: transposed by its own rank
            perm = self._perm(len(child.shape))
        if sorted(perm) != list(range(len(child.shape))):
            raise ValueError(f"transpose perm {list(perm)} does not fit {child.describe()}.")
        return Transpose(child, tuple(perm))

    def infer(self, target, env, out):
        inv = np.argsort(self._perm(len(target)))
        self.child.infer(tuple(target[i] for i in inv), env, out)


@dataclasses.dataclass(frozen=True)
class _Stack(Spec):
    child: Spec
    axis: int
    var: str

    def build(self, target, env, shapes):
        n = target[self.axis]
        inner = target[: self.axis] + target[self.axis + 1 :]
        return Concat(
            tuple(self.child.build(inner, {**env, self.var: i}, shapes) for i in range(n)), self.axis, stack=True
        )

    def infer(self, target, env, out):
        for i in range(target[self.axis]):
            self.child.infer(target[: self.axis] + target[self.axis + 1 :], {**env, self.var: i}, out)


@dataclasses.dataclass(frozen=True)
class _SplitDim(Spec):
    child: Spec
    axis: int

    def _merged(self, target):
        a = self.axis
        return target[:a] + (target[a] * target[a + 1],) + target[a + 2 :]

    def build(self, target, env, shapes):
        return Reshape(self.child.build(self._merged(target), env, shapes), tuple(target))

    def infer(self, target, env, out):
        self.child.infer(self._merged(target), env, out)


@dataclasses.dataclass(frozen=True)
class _MergeDims(Spec):
    child: Spec
    axis: int
    inner: int

    def _split(self, target):
        a, n = self.axis, target[self.axis]
        if n % self.inner:
            raise ValueError(f"merge_dims: dimension {a} of size {n} does not split into rows of {self.inner}.")
        return target[:a] + (n // self.inner, self.inner) + target[a + 1 :]

    def build(self, target, env, shapes):
        return Reshape(self.child.build(self._split(target), env, shapes), tuple(target))

    def infer(self, target, env, out):
        self.child.infer(self._split(target), env, out)


@dataclasses.dataclass(frozen=True)
class _Concat(Spec):
    children: tuple[Spec, ...]
    axis: int
    sizes: tuple[int, ...] | None

    def build(self, target, env, shapes):
        if self.sizes is not None:
            parts = [
                c.build(target[: self.axis] + (s,) + target[self.axis + 1 :], env, shapes)
                for c, s in zip(self.children, self.sizes)
            ]
        else:
            parts = [
                c.build(target[: self.axis] + (None,) + target[self.axis + 1 :], env, shapes) for c in self.children
            ]
        return Concat(tuple(parts), self.axis)

    def infer(self, target, env, out):
        if self.sizes is None:
            raise ValueError("concat(...) needs sizes=... to export: the parts' extents along the axis.")
        for c, s in zip(self.children, self.sizes):
            c.infer(target[: self.axis] + (s,) + target[self.axis + 1 :], env, out)


@dataclasses.dataclass(frozen=True)
class _Part(Spec):
    child: Spec
    axis: int
    start: int

    def build(self, target, env, shapes):
        child = self.child.build(target[: self.axis] + (None,) + target[self.axis + 1 :], env, shapes)
        return Part(child, self.axis, self.start, target[self.axis])

    def infer(self, target, env, out):
        self.child.infer(
            target[: self.axis] + (("min", self.start + target[self.axis]),) + target[self.axis + 1 :], env, out
        )


def transpose(spec, perm: Sequence[int] | None = None) -> Spec:
    """The tensor with its dimensions permuted: ``perm`` as in ``np.transpose`` (default:
    reversed, a torch ``Linear`` weight ``[out, in]`` as a Flax kernel ``[in, out]``)."""
    return _Transpose(_spec(spec), None if perm is None else tuple(perm))


def stack(spec, axis: int = 0, var: str = "i") -> Spec:
    """One tensor per index of the parameter's dimension ``axis`` (a scanned stack of
    layers): ``spec``'s names are formatted with ``{var}`` = the index."""
    return _Stack(_spec(spec), axis, var)


def split_dim(spec, axis: int) -> Spec:
    """The parameter's dimensions ``axis`` and ``axis + 1`` are one dimension of the tensor
    (heads x head_dim stored as one)."""
    return _SplitDim(_spec(spec), axis)


def merge_dims(spec, axis: int, inner: int) -> Spec:
    """The parameter's dimension ``axis`` is two dimensions of the tensor, the second of
    size ``inner`` (the inverse of :func:`split_dim`)."""
    return _MergeDims(_spec(spec), axis, inner)


def concat(specs: Sequence, axis: int, sizes: Sequence[int] | None = None) -> Spec:
    """Tensors joined along ``axis`` (a fused q/k/v parameter from separate tensors);
    ``sizes``, their extents along it, is needed to export."""
    return _Concat(tuple(_spec(s) for s in specs), axis, None if sizes is None else tuple(sizes))


def part(spec, axis: int, start: int) -> Spec:
    """The slice of a tensor along ``axis`` from ``start``, as long as the parameter is
    there (one of q/k/v from a fused tensor)."""
    return _Part(_spec(spec), axis, start)


# ----------------------------------------------------------------------------------------------
# The map.


def _key_pattern(key: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", key)
    rx = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts))
    return re.compile(rx + r"\Z")


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """Parameters (dotted names; keys may hold ``{field}`` parts) -> specs of tensors.

    Attributes:
      entries: ``(parameter name, spec)`` pairs (a mapping is accepted).
      ignore: ``fnmatch`` patterns of checkpoint tensors no parameter reads (they are
        otherwise refused as extra).
      identity: parameters with no entry are the tensor of their own name (zerojax's own
        export format).
      hf_config: the source checkpoint's ``config.json`` (a dict), or None. An export with
        ``layout="hf"`` writes it beside the weights, its dtype updated (see
        :func:`zerojax.export_weights`); it plays no part in mapping (maps compare, hash and
        print without it).
      generation_config: the source's ``generation_config.json`` (a dict), or None; written
        beside ``config.json``.
    """

    entries: Any = ()
    ignore: tuple[str, ...] = ()
    identity: bool = False
    hf_config: dict | None = dataclasses.field(default=None, compare=False, repr=False)
    generation_config: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        entries = tuple(self.entries.items()) if isinstance(self.entries, Mapping) else tuple(self.entries)
        for k, _ in entries:
            if not isinstance(k, str):
                raise TypeError(f"WeightMap keys are parameter names (str), got {k!r}.")
        object.__setattr__(self, "entries", tuple((k, _spec(s)) for k, s in entries))
        ignore = (self.ignore,) if isinstance(self.ignore, str) else tuple(self.ignore)
        object.__setattr__(self, "ignore", ignore)
        for field in ("hf_config", "generation_config"):
            object.__setattr__(self, field, json_object(getattr(self, field), f"WeightMap.{field}"))

    def spec_for(self, name: str) -> tuple[Spec, dict] | None:
        for key, spec in self.entries:
            m = _key_pattern(key).match(name)
            if m:
                return spec, {k: int(v) for k, v in m.groupdict().items()}
        return (Name(name.replace("{", "{{").replace("}", "}}")), {}) if self.identity else None

    def ignored(self, tensor: str) -> bool:
        return any(fnmatch.fnmatchcase(tensor, p) for p in self.ignore)


def json_object(value: Any, what: str) -> dict | None:
    """A private copy of a JSON object (a config), or None; refuses anything else."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} is a config as a dict (the JSON object of config.json), got {type(value).__name__}.")
    try:
        return json.loads(json.dumps(dict(value)))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON (as config.json is): {e}.") from None


IDENTITY = WeightMap(identity=True)


@dataclasses.dataclass
class Resolution:
    """Each parameter's expression, and what does not fit."""

    exprs: dict[str, Expr]
    unmapped: list[str]
    missing: dict[str, list[str]]  # parameter -> tensors it needs that the checkpoint lacks
    misshapen: list[str]
    extra: list[str]
    errors: list[str]
    present: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # ... and those it has

    def absent(self, optional: Callable[[str], bool] = lambda name: False) -> list[str]:
        """The parameters ``optional`` accepts that the map does not name or the checkpoint
        lacks entirely: they are taken from elsewhere (an init function, given values)."""
        return [n for n in self.unmapped if optional(n)] + [
            n for n in self.missing if optional(n) and not self.present.get(n)
        ]

    def problems(self, optional: Callable[[str], bool] = lambda name: False) -> list[str]:
        out = []
        unmapped = [n for n in self.unmapped if not optional(n)]
        if unmapped:
            out.append(f"parameters the map does not name ({len(unmapped)}): {_short(unmapped)}")
        missing = sorted({t for n, ts in self.missing.items() if not optional(n) for t in ts})
        if missing:
            params = [n for n in self.missing if not optional(n)]
            out.append(
                f"missing from the checkpoint ({len(missing)}): {_short(missing)} (read by {_short(params, 10)})"
            )
        partial = [
            f"{n} (has {_short(self.present[n], 3)}; lacks {_short(self.missing[n], 3)})"
            for n in self.missing
            if optional(n) and self.present.get(n)
        ]
        if partial:
            out.append(
                f"optional parameters partly in the checkpoint, neither loadable nor to initialise "
                f"({len(partial)}): {'; '.join(partial)}"
            )
        if self.extra:
            out.append(f"in the checkpoint but read by no parameter ({len(self.extra)}): {_short(self.extra)}")
        if self.misshapen:
            out.append(f"shapes differ ({len(self.misshapen)}): {'; '.join(self.misshapen)}")
        return out + self.errors


def _short(names: list[str], n: int = 40) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def resolve(wmap: WeightMap, params: dict[str, tuple[int, ...]], tensors: dict[str, tuple]) -> Resolution:
    """Builds each parameter's expression against the checkpoint's ``tensors`` (``{name:
    (shape, dtype)}``) and collects every unmapped parameter, missing, extra and
    mis-shaped tensor."""
    shapes = Shapes(lambda name: tensors[name])
    res = Resolution({}, [], {}, [], [], [])
    used: set[str] = set()
    for name, shape in params.items():
        found = wmap.spec_for(name)
        if found is None:
            res.unmapped.append(name)
            continue
        spec, env = found
        try:
            expr = spec.build(tuple(shape), env, shapes)
        except MissingTensor:
            wanted = _named(spec, tuple(shape), env)
            res.missing[name] = sorted(n for n in wanted if n not in tensors)
            res.present[name] = sorted(n for n in wanted if n in tensors)
            continue
        except ValueError as e:
            res.errors.append(f"{name}: {e}")
            continue
        used.update(t.name for t in expr.tensors())
        if tuple(expr.shape) != tuple(shape):
            res.misshapen.append(f"{name} {list(shape)} in the model, {list(expr.shape)} from {expr.describe()}")
            continue
        res.exprs[name] = expr
    # A tensor a parameter with missing ones names is reported with it, not as extra.
    named = {t for ts in res.present.values() for t in ts}
    res.extra = sorted(t for t in tensors if t not in used and t not in named and not wmap.ignored(t))
    return res


def _named(spec: Spec, shape, env) -> set[str]:
    """Every tensor ``spec`` names for a parameter of ``shape`` (present or not)."""
    wanted: dict = {}
    try:
        spec.infer(shape, env, wanted)
    except ValueError:
        pass
    return set(wanted)


def infer_tensors(wmap: WeightMap, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The tensors an export writes and their shapes, from the parameters' shapes."""
    out: dict = {}
    for name, shape in params.items():
        found = wmap.spec_for(name)
        if found is None:
            raise ValueError(f"the map names no tensor for parameter {name!r}; add an entry for it.")
        spec, env = found
        spec.infer(tuple(shape), env, out)
    return {k: tuple(d if isinstance(d, int) else d[1] for d in v) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Exports: which parameter writes each element.


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
