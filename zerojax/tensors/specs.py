"""Specs: what a weight map says of one parameter, built into an expression.

A spec is a tensor name (a string) or one of :func:`transpose`, :func:`stack`,
:func:`split_dim`, :func:`merge_dims`, :func:`concat` and :func:`part` around specs. Its one
method, :meth:`Spec.build`, carries the parameter's shape (the *target*) down to the tensor
names and asks a :class:`Shapes` for each tensor's shape, returning the
:class:`~zerojax.tensors.expressions.Expr` that reads the parameter from them.

The same traversal serves both directions:

- loading, against a checkpoint's shapes (:class:`Shapes`), which ignore the target;
- exporting, against :class:`Recorded`, which answers each tensor with the target it is asked
  for and records it: the shapes an export writes.

A target dimension is an ``int``, :class:`AtLeast` (the extent a :func:`part` needs of its
fused tensor: its start plus the parameter's size) or ``None`` (what a :func:`concat` without
``sizes`` leaves unknown).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from zerojax.tensors.expressions import Concat, Expr, Part, Reshape, Tensor, Transpose


@dataclasses.dataclass(frozen=True)
class AtLeast:
    """A target dimension only bounded below: the tensor has at least ``n`` there."""

    n: int

    def __repr__(self):
        return f">={self.n}"


class MissingTensor(KeyError):
    """A spec names a tensor the checkpoint does not have."""


class Shapes:
    """Tensor shapes and dtypes a spec builds against: a checkpoint's, by ``lookup(name) ->
    (shape, dtype)`` (which raises ``KeyError`` for a tensor it lacks)."""

    def __init__(self, lookup: Callable[[str], tuple[tuple[int, ...], np.dtype]]):
        self.lookup = lookup

    def __call__(self, name: str, target: tuple) -> tuple[tuple[int, ...], np.dtype]:
        """The shape and dtype of tensor ``name``, which the spec expects to be ``target``."""
        try:
            shape, dtype = self.lookup(name)
        except KeyError:
            raise MissingTensor(name) from None
        return tuple(shape), np.dtype(dtype)


class Recorded(Shapes):
    """The shapes the parameters imply (exporting, where no checkpoint says them): each
    tensor is the shape its spec asks for, recorded in :attr:`shapes` (``{name: target}``,
    merged over every spec that names it). A tensor asked for with two different extents
    is refused. ``unknown``: the extent answered where no parameter fixes one (a
    :func:`concat` without ``sizes``); None refuses it, as an export must."""

    def __init__(self, dtype=np.float32, unknown: int | None = None):
        self.shapes: dict[str, tuple] = {}
        self.dtype = np.dtype(dtype)
        self.unknown = unknown

    def __call__(self, name, target):
        target = tuple(target)
        prev = self.shapes.get(name)
        if prev is not None:
            merged = _merge(prev, target)
            if merged is None:
                raise ValueError(f"tensor {name!r} is mapped with shapes {list(prev)} and {list(target)}.")
            target = merged
        self.shapes[name] = target
        if self.unknown is None and None in target:
            raise ValueError(
                f"the extent of tensor {name!r} along dimension {target.index(None)} is not known from the "
                "parameters: concat(...) needs sizes=... to export: the parts' extents along the axis."
            )
        return tuple(self.unknown if n is None else _least(n) for n in target), self.dtype

    def exact(self) -> dict[str, tuple[int, ...]]:
        """The recorded shapes, each bound taken at its least."""
        return {k: tuple(_least(n) for n in v) for k, v in self.shapes.items()}


def _least(n: int | AtLeast) -> int:
    return n.n if isinstance(n, AtLeast) else n


def _merge(a: tuple, b: tuple) -> tuple | None:
    """One target for a tensor asked for as ``a`` and as ``b``, or None where they differ."""
    if len(a) != len(b):
        return None
    out = []
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return None
            out.append(x)
        elif isinstance(x, int) or isinstance(y, int):
            known, bound = (x, y) if isinstance(x, int) else (y, x)
            if bound is not None and known < bound.n:
                return None
            out.append(known)
        elif x is None or y is None:
            out.append(x if y is None else y)
        else:
            out.append(AtLeast(max(x.n, y.n)))
    return tuple(out)


def _exact(target: tuple, axis: int, what: str) -> int:
    """``target[axis]``, which ``what`` needs fixed by the parameter."""
    n = target[axis]
    if not isinstance(n, int):
        raise ValueError(
            f"{what} needs the extent of dimension {axis} fixed by the parameter, but it is {n!r} "
            "(inside a part(...) along that axis, or a concat(...) without sizes=...)."
        )
    return n


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one parameter is made of checkpoint tensors."""

    def build(self, target: tuple, env: dict, shapes: Shapes) -> Expr:
        """The expression for a parameter of shape ``target``, its names formatted with
        ``env`` and its tensors' shapes asked of ``shapes``."""
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
        name = self.name(env)
        shape, dtype = shapes(name, tuple(target))
        return Tensor(name, shape, dtype)


def as_spec(s) -> Spec:
    """``s`` as a spec: a string is the tensor of that name."""
    if isinstance(s, Spec):
        return s
    if isinstance(s, str):
        return Name(s)
    raise TypeError(
        f"a map entry is a tensor name (str) or a spec (transpose, stack, ...), got {type(s).__name__} {s!r}."
    )


def _with(target: tuple, axis: int, n) -> tuple:
    return target[:axis] + (n,) + target[axis + 1 :]


