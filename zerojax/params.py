"""Full parameters back from a sharded state."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from zerojax.sharding.plan import ZeroPlan
from zerojax.state import ZeroState, check_alive


def gather_params(state: ZeroState) -> Any:
    """The full parameter tree, same structure and shapes as given to ``init_state``.

    The trainable parameters are their fp32 masters (all-gathered and unpadded where
    sharded), cast to the dtypes the params had when given to ``init_state``. The frozen
    parameters come back as stored, in the dtype they are stored in, so that the dtype says
    what they hold: with ``ZeroConfig(frozen_dtype="compute")`` (the default) in a bf16 or
    fp16 run, a frozen fp32 weight comes back as its bf16/fp16 rounding, in bf16/fp16;
    ``frozen_dtype="param"`` keeps it exactly as given. Every device (and process) gets the
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
    check_alive(state, "gather_params")
    from_storage = state.master is not None  # else the replicated params are the fp32 masters
    train = jax.tree.leaves(state.master if from_storage else state.params)
    frozen = jax.tree.leaves(state.frozen) if state.frozen is not None else []
    return _gather_fn(state.plan, from_storage)(train, frozen)


@functools.lru_cache(maxsize=64)
def _gather_fn(plan: ZeroPlan, from_storage: bool):
    dtypes = plan.join([l.dtype for l in plan.train_layouts], [l.dtype for l in plan.frozen_layouts])

    def full(train, frozen):
        train = [l.from_storage(x) if from_storage else x for l, x in zip(plan.master_layouts, train)]
        frozen = [l.from_storage(x) for l, x in zip(plan.frozen_layouts, frozen)]
        # An explicit copy: an unchanged input would otherwise come back as the same buffer.
        return plan.unflatten(jnp.array(x.astype(d), copy=True) for x, d in zip(plan.join(train, frozen), dtypes))

    return jax.jit(full, out_shardings=plan.unflatten([plan.replicated] * len(plan.layouts)))
