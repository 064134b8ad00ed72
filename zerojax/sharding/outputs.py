"""How a loss's ``aux`` (or an eval function's outputs) combine over micro-batches and devices.

Each device computes its outputs on its own rows of the batch, one micro-batch at a time.
Every output leaf says how those per-device values make one result:

* ``"mean"``: the mean over micro-batches and devices (floating leaves only; for a scalar
  metric that is a mean over equal-sized shares of the batch, this is the global mean);
* ``"sum"``: the sum (counts, totals; booleans count as 0/1);
* ``"concat"``: per-example rows, in global batch order (each device's rows put back in
  their order from its strided micro-batches, devices in mesh order).

By default a floating scalar is averaged; every other leaf must be given a rule, because
averaging per-example predictions element by element, or an integer count into a float,
would be silently wrong.

Dtypes: floating "mean" and "sum" leaves are combined, and returned, in float32 (or wider),
whatever the compute dtype: eight fp16 losses of 10,000 sum to 80,000, past fp16's
largest value (65,504), and an fp16 count is exact only up to 2,048. Integer and boolean
"sum" leaves come back as int32 (booleans) or their own dtype; "concat" leaves keep theirs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

RULES = ("mean", "sum", "concat")


@dataclasses.dataclass(frozen=True)
class Combine:
    """The rule of every leaf of one output tree (static: hashable)."""

    treedef: Any
    rules: tuple[str, ...]

    def over_micro_batches(self, stacked: Any) -> Any:
        """Leaves stacked on a leading micro-batch axis (from ``lax.scan``) -> one value."""

        def one(rule, x):
            if rule == "mean":
                return jnp.mean(_summable(x), axis=0)
            if rule == "sum":
                return jnp.sum(_summable(x), axis=0)
            # micro-batch j holds the device's rows j, j + k, ...: back to row order
            return x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

        return self._map(one, stacked)

    def over_devices(self, tree: Any, axis: str) -> Any:
        """This device's value -> the combined one (concat leaves stay local: the
        ``shard_map`` output spec joins them, see :meth:`specs`)."""

        def one(rule, x):
            if rule == "mean":
                return jax.lax.pmean(_summable(x), axis)
            if rule == "sum":
                return jax.lax.psum(_summable(x), axis)
            return x

        return self._map(one, tree)

    def specs(self, axis: str) -> Any:
        """``shard_map`` output specs: replicated, or split over ``axis`` for concat."""
        return jax.tree.unflatten(self.treedef, [P(axis) if r == "concat" else P() for r in self.rules])

    def _map(self, fn, tree):
        leaves = self.treedef.flatten_up_to(tree)
        return jax.tree.unflatten(self.treedef, [fn(r, x) for r, x in zip(self.rules, leaves)])


def _summable(x: jax.Array) -> jax.Array:
    """``x`` in the dtype its sum or mean is taken in: float32 for narrower floats
    (bf16/fp16 overflow or round: see the module docstring), int32 for booleans."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int32)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x


def plan(spec: Any, shapes: Any, what: str = "aux", arg: str = "aux_reduce") -> Combine:
    """Validates ``spec`` (None, a rule for every leaf, or a pytree prefix of ``shapes`` with
    a rule at each of its leaves) against the output ``shapes`` (``jax.ShapeDtypeStruct``)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    if spec is None:
        rules = [None] * len(leaves)
    else:
        if isinstance(spec, str):
            spec_tree = jax.tree.map(lambda _: spec, shapes)
        else:
            try:
                spec_tree = jax.tree.map(lambda rule, sub: jax.tree.map(lambda _: rule, sub), spec, shapes)
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"{arg} must be one of {RULES}, or a tree with the structure of {what} "
                    f"(or a prefix of it) holding those names; got {spec!r} for {what} "
                    f"{jax.tree.structure(shapes)}: {e}"
                ) from None
        rules = jax.tree.leaves(spec_tree)
    out = []
    for (path, x), rule in zip(leaves, rules):
        name = f"{what}{jax.tree_util.keystr(path)}"
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        if rule is None:
            if x.shape == () and floating:
                out.append("mean")
                continue
            hint = "per-example rows: 'concat'" if x.shape else "a count or total: 'sum'"
            raise ValueError(
                f"{name} has shape {x.shape} and dtype {x.dtype}: say how it combines over "
                f"devices and micro-batches with {arg}= ('mean', 'sum' or 'concat'; for "
                f"{hint}). Only floating scalars are averaged by default."
            )
        if rule not in RULES:
            raise ValueError(f"{arg} for {name} must be one of {RULES}, got {rule!r}.")
        if rule == "mean" and not floating:
            raise ValueError(
                f"{name} has dtype {x.dtype}: its mean over devices would turn it into a float. "
                f"Use {arg}='sum' for counts, or return a float."
            )
        if rule == "concat" and not x.shape:
            raise ValueError(
                f"{name} is a scalar: 'concat' joins per-example rows along a leading axis. "
                "Use 'mean' or 'sum', or return one row per example."
            )
        out.append(rule)
    return Combine(treedef=treedef, rules=tuple(out))
