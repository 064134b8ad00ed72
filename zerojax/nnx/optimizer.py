"""``zj.nnx.Optimizer``: an NNX module and an optax optimizer, sharded by ZeRO."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from zerojax.config import ZeroConfig
from zerojax.nnx import held
from zerojax.nnx.model import Parts, build
from zerojax.params import gather_params
from zerojax.state import ZeroState, init_state


class Optimizer:
    """A module's parameters, optimizer state and model state, sharded over ``mesh`` as
    ``config`` says; what ``nnx.Optimizer(model, tx, wrt=...)`` is to a single device.

    Args:
      model: an NNX module, or a function of no arguments that builds one: then the module
        is never built whole anywhere (``nnx.eval_shape`` plans it, each device creates its
        own shards), for a model larger than one device.
      tx: any optax optimizer.
      wrt: an NNX filter: the parameters it selects train (``nnx.Param``, the default: all;
        ``nnx.LoRAParam``: the adapters only). The other ``nnx.Param`` s are frozen: no
        optimizer state, no gradient. It may also select non-Param floating Variables.
      mesh, config: as for :func:`zerojax.init_state`.
      seed: the base key that salts the module's rng streams per step, device and micro-batch.
      sync_batch_stats: whether each ``nnx.BatchNorm`` without an ``axis_name`` normalizes
        over the global batch (its statistics reduced over the batch axes), as the same
        module does on one device (default); with False, each device normalizes its own
        rows and the step keeps the mean of the devices' new running statistics.

    The module's ``nnx.BatchStat`` (and any other Variable that is neither a parameter nor
    an rng stream) are the model state, and its ``nnx.Rngs`` streams drive dropout: see
    :mod:`zerojax.nnx.model`. Train with :func:`zerojax.nnx.make_train_step`. As with
    ``nnx.Optimizer``, the module given holds the trained values after every step
    (:attr:`model`; sharded where ZeRO stores them evenly); :meth:`gathered_model` gives a
    copy with every parameter whole. ``state`` is the :class:`zerojax.ZeroState`
    (for ``zj.report.state_bytes_per_device``, ``communication_report`` and the rest).

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> from flax import nnx
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> opt = zj.nnx.Optimizer(model, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> opt.step, opt.gathered_model().kernel.shape
      (0, (3, 1))
    """

    def __init__(
        self,
        model: nnx.Module | Callable[[], nnx.Module],
        tx: optax.GradientTransformation,
        *,
        mesh: Mesh,
        config: ZeroConfig,
        wrt: Any = nnx.Param,
        seed: int = 0,
        sync_batch_stats: bool = True,
    ):
        module, init_fn = build(model)
        self.parts = Parts.of(module, wrt)
        self.tx, self.mesh, self.config, self.wrt = tx, mesh, config, wrt
        if not isinstance(sync_batch_stats, bool):
            raise TypeError(f"sync_batch_stats must be a bool, got {sync_batch_stats!r}.")
        self.sync_batch_stats = sync_batch_stats
        trainable = None if all(self.parts.trainable) else wrt
        rng = jax.random.key(seed) if self.parts.has_rngs else None
        if init_fn is None:
            params, model_state = self.parts.split(module)
        else:
            params = lambda: self.parts.split(init_fn())[0]
            model_state = lambda: self.parts.split(init_fn())[1]
        # The module given holds the trained values after every change of the state (as
        # nnx.Optimizer leaves it); a module built here by a function is made on first use.
        self._module = module if init_fn is None else None
        self._state: ZeroState = init_state(
            params, tx, mesh=mesh, config=config, rng=rng, model_state=model_state, trainable=trainable
        )

    @property
    def state(self) -> ZeroState:
        """The :class:`zerojax.ZeroState` (parameters, optimizer state and model state, sharded)."""
        return self._state

    @state.setter
    def state(self, new: ZeroState) -> None:
        if not isinstance(new, ZeroState):
            raise TypeError(f"Optimizer.state must be a zj.ZeroState, got {type(new).__name__}.")
        self._state = new
        if self._module is not None:
            self._hold(self._module)

    @property
    def model(self) -> nnx.Module:
        """The module, holding the current parameters and model state (see
        :mod:`zerojax.nnx.held`): the module given, updated in place after every step as
        ``nnx.Optimizer`` does, or one made from the state when a function built it. Its
        parameters stay sharded where ZeRO stores them evenly; :meth:`gathered_model`
        gives a copy with every parameter whole."""
        if self._module is None:
            model_state = jax.tree.map(jnp.copy, self.state.model_state)
            frozen = [l.from_storage(x) for l, x in zip(self.state.plan.frozen_layouts, self._frozen_leaves())]
            self._module = self.parts.merge(self.state.plan.unflatten(self._join(frozen)), model_state)
        return self._module

    def _frozen_leaves(self) -> list:
        return jax.tree.leaves(self.state.frozen) if self.state.frozen is not None else []

    def _join(self, frozen: list) -> list:
        return self.state.plan.join(held.trained_values(self.state), frozen)

    def _hold(self, module: nnx.Module) -> None:
        """Puts the state's trained values and model state into ``module`` (in place)."""
        plan = self.state.plan
        params, _ = self.parts.split(module)
        _, frozen = plan.split(jax.tree.leaves(params))
        nnx.update(module, plan.unflatten(self._join(frozen)))
        model_state = self.state.model_state
        nnx.update(module, self.parts.unpack(model_state["rngs"]), model_state["rest"])

    @property
    def step(self) -> int:
        """Train-step calls so far (skipped ones included)."""
        return int(self.state.step)

    def gathered_model(self) -> nnx.Module:
        """The module with the current parameters, whole on every device (trainable ones
        from their fp32 masters, frozen ones as stored), its model state and rng streams:
        an ordinary NNX module again."""
        model_state = jax.tree.map(jnp.copy, self.state.model_state)  # its own: steps donate theirs
        return self.parts.merge(gather_params(self.state), model_state)

    def save(self, directory: Any, step: int | None = None, **kwargs: Any) -> None:
        """:func:`zerojax.save_checkpoint` of this optimizer's state, as step ``step``
        (default: the train steps taken so far)."""
        from zerojax.checkpoint import save_checkpoint

        save_checkpoint(directory, self.state, self.step if step is None else step, **kwargs)

    def restore(self, directory: Any, step: int | None = None) -> None:
        """Replaces the state with checkpoint ``step`` (default: the latest) of ``directory``,
        in this optimizer's layout: the saved run's stage, device count and precision may
        differ (see :func:`zerojax.restore_checkpoint`)."""
        from zerojax.checkpoint import restore_checkpoint

        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        self.state = restore_checkpoint(directory, target, step=step)

    def __repr__(self) -> str:
        return f"zj.nnx.Optimizer(step={self.step}, {self.config}, mesh={dict(self.mesh.shape)})"
