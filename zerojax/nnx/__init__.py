"""Flax NNX, the way NNX users write it: ``zj.nnx.Optimizer(model, tx, wrt=..., mesh=...,
config=...)`` shards a module's parameters, optimizer state and model state; steps take
the module (``loss_fn(model, batch)``) and update the optimizer in place."""

from zerojax.nnx.optimizer import Optimizer
from zerojax.nnx.steps import EvalStep, TrainStep, make_eval_step, make_train_step
from zerojax.sharding.filters import is_filter, select

__all__ = ["EvalStep", "Optimizer", "TrainStep", "is_filter", "make_eval_step", "make_train_step", "select"]
