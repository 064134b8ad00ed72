"""Layers for long sequences: attention over a sequence split across a context axis
(:mod:`zerojax.context.attention`, with the layouts of that split in
:mod:`zerojax.context.layout`) and Megatron's sequence parallelism on the tensor axis
(:mod:`zerojax.nn.megatron`); and the weights of a masked mean over the global batch
(:func:`zerojax.nn.global_weights`)."""

from zerojax.context import attention
from zerojax.context.attention import METHODS, context_size, dot_product_attention
from zerojax.context.layout import global_positions
from zerojax.moe.experts import routed_experts
from zerojax.nn import megatron
from zerojax.nn.masked_mean import global_weights
from zerojax.nn.megatron import column_parallel, row_parallel, sequence_parallel, tensor_parallel

__all__ = [
    "METHODS",
    "attention",
    "column_parallel",
    "context_size",
    "dot_product_attention",
    "global_positions",
    "global_weights",
    "megatron",
    "routed_experts",
    "row_parallel",
    "sequence_parallel",
    "tensor_parallel",
]
