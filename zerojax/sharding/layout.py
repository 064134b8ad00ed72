"""How one array of the state is stored over the data axis.

Every parameter, and every array of the optimizer state, is stored sharded over the N
devices of the data axis (nothing param-sized is replicated; scalars are the exception).
Which way depends only on the array's shape, so a parameter and the optimizer moments of
its shape are always stored alike:

* ``dim``: in its own shape, split along one dimension. A dimension that does not divide N
  is zero-padded at its end to the next multiple; this layout is used when some dimension
  divides N, or when padding one costs at most ``PADDING_TOLERANCE`` of the leaf more than
  flattening would. For arrays of two or more dimensions, dimensions 1, 2, ... are tried
  before dimension 0, which is kept whole where possible: a stack of layers (layer axis
  first) can then be sliced one layer at a time. The optimizer sees the array in its own
  shape, split the same way, with no copy and no communication.
* ``flat``: flattened (whole, or row by row keeping dimension 0) and zero-padded to divide
  N, as DeepSpeed does; for arrays every dimension of which would need more padding (all
  their dimensions are small: under ``(N - 1) / PADDING_TOLERANCE``). The optimizer sees
  them whole: they are all-gathered for the update (the exact path; its cost is one
  such array per optimizer-state moment, transiently, on every device).
* ``replicated``: 0-d arrays (and empty ones): held whole on every device, which is what
  a padded one-element shard would cost anyway.

Padding is zero in storage and never reaches the optimizer: it sees the array without it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# A ``dim`` layout may cost at most this fraction of the array in padding beyond ``flat``.
PADDING_TOLERANCE = 0.02
KINDS = ("dim", "flat", "replicated")


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Storage of one array (see the module docstring).

    Attributes:
      shape: the array's own shape.
      dtype: its dtype name.
      n: number of shards (``ZeroPlan.shards``: devices on the data axis); the name is
        part of the checkpoint format (``to_json``).
      kind: ``"dim"``, ``"flat"`` or ``"replicated"``.
      dim: ``dim`` layout: the dimension it is split along.
      lead: ``flat`` layout: leading dimensions kept whole (0, or 1 for row by row).
    """

    shape: tuple[int, ...]
    dtype: str
    n: int
    kind: str = "dim"
    dim: int = 0
    lead: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layout kind must be one of {KINDS}, got {self.kind!r}")

    # Sizes.
    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def inner_size(self) -> int:
        """``flat``: elements of the flattened part (one row, or the whole array)."""
        return math.prod(self.shape[self.lead:])

    @property
    def chunk(self) -> int:
        """Length of the split axis held by each shard."""
        if self.kind == "dim":
            return -(-self.shape[self.dim] // self.n)
        if self.kind == "flat":
            return max(1, -(-self.inner_size // self.n))
        raise ValueError("a replicated layout is not split")

    @property
    def split_axis(self) -> int | None:
        """The axis of the *storage* array that is split over the devices."""
        return {"dim": self.dim, "flat": self.lead, "replicated": None}[self.kind]

    @property
    def storage_shape(self) -> tuple[int, ...]:
        if self.kind == "dim":
            return self.shape[: self.dim] + (self.n * self.chunk,) + self.shape[self.dim + 1:]
        if self.kind == "flat":
            return self.shape[: self.lead] + (self.n * self.chunk,)
        return self.shape

    @property
    def shard_shape(self) -> tuple[int, ...]:
        if self.kind == "replicated":
            return self.shape
        s = list(self.storage_shape)
        s[self.split_axis] = self.chunk
        return tuple(s)

    @property
    def padding(self) -> int:
        """Zero elements stored to make the array divide into ``n`` shards."""
        return math.prod(self.storage_shape) - self.size

    def partition_spec(self, axis: str) -> P:
        """How the storage array is sharded over the mesh axis ``axis``."""
        if self.kind == "replicated":
            return P()
        return P(*([None] * self.split_axis), axis)

    def view_spec(self, axis: str) -> P:
        """How the optimizer's view (the array in its own shape) is laid out: split like the
        storage for ``dim`` (uneven where padded), whole for ``flat``."""
        return P(*([None] * self.dim), axis) if self.kind == "dim" else P()

    # Conversions between the array and its storage (global arrays under jit; numpy too for
    # ``from_storage``).
    def to_storage(self, x: jax.Array) -> jax.Array:
        if self.kind == "replicated":
            return x
        if self.kind == "dim":
            pad = self.n * self.chunk - self.shape[self.dim]
            if not pad:
                return x
            return jnp.pad(x, [(0, pad if i == self.dim else 0) for i in range(len(self.shape))])
        flat = jnp.reshape(x, self.shape[: self.lead] + (self.inner_size,))
        pad = self.n * self.chunk - self.inner_size
        return jnp.pad(flat, [(0, 0)] * self.lead + [(0, pad)]) if pad else flat

    def from_storage(self, s: Any) -> Any:
        if self.kind == "replicated":
            return s
        if self.kind == "dim":
            if self.n * self.chunk == self.shape[self.dim]:
                return s
            return s[(slice(None),) * self.dim + (slice(0, self.shape[self.dim]),)]
        return s[..., : self.inner_size].reshape(self.shape)

    # Inside shard_map over ``axis``: the local shard <-> the full array.
    def gather(self, shard: jax.Array, axis: str) -> jax.Array:
        """All-gathers a local shard into the full array (transpose: reduce-scatter)."""
        if self.kind == "replicated":
            return shard
        full = jax.lax.all_gather(shard, axis, axis=self.split_axis, tiled=True)
        return self.from_storage(full)

    def scatter(self, full: jax.Array, axis: str) -> jax.Array:
        """Sums a full array over ``axis`` into this device's shard (reduce-scatter; an
        all-reduce for a replicated layout)."""
        if self.kind == "replicated":
            return jax.lax.psum(full, axis)
        return jax.lax.psum_scatter(self.to_storage(full), axis, scatter_dimension=self.split_axis, tiled=True)

    # Stacks of layers.
    @property
    def can_slice_layers(self) -> bool:
        """Whether one layer (a slice along dimension 0) can be gathered on its own."""
        if self.kind == "dim":
            return len(self.shape) >= 2 and self.dim >= 1
        return self.kind == "flat" and self.lead == 1

    def row(self) -> LeafLayout:
        """The layout of one layer of a stack (dimension 0 removed)."""
        if not self.can_slice_layers:
            raise ValueError(f"layout {self} has no layer axis to slice")
        if self.kind == "dim":
            return dataclasses.replace(self, shape=self.shape[1:], dim=self.dim - 1)
        return dataclasses.replace(self, shape=self.shape[1:], lead=0)

    # Other device counts, other placements, and the checkpoint record.
    def with_n(self, n: int) -> LeafLayout:
        """The same way of storing for ``n`` shards (padding recomputed)."""
        return dataclasses.replace(self, n=n)

    def replicated(self) -> LeafLayout:
        """The array held whole on every device (stage 0)."""
        return dataclasses.replace(self, kind="replicated", dim=0, lead=0)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> LeafLayout:
        return cls(**{**d, "shape": tuple(d["shape"])})

    def describe(self) -> str:
        if self.kind == "dim":
            pad = f", padded {self.shape[self.dim]}->{self.n * self.chunk}" if self.padding else ""
            return f"split along dim {self.dim}{pad}"
        if self.kind == "flat":
            return ("flattened row by row" if self.lead else "flattened") + f", padded by {self.padding}"
        return "replicated"


def layout_for(shape: tuple[int, ...], dtype: Any, n: int) -> LeafLayout:
    """The layout of an array of ``shape`` split ``n`` ways (see the module docstring).

    Example:
      >>> from zerojax.sharding.layout import layout_for
      >>> layout_for((50257, 768), "float32", 8).describe()    # d_model divides 8
      'split along dim 1'
      >>> layout_for((12, 768, 3072), "float32", 64).describe()  # a stack keeps its layer axis
      'split along dim 1'
      >>> layout_for((50257,), "float32", 8).describe()          # a vector pads its end
      'split along dim 0, padded 50257->50264'
      >>> layout_for((13, 20), "float32", 8).describe()          # every dim would pad > 0.5%
      'flattened, padded by 4'
    """
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype).name
    size = math.prod(shape)
    if not shape or size == 0:
        return LeafLayout(shape, dtype, n, "replicated")
    flat = LeafLayout(shape, dtype, n, "flat")
    budget = flat.padding + PADDING_TOLERANCE * size
    pad = lambda k: LeafLayout(shape, dtype, n, "dim", dim=k).padding
    if len(shape) == 1:
        return LeafLayout(shape, dtype, n, "dim", dim=0)
    best = min(range(1, len(shape)), key=lambda k: (pad(k), k))
    for k in (best, 0):
        if pad(k) <= budget:
            return LeafLayout(shape, dtype, n, "dim", dim=k)
    rows = LeafLayout(shape, dtype, n, "flat", lead=1)
    return rows if rows.padding <= budget else flat
