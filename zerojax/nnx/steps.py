"""Train and eval steps that take an NNX module, as NNX's own steps do.

``loss_fn(model, batch)`` and ``fn(model, batch)`` receive the module itself, rebuilt on
each device from the parameters where ZeRO keeps them (at stage 3, each layer gathered
where it runs), with this device's rows of the batch. The train step runs it in training
mode (``model.train()``: dropout on, BatchNorm batch statistics), the eval step in
evaluation mode (``model.eval()``). An ``nnx.BatchNorm`` without an ``axis_name`` takes
the global batch's statistics, as on one device, unless the optimizer was built with
``sync_batch_stats=False``. ``ZeroConfig(remat=...)`` applies to each layer loop
(``nnx.scan``) and to each block held in a list (``nnx.List`` of one block class): one
remat region per block call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax

from zerojax.config import StepOptions
from zerojax.evaluate import EvalStep as ZeroEvalStep
from zerojax.nnx.model import remat_listed_blocks, sync_batch_norms
from zerojax.nnx.optimizer import Optimizer
from zerojax.sharding.mesh import batch_axes
from zerojax.step import LossScaleError
from zerojax.step import TrainStep as ZeroTrainStep


def _batch_axes(optimizer: Optimizer) -> str | tuple[str, ...] | None:
    """The axes BatchNorm statistics reduce over, or None when they stay per device."""
    cfg = optimizer.config
    return batch_axes(optimizer.mesh, cfg.axes.data, cfg.axes.replica) if optimizer.sync_batch_stats else None


def _check_optimizer(optimizer: Any, what: str) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"{what} takes a zj.nnx.Optimizer as its first argument, got {type(optimizer).__name__}. "
            "Call it as step(optimizer, batch)."
        )


class TrainStep:
    """``metrics = train_step(optimizer, batch)``: one ZeRO train step that updates
    ``optimizer`` in place. ``metrics`` are :class:`zerojax.TrainStep` 's (``loss``,
    ``grad_norm``, ...; ``aux`` with ``has_aux=True``)."""

    def __init__(
        self, loss_fn: Callable, *, has_aux: bool = False, aux_reduce: Any = None, timeout_s: float | None = None
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {loss_fn!r}.")
        self.loss_fn, self.has_aux, self.aux_reduce, self.timeout_s = loss_fn, has_aux, aux_reduce, timeout_s
        self._steps: weakref.WeakKeyDictionary[Optimizer, ZeroTrainStep] = weakref.WeakKeyDictionary()

    def step_for(self, optimizer: Optimizer) -> ZeroTrainStep:
        """The :class:`zerojax.TrainStep` this step runs on ``optimizer`` 's state."""
        _check_optimizer(optimizer, "train_step")
        step = self._steps.get(optimizer)
        if step is None:
            parts, user, has_aux = optimizer.parts, self.loss_fn, self.has_aux
            sync = _batch_axes(optimizer)
            remat = optimizer.config.remat

            def loss(params, batch, rng=None, model_state=None):
                model = parts.merge(params, model_state, salt=rng)
                model.train()
                if sync:
                    sync_batch_norms(model, sync)
                if remat.active:  # the config's policy reaches layers held in a list too
                    remat_listed_blocks(model, remat)
                out = user(model, batch)
                new = parts.new_model_state(model, model_state)
                if has_aux:
                    if not (isinstance(out, tuple) and len(out) == 2):
                        raise ValueError(
                            f"loss_fn must return (loss, aux) with has_aux=True, got {type(out).__name__}."
                        )
                    return out[0], (new, out[1])
                return out, new

            step = ZeroTrainStep(
                loss,
                optimizer.tx,
                mesh=optimizer.mesh,
                config=optimizer.config,
                options=StepOptions(
                    has_aux=has_aux, aux_reduce=self.aux_reduce, with_rng=parts.has_rngs, with_model_state=True
                ),
                timeout_s=self.timeout_s,
            )
            self._steps[optimizer] = step
        return step

    def __call__(self, optimizer: Optimizer, batch: Any, *extra: Any) -> dict[str, jax.Array]:
        if extra or isinstance(batch, Optimizer):
            raise TypeError(
                "a zj.nnx train step is called as metrics = train_step(optimizer, batch), not as Flax's "
                "train_step(model, optimizer, batch): the optimizer holds the model (optimizer.model, "
                "trained in place)."
            )
        step = self.step_for(optimizer)
        try:
            optimizer.state, metrics = step(optimizer.state, batch)
        except LossScaleError as e:  # the newest state holds only finite updates: keep it
            optimizer.state = e.state
            raise
        return metrics

    def lower(self, optimizer: Optimizer, batch: Any):
        """The lowered program: ``.compile()`` it to read its memory and collectives."""
        return self.step_for(optimizer).lower(optimizer.state, batch)


