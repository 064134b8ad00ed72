"""The batch's sequence over the context axis (``zj.make_mesh(context=C)``): which leaves and
dimensions are sequences, where the step splits them, and their layout's order.

Every batch leaf is split over the data axes along its first dimension, as always; with a
context axis, a leaf's sequence dimensions (:func:`sequence_dims`) are what the context
axis touches: the first is split over it, and in the balanced layout every one of them is
permuted into the layout's order (a ``[B, T, T]`` mask on its rows and its columns). The
step's ``shard_map`` is manual over the data axes only, so the loss sees each of its rows'
whole sequence, split over the context axis automatically: XLA partitions every op of the
loss over it (plain attention included: exact), and ``zj.nn.dot_product_attention`` runs
its Ulysses or ring kernel manual over it.

Which dimensions are sequences (``ZeroConfig.context.dims``):

- ``{batch leaf path: dim, (dims...) or None}``: exactly those (paths as
  ``jax.tree_util.keystr`` writes them, e.g. ``"['mask']"``); leaves not named are not
  sequences;
- an int ``d``: dimension ``d`` of every leaf that has one;
- None (default), contiguous layout: dimension 1 of every leaf with two or more
  dimensions (splitting a leaf that is not a sequence costs nothing: XLA keeps it exact),
  except where the leaves disagree on it and one length is held by more leaves than any
  other: that length is the sequence's, and a leaf of another length (a per-example
  ``[B, 3]`` beside ``[B, T]`` inputs and targets) is not split (exact either way: XLA
  partitions the loss). A tie is no such evidence: every leaf stays a sequence, and one
  that does not split is refused naming the ``dims`` that would say otherwise;
- None, balanced layout, where a wrong guess would permute values: dimension 1 of every
  leaf with two or more dimensions, provided they all have the same length there, and no
  leaf has that length on another dimension too; otherwise the step refuses the batch and
  asks for ``context_dims``.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.context.layout import Layout


def layout_of(plan: Any) -> Layout:
    """The layout a step with ``plan`` lays its sequences out in."""
    return Layout(
        plan.config.context.layout if plan.context > 1 else "contiguous", plan.context, plan.config.axes.context
    )


def sequence_dims(config: Any, batch: Any) -> list[tuple[int, ...]]:
    """Per batch leaf (``jax.tree.leaves`` order): its sequence dimensions, the one split
    over the context axis first (empty: not a sequence)."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    shapes = [tuple(getattr(x, "shape", ())) for _, x in leaves]
    dims = config.context.dims
    if isinstance(dims, tuple):  # {leaf path: dims}
        table = dict(dims)
        unknown = sorted(set(table) - set(names))
        if unknown:
            raise ValueError(
                f"ZeroConfig.context.dims names {unknown}, which are not batch leaves; the batch has {sorted(names)}."
            )
        out = [_as_dims(table.get(n)) for n in names]
    elif dims is not None:
        out = [(dims,) if len(s) > dims else () for s in shapes]
    elif config.context.layout == "balanced":
        out = _balanced_default(names, shapes)
    else:
        out = _contiguous_default(shapes)
    for n, s, ds in zip(names, shapes, out):
        if any(d >= len(s) for d in ds):
            raise ValueError(
                f"ZeroConfig.context.dims puts batch leaf {n}'s sequence on dimension(s) {ds}, but it has shape {s}."
            )
    return out


def _as_dims(d: Any) -> tuple[int, ...]:
    if d is None:
        return ()
    return (d,) if isinstance(d, int) else tuple(d)


def _contiguous_default(shapes: list[tuple]) -> list[tuple[int, ...]]:
    """Dimension 1 of every leaf with two or more, or where the leaves disagree and one
    length is the most common, of the leaves of that length."""
    counts = collections.Counter(s[1] for s in shapes if len(s) >= 2).most_common()
    seq = counts[0][0] if len(counts) > 1 and counts[0][1] > counts[1][1] else None
    return [(1,) if len(s) >= 2 and (seq is None or s[1] == seq) else () for s in shapes]


def _balanced_default(names: list[str], shapes: list[tuple]) -> list[tuple[int, ...]]:
    """Dimension 1 of every leaf with two or more, when that is unambiguous."""
    lengths = {s[1] for s in shapes if len(s) >= 2}
    fix = (
        "say which leaves and dimensions are sequences: ZeroConfig(context={'dims': {leaf path: dim, (dims...) or "
        "None}}), e.g. {\"['tokens']\": 1, \"['mask']\": (1, 2), \"['label']\": None}"
    )
    if len(lengths) > 1:
        seen = ", ".join(f"{n} {list(s)}" for n, s in zip(names, shapes) if len(s) >= 2)
        raise ValueError(
            f"context={{'layout': 'balanced'}} permutes each sequence of the batch, but its leaves have "
            f"different lengths on dimension 1 ({seen}): the step does not guess which are sequences; "
            f"{fix}."
        )
    out = []
    for n, s in zip(names, shapes):
        if len(s) < 2:
            out.append(())
            continue
        again = [d for d in range(2, len(s)) if s[d] == s[1]]
        if again:
            raise ValueError(
                f"context={{'layout': 'balanced'}}: batch leaf {n} {list(s)} has the sequence length {s[1]} on "
                f"dimension(s) {[1] + again}; a [B, T, T] mask is a sequence on each, a [B, T, D] "
                f"feature with D = T on one only: {fix}."
            )
        out.append((1,))
    return out


