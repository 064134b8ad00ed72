"""The train state pytree and how it is born sharded."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from zerojax.config import ZeroConfig
from zerojax.optim import loss_scale as ls
from zerojax.optim.update import check_optimizer
from zerojax.sharding.plan import ZeroPlan, make_plan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ZeroState:
    """Train state: a pytree of arrays plus a static ``plan``.

    Fields:
      step: int32[], train-step calls so far (skipped ones included).
      params: what forward reads. Stage 0: the fp32 master params (full, replicated).
        Stages 1–2: the full params in the compute dtype (replicated). Stage 3: each leaf's
        fp32 master storage, sharded (see :mod:`zerojax.sharding.layout`).
      master: stages 1–2 with bf16/fp16 compute: the fp32 master storage, sharded;
        otherwise ``None`` (the masters are ``params``).
      opt_state: the optax state over the masters (full for stage 0, sharded storage from
        stage 1 on).
      loss_scale: the fp16 loss scaler's state, or ``None``.
      skipped: int32[], steps skipped for non-finite gradients so far.

    Use :func:`zerojax.gather_params` for the full parameter tree in any stage.
    """

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any
    loss_scale: ls.LossScaleState | None
    skipped: jax.Array
    plan: ZeroPlan = dataclasses.field(metadata=dict(static=True))


def master_dtype(dtype) -> jnp.dtype:
    """fp32 for narrow float params (bf16/fp16), the params' own dtype otherwise."""
    return jnp.promote_types(dtype, jnp.float32)


def has_master(plan: ZeroPlan) -> bool:
    return plan.stage in (1, 2) and plan.config.mixed


def state_shardings(plan: ZeroPlan, opt_state: Any, scaler: Any) -> ZeroState:
    unflat = lambda xs: jax.tree.unflatten(plan.treedef, xs)
    rep = plan.replicated
    return ZeroState(
        step=rep,
        params=unflat(plan.param_shardings()),
        master=unflat(plan.storage_shardings()) if has_master(plan) else None,
        opt_state=plan.opt_shardings(opt_state),
        loss_scale=jax.tree.map(lambda _: rep, scaler),
        skipped=rep,
        plan=plan,
    )


def init_state(params: Any, tx: optax.GradientTransformation, *, mesh: Mesh, config: ZeroConfig) -> ZeroState:
    """Builds a sharded train state from full ``params`` (the initial master weights).

    The optimizer state and masters are created directly in their sharded layout
    (``jax.jit`` with ``out_shardings``): no device ever holds more than its share of them.

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> params = {"w": jnp.ones((13, 7)), "b": jnp.zeros((7,))}
      >>> state = zj.init_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> int(state.step), zj.gather_params(state)["w"].shape
      (0, (13, 7))
    """
    build, leaves, plan, shardings = _init_program(params, tx, mesh=mesh, config=config)
    out = (shardings.params, shardings.master, shardings.opt_state)
    p, master, opt_state = jax.jit(build, out_shardings=out)(leaves)
    rep = plan.replicated
    return ZeroState(
        step=jax.device_put(jnp.zeros((), jnp.int32), rep), params=p, master=master,
        opt_state=opt_state, loss_scale=jax.device_put(ls.init(config), rep),
        skipped=jax.device_put(jnp.zeros((), jnp.int32), rep), plan=plan,
    )


def lower_init(params: Any, tx: optax.GradientTransformation, *, mesh: Mesh, config: ZeroConfig):
    """The lowered program ``init_state`` runs, to inspect its memory before running it."""
    build, leaves, _, shardings = _init_program(params, tx, mesh=mesh, config=config)
    out = (shardings.params, shardings.master, shardings.opt_state)
    return jax.jit(build, out_shardings=out).lower(leaves)


def abstract_state(params: Any, tx: optax.GradientTransformation, *, mesh: Mesh,
                   config: ZeroConfig) -> ZeroState:
    """The state ``init_state`` would build, as ``jax.ShapeDtypeStruct`` leaves with shardings.

    Nothing is allocated: ``params`` may itself be abstract (``jax.eval_shape`` /
    ``nnx.eval_shape``), so a model far larger than the machine can be planned.
    ``train_step.lower(abstract, batch).compile()`` then gives the compiled step and its
    ``memory_analysis()`` before any array exists (see :func:`zerojax.step_memory`).

    Example:
      >>> import jax, optax, zerojax as zj
      >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), "float32")}
      >>> st = zj.abstract_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> st.params["w"].shape, st.params["w"].sharding.shard_shape(st.params["w"].shape)
      ((4096, 4096), (4096, 512))
    """
    build, leaves, plan, shardings = _init_program(params, tx, mesh=mesh, config=config)
    p, master, opt_state = jax.eval_shape(build, leaves)
    abstract = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    rep = plan.replicated
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    return ZeroState(
        step=scalar,
        params=jax.tree.map(abstract, p, shardings.params),
        master=None if master is None else jax.tree.map(abstract, master, shardings.master),
        opt_state=jax.tree.map(abstract, opt_state, shardings.opt_state),
        loss_scale=jax.tree.map(lambda x: abstract(x, rep), ls.init(config)),
        skipped=scalar,
        plan=plan,
    )


def _init_program(params, tx, *, mesh, config):
    plan = make_plan(params, mesh, config)
    check_optimizer(tx)
    leaves = jax.tree.leaves(params)
    unflat = lambda xs: jax.tree.unflatten(plan.treedef, xs)
    compute = jnp.dtype(config.compute_dtype)

    def build(leaves):
        masters = [jnp.asarray(x).astype(master_dtype(x.dtype)) for x in leaves]
        if plan.stage == 0:
            return unflat(masters), None, tx.init(unflat(masters))
        storage = [l.to_storage(x) for l, x in zip(plan.layouts, masters)]
        opt_state = tx.init(unflat(storage))
        if plan.stage == 3:
            return unflat(storage), None, opt_state
        if has_master(plan):
            return unflat([x.astype(compute) for x in masters]), unflat(storage), opt_state
        return unflat(masters), None, opt_state

    opt_shape = jax.eval_shape(build, leaves)[2]
    return build, leaves, plan, state_shardings(plan, opt_shape, ls.init(config))
