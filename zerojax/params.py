"""Full parameters back from a sharded state."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from zerojax.sharding.plan import ZeroPlan
from zerojax.state import ZeroState


def gather_params(state: ZeroState) -> Any:
    """The full parameter tree, same structure, shapes and dtypes as given to ``init_state``.

    The fp32 masters are returned (all-gathered and unpadded where sharded), cast to the
    dtypes the params had when given to ``init_state``. Every device (and process) gets the
    full values, in new arrays at every stage: a later (donating) train step does not
    invalidate them.

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> params = {"b": jnp.arange(13.0)}
      >>> state = zj.init_state(params, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> zj.gather_params(state)["b"].tolist() == params["b"].tolist()
      True
    """
    if not isinstance(state, ZeroState):
        raise TypeError(f"gather_params takes a zj.init_state state, got {type(state).__name__}.")
    if state.master is None:  # the replicated params are the fp32 masters
        return _gather_fn(state.plan, False)(jax.tree.leaves(state.params))
    return _gather_fn(state.plan, True)(jax.tree.leaves(state.master))


@functools.lru_cache(maxsize=64)
def _gather_fn(plan: ZeroPlan, from_storage: bool):
    def full(arrays):
        unpad = (lambda l, s: l.from_storage(s)) if from_storage else (lambda l, x: x)
        # An explicit copy: an unchanged input would otherwise come back as the same buffer.
        return plan.unflatten(jnp.array(unpad(l, s).astype(l.dtype), copy=True)
                              for l, s in zip(plan.master_layouts, arrays))

    return jax.jit(full, out_shardings=plan.unflatten([plan.replicated] * len(plan.layouts)))
