"""How one parameter leaf is padded, flattened and split over the data axis.

Every leaf is partitioned, whatever its shape, the way DeepSpeed does it: the leaf is
flattened (whole, or row by row) and zero-padded so that the flat part divides the number
of shards ``n``. Two layouts exist:

* ``rows``: a leaf of shape ``(d0, *inner)`` is stored as ``(d0, n * chunk)`` with the
  second axis sharded. Stacked layers (``d0`` = layer count, run with ``lax.scan``) keep
  their layer axis whole, so one layer can be sliced off and gathered on its own.
* ``flat``: a leaf is stored as ``(n * chunk,)``, sharded. Used for vectors and scalars, and
  for matrices whose rows would need more padding than the whole leaf.

Padding is zero and stays zero through every optimizer that maps a zero gradient on a
zero parameter to a zero update (SGD, momentum, Adam, AdamW, Lion, ...).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# A row layout may cost at most this fraction of the leaf in padding beyond a flat layout.
ROW_PADDING_TOLERANCE = 0.005


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Storage of one leaf: ``lead`` dims kept whole, ``inner`` dims flattened and split.

    Attributes:
      lead: leading dims kept as they are (``()`` or ``(d0,)``).
      inner: dims flattened into the sharded axis.
      n: number of shards.
      dtype: the leaf's dtype name.
    """

    lead: tuple[int, ...]
    inner: tuple[int, ...]
    n: int
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        """The leaf's own shape."""
        return self.lead + self.inner

    @property
    def inner_size(self) -> int:
        return math.prod(self.inner)

    @property
    def chunk(self) -> int:
        """Elements of the flattened part held by each shard."""
        return max(1, -(-self.inner_size // self.n))

    @property
    def storage_shape(self) -> tuple[int, ...]:
        return self.lead + (self.n * self.chunk,)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return self.lead + (self.chunk,)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def padding(self) -> int:
        """Zero elements added to make the leaf divide into ``n`` shards."""
        return math.prod(self.storage_shape) - self.size

    def partition_spec(self, axis: str) -> P:
        return P(*([None] * len(self.lead)), axis)

    @property
    def can_slice_layers(self) -> bool:
        """Whether one row (one layer of a stacked leaf) can be gathered on its own."""
        return len(self.lead) == 1

    def row(self) -> LeafLayout:
        """The layout of one row of a ``rows`` leaf (one layer of a stack)."""
        if not self.can_slice_layers:
            raise ValueError(f"layout {self} has no rows to slice")
        return LeafLayout(lead=(), inner=self.inner, n=self.n, dtype=self.dtype)

    # Conversions between the leaf and its storage (global arrays; jit-friendly).
    def to_storage(self, x: jax.Array) -> jax.Array:
        flat = jnp.reshape(x, self.lead + (self.inner_size,))
        pad = self.n * self.chunk - self.inner_size
        if pad:
            flat = jnp.pad(flat, [(0, 0)] * len(self.lead) + [(0, pad)])
        return flat

    def from_storage(self, s: jax.Array) -> jax.Array:
        return jnp.reshape(s[..., : self.inner_size], self.shape)

    # Inside shard_map over ``axis``: the local shard <-> the full leaf.
    def gather(self, shard: jax.Array, axis: str) -> jax.Array:
        """All-gathers a local shard into the full leaf (transpose: reduce-scatter)."""
        full = jax.lax.all_gather(shard, axis, axis=len(self.lead), tiled=True)
        return self.from_storage(full)

    def scatter(self, full: jax.Array, axis: str) -> jax.Array:
        """Reduce-scatters (sums) a full leaf-shaped value into this device's shard."""
        return jax.lax.psum_scatter(
            self.to_storage(full), axis, scatter_dimension=len(self.lead), tiled=True
        )


def layout_for(shape: tuple[int, ...], dtype, n: int) -> LeafLayout:
    """Chooses the layout of a leaf of ``shape`` split ``n`` ways (see module docstring)."""
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype).name
    flat = LeafLayout(lead=(), inner=shape, n=n, dtype=dtype)
    if len(shape) < 2 or shape[0] == 0:
        return flat
    rows = LeafLayout(lead=shape[:1], inner=shape[1:], n=n, dtype=dtype)
    if rows.padding <= flat.padding + ROW_PADDING_TOLERANCE * flat.size:
        return rows
    return flat
