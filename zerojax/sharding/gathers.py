"""Batched gathers rewritten as a select and a sum, on a data x context x tensor mesh.

Inside the train step's ``shard_map`` (manual over the data axes, "context" and "tensor"
automatic), XLA's SPMD partitioner aborts the process (a failed check in
``spmd_partitioner_util.cc``, jax 0.10 to 0.12) on a gather with operand batching
dimensions whose operand is split over "context" on a batching dimension and over "tensor"
on the dimension it indexes: ``jnp.take_along_axis(logits, targets[..., None], -1)`` on
``[batch, seq, vocab]`` logits, which is how optax's
``softmax_cross_entropy_with_integer_labels`` picks each target's logit. The same gather
with only one of the two splits, and every other op of a transformer's step, partitions.

So on a mesh with both axes the loss is evaluated from its jaxpr with each such gather
written as ``where(iota == index, operand, 0).sum(dim)``: the same values (one term plus
zeros; ``where``, not a one-hot product, so an infinite or NaN logit elsewhere does not
leak in), the same out-of-range behaviour (clamped, or the gather's fill value), and on a
vocabulary split over "tensor" it is Megatron's vocab-parallel pick: each tensor shard sums
its part, then one all-reduce of ``[batch, seq]``. A gather with batching dimensions of
another form is refused with a ``ValueError`` naming its source line, rather than left to
abort the process. ``shard_map`` regions (zerojax's attention kernels) are bound whole:
their axes exist only inside them. Everything read of JAX's program form goes through
:mod:`zerojax._jaxpr`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._jaxpr import check, constructs, form, lines
from zerojax._jaxpr.form import Equation
from zerojax._jaxpr.retrace import Retracer


def needed(plan: Any) -> bool:
    """Whether ``plan``'s mesh has both a tensor and a context axis (the rewrite's case)."""
    return plan.tensor > 1 and plan.context > 1


def wrap(plan: Any, fn: Callable) -> Callable:
    """``fn`` as is, or on a mesh with tensor and context axes, ``fn`` evaluated from its
    jaxpr with its batched gathers rewritten (same signature, positional and keyword
    arguments alike). Where zerojax reads no program, such a mesh is refused
    (:class:`zerojax._jaxpr.check.ProgramReadingRequired`): without the rewrite XLA's
    partitioner may abort the process."""
    if not needed(plan):
        return fn
    check.require(
        f"A mesh with both a tensor ({plan.tensor}) and a context ({plan.context}) axis",
        "Train on a mesh with one of the two (zj.make_mesh(tensor=...) or zj.make_mesh(context=...)).",
    )

    @functools.wraps(fn)
    def rewritten(*args, **kwargs):
        flat, tree = jax.tree.flatten((args, kwargs))
        closed, shapes = jax.make_jaxpr(lambda *f: _call(fn, tree, f), return_shape=True)(*flat)
        return jax.tree.unflatten(jax.tree.structure(shapes), Rewriter().evaluate(closed, flat))

    return rewritten


def _call(fn: Callable, tree: Any, flat: Any) -> Any:
    args, kwargs = jax.tree.unflatten(tree, flat)
    return fn(*args, **kwargs)


class Rewriter(Retracer):
    """Re-traces a program with every ``jnp.take_along_axis``-form gather written as a
    select and a sum (see the module docstring)."""

    def replace(self, eqn: Equation, invals: list[Any]) -> list[Any] | None:
        if constructs.is_manual_region(eqn):
            return form.bind(eqn, invals)
        if constructs.is_gather(eqn) and constructs.has_batching_dims(eqn):
            pick = constructs.take_along(eqn)
            if pick is None:
                line = lines.where(eqn) or "a library line"
                raise ValueError(
                    f"the loss gathers with batching dimensions at {line} in a form zerojax does not "
                    f"rewrite (dimension numbers {constructs.gather_form(eqn)}), and on a mesh with both a tensor "
                    "and a context axis XLA's partitioner aborts on such gathers. Index with jnp.take_along_axis "
                    "(one element per index along one axis), or train on zj.make_mesh(context=C) or "
                    "zj.make_mesh(tensor=T) alone."
                )
            return [select_sum(pick, *invals, out_shape=form.shape(eqn.outvars[0]))]
        return None


def select_sum(
    pick: constructs.TakeAlong, operand: jax.Array, indices: jax.Array, *, out_shape: tuple[int, ...]
) -> jax.Array:
    """The gather ``pick`` of ``operand`` at ``indices`` (its last dimension the index
    vector, of size 1), without a gather.

    Example (``jnp.take_along_axis``'s result):
      >>> import jax.numpy as jnp
      >>> from zerojax._jaxpr.constructs import TakeAlong
      >>> x, i = jnp.arange(6.0).reshape(2, 3), jnp.array([[2], [0]])
      >>> select_sum(TakeAlong(dim=1, pairs=((0, 0),), fill=True, fill_value=None), x, i, out_shape=(2, 1))
      Array([[2.],
             [3.]], dtype=float32)
    """
    size = operand.shape[pick.dim]
    idx = indices[..., 0]
    # the operand laid out like the indices: each batching dimension where its indices'
    # dimension is, the picked one last
    order = [o for o, _ in sorted(pick.pairs, key=lambda p: p[1])] + [pick.dim]
    shape = [1] * idx.ndim
    for o, i in pick.pairs:
        shape[i] = operand.shape[o]
    op = jnp.transpose(operand, order).reshape(shape + [size])
    if not pick.fill:
        idx = jnp.clip(idx, 0, size - 1)
    hit = jax.lax.broadcasted_iota(idx.dtype, idx.shape + (size,), idx.ndim) == idx[..., None]
    out = jnp.where(hit, op, jnp.zeros((), op.dtype)).sum(-1).astype(op.dtype)
    if pick.fill:
        out = jnp.where((idx >= 0) & (idx < size), out, _fill(pick.fill_value, op.dtype))
    return out.reshape(out_shape)


def _fill(value: Any, dtype: Any) -> jax.Array:
    """A gather's fill for out-of-range indices: its ``fill_value``, else JAX's default
    (NaN for inexact types, the minimum for signed integers, the maximum for unsigned, True
    for booleans)."""
    if value is None:
        if jnp.issubdtype(dtype, jnp.inexact):
            value = jnp.nan
        elif jnp.issubdtype(dtype, jnp.signedinteger):
            value = jnp.iinfo(dtype).min
        elif jnp.issubdtype(dtype, jnp.unsignedinteger):
            value = jnp.iinfo(dtype).max
        else:
            value = True
    return jnp.asarray(value, dtype)
