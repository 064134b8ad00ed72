"""What a context kernel is computing: :class:`KernelSpec`."""

from __future__ import annotations

import dataclasses
from typing import Any

from zerojax.context.layout import Layout


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One attention call as the kernels see it: the sequence's layout over the context axis
    (its kind, device count and axis), the shapes, and the options that shape the logits.

    Fields:
      layout: the :class:`~zerojax.context.layout.Layout` of the query and key sequences.
      t, s: the global query and key lengths.
      n, kh: query heads and key/value heads.
      causal: the causal mask.
      window: ``(left, right)`` local window, or None.
      zero_padded_rows: query lengths were given: rows past them are zero, as JAX's.
      precision: the matmuls' precision (JAX's ``precision=``).
      mesh: the mesh given to the call, or None (the ambient one).
      block: keys per chunk of the local online softmax.
      local: the call runs inside a ``shard_map`` already manual over the context axis.
    """

    layout: Layout
    t: int
    s: int
    n: int
    kh: int
    causal: bool = False
    window: tuple[int, int] | None = None
    zero_padded_rows: bool = False
    precision: Any = None
    mesh: Any = None
    block: int = 512
    local: bool = False