def batch_shardings(plan: Any, batch: Any) -> list[NamedSharding]:
    """Per batch leaf (``jax.tree.leaves`` order): where the step splits it, rows over the
    batch axes and, on a context mesh, its first sequence dimension over the context axis
    (what an ahead-of-time compile gives its batch shapes)."""
    leaves = jax.tree.leaves(batch)
    dims = sequence_dims(plan.config, batch) if plan.context > 1 else [()] * len(leaves)
    return [
        NamedSharding(plan.mesh, _spec(plan, x.ndim if hasattr(x, "ndim") else len(x.shape), d))
        for x, d in zip(leaves, dims)
    ]


def _rows(plan: Any) -> Any:
    """The axes a leaf's rows are split over: the batch axes, and the expert axis after them
    on an expert mesh (automatic in the step: each expert device holds its own rows)."""
    if plan.expert == 1:
        return plan.batch_axes
    b = plan.batch_axes
    return (*((b,) if isinstance(b, str) else b), plan.config.axes.expert)


def _spec(plan: Any, ndim: int, dims: tuple[int, ...]) -> P:
    spec = [_rows(plan)] + [None] * (ndim - 1)
    if dims:
        spec[dims[0]] = plan.config.axes.context
    return P(*spec)


def check(plan: Any, batch: Any) -> None:
    """Refuses a batch whose sequences do not split over the context axis."""
    check_lengths(plan.config, batch, plan.context)


def check_lengths(config: Any, batch: Any, c: int) -> None:
    """Refuses a batch whose sequences do not split over ``c`` context devices in
    ``config``'s layout, naming the leaf and the lengths that fit."""
    if c == 1:
        return
    layout = Layout(config.context.layout, c)
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    seqs = sequence_dims(config, batch)
    for (path, x), dims in zip(leaves, seqs):
        name = jax.tree_util.keystr(path)
        for d in dims:
            try:
                layout.check(int(x.shape[d]), f"batch leaf {name}'s sequence length (dimension {d})")
            except ValueError as e:
                if config.context.dims is not None:  # the user said it is a sequence
                    raise
                say = {
                    jax.tree_util.keystr(p): (ds[0] if len(ds) == 1 else ds) if ds else None
                    for (p, _), ds in zip(leaves, seqs)
                }
                say[name] = None
                raise ValueError(
                    f"{e} If {name} {list(x.shape)} is not a sequence (a per-example value), say which leaves "
                    f"are: ZeroConfig(context={{'dims': {say}}})."
                ) from None


def constrain(plan: Any, batch: Any) -> Any:
    """``batch`` with each leaf's sequence split over the context axis (and its rows over
    the data axes, and over the expert axis on an expert mesh); in the balanced layout, every
    sequence dimension permuted into its order first."""
    if plan.context == 1 and plan.expert == 1:
        return batch
    layout = layout_of(plan)
    leaves, treedef = jax.tree.flatten(batch)
    out = []
    seqs = sequence_dims(plan.config, batch) if plan.context > 1 else [()] * len(leaves)
    for x, dims in zip(leaves, seqs):
        for d in dims:
            x = layout.permute(x, d)
        out.append(jax.lax.with_sharding_constraint(x, NamedSharding(plan.mesh, _spec(plan, x.ndim, dims))))
    return jax.tree.unflatten(treedef, out)


def permuted_dims(plan: Any, batch: Any) -> list[frozenset[int]]:
    """Per batch leaf: the dimensions the step reorders (none unless the layout moves)."""
    if not layout_of(plan).moves:
        return [frozenset()] * len(jax.tree.leaves(batch))
    return [frozenset(d) for d in sequence_dims(plan.config, batch)]


def whole(plan: Any, x: jax.Array, layout: Any = None) -> jax.Array:
    """Inside the step's ``shard_map``: ``x`` (a gradient in its parameter's shape) made whole
    over the automatic context axis, so that a collective over the data axes takes it (XLA
    reduces a gradient's per-chunk sums over the context axis here); a tensor-parallel
    leaf keeps its split over the tensor axis (``layout``: its leaf layout). On an expert
    mesh the same holds over the automatic expert axis (the rows are split over it), a
    routed expert's gradient keeping its split over it."""
    if plan.context == 1 and plan.expert == 1:
        return x
    spec = layout.tensor_spec() if layout is not None and layout.tp and x.ndim == len(layout.shape) else P()
    return jax.lax.with_sharding_constraint(x, spec)
