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

Tensor parallelism (``zj.make_mesh(tensor=T)``): an array whose dimension ``tdim`` is split
over the tensor axis is stored on its *grid*, its shape with that dimension ``S`` written as
``(T, S/T)``: the ``T`` axis is sharded over the tensor axis (each tensor shard holds its
contiguous ``S/T`` block, as the model's annotation says), and the data split above is chosen
among the other grid dimensions (``S/T`` included), never the ``T`` axis. Inside the step's
``shard_map`` (manual over the data axes, automatic over "tensor") every collective of such an
array runs per tensor shard (:func:`per_tensor_shard`: a nested ``shard_map`` over the tensor
axis), so a gather over the data axis never gathers over "tensor" too.
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
      tensor: devices of the tensor axis this array is split over (1: none).
      tdim: the dimension of ``shape`` split over the tensor axis (-1: none).
      taxis: the tensor axis's name.

    With ``tensor > 1``, ``dim`` and ``lead`` refer to the grid (see the module docstring).
    """

    shape: tuple[int, ...]
    dtype: str
    n: int
    kind: str = "dim"
    dim: int = 0
    lead: int = 0
    tensor: int = 1
    tdim: int = -1
    taxis: str = "tensor"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layout kind must be one of {KINDS}, got {self.kind!r}")
        if self.tensor > 1 and not (0 <= self.tdim < len(self.shape) and self.shape[self.tdim] % self.tensor == 0):
            raise ValueError(f"layout: dimension {self.tdim} of shape {self.shape} does not split {self.tensor} ways")

    # Tensor parallelism.
    @property
    def tp(self) -> bool:
        """Whether this array is split over the tensor axis."""
        return self.tensor > 1

    @property
    def grid(self) -> tuple[int, ...]:
        """The shape the data split is chosen on: ``shape`` with ``tdim`` written ``(T, S/T)``."""
        if not self.tp or self.kind == "replicated":
            return self.shape
        t = self.tdim
        return self.shape[:t] + (self.tensor, self.shape[t] // self.tensor) + self.shape[t + 1 :]

    def _plain(self, local: bool = False) -> LeafLayout:
        """This layout on its grid, without the tensor split (``local``: one tensor shard's
        grid, its ``T`` axis of size 1, as a nested ``shard_map`` over the tensor axis sees it)."""
        grid = self.grid
        if local and self.tp:
            grid = grid[: self.tdim] + (1,) + grid[self.tdim + 1 :]
        return LeafLayout(grid, self.dtype, self.n, self.kind, self.dim, self.lead)

    def local(self) -> LeafLayout:
        """One tensor shard's layout (itself without tensor parallelism)."""
        if not self.tp:
            return self
        if self.kind == "replicated":
            t = self.tdim
            return LeafLayout(
                self.shape[:t] + (self.shape[t] // self.tensor,) + self.shape[t + 1 :], self.dtype, self.n, "replicated"
            )
        return self._plain(local=True)

    def tensor_spec(self) -> P:
        """The spec of the tensor split alone (position ``tdim`` of the grid, or of the shape)."""
        return P(*([None] * self.tdim), self.taxis) if self.tp else P()

    # Sizes.
    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def inner_size(self) -> int:
        """``flat``: elements of the flattened part (one row, or the whole array)."""
        return math.prod(self.grid[self.lead :])

    @property
    def chunk(self) -> int:
        """Length of the split axis held by each shard."""
        if self.kind == "dim":
            return -(-self.grid[self.dim] // self.n)
        if self.kind == "flat":
            return max(1, -(-self.inner_size // self.n))
        raise ValueError("a replicated layout is not split")

    @property
    def split_axis(self) -> int | None:
        """The axis of the *storage* array that is split over the devices."""
        return {"dim": self.dim, "flat": self.lead, "replicated": None}[self.kind]

    @property
    def storage_shape(self) -> tuple[int, ...]:
        g = self.grid
        if self.kind == "dim":
            return g[: self.dim] + (self.n * self.chunk,) + g[self.dim + 1 :]
        if self.kind == "flat":
            return g[: self.lead] + (self.n * self.chunk,)
        return self.shape

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """One device's shard (split over the data axis, and over the tensor axis)."""
        s = list(self.storage_shape)
        if self.kind != "replicated":
            s[self.split_axis] = self.chunk
        if self.tp:
            s[self.tdim] //= self.tensor
        return tuple(s)

    @property
    def padding(self) -> int:
        """Zero elements stored to make the array divide into ``n`` shards."""
        return math.prod(self.storage_shape) - self.size

    def partition_spec(self, axis: str) -> P:
        """How the storage array is sharded over the mesh axis ``axis`` (the data axis alone:
        a ``shard_map`` spec over the manual axes; see :meth:`storage_spec` for the placement)."""
        if self.kind == "replicated":
            return P()
        return P(*([None] * self.split_axis), axis)

    def storage_spec(self, axis: str) -> P:
        """Where the storage array lives: over the data axis ``axis`` and the tensor axis."""
        spec: list[Any] = [None] * len(self.storage_shape)
        if self.kind != "replicated":
            spec[self.split_axis] = axis
        if self.tp and self.taxis:
            spec[self.tdim] = self.taxis
        while spec and spec[-1] is None:
            spec.pop()
        return P(*spec)

    def view_spec(self, axis: str) -> P:
        """How the optimizer's view (the array in its own shape) is laid out: split like the
        storage for ``dim`` (uneven where padded), whole for ``flat`` (split over the tensor
        axis as stored, with tensor parallelism)."""
        spec: list[Any] = [None] * len(self.shape)
        if self.tp:
            spec[self.tdim] = self.taxis
        if self.kind == "dim":
            k = self.dim if not self.tp or self.dim < self.tdim else self.dim - 1
            names = axis if isinstance(axis, tuple) else (axis,)  # data x context: a tuple of axes
            spec[k] = (self.taxis, *names) if spec[k] == self.taxis else axis
        while spec and spec[-1] is None:
            spec.pop()
        return P(*spec)

    # Conversions between the array and its storage (global arrays under jit; numpy too for
    # ``from_storage``).
    def to_storage(self, x: jax.Array) -> jax.Array:
        if self.tp and self.kind != "replicated":
            return self._plain().to_storage(jnp.reshape(x, self.grid))
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
        if self.tp and self.kind != "replicated":
            return self._plain().from_storage(s).reshape(self.shape)
        if self.kind == "replicated":
            return s
        if self.kind == "dim":
            if self.n * self.chunk == self.shape[self.dim]:
                return s
            return s[(slice(None),) * self.dim + (slice(0, self.shape[self.dim]),)]
        return s[..., : self.inner_size].reshape(self.shape)

    # Inside shard_map over ``axis``: the local shard <-> the full array.
    def gather(self, shard: jax.Array, axis: str) -> jax.Array:
        """All-gathers a local shard into the full array (transpose: reduce-scatter); over
        ``axis`` only, each tensor shard on its own."""
        if self.kind == "replicated":
            return shard
        if self.tp:
            return self.on_tensor_shards(lambda l, s: l.gather(s, axis), shard, whole=True)
        full = jax.lax.all_gather(shard, axis, axis=self.split_axis, tiled=True)
        return self.from_storage(full)

    def scatter(self, full: jax.Array, axis: str) -> jax.Array:
        """Sums a full array over ``axis`` into this device's shard (reduce-scatter; an
        all-reduce for a replicated layout)."""
        if self.tp:
            return self.on_tensor_shards(lambda l, x: l.scatter(x, axis), full, whole=False)
        if self.kind == "replicated":
            return jax.lax.psum(full, axis)
        return jax.lax.psum_scatter(self.to_storage(full), axis, scatter_dimension=self.split_axis, tiled=True)

    def on_tensor_shards(self, fn, x: jax.Array, *, whole: bool) -> jax.Array:
        """``fn(self.local(), x_t)`` on each tensor shard ``x_t`` of ``x`` (an array of this
        layout's grid or storage, or of its own shape when replicated over the data axis: the
        tensor axis at ``tdim`` in each), as a nested ``shard_map`` manual over the tensor
        axis: collectives over the data axes in ``fn`` then never involve the tensor axis.
        ``whole``: ``fn`` returns the grid's full array (a gather), reshaped here to
        ``shape``; else a storage shard (a scatter), returned as it is, even where it has the
        grid's shape (a data axis of one device stores the whole grid)."""
        spec = self.tensor_spec()
        if self.kind != "replicated" and tuple(x.shape) == self.shape:
            x = jnp.reshape(x, self.grid)
        out = jax.shard_map(
            lambda v: fn(self.local(), v), in_specs=spec, out_specs=spec, axis_names={self.taxis}, check_vma=False
        )(x)
        return out.reshape(self.shape) if whole and tuple(out.shape) == self.grid != self.shape else out

    # Stacks of layers.
    @property
    def can_slice_layers(self) -> bool:
        """Whether one layer (a slice along dimension 0) can be gathered on its own."""
        if self.tp and self.tdim == 0:
            return False
        if self.kind == "dim":
            return len(self.shape) >= 2 and self.dim >= 1
        return self.kind == "flat" and self.lead >= 1

    def row(self) -> LeafLayout:
        """The layout of one layer of a stack (dimension 0 removed)."""
        if not self.can_slice_layers:
            raise ValueError(f"layout {self} has no layer axis to slice")
        tdim = self.tdim - 1 if self.tp else self.tdim
        if self.kind == "dim":
            return dataclasses.replace(self, shape=self.shape[1:], dim=self.dim - 1, tdim=tdim)
        return dataclasses.replace(self, shape=self.shape[1:], lead=self.lead - 1, tdim=tdim)

    # Other device counts, other placements, and the checkpoint record.
    def with_n(self, n: int) -> LeafLayout:
        """The same way of storing for ``n`` shards (padding recomputed)."""
        return dataclasses.replace(self, n=n)

    def replicated(self) -> LeafLayout:
        """The array held whole on every device of the data axis (stage 0); still split over
        the tensor axis where it is."""
        return dataclasses.replace(self, kind="replicated", dim=0, lead=0)

    def without_tensor(self) -> LeafLayout:
        """The same storage with the tensor axis replicated (to read a checkpoint saved with
        another tensor degree): the grid is kept, only its placement changes."""
        return dataclasses.replace(self, taxis="") if self.tp else self

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> LeafLayout:
        return cls(**{**d, "shape": tuple(d["shape"])})

    def describe(self) -> str:
        tp = f"; dim {self.tdim} split {self.tensor} ways over {self.taxis!r}" if self.tp else ""
        if self.kind == "dim":
            pad = f", padded {self.grid[self.dim]}->{self.n * self.chunk}" if self.padding else ""
            where = f"dim {self.dim}" + (" of the grid " + str(self.grid) if self.tp else "")
            return f"split along {where}{pad}{tp}"
        if self.kind == "flat":
            return ("flattened row by row" if self.lead else "flattened") + f", padded by {self.padding}{tp}"
        return "replicated" + tp


def layout_for(
    shape: tuple[int, ...], dtype: Any, n: int, *, tensor: int = 1, tdim: int = -1, taxis: str = "tensor"
) -> LeafLayout:
    """The layout of an array of ``shape`` split ``n`` ways over the data axis (and, with
    ``tensor > 1``, dimension ``tdim`` split ``tensor`` ways over ``taxis``; see the module
    docstring).

    Example:
      >>> from zerojax.sharding.leaf_layout import layout_for
      >>> layout_for((50257, 768), "float32", 8).describe()    # d_model divides 8
      'split along dim 1'
      >>> layout_for((12, 768, 3072), "float32", 64).describe()  # a stack keeps its layer axis
      'split along dim 1'
      >>> layout_for((50257,), "float32", 8).describe()          # a vector pads its end
      'split along dim 0, padded 50257->50264'
      >>> layout_for((13, 20), "float32", 8).describe()          # every dim would pad > 0.5%
      'flattened, padded by 4'
      >>> layout_for((768, 3072), "float32", 4, tensor=2, tdim=1).describe()  # column-parallel
      "split along dim 0 of the grid (768, 2, 1536); dim 1 split 2 ways over 'tensor'"
      >>> layout_for((3072,), "float32", 4, tensor=2, tdim=0).shard_shape       # its bias
      (1, 384)
    """
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype).name
    if tensor <= 1 or not shape or math.prod(shape) == 0:
        return _choose(shape, dtype, n, -1)
    if not 0 <= tdim < len(shape) or shape[tdim] % tensor:
        raise ValueError(f"layout_for: dimension {tdim} of shape {shape} does not split {tensor} ways")
    grid = shape[:tdim] + (tensor, shape[tdim] // tensor) + shape[tdim + 1 :]
    plain = _choose(grid, dtype, n, tdim)
    return dataclasses.replace(plain, shape=shape, tensor=tensor, tdim=tdim, taxis=taxis)


def _choose(shape: tuple[int, ...], dtype: str, n: int, keep: int) -> LeafLayout:
    """The data split of an array of ``shape`` (a grid whose dimension ``keep`` is the
    tensor axis, never split over data, when ``keep >= 0``)."""
    size = math.prod(shape)
    if not shape or size == 0:
        return LeafLayout(shape, dtype, n, "replicated")
    lead = 0 if keep < 0 else keep + 1  # the flat layouts keep the tensor axis whole
    flat = LeafLayout(shape, dtype, n, "flat", lead=lead)
    budget = flat.padding + PADDING_TOLERANCE * size
    pad = lambda k: LeafLayout(shape, dtype, n, "dim", dim=k).padding
    if len(shape) == 1:
        return LeafLayout(shape, dtype, n, "dim", dim=0)
    # Another dimension than the tensor-split one where possible (its S/T part last), the
    # layer axis (0) after the others.
    others = [k for k in range(1, len(shape)) if k not in (keep, keep + 1)]
    order = ([min(others, key=lambda k: (pad(k), k))] if others else []) + ([0] if keep != 0 else [])
    for k in order + ([keep + 1] if keep >= 0 else []):
        if pad(k) <= budget:
            return LeafLayout(shape, dtype, n, "dim", dim=k)
    rows = LeafLayout(shape, dtype, n, "flat", lead=max(1, lead))
    return rows if rows.padding <= budget else flat
