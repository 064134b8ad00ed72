"""The GPipe schedule in one SPMD program: micro-batches through ``P`` stages, one tick at a time.

Stage ``p`` (the devices at index ``p`` of the pipeline axis) holds layers ``[p·K,
(p+1)·K)`` of the stack (``K = L / P``). At tick ``t`` every stage runs its ``K`` layers on
the activation it holds: stage 0 on micro-batch ``t``, stage ``p`` on what stage ``p - 1``
made at tick ``t - 1`` (micro-batch ``t - p``); then every stage's output moves one stage on
(a ``collective-permute`` over the pipeline axis) and the last stage's is micro-batch
``t - (P - 1)``'s result. ``M + P - 1`` ticks take ``M`` micro-batches through; in the
first and last ``P - 1`` ticks some stages compute on padding, the bubble
``(P - 1) / (M + P - 1)``. Backward is JAX's transpose of this loop: the same ticks in
reverse, each activation's cotangent moving one stage back.

The stages are one function ``vmap``-ed over the pipeline dimension of the stacked
parameters ``[P, K, ...]`` and of the activations ``[P, rows, ...]``, both constrained to
the pipeline axis, so XLA's partitioner gives each device its own stage's slice (the
pipeline axis is automatic inside the step's ``shard_map``, as the tensor axis is).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def on_stages(x: jax.Array, axis: str) -> jax.Array:
    """``x`` (leading dimension: one entry per stage) placed one entry per pipeline device."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), P(axis)))


def run(
    stage: Callable,
    xs: list[jax.Array],
    carries: list[jax.Array],
    per_micro: list[jax.Array],
    stages: int,
    micro: int,
    axis: str,
) -> list[jax.Array]:
    """The GPipe loop (see the module docstring).

    Args:
      stage: ``stage(xs_p, carry, per_micro_j, j) -> carry``: one stage's layers on one
        micro-batch ``j`` (``xs_p``: its ``[K, ...]`` slices of ``xs``).
      xs: the scanned operands, ``[P, K, ...]`` each.
      carries: the carried values, ``[M, rows, ...]`` each (a micro-batch per entry).
      per_micro: other operands that differ per micro-batch, ``[M, rows, ...]`` each.
      stages, micro: ``P`` and ``M``.
      axis: the pipeline axis.

    Returns:
      each carry after the last stage, ``[M, rows, ...]``.
    """
    xs = [on_stages(x, axis) for x in xs]
    state = [on_stages(jnp.zeros((stages,) + c.shape[1:], c.dtype), axis) for c in carries]
    outs = [jnp.zeros_like(c) for c in carries]
    index = jnp.arange(stages)

    def tick(loop, t):
        state, outs = loop
        first = jnp.minimum(t, micro - 1)  # past the last micro-batch, stage 0 computes on padding
        state = [on_stages(s.at[0].set(c[first]), axis) for s, c in zip(state, carries)]
        j = jnp.clip(t - index, 0, micro - 1)  # the micro-batch each stage holds
        here = [p[j] for p in per_micro]
        new = jax.vmap(stage, spmd_axis_name=axis)(xs, state, here, j)
        new = [on_stages(n, axis) for n in new]
        # The last stage finished micro-batch t - (P - 1); before tick P - 1 it wrote padding
        # to entry 0, which micro-batch 0 then overwrites.
        done = jnp.maximum(t - (stages - 1), 0)
        outs = [o.at[done].set(n[stages - 1]) for o, n in zip(outs, new)]
        state = [on_stages(jnp.roll(n, 1, axis=0), axis) for n in new]
        return (state, outs), None

    (_, outs), _ = jax.lax.scan(tick, (state, outs), jnp.arange(micro + stages - 1))
    return outs


def split(x: jax.Array, micro: int) -> jax.Array:
    """A device's rows ``[m, ...]`` -> ``[M, m / M, ...]``, row ``r`` to micro-batch ``r % M``
    (as gradient accumulation splits them: :func:`zerojax.stages.gradients.micro_batches`)."""
    return x.reshape((x.shape[0] // micro, micro) + x.shape[1:]).swapaxes(0, 1)


def merge(x: jax.Array) -> jax.Array:
    """The inverse of :func:`split`."""
    return x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