@dataclasses.dataclass(frozen=True)
class _Transpose(Spec):
    child: Spec
    perm: tuple[int, ...] | None

    def _perm(self, n):
        return self.perm if self.perm is not None else tuple(range(n - 1, -1, -1))

    def build(self, target, env, shapes):
        perm = self._perm(len(target))
        inv = np.argsort(perm)
        fits = sorted(perm) == list(range(len(target)))
        child = self.child.build(tuple(target[i] for i in inv) if fits else target, env, shapes)
        if len(child.shape) != len(target):  # a tensor of another rank: transposed by its own rank
            perm = self._perm(len(child.shape))
        if sorted(perm) != list(range(len(child.shape))):
            raise ValueError(f"transpose perm {list(perm)} does not fit {child.describe()}.")
        return Transpose(child, tuple(perm))


@dataclasses.dataclass(frozen=True)
class _Stack(Spec):
    child: Spec
    axis: int
    var: str

    def build(self, target, env, shapes):
        n = _exact(target, self.axis, "stack(...)")
        if self.var in env:  # an outer stack or the key names it: one name, two indices
            raise ValueError(
                f"stack(..., var={self.var!r}) inside a stack or a key that already defines {{{self.var}}}: "
                f"its index would hide the outer one and every outer entry would read the same tensors. "
                f"Give each level its own name: stack(..., var='j') and '{{j}}' in the inner tensor names."
            )
        inner = target[: self.axis] + target[self.axis + 1 :]
        return Concat(
            tuple(self.child.build(inner, {**env, self.var: i}, shapes) for i in range(n)), self.axis, stack=True
        )


@dataclasses.dataclass(frozen=True)
class _SplitDim(Spec):
    child: Spec
    axis: int

    def build(self, target, env, shapes):
        a = self.axis
        rows, cols = (_exact(target, d, "split_dim(...)") for d in (a, a + 1))
        child = self.child.build(target[:a] + (rows * cols,) + target[a + 2 :], env, shapes)
        # The tensor's own extents, so that a tensor of another shape reads as mis-shapen.
        if len(child.shape) <= a or child.shape[a] % cols:
            raise ValueError(f"split_dim(axis={a}): {child.describe()} does not split into rows of {cols} there.")
        return Reshape(child, child.shape[:a] + (child.shape[a] // cols, cols) + child.shape[a + 1 :])


@dataclasses.dataclass(frozen=True)
class _MergeDims(Spec):
    child: Spec
    axis: int
    inner: int

    def build(self, target, env, shapes):
        a, n = self.axis, _exact(target, self.axis, "merge_dims(...)")
        if n % self.inner:
            raise ValueError(f"merge_dims: dimension {a} of size {n} does not split into rows of {self.inner}.")
        child = self.child.build(target[:a] + (n // self.inner, self.inner) + target[a + 1 :], env, shapes)
        if len(child.shape) <= a + 1:
            raise ValueError(f"merge_dims(axis={a}): {child.describe()} has no dimensions {a} and {a + 1} to merge.")
        shape = child.shape
        return Reshape(child, shape[:a] + (shape[a] * shape[a + 1],) + shape[a + 2 :])


@dataclasses.dataclass(frozen=True)
class _Concat(Spec):
    children: tuple[Spec, ...]
    axis: int
    sizes: tuple[int, ...] | None

    def build(self, target, env, shapes):
        sizes = self.sizes or (None,) * len(self.children)
        parts = [c.build(_with(target, self.axis, s), env, shapes) for c, s in zip(self.children, sizes)]
        return Concat(tuple(parts), self.axis)


@dataclasses.dataclass(frozen=True)
class _Part(Spec):
    child: Spec
    axis: int
    start: int

    def build(self, target, env, shapes):
        size = _exact(target, self.axis, "part(...)")
        child = self.child.build(_with(target, self.axis, AtLeast(self.start + size)), env, shapes)
        return Part(child, self.axis, self.start, size)


def transpose(spec, perm: Sequence[int] | None = None) -> Spec:
    """The tensor with its dimensions permuted: ``perm`` as in ``np.transpose`` (default:
    reversed, a torch ``Linear`` weight ``[out, in]`` as a Flax kernel ``[in, out]``)."""
    return _Transpose(as_spec(spec), None if perm is None else tuple(perm))


def stack(spec, axis: int = 0, var: str = "i") -> Spec:
    """One tensor per index of the parameter's dimension ``axis`` (a scanned stack of
    layers): ``spec``'s names are formatted with ``{var}`` = the index."""
    return _Stack(as_spec(spec), axis, var)


def split_dim(spec, axis: int) -> Spec:
    """The parameter's dimensions ``axis`` and ``axis + 1`` are one dimension of the tensor
    (heads x head_dim stored as one)."""
    return _SplitDim(as_spec(spec), axis)


def merge_dims(spec, axis: int, inner: int) -> Spec:
    """The parameter's dimension ``axis`` is two dimensions of the tensor, the second of
    size ``inner`` (the inverse of :func:`split_dim`)."""
    return _MergeDims(as_spec(spec), axis, inner)


def concat(specs: Sequence, axis: int, sizes: Sequence[int] | None = None) -> Spec:
    """Tensors joined along ``axis`` (a fused q/k/v parameter from separate tensors);
    ``sizes``, their extents along it, is needed to export."""
    specs = tuple(as_spec(s) for s in specs)
    sizes = None if sizes is None else tuple(sizes)
    if not specs:
        raise ValueError("concat(...) needs at least one spec to join.")
    if sizes is not None and len(sizes) != len(specs):
        raise ValueError(f"concat(...) of {len(specs)} specs has {len(sizes)} sizes {list(sizes)}: give one per spec.")
    return _Concat(specs, axis, sizes)


def part(spec, axis: int, start: int) -> Spec:
    """The slice of a tensor along ``axis`` from ``start``, as long as the parameter is
    there (one of q/k/v from a fused tensor)."""
    return _Part(as_spec(spec), axis, start)
