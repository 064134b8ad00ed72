"""Layers for long sequences: attention over a sequence split across a context axis
(:mod:`zerojax.nn.attention`) and the layouts of that split (:mod:`zerojax.nn.context`)."""

from zerojax.nn import context
from zerojax.nn.attention import METHODS, context_size, dot_product_attention

__all__ = ["METHODS", "context", "context_size", "dot_product_attention"]
