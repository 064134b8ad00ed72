"""``make_train_step``: one jitted ZeRO train step for any loss function and optax optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zerojax.config import ZeroConfig
from zerojax.optim.update import apply_optimizer
from zerojax.sharding.gradients import local_grads
from zerojax.sharding.mesh import auto_axes, axis_size
from zerojax.sharding.plan import ZeroPlan
from zerojax.state import ZeroState, state_shardings


def _all_gather_leaves(plan: ZeroPlan, storage: list[jax.Array]) -> list[jax.Array]:
    """Sharded storage -> full, replicated leaves (one explicit all-gather per leaf)."""
    specs = [l.partition_spec(plan.axis) for l in plan.layouts]
    gather = jax.shard_map(
        lambda shards: [l.gather(s, plan.axis) for l, s in zip(plan.layouts, shards)],
        mesh=plan.mesh, in_specs=(specs,), out_specs=[P()] * len(specs), check_vma=False,
    )
    return gather(storage)


def _step(loss_fn: Callable, tx: optax.GradientTransformation, has_aux: bool,
          state: ZeroState, batch: Any) -> tuple[ZeroState, dict[str, Any]]:
    plan = state.plan
    layouts = plan.layouts
    batch_spec = jax.tree.map(lambda _: P(plan.axis), batch)
    grads_fn = local_grads(plan, loss_fn, has_aux, batch_spec)
    leaves = jax.tree.leaves(state.params)
    storage_shardings = plan.storage_shardings()

    if plan.stage == 0:
        loss, aux, grads = grads_fn(leaves, batch)
        new_leaves, opt_state = apply_optimizer(plan, tx, grads, state.opt_state, leaves)
        new_params = new_leaves
    else:
        if plan.stage == 3:
            master = leaves
        else:  # replicated params: each device slices out the shard it owns (no traffic)
            master = [jax.lax.with_sharding_constraint(l.to_storage(x), s)
                      for l, x, s in zip(layouts, leaves, storage_shardings)]
        if plan.stage == 1:
            loss, aux, grads = grads_fn(leaves, batch)
        elif plan.stage == 2:
            loss, aux, grads = grads_fn(leaves, master, batch)
        else:
            loss, aux, grads = grads_fn(master, batch)
        new_master, opt_state = apply_optimizer(plan, tx, grads, state.opt_state, master)
        new_master = [jax.lax.with_sharding_constraint(x, s) for x, s in zip(new_master, storage_shardings)]
        new_params = new_master if plan.stage == 3 else _all_gather_leaves(plan, new_master)

    new_state = ZeroState(
        step=state.step + 1, params=jax.tree.unflatten(plan.treedef, new_params),
        opt_state=opt_state, plan=plan,
    )
    metrics = {"loss": loss}
    if has_aux:
        metrics["aux"] = aux
    return new_state, metrics


class TrainStep:
    """A jitted ZeRO train step: ``state, metrics = train_step(state, batch)``.

    Inputs are checked before anything is traced or run. ``lower`` gives the compiled
    program for inspection (``train_step.lower(state, batch).compile()``).
    """

    def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, *, mesh: Mesh,
                 config: ZeroConfig, has_aux: bool = False):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(params, batch), got {loss_fn!r}.")
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a zj.ZeroConfig, got {type(config).__name__}.")
        self.n = axis_size(mesh, config.axis)
        self.mesh, self.config, self.tx, self.loss_fn = auto_axes(mesh), config, tx, loss_fn

        def step(state, batch):
            return _step(loss_fn, tx, has_aux, state, batch)

        self._jitted = {}
        self._step = step

    def _jit_for(self, state: ZeroState):
        plan = state.plan
        fn = self._jitted.get(plan)
        if fn is None:
            out = state_shardings(plan, state.opt_state)
            fn = jax.jit(
                self._step,
                out_shardings=(out, plan.replicated),
                donate_argnums=(0,) if self.config.donate else (),
            )
            self._jitted[plan] = fn
        return fn

    def check(self, state: ZeroState, batch: Any) -> None:
        """Raises a clear error for a state or batch this step cannot take."""
        if not isinstance(state, ZeroState):
            raise TypeError(f"state must come from zj.init_state, got {type(state).__name__}.")
        if state.plan.config != self.config or state.plan.mesh != self.mesh:
            raise ValueError(
                f"state was built for {state.plan.config} on mesh {dict(state.plan.mesh.shape)}, "
                f"but this train step uses {self.config} on mesh {dict(self.mesh.shape)}. "
                "Build both with the same mesh and config."
            )
        leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
        if not leaves:
            raise ValueError("batch has no arrays; pass the global batch (leading axis = examples).")
        for path, x in leaves:
            shape = getattr(x, "shape", None)
            name = jax.tree_util.keystr(path) or "<root>"
            if shape is None or len(shape) == 0:
                raise ValueError(
                    f"batch leaf {name} has no leading axis (shape {shape}); every batch leaf "
                    f"is split over the {self.config.axis!r} axis along its first dimension."
                )
            if shape[0] % self.n:
                raise ValueError(
                    f"batch leaf {name} has leading dimension {shape[0]}, which does not divide "
                    f"over the {self.n} devices of the {self.config.axis!r} axis. Use a global "
                    f"batch size that is a multiple of {self.n} (e.g. {max(1, shape[0] // self.n) * self.n} "
                    f"or {(shape[0] // self.n + 1) * self.n})."
                )

    def __call__(self, state: ZeroState, batch: Any) -> tuple[ZeroState, dict[str, jax.Array]]:
        self.check(state, batch)
        return self._jit_for(state)(state, batch)

    def lower(self, state: ZeroState, batch: Any):
        """``jax.jit(...).lower`` of the step: ``.compile()`` it to inspect the program."""
        self.check(state, batch)
        return self._jit_for(state).lower(state, batch)

    def cache_size(self) -> int:
        """Number of compiled programs (one per state layout and batch shape)."""
        return sum(fn._cache_size() for fn in self._jitted.values())


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, *, mesh: Mesh,
                    config: ZeroConfig, has_aux: bool = False) -> TrainStep:
    """Builds the train step for ``loss_fn(params, batch)`` and optimizer ``tx``.

    ``loss_fn`` sees the full parameter tree and this device's share of the batch, exactly
    as in single-device training; it returns a scalar (or ``(scalar, aux)`` with
    ``has_aux=True``; ``aux`` is averaged over the data axis).

    Example:
      >>> import jax, jax.numpy as jnp, optax, zerojax as zj
      >>> mesh, cfg, tx = zj.make_mesh(), zj.ZeroConfig(stage=3), optax.sgd(0.1)
      >>> params = {"w": jnp.zeros((3, 1))}
      >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> state = zj.init_state(params, tx, mesh=mesh, config=cfg)
      >>> step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 1))}
      >>> state, metrics = step(state, batch)
      >>> float(metrics["loss"])
      1.0
    """
    return TrainStep(loss_fn, tx, mesh=mesh, config=config, has_aux=has_aux)
