"""Context parallelism: a sequence split over the ``"context"`` axis of a mesh.

- :mod:`zerojax.context.layout`: how a sequence is laid out over the axis, as a value
  (:class:`Layout`), and :func:`global_positions`;
- :mod:`zerojax.context.batch`: which leaves and dimensions of a batch are sequences, and
  how the train step splits and permutes them;
- :mod:`zerojax.context.attention`: the kernels, Ulysses and ring attention
  (``zj.nn.dot_product_attention``);
- :mod:`zerojax.context.checks`: what the step checks of a traced loss before compiling.
"""

from zerojax.context import batch, layout
from zerojax.context.layout import CONTIGUOUS, KINDS, Layout, global_positions

__all__ = ["CONTIGUOUS", "KINDS", "Layout", "batch", "global_positions", "layout"]
