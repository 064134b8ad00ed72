"""Applying any optax transformation to sharded parameters.

The update runs outside ``shard_map``, on global arrays whose storage is sharded over the
data axis. Elementwise optimizer math then stays local to each device's shard, and any
reduction an optimizer makes (``clip_by_global_norm``'s norm, a trust ratio) is computed
by XLA over all shards: the true global value, not a per-device one.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from zerojax.sharding.plan import ZeroPlan


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
