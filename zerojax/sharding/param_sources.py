"""What a use of a sharded parameter does, as data: one :class:`ParamSource` for every stage.

Per-use evaluation (:mod:`zerojax.sharding.per_use`) keeps a parameter *pending* until an
equation consumes it; its source says how the stored arrays become the full value there
and where the gradient of that use goes:

=====================  ==================  =====================  ==========================
use                    stored arrays       forward                gradient
=====================  ==================  =====================  ==========================
stage 3                ``(shard,)``        all-gather             reduce-scatter, to shard
stage 3, offloaded     ``(host, sink)``    to device, all-gather  reduce-scatter, to sink
stage 2                ``(full, sink)``    as it is               reduce-scatter, to sink
frozen at stage 3      ``(shard,)``        all-gather             none
=====================  ==================  =====================  ==========================

Gathers run in the compute dtype (or as blockwise int8 with ``quant_block``); gradients
are reduced in the reduce dtype (or as blockwise int8 with ``reduce_block``) and averaged over ``world`` devices
(:func:`zerojax.sharding.collectives.reduce_grad`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from zerojax.sharding import collectives
from zerojax.sharding.leaf_layout import LeafLayout


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """How a pending parameter is materialised and where its gradient goes (see the module
    docstring). Build one with :meth:`gathered`, :meth:`scattered` or :meth:`frozen`."""

    axis: str  # the data axis: gathers and reduce-scatters run over it
    world: int  # devices a gradient is averaged over (every device of the batch)
    compute_dtype: str = "float32"
    reduce_dtype: str | None = "float32"  # None: frozen, no gradient
    quant_block: int | None = None  # gather as blockwise int8 (ZeroConfig.collectives.gather_dtype)
    replica: str | None = None  # replica-group axis: gradient shards are all-reduced over it
    resident: bool = False  # the full parameter is stored (stage 2): nothing to gather
    sink: bool = False  # the gradient goes to a separate array, stored last
    reduce_block: int | None = None  # elements per fp32 scale of an int8 gradient reduction

    @classmethod
    def gathered(
        cls,
        axis: str,
        world: int,
        compute_dtype: str,
        reduce_dtype: str,
        quant_block: int | None = None,
        replica: str | None = None,
        *,
        host: bool = False,
        reduce_block: int | None = None,
    ) -> ParamSource:
        """Stage 3: the shard is stored (``host=True``: in host memory, with a device sink)."""
        return cls(axis, world, compute_dtype, reduce_dtype, quant_block, replica, sink=host, reduce_block=reduce_block)

    @classmethod
    def scattered(
        cls, axis: str, world: int, reduce_dtype: str, replica: str | None = None, reduce_block: int | None = None
    ) -> ParamSource:
        """Stage 2: the full parameter is stored; its gradient is reduce-scattered into a sink."""
        return cls(
            axis, world, reduce_dtype=reduce_dtype, replica=replica, resident=True, sink=True, reduce_block=reduce_block
        )

    @classmethod
    def frozen(cls, axis: str, compute_dtype: str, quant_block: int | None = None) -> ParamSource:
        """A frozen parameter at stage 3: gathered for every use, never given a gradient."""
        return cls(axis, 1, compute_dtype, None, quant_block)

    @property
    def trains(self) -> bool:
        return self.reduce_dtype is not None

    @property
    def regathers(self) -> bool:
        """Whether backward gathers the parameter again rather than keep forward's copy."""
        return not self.resident

    def values(self, layout: LeafLayout, stored: jax.Array) -> jax.Array:
        """The full parameter from its stored array, in forward (no gradient rule)."""
        if self.resident:
            return stored
        if in_host_memory(stored):  # offload_params
            stored = jax.device_put(stored, jax.memory.Space.Device)
        return collectives.gather_values(layout, self.axis, stored, self.compute_dtype, self.quant_block)

    def grad(self, layout: LeafLayout, ct: jax.Array, dtype) -> jax.Array:
        """A use's cotangent, reduced into this device's shard of the storage, in ``dtype``."""
        return collectives.reduce_grad(
            ct, self.axis, self.world, self.reduce_dtype, layout, self.replica, self.reduce_block
        ).astype(dtype)

    def materialize(self, layout: LeafLayout, arrays: Sequence[jax.Array]) -> jax.Array:
        """The full parameter for one use, whose gradient is reduced where the source says."""
        if not self.trains:
            return jax.lax.stop_gradient(self.values(layout, arrays[0]))

        stored, sink = arrays[0], (arrays[-1] if self.sink else None)
        target = (sink if self.sink else stored).dtype  # nothing but dtypes is kept for backward

        @jax.custom_vjp
        def use(stored, sink):
            return self.values(layout, stored)

        def fwd(stored, sink):  # the forward value itself, not a nested call of ``use``: for a
            return self.values(layout, stored), None  # resident parameter that is no copy at all

        def bwd(_, ct):
            g = self.grad(layout, ct, target)
            return (None, g) if self.sink else (g, None)

        use.defvjp(fwd, bwd)
        return use(stored, sink)


def in_host_memory(x: jax.Array) -> bool:
    """Whether ``x`` is stored in host memory (``offload_params``)."""
    return str(getattr(jax.typeof(x), "memory_space", "")).endswith("Host")
