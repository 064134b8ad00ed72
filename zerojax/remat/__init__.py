"""Activation rematerialization: typed policies and how to apply them to Flax models."""

from zerojax.remat.policy import KINDS, Remat, policy, resolve
from zerojax.remat.wrap import checkpoint, linen_module, nnx_module

__all__ = ["KINDS", "Remat", "checkpoint", "linen_module", "nnx_module", "policy", "resolve"]
