"""How a sequence is laid out over a context axis of ``C`` devices, as a value.

``Layout("contiguous", C)``: device ``i`` holds positions ``[i·S/C, (i+1)·S/C)``, what
``PartitionSpec(None, "context")`` on the sequence dimension gives. ``Layout("balanced", C)``:
the sequence is cut into ``2C`` chunks and device ``i`` holds chunks ``i`` and ``2C-1-i`` (one
early, one late), so that under causal attention every device has the same work (ring
attention's load balancing, as in Megatron's and torchtitan's context parallelism). In the
balanced layout every sequence-indexed input is permuted by :meth:`Layout.order` before it is
split, and attention reads the positions each device holds from
:meth:`Layout.device_positions`.

A layout is a frozen value: the train step hands it to the loss (``make_train_step(...,
with_layout=True)`` calls ``loss_fn(params, batch, layout=...)``), the loss hands it to
``zj.nn.dot_product_attention(..., layout=layout)`` and ``zj.nn.global_positions(T, layout)``,
and a jitted function that takes it as a static argument is traced once per layout. Nothing
reads a layout from ambient state. A layout names the mesh axis it splits the sequence over
(``axis``: the step's ``ZeroConfig(axes={"context": ...})``), so that a kernel handed it
finds that axis without an ``axis=`` of its own (:func:`axis_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.sharding.mesh import context_size

KINDS = ("contiguous", "balanced")
CONTEXT_AXIS = "context"  # the context axis's name where nothing names another
# The jax.named_scope an attention kernel runs under, naming its layout ("...=balanced"): the
# step reads it from the traced loss and checks it is its own (zerojax.context.checks), and
# the sequence-order check knows the kernels by it (zerojax.context.sequence_order).
KERNEL_SCOPE = "zerojax_attention_layout="


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Layout:
    """A sequence layout over ``c`` devices of the mesh axis ``axis`` (``kind``:
    ``"contiguous"`` or ``"balanced"``).

    Example:
      >>> lay = Layout("balanced", 2)
      >>> lay.order(8).tolist()        # chunks of 2: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2
      [0, 1, 6, 7, 2, 3, 4, 5]
      >>> lay.device_positions(8).tolist()
      [[0, 1, 6, 7], [2, 3, 4, 5]]
      >>> Layout("contiguous", 4).moves, lay.moves
      (False, True)

    A layout is a pytree with no leaves (JAX's ``register_static``): passed to a jitted
    function, a ``jax.checkpoint`` or a Flax transform it is part of the trace's static
    structure, so each layout gets a trace of its own.
    """

    kind: str = "contiguous"
    c: int = 1
    axis: str = CONTEXT_AXIS

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a context layout is one of {KINDS}, got {self.kind!r}.")
        if isinstance(self.c, bool) or not isinstance(self.c, (int, np.integer)) or self.c < 1:
            raise ValueError(f"a context layout's device count must be a positive int, got {self.c!r}.")
        if not isinstance(self.axis, str) or not self.axis:
            raise ValueError(f"a context layout's axis is a mesh axis name (a non-empty str), got {self.axis!r}.")
        object.__setattr__(self, "c", int(self.c))

    @property
    def moves(self) -> bool:
        """Whether the layout reorders a sequence (balanced over 2+ devices)."""
        return self.kind == "balanced" and self.c > 1

    @property
    def unit(self) -> int:
        """What every sequence length must be a multiple of."""
        return 2 * self.c if self.kind == "balanced" else self.c

    def check(self, seq_len: int, what: str = "sequence length", *, in_loss: bool = False) -> None:
        """Refuses a ``seq_len`` this layout cannot split, listing the lengths near it that
        fit. ``in_loss``: the length is one the loss computed (a kernel's, the positions'),
        which in a moving layout is most often a slice of the batch's sequence."""
        if seq_len % self.unit:
            unit = self.unit
            near = sorted({max(unit, seq_len // unit * unit), (seq_len // unit + 1) * unit})
            why = (
                f"{self.c} context devices"
                if self.kind == "contiguous"
                else f"2 x {self.c} chunks (the balanced layout gives each of the {self.c} context devices two)"
            )
            hint = ""
            if in_loss and self.moves:
                hint = (
                    " A loss that slices the batch's sequence (tokens[:, :-1] and tokens[:, 1:]) cannot run in "
                    "the balanced layout, whose sequence is permuted: give the shifted targets in the batch "
                    "(inputs and targets leaves of the same length)."
                )
            raise ValueError(
                f"{what} {seq_len} does not split into {why}: use a multiple of {unit} "
                f"(e.g. {' or '.join(map(str, near))}), or pad the sequence to one.{hint}"
            )

    def order(self, seq_len: int) -> np.ndarray:
        """The permutation that lays a sequence out: ``x[:, order]`` split into ``c``
        contiguous parts gives each device its positions."""
        self.check(seq_len)
        if not self.moves:
            return np.arange(seq_len)
        c = self.c
        chunks = np.arange(seq_len).reshape(2 * c, seq_len // (2 * c))
        return np.concatenate([np.concatenate([chunks[i], chunks[2 * c - 1 - i]]) for i in range(c)])

    def inverse(self, seq_len: int) -> np.ndarray:
        """The permutation that undoes :meth:`order`."""
        return np.argsort(self.order(seq_len))

    def device_positions(self, seq_len: int) -> np.ndarray:
        """``[c, seq_len // c]``: the global positions device ``i`` holds, in its order."""
        return self.order(seq_len).reshape(self.c, seq_len // self.c)

    def positions(self, seq_len: int) -> jax.Array:
        """``int32[seq_len]``: the global position of each index of a sequence in this
        layout (``jnp.arange`` when the layout does not move anything)."""
        if not self.moves:
            return jax.lax.iota(jnp.int32, seq_len)
        self.check(seq_len, "the positions' sequence length", in_loss=True)
        return jnp.asarray(self.order(seq_len), jnp.int32)

    def permute(self, x: jax.Array, dim: int) -> jax.Array:
        """``x`` with dimension ``dim`` in this layout's order: as ``jnp.take(x, order)``,
        written as slices and a reverse so that XLA moves whole chunks."""
        if not self.moves:
            return x
        n, c = x.shape[dim], self.c
        self.check(n, f"sequence length (dimension {dim})")
        chunks = x.reshape(x.shape[:dim] + (2 * c, n // (2 * c)) + x.shape[dim + 1 :])
        early = jax.lax.slice_in_dim(chunks, 0, c, axis=dim)
        late = jnp.flip(jax.lax.slice_in_dim(chunks, c, 2 * c, axis=dim), axis=dim)
        return jnp.stack([early, late], axis=dim + 1).reshape(x.shape)


CONTIGUOUS = Layout()


def axis_of(layout: Layout | str | None, axis: str | None, mesh: Any) -> str:
    """The context axis a kernel or :func:`global_positions` runs over: ``axis`` where given,
    else the :class:`Layout`'s own, else ``"context"``. Refuses what it would otherwise have
    to guess: an ``axis`` other than the layout's, a layout over ``C > 1`` devices of an axis
    the mesh does not have (or has at another size), and a layout kind that moves the
    sequence (``"balanced"``) named without an axis on a mesh that has no ``"context"`` axis.
    (Off a mesh, a kind runs as what it is over one device.)"""
    if axis is not None and (not isinstance(axis, str) or not axis):
        raise ValueError(f"axis must be the name of the mesh's context axis (a non-empty str), got {axis!r}.")
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    if isinstance(layout, Layout):
        if axis is not None and axis != layout.axis:
            raise ValueError(
                f"axis={axis!r}, but the layout {layout} splits the sequence over {layout.axis!r}. Pass the "
                f"layout alone (it names its axis), or Layout({layout.kind!r}, {layout.c}, axis={axis!r})."
            )
        if layout.c > 1 and context_size(mesh, layout.axis) != layout.c:
            has = (
                f"has {context_size(mesh, layout.axis)} devices on it"
                if layout.axis in names
                else f"has no such axis (its axes: {names})"
            )
            raise ValueError(
                f"{layout} splits the sequence over {layout.c} devices of the mesh axis {layout.axis!r}, but the "
                f"mesh {has}. Call it under the mesh of the step that handed the loss the layout "
                f"(jax.set_mesh(mesh)), or pass the layout that mesh's step hands the loss."
            )
        return layout.axis
    if axis is not None:
        return axis
    if layout == "balanced" and names and CONTEXT_AXIS not in names:
        raise ValueError(
            f"layout='balanced' names no axis, and the mesh has no {CONTEXT_AXIS!r} axis (its axes: {names}): "
            f"which axis splits the sequence is not known. Pass the layout the step hands the loss "
            f"(make_train_step(..., with_layout=True): it names its axis), or axis= the context axis."
        )
    return CONTEXT_AXIS


def resolve(layout: Layout | str | None, c: int, axis: str = CONTEXT_AXIS) -> Layout:
    """A :class:`Layout` over ``c`` devices of ``axis`` from a layout, its kind, or None
    (contiguous); a layout made for another device count is refused."""
    if layout is None:
        return Layout("contiguous", c, axis)
    if isinstance(layout, str):
        return Layout(layout, c, axis)
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a zj.context.Layout, 'contiguous', 'balanced' or None, got {layout!r}.")
    if layout.c != c and layout.moves:
        raise ValueError(
            f"{layout} is laid out over {layout.c} context devices, but the mesh's context axis has "
            f"{c}; pass the layout the step hands the loss."
        )
    return Layout(layout.kind, c, axis)


def global_positions(seq_len: int, layout: Layout | str | None = None, axis: str | None = None) -> jax.Array:
    """``int32[seq_len]``: the global position of each index of a sequence laid out in
    ``layout`` (the one the step hands the loss: ``make_train_step(..., with_layout=True)``),
    ``jnp.arange(seq_len)`` for the contiguous layout (None) or off a context mesh. Use it
    where a model builds positions (RoPE, learned position embeddings, masks). ``axis``: the
    context axis (default: the layout's, else ``"context"``; see :func:`axis_of`).

    Example:
      >>> import zerojax as zj
      >>> zj.nn.global_positions(4).tolist()      # contiguous: 0, 1, 2, 3
      [0, 1, 2, 3]
    """
    mesh = jax.sharding.get_abstract_mesh()
    axis = axis_of(layout, axis, mesh)
    return resolve(layout, context_size(mesh, axis), axis).positions(seq_len)
