"""The batch's sequence dimension over the context axis (``zj.make_mesh(context=C)``).

Every batch leaf is split over the data axes along its first dimension, as always; with a
context axis, its sequence dimension (``ZeroConfig.context_dims``: dimension 1 of every leaf
with two or more dimensions by default) is split over the context axis too. The step's
``shard_map`` is manual over the data axes only, so the loss sees each of its rows' whole
sequence, split over the context axis automatically: XLA partitions every op of the loss
over it (plain attention included: exact), and ``zj.nn.dot_product_attention`` runs its
Ulysses or ring kernel manual over it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.nn import context as layouts
from zerojax.nn.context import check as check_length


def sequence_dims(config: Any, batch: Any) -> list[int | None]:
    """Per batch leaf (``jax.tree.leaves`` order): its sequence dimension, or None."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    dims = config.context_dims
    table = dict(dims) if isinstance(dims, tuple) else None
    out = []
    for path, x in leaves:
        ndim = len(getattr(x, "shape", ()))
        if table is not None:
            name = jax.tree_util.keystr(path)
            d = table.get(name)
        else:
            d = (1 if ndim >= 2 else None) if dims is None else dims
        if d is not None and d >= ndim:
            raise ValueError(f"ZeroConfig.context_dims puts batch leaf {jax.tree_util.keystr(path)}'s sequence on "
                             f"dimension {d}, but it has shape {tuple(x.shape)}.")
        out.append(d)
    if table is not None:
        names = {jax.tree_util.keystr(p) for p, _ in leaves}
        unknown = sorted(set(table) - names)
        if unknown:
            raise ValueError(f"ZeroConfig.context_dims names {unknown}, which are not batch leaves; the batch has "
                             f"{sorted(names)}.")
    return out


def batch_shardings(plan: Any, batch: Any) -> list[NamedSharding]:
    """Per batch leaf (``jax.tree.leaves`` order): where the step splits it, rows over the
    batch axes and, on a context mesh, its sequence dimension over the context axis (what
    an ahead-of-time compile gives its batch shapes)."""
    dims = sequence_dims(plan.config, batch) if plan.context > 1 else [None] * len(jax.tree.leaves(batch))
    out = []
    for x, d in zip(jax.tree.leaves(batch), dims):
        spec = [plan.batch_axes] + [None] * (len(x.shape) - 1)
        if d is not None:
            spec[d] = plan.config.context_axis
        out.append(NamedSharding(plan.mesh, P(*spec)))
    return out


def check(plan: Any, batch: Any) -> None:
    """Refuses a batch whose sequence does not split over the context axis."""
    check_lengths(plan.config, batch, plan.context)


def check_lengths(config: Any, batch: Any, c: int) -> None:
    """Refuses a batch whose sequence does not split over ``c`` context devices in
    ``config``'s layout, naming the leaf and the lengths that fit."""
    if c == 1:
        return
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    for (path, x), d in zip(leaves, sequence_dims(config, batch)):
        if d is not None:
            check_length(int(x.shape[d]), c, config.context_layout,
                         f"batch leaf {jax.tree_util.keystr(path)}'s sequence length (dimension {d})")


def constrain(plan: Any, batch: Any) -> Any:
    """``batch`` with each leaf's sequence dimension split over the context axis (and its
    rows over the data axes); in the balanced layout, permuted into its order first."""
    if plan.context == 1:
        return batch
    leaves, treedef = jax.tree.flatten(batch)
    out = []
    for x, d in zip(leaves, sequence_dims(plan.config, batch)):
        spec = [plan.batch_axes] + [None] * (x.ndim - 1)
        if d is not None:
            spec[d] = plan.config.context_axis
            if plan.config.context_layout == "balanced":
                x = layouts.permute(x, d, plan.context)
        out.append(jax.lax.with_sharding_constraint(x, NamedSharding(plan.mesh, P(*spec))))
    return jax.tree.unflatten(treedef, out)


def whole(plan: Any, x: jax.Array, layout: Any = None) -> jax.Array:
    """Inside the step's ``shard_map``: ``x`` (a gradient in its parameter's shape) made whole
    over the automatic context axis, so that a collective over the data axes takes it (XLA
    reduces a gradient's per-chunk sums over the context axis here); a tensor-parallel
    leaf keeps its split over the tensor axis (``layout``)."""
    if plan.context == 1:
        return x
    spec = layout.tensor_spec() if layout is not None and layout.tp and x.ndim == len(layout.shape) else P()
    return jax.lax.with_sharding_constraint(x, spec)


@contextlib.contextmanager
def tracing(plan: Any) -> Iterator[None]:
    """The context a step traces its loss in: the layout the kernels and
    ``zj.nn.global_positions`` read. On leaving, it refuses a balanced step whose loss never
    called ``zj.nn.dot_product_attention`` (attention written with plain ops would see the
    permuted sequence as if it were in order)."""
    layout = plan.config.context_layout if plan.context > 1 else "contiguous"
    with layouts.tracing(layout) as scope:
        yield
    if layout == "balanced" and not scope.aware:
        raise ValueError(
            "ZeroConfig(context_layout='balanced') hands the loss each sequence permuted into the balanced order "
            "(zj.nn.context.order), but the loss never called zj.nn.dot_product_attention: attention written "
            "with plain ops would treat the permuted sequence as if it were in order. Use "
            "zj.nn.dot_product_attention (ring or Ulysses) and, for positions the model builds, "
            "zj.nn.global_positions instead of jnp.arange; or context_layout='contiguous'.")
