"""Applying any optax transformation to sharded parameters.

The update runs outside ``shard_map``, on global arrays whose storage is sharded over the
data axis. Elementwise optimizer math then stays local to each device's shard, and any
reduction an optimizer makes (``clip_by_global_norm``'s norm, a trust ratio) is computed
by XLA over all shards: the true global value, not a per-device one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from zerojax.sharding.plan import ZeroPlan


def check_optimizer(tx: Any) -> None:
    """Accepts any object with optax's ``init(params)`` / ``update(updates, state, params)``
    protocol (``optax.GradientTransformation``, ``optax.MultiSteps``, ...)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"tx must be an optax optimizer: an object with init(params) and "
            f"update(updates, state, params) (e.g. optax.adamw(1e-3)), got {tx!r}.")


def apply_optimizer(
    plan: ZeroPlan, tx: optax.GradientTransformation, grads: list[jax.Array],
    opt_state: Any, arrays: list[jax.Array],
) -> tuple[list[jax.Array], Any]:
    """One optax step on the arrays the optimizer owns; returns new arrays and state."""
    unflat = lambda leaves: jax.tree.unflatten(plan.treedef, leaves)
    params = unflat(arrays)
    updates, opt_state = tx.update(unflat(grads), opt_state, params)
    new = optax.apply_updates(params, updates)
    new = [x.astype(a.dtype) for x, a in zip(jax.tree.leaves(new), arrays)]
    opt_state = jax.lax.with_sharding_constraint(opt_state, plan.opt_shardings(opt_state))
    return new, opt_state


def clip_by_global_norm(grads: list[jax.Array], norm: jax.Array, max_norm: float) -> list[jax.Array]:
    """optax's ``clip_by_global_norm`` given the (global, all-shard) norm."""
    factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return [(g * factor).astype(g.dtype) for g in grads]


def keep_if(skip: jax.Array, old: Any, new: Any) -> Any:
    """``old`` where ``skip`` else ``new``, leaf by leaf (bit-for-bit either way)."""
    return jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)
