"""The train state pytree and how it is born sharded."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from zerojax.config import ZeroConfig
from zerojax.optim import loss_scale as ls
from zerojax.optim.update import check_optimizer
from zerojax.sharding.plan import ZeroPlan, make_plan, master_dtype
from zerojax.sharding.stages import stage_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ZeroState:
    """Train state: a pytree of arrays plus a static ``plan``. Each field means one thing at
    every stage; which fields a stage keeps is :mod:`zerojax.sharding.stages`' business.

    Fields:
      step: int32[], train-step calls so far (skipped ones included).
      params: the full parameters forward reads, replicated on every device, in the user's
        tree: stage 0 (fp32, cast to the compute dtype in the step) and stages 1–2 (in the
        compute dtype). ``None`` at stage 3, where forward gathers each layer from ``master``.
      master: the fp32 master weights in sharded storage (one array per parameter, laid out
        by ``plan.layouts``, see :mod:`zerojax.sharding.layout`); ``None`` where ``params``
        are the masters themselves (stage 0, and stages 1–2 with fp32 compute).
      opt_state: the optax state of the masters, in optax's own tree; each array stored by
        its own layout (``plan.opt_layouts``): sharded from stage 1 on, replicated at
        stage 0; scalars (step counts, injected hyperparameters) are plain scalars.
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


def state_shardings(plan: ZeroPlan, scaler: Any) -> ZeroState:
    """Where every field of a state of ``plan`` lives."""
    params, master = stage_of(plan).field_shardings(plan)
    rep = plan.replicated
    return ZeroState(
        step=rep,
        params=None if params is None else plan.unflatten(params),
        master=None if master is None else plan.unflatten(master),
        opt_state=plan.unflatten_opt(plan.shardings(plan.opt_storage_layouts)),
        loss_scale=jax.tree.map(lambda _: rep, scaler),
        skipped=rep,
        plan=plan,
    )


def init_state(params: Any, tx: Any, *, mesh: Mesh, config: ZeroConfig) -> ZeroState:
    """Builds a sharded train state from full ``params`` (the initial master weights).

    ``tx`` is any optax optimizer (an object with ``init`` and ``update``). The optimizer
    state and masters are created directly in their sharded layout (``jax.jit`` with
    ``out_shardings``): no device ever holds more than its share of them.

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> params = {"w": jnp.ones((13, 7)), "b": jnp.zeros((7,))}
      >>> state = zj.init_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> int(state.step), zj.gather_params(state)["w"].shape
      (0, (13, 7))
    """
    build, leaves, plan, out = _init_program(params, tx, mesh=mesh, config=config)
    p, master, opt_state = jax.jit(build, out_shardings=out)(leaves)
    rep = plan.replicated
    return ZeroState(
        step=jax.device_put(jnp.zeros((), jnp.int32), rep), params=p, master=master,
        opt_state=opt_state, loss_scale=jax.device_put(ls.init(config), rep),
        skipped=jax.device_put(jnp.zeros((), jnp.int32), rep), plan=plan,
    )


def lower_init(params: Any, tx: Any, *, mesh: Mesh, config: ZeroConfig):
    """The lowered program ``init_state`` runs, to inspect its memory before running it."""
    build, leaves, _, out = _init_program(params, tx, mesh=mesh, config=config)
    return jax.jit(build, out_shardings=out).lower(leaves)


def abstract_state(params: Any, tx: Any, *, mesh: Mesh, config: ZeroConfig) -> ZeroState:
    """The state ``init_state`` would build, as ``jax.ShapeDtypeStruct`` leaves with shardings.

    Nothing is allocated: ``params`` may itself be abstract (``jax.eval_shape`` /
    ``nnx.eval_shape``), so a model far larger than the machine can be planned.
    ``train_step.lower(abstract, batch).compile()`` then gives the compiled step and its
    ``memory_analysis()`` before any array exists (see :func:`zerojax.step_memory`).

    Example:
      >>> import jax, optax, zerojax as zj
      >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), "float32")}
      >>> st = zj.abstract_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> st.master["w"].shape, st.master["w"].sharding.shard_shape(st.master["w"].shape)
      ((4096, 4096), (4096, 512))
    """
    build, leaves, plan, out = _init_program(params, tx, mesh=mesh, config=config)
    shapes = jax.eval_shape(build, leaves)
    abstract = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    p, master, opt_state = jax.tree.map(abstract, shapes, out)
    rep = plan.replicated
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    return ZeroState(
        step=scalar, params=p, master=master, opt_state=opt_state,
        loss_scale=jax.tree.map(lambda x: abstract(x, rep), ls.init(config)), skipped=scalar, plan=plan,
    )


def _init_program(params, tx, *, mesh, config):
    check_optimizer(tx)
    plan = make_plan(params, mesh, config, tx)
    stage = stage_of(plan)
    leaves = jax.tree.leaves(params)

    def build(leaves):
        masters = [jnp.asarray(x).astype(master_dtype(x.dtype)) for x in leaves]
        opt = jax.tree.leaves(tx.init(plan.unflatten(masters)))
        storage = [jax.lax.with_sharding_constraint(l.to_storage(x), s)
                   for l, x, s in zip(plan.master_layouts, masters, plan.shardings(plan.master_layouts))]
        p, m = stage.fields(plan, storage)
        opt = [l.to_storage(x) for l, x in zip(plan.opt_storage_layouts, opt)]
        return (None if p is None else plan.unflatten(p), None if m is None else plan.unflatten(m),
                plan.unflatten_opt(opt))

    sh = state_shardings(plan, ls.init(config))
    return build, leaves, plan, (sh.params, sh.master, sh.opt_state)
