"""Applying any optax transformation to sharded state, with every array in its own shape.

The optimizer never sees the storage layout. Each array (parameter, gradient, optimizer
state) is viewed in its own shape before ``tx.update`` and stored back after it
(:mod:`zerojax.sharding.leaf_layout`):

* a ``dim`` array is its storage without the padding, split over the devices along the
  same dimension: elementwise math stays local to each device's shard, with no copy;
* a ``flat`` array is all-gathered whole for the update (the exact path for arrays whose
  every dimension is too small to split evenly), then each device keeps its shard again;
* a replicated array (a scalar) is used as it is.

The update runs outside ``shard_map``, on global arrays, so anything an optimizer computes
across an array (Adafactor's row and column means, Muon's Newton–Schulz matmuls, LAMB's
trust ratio, a global-norm clip) is computed by XLA over all shards: the same value as on
one device, whatever the transform.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from zerojax.optim.rounding import round_to
from zerojax.sharding.leaf_layout import LeafLayout
from zerojax.sharding.plan import ZeroPlan, master_dtype


def check_optimizer(tx: Any) -> None:
    """Accepts any object with optax's ``init(params)`` / ``update(updates, state, params)``
    protocol (``optax.GradientTransformation``, ``optax.MultiSteps``, ...)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"tx must be an optax optimizer: an object with init(params) and "
            f"update(updates, state, params) (e.g. optax.adamw(1e-3)), got {tx!r}."
        )


def view(
    plan: ZeroPlan, layouts: tuple[LeafLayout, ...], storage: list[jax.Array], memory_kind: str | None = None
) -> list[jax.Array]:
    """Each stored array in its own shape, laid out for the optimizer (see the module docstring)."""
    out = []
    for l, x in zip(layouts, storage):
        v = l.from_storage(x)
        if l.kind != "replicated" or l.tp:
            v = jax.lax.with_sharding_constraint(
                v, NamedSharding(plan.mesh, l.view_spec(plan.storage_axes_of(l)), memory_kind=memory_kind)
            )
        out.append(v)
    return out


def store(
    plan: ZeroPlan, layouts: tuple[LeafLayout, ...], arrays: list[jax.Array], memory_kind: str | None = None
) -> list[jax.Array]:
    """The inverse of :func:`view`: each array in its storage layout."""
    return [
        jax.lax.with_sharding_constraint(l.to_storage(x), plan.sharding(l, memory_kind))
        for l, x in zip(layouts, arrays)
    ]


def update(
    plan: ZeroPlan,
    tx: Any,
    grads: list[jax.Array],
    opt_leaves: list[jax.Array],
    masters: list[jax.Array],
    memory_kind: str | None = None,
    step: jax.Array | None = None,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """One optax step on the fp32 masters of the trainable parameters (all in the stage's
    storage layouts; the frozen ones are ``optax.MaskedNode()`` in the trees the optimizer
    sees, as inside ``optax.masked``); returns the new masters and optimizer-state leaves,
    stored the same way, in ``memory_kind``.

    State stored narrower than it computes (``ZeroConfig.state_dtypes``) is cast up to the
    dtype ``tx.init`` gives (the masters to fp32) before ``tx.update`` and back down after
    it; bf16 masters round stochastically with ``step``'s key where the config says so."""
    layouts, opt_layouts = plan.master_layouts, plan.opt_storage_layouts
    up = lambda xs, dtypes: [x.astype(d) for x, d in zip(xs, dtypes)]
    params = plan.unflatten_train(
        up(view(plan, layouts, masters, memory_kind), [master_dtype(l.dtype) for l in layouts])
    )
    updates, new_opt = tx.update(
        plan.unflatten_train(view(plan, layouts, grads, memory_kind)),
        plan.unflatten_opt(up(view(plan, opt_layouts, opt_leaves, memory_kind), [l.dtype for l in plan.opt_layouts])),
        params,
    )
    keys = rounding_keys(plan, step, len(masters))
    new = [
        round_to(x, m.dtype, k) for x, m, k in zip(jax.tree.leaves(optax.apply_updates(params, updates)), masters, keys)
    ]
    new_opt, treedef = jax.tree.flatten(new_opt)
    if treedef != plan.opt_treedef:
        raise ValueError(
            f"the optimizer's update changed its state's structure from {plan.opt_treedef} to "
            f"{treedef}; zerojax stores the state tx.init creates and needs it to keep its shape."
        )
    new_opt = [x.astype(l.dtype) for x, l in zip(new_opt, opt_layouts)]
    return store(plan, layouts, new, memory_kind), store(plan, opt_layouts, new_opt, memory_kind)


def rounding_keys(plan: ZeroPlan, step: jax.Array | None, n: int) -> list[jax.Array | None]:
    """One key per master for stochastic rounding at ``step`` (``fold_in(key(seed), step)``,
    then the leaf's index), or None each where the masters round to nearest."""
    dtypes = plan.config.state_dtypes
    if dtypes.rounding != "stochastic":
        return [None] * n
    if step is None:
        raise ValueError("stochastic rounding of the masters needs the step count to fold into its key.")
    base = jax.random.fold_in(jax.random.key(dtypes.seed), step)
    return [jax.random.fold_in(base, i) for i in range(n)]


def clip_by_global_norm(grads: list[jax.Array], norm: jax.Array, max_norm: float) -> list[jax.Array]:
    """optax's ``clip_by_global_norm`` given the (global, all-shard) norm."""
    factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return [(g * factor).astype(g.dtype) for g in grads]


def keep_if(skip: jax.Array | None, old: Any, new: Any) -> Any:
    """``old`` where ``skip`` else ``new``, leaf by leaf (bit-for-bit either way); ``new``
    when ``skip`` is None."""
    if skip is None:
        return new
    return jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)
