"""Activation rematerialization: typed policies and how to apply them to Flax models."""

from zerojax.remat.apply import checkpoint, linen_module, nnx_module
from zerojax.remat.policy import KINDS, Remat, policy, resolve

__all__ = ["KINDS", "Remat", "checkpoint", "linen_module", "nnx_module", "policy", "resolve"]
