"""The circular schedule in one SPMD program: every micro-batch goes round the ``P`` stages
``R`` times, through the next block of each stage every round (docs/pipeline.md)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from zerojax.pipeline.gpipe import on_stages


def run(
    stage: Callable,
    xs: list[jax.Array],
    carries: list[jax.Array],
    per_micro: list[jax.Array],
    stages: int,
    repeats: int,
    axis: str,
) -> list[jax.Array]:
    """The circular schedule (stage repeats, "interleaved" in Megatron's words): stage ``p``
    holds blocks ``p, p + P, ..., p + (R - 1)·P`` of ``l = L / (P·R)`` layers each, and every
    micro-batch goes round the ``P`` stages ``R`` times, each time through the next block of
    every stage. With ``M = P`` micro-batches the stage a micro-batch leaves is free exactly
    when it comes round again, so no activation waits: micro-batch ``j`` is at stage ``p`` in
    round ``r`` at tick ``r·P + j + p``. ``R·P + P - 1`` ticks take the ``P`` micro-batches
    through, and the bubble is ``(P - 1) / (R·P + P - 1)``, GPipe's with ``R`` times the
    micro-batches (each ``R`` times larger).

    Args:
      stage: as for :func:`zerojax.pipeline.gpipe.run` (``xs_p``: one block's ``[l, ...]`` slices).
      xs: the scanned operands, ``[P, R, l, ...]`` each (stage, round, layer).
      carries, per_micro: as for :func:`zerojax.pipeline.gpipe.run`, with ``M = P`` micro-batches.
      stages, repeats: ``P`` and ``R``.
      axis: the pipeline axis.

    Returns:
      each carry after the last block, ``[M, rows, ...]``.
    """
    micro = stages
    xs = [on_stages(x, axis) for x in xs]
    state = [on_stages(jnp.zeros((stages,) + c.shape[1:], c.dtype), axis) for c in carries]
    outs = [jnp.zeros_like(c) for c in carries]
    index = jnp.arange(stages)

    def tick(loop, t):
        state, outs = loop
        # Stage 0 takes a new micro-batch in the first P ticks; afterwards the micro-batch the
        # last stage passed on comes round (the roll below put it in entry 0).
        first = jnp.minimum(t, micro - 1)
        state = [on_stages(jnp.where(t < micro, s.at[0].set(c[first]), s), axis) for s, c in zip(state, carries)]
        step = t - index  # ticks since micro-batch j entered: r·P + j at stage p
        j = jnp.mod(step, micro)
        r = jnp.clip(step // micro, 0, repeats - 1)
        here = [p[j] for p in per_micro]
        blocks = [jax.vmap(lambda x, rp: x[rp])(x, r) for x in xs]
        new = jax.vmap(stage, spmd_axis_name=axis)(blocks, state, here, j)
        new = [on_stages(n, axis) for n in new]
        # The last stage finishes micro-batch j's last round at tick (R - 1)·P + j + P - 1;
        # before that it writes what it holds to entry 0, which micro-batch 0 then overwrites.
        last = t - (stages - 1)
        done = jnp.where(last >= (repeats - 1) * micro, jnp.mod(last, micro), 0)
        keep = last >= (repeats - 1) * micro
        outs = [o.at[done].set(jnp.where(keep, n[stages - 1], o[done])) for o, n in zip(outs, new)]
        state = [on_stages(jnp.roll(n, 1, axis=0), axis) for n in new]
        return (state, outs), None

    (_, outs), _ = jax.lax.scan(tick, (state, outs), jnp.arange(repeats * micro + stages - 1))
    return outs
