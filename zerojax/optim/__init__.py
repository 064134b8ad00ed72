"""Applying optax transformations to sharded state, and DeepSpeed's learning-rate schedules."""

from zerojax.optim import schedules
from zerojax.optim.apply import apply_optimizer

__all__ = ["apply_optimizer", "schedules"]
