"""Context parallelism: a sequence split over the ``"context"`` axis of a mesh. The layout of
that split as a value (:class:`Layout`) and the train step's handling of a batch's sequences
(:mod:`zerojax.context.batch`)."""

from zerojax.context import batch, layout
from zerojax.context.layout import CONTIGUOUS, KINDS, Layout

__all__ = ["CONTIGUOUS", "KINDS", "Layout", "batch", "layout"]
