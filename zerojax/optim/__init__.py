"""Applying optax transformations to sharded state."""

from zerojax.optim.apply import apply_optimizer

__all__ = ["apply_optimizer"]
