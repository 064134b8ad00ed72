"""Layers for long sequences: attention over a sequence split across a context axis
(:mod:`zerojax.nn.attention`), the layouts of that split (:mod:`zerojax.nn.context`) and
sequence parallelism on the tensor axis (:mod:`zerojax.nn.sequence`)."""

from zerojax.nn import attention, context
from zerojax.nn.context import global_positions
from zerojax.nn.attention import METHODS, context_size, dot_product_attention
from zerojax.nn.sequence import column_parallel, row_parallel, sequence_parallel, tensor_parallel

__all__ = ["METHODS", "attention", "column_parallel", "context", "context_size", "dot_product_attention",
           "global_positions", "row_parallel", "sequence_parallel", "tensor_parallel"]