class EvalStep:
    """``outputs = eval_step(optimizer, batch)``: ``fn(model, batch)`` in evaluation mode,
    forward only; the optimizer is not changed."""

    def __init__(self, fn: Callable, *, reduce: Any = None):
        if not callable(fn):
            raise TypeError(f"fn must be callable as fn(model, batch), got {fn!r}.")
        self.fn, self.reduce = fn, reduce
        self._steps: weakref.WeakKeyDictionary[Optimizer, ZeroEvalStep] = weakref.WeakKeyDictionary()

    def step_for(self, optimizer: Optimizer) -> ZeroEvalStep:
        """The :class:`zerojax.EvalStep` this step runs on ``optimizer`` 's state."""
        _check_optimizer(optimizer, "eval_step")
        step = self._steps.get(optimizer)
        if step is None:
            parts, user = optimizer.parts, self.fn

            def fn(params, batch, model_state=None):
                model = parts.merge(params, model_state)
                model.eval()
                return user(model, batch)

            step = ZeroEvalStep(
                fn,
                mesh=optimizer.mesh,
                config=optimizer.config,
                reduce=self.reduce,
                options=StepOptions(with_model_state=True),
            )
            self._steps[optimizer] = step
        return step

    def __call__(self, optimizer: Optimizer, batch: Any) -> Any:
        return self.step_for(optimizer)(optimizer.state, batch)


def make_train_step(
    loss_fn: Callable, *, has_aux: bool = False, aux_reduce: Any = None, timeout_s: float | None = None
) -> TrainStep:
    """The train step for ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with
    ``has_aux=True``), called as ``metrics = train_step(optimizer, batch)`` with a
    :class:`zerojax.nnx.Optimizer`, which it updates in place. ``batch`` is the global batch;
    ``aux_reduce`` and ``timeout_s`` are :func:`zerojax.make_train_step` 's.

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> from flax import nnx
      >>> opt = zj.nnx.Optimizer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1),
      ...                        mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> train_step = zj.nnx.make_train_step(lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2))
      >>> metrics = train_step(opt, {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))})
      >>> opt.step, metrics["loss"].shape
      (1, ())
    """
    return TrainStep(loss_fn, has_aux=has_aux, aux_reduce=aux_reduce, timeout_s=timeout_s)


def make_eval_step(fn: Callable, *, reduce: Any = None) -> EvalStep:
    """A forward-only step for ``fn(model, batch)``, called as ``eval_step(optimizer, batch)``,
    with the module in evaluation mode (``model.eval()``: dropout off, BatchNorm's running
    statistics). ``reduce`` is :func:`zerojax.make_eval_step` 's.

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> from flax import nnx
      >>> opt = zj.nnx.Optimizer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1),
      ...                        mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=2))
      >>> ev = zj.nnx.make_eval_step(lambda model, b: {"pred": model(b)}, reduce="concat")
      >>> ev(opt, jnp.ones((8, 3)))["pred"].shape
      (8, 1)
    """
    return EvalStep(fn, reduce=reduce)
