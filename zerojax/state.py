"""The train state pytree and how it is born sharded."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from zerojax.config import ZeroConfig
from zerojax.sharding.plan import ZeroPlan, make_plan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ZeroState:
    """Train state: a pytree of ``step``, ``params`` and ``opt_state``.

    ``params`` holds the user's parameter tree for stages 0–2 (replicated) and, for stage
    3, each leaf's sharded storage (see :mod:`zerojax.sharding.layout`); use
    :func:`zerojax.gather_params` for the full tree in any stage. ``opt_state`` is the optax
    state over the arrays the optimizer updates: the parameters for stage 0, their sharded
    storage from stage 1 on. ``plan`` is static (part of the tree structure).
    """

    step: jax.Array  # int32[]
    params: Any
    opt_state: Any
    plan: ZeroPlan = dataclasses.field(metadata=dict(static=True))

    def shardings(self) -> ZeroState:
        """The ``NamedSharding`` of every leaf, as a state-shaped tree."""
        return state_shardings(self.plan, self.opt_state)


def state_shardings(plan: ZeroPlan, opt_state: Any) -> ZeroState:
    params = jax.tree.unflatten(plan.treedef, plan.param_shardings())
    return ZeroState(step=plan.replicated, params=params, opt_state=plan.opt_shardings(opt_state), plan=plan)


def _to_update_arrays(plan: ZeroPlan, leaves: list[jax.Array]) -> list[jax.Array]:
    """The arrays the optimizer updates: the leaves for stage 0, their storage otherwise."""
    if plan.stage == 0:
        return list(leaves)
    return [l.to_storage(x) for l, x in zip(plan.layouts, leaves)]


def init_state(params: Any, tx: optax.GradientTransformation, *, mesh: Mesh, config: ZeroConfig) -> ZeroState:
    """Builds a sharded train state from full ``params``.

    The optimizer state is created directly in its sharded layout (``jax.jit`` with
    ``out_shardings``): no device ever holds more than its share of it.

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> params = {"w": jnp.ones((13, 7)), "b": jnp.zeros((7,))}
      >>> state = zj.init_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> int(state.step), zj.gather_params(state)["w"].shape
      (0, (13, 7))
    """
    build, leaves, plan, shardings = _init_program(params, tx, mesh=mesh, config=config)
    p, opt_state = jax.jit(build, out_shardings=(shardings.params, shardings.opt_state))(leaves)
    step = jax.device_put(jax.numpy.zeros((), jax.numpy.int32), plan.replicated)
    return ZeroState(step=step, params=p, opt_state=opt_state, plan=plan)


def lower_init(params: Any, tx: optax.GradientTransformation, *, mesh: Mesh, config: ZeroConfig):
    """The lowered program ``init_state`` runs, to inspect its memory before running it."""
    build, leaves, _, shardings = _init_program(params, tx, mesh=mesh, config=config)
    return jax.jit(build, out_shardings=(shardings.params, shardings.opt_state)).lower(leaves)


def _init_program(params, tx, *, mesh, config):
    plan = make_plan(params, mesh, config)
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
    leaves = jax.tree.leaves(params)

    def build(leaves):
        update_arrays = _to_update_arrays(plan, leaves)
        opt_state = tx.init(jax.tree.unflatten(plan.treedef, update_arrays))
        stored = update_arrays if plan.stage == 3 else leaves
        return jax.tree.unflatten(plan.treedef, stored), opt_state

    opt_shape = jax.eval_shape(build, leaves)[1]
    return build, leaves, plan, state_shardings(plan, opt_shape)
