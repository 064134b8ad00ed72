"""Stage 3 over a stack of layers with the next layers' gathers issued ahead of use.

A ``scan`` over stacked parameters (``nnx.scan``, ``nn.scan``, ``lax.scan``) normally
gathers layer i inside iteration i, after layer i−1 is done. With ``ZeroConfig(prefetch=d)``
the stack runs as one ``custom_vjp``:

* forward: the loop carries the next ``d`` layers already gathered; iteration i computes
  layer i with the first of them while it gathers layer i + d. The gather and the layer's
  compute do not depend on each other, so a backend that runs collectives asynchronously
  overlaps them. At most d + 1 gathered layers are live.
* backward, in reverse: iteration i gathers layer i − d while it recomputes layer i's
  forward from the layer's saved input and back-propagates through it; the weight
  cotangent is reduce-scattered into the layer's gradient shard. At most d + 1 gathered
  layers and one weight cotangent are live.

Only each layer's input is saved from forward (as with ``remat="full"``), never a gathered
layer, so backward recomputes each layer's forward once: prefetch costs no extra FLOPs
with full remat, and one forward of the stack otherwise. The last ``d`` iterations of each
direction run in a second, shorter scan with nothing left to fetch, so every layer is
gathered exactly once per direction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def applies(carry: Sequence[Any], others: Sequence[Any], out_avals: Sequence[Any]) -> bool:
    """Whether the prefetching scan can run this stack: every carry, scanned input and
    output floating (their cotangents are arrays of the same shape)."""
    floating = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)
    return all(floating(x) for x in [*carry, *others, *out_avals])


def prefetched_scan(
    body: Callable[[list, list, list], list],
    n_carry: int,
    length: int,
    depth: int,
    stacks: Sequence[Any],
    stack_pos: Sequence[int],
    consts: list,
    carry: list,
    others: list,
    n_xs: int,
) -> list:
    """Runs ``body(consts, carry, xs_vals) -> carry + ys`` over ``length`` layers.

    ``stacks`` are the pending stacked parameters scanned over (``Pending`` with one storage
    array each and a source that gathers: stage 3's, trained or frozen), at positions ``stack_pos`` of the
    ``n_xs`` scanned inputs; ``others`` are the other scanned inputs, in order. Returns the
    scan's outputs (final carry, then the stacked ys)."""
    depth = min(depth, length)
    rows = [s.rebuild([s.arrays[0][0]], sliced=True) for s in stacks]  # one layer's layout, source, ops
    diff = [i for i, c in enumerate(consts) if jnp.issubdtype(c.dtype, jnp.inexact)]

    def fetch(shards: list, i) -> list:
        """Layer ``i`` of every stack, gathered in the compute dtype (before shape-only ops)."""
        return [_gather(r, jax.lax.dynamic_index_in_dim(s, i, keepdims=False)) for r, s in zip(rows, shards)]

    def layer(consts, carry, gathered, other_vals):
        it_s, it_o = iter(_apply_ops(rows, gathered)), iter(other_vals)
        xs_vals = [next(it_s) if k in stack_pos else next(it_o) for k in range(n_xs)]
        outs = body(consts, carry, xs_vals)
        return outs[:n_carry], outs[n_carry:]

    def forward(consts, carry, shards, others):
        def step(state, xs):
            carry, queue = state
            i, other_vals = xs
            nxt = fetch(shards, i + depth)  # issued now, used depth iterations later
            carry_out, ys = layer(consts, carry, queue[0], other_vals)
            return (carry_out, queue[1:] + [nxt]), (ys, carry)

        def tail(state, xs):  # nothing left to fetch: the queue rotates, keeping its shape
            carry, queue = state
            carry_out, ys = layer(consts, carry, queue[0], xs[1])
            return (carry_out, queue[1:] + queue[:1]), (ys, carry)

        queue = [fetch(shards, i) for i in range(depth)]
        idx, cut = jnp.arange(length), length - depth
        (carry, queue), (ys1, in1) = jax.lax.scan(step, (carry, queue), (idx[:cut], [o[:cut] for o in others]))
        (carry, _), (ys2, in2) = jax.lax.scan(tail, (carry, queue), (idx[cut:], [o[cut:] for o in others]))
        return carry, _join(ys1, ys2), _join(in1, in2)

    @jax.custom_vjp
    def run(consts, carry, shards, others):
        carry_out, ys, _ = forward(consts, carry, shards, others)
        return carry_out, ys

    def fwd(consts, carry, shards, others):
        carry_out, ys, inputs = forward(consts, carry, shards, others)
        return (carry_out, ys), (consts, inputs, shards, others)

    def bwd(res, cts):
        consts, inputs, shards, others = res
        ct_carry, ct_ys = cts

        def with_diff(dc):
            c = list(consts)
            for i, x in zip(diff, dc):
                c[i] = x
            return c

        def backprop(state, xs, prefetching: bool):
            ct_carry, queue, ct_consts = state
            i, carry_in, other_vals, ct_y = xs
            nxt = fetch(shards, i - depth) if prefetching else None  # issued now, used later
            _, vjp = jax.vjp(
                lambda dc, cr, g, o: layer(with_diff(dc), cr, g, o),
                [consts[k] for k in diff],
                carry_in,
                queue[0],
                other_vals,
            )
            d_consts, d_carry, d_gathered, d_others = vjp((ct_carry, ct_y))
            d_shards = [_reduce(r, g, s) for r, g, s in zip(rows, d_gathered, shards)]
            queue = queue[1:] + ([nxt] if prefetching else queue[:1])
            return (d_carry, queue, [a + b for a, b in zip(ct_consts, d_consts)]), (d_shards, d_others)

        queue = [fetch(shards, length - 1 - i) for i in range(depth)]
        zeros = [jnp.zeros_like(consts[k]) for k in diff]
        idx = jnp.arange(length)
        part = lambda sl: (idx[sl], [x[sl] for x in inputs], [o[sl] for o in others], [y[sl] for y in ct_ys])
        state, (ds1, do1) = jax.lax.scan(
            lambda s, x: backprop(s, x, True), (ct_carry, queue, zeros), part(slice(depth, None)), reverse=True
        )
        (d_carry, _, d_consts), (ds2, do2) = jax.lax.scan(
            lambda s, x: backprop(s, x, False), state, part(slice(0, depth)), reverse=True
        )
        ct_consts = [None] * len(consts)
        for k, d in zip(diff, d_consts):
            ct_consts[k] = d
        return ct_consts, d_carry, _join(ds2, ds1), _join(do2, do1)

    run.defvjp(fwd, bwd)
    carry_out, ys = run(consts, carry, [s.arrays[0] for s in stacks], others)
    return [*carry_out, *ys]


def _join(first: list, second: list) -> list:
    return [jnp.concatenate([a, b]) for a, b in zip(first, second)]


def _gather(row, shard: jax.Array) -> jax.Array:
    """One layer's full parameter in the compute dtype, from this device's shard."""
    return row.source.values(row.layout, shard)


def _apply_ops(rows, gathered: list) -> list:
    out = []
    for r, g in zip(rows, gathered):
        for prim, params in r.ops:
            g = prim.bind(g, **params)
        out.append(g)
    return out


def _reduce(row, ct: jax.Array, shard_stack: jax.Array) -> jax.Array:
    """The gathered layer's cotangent, reduce-scattered into the layer's gradient shard (zero
    for a frozen stack: it has no gradient, and nothing is reduced)."""
    if not row.source.trains:
        return jnp.zeros(shard_stack.shape[1:], shard_stack.dtype)
    return row.source.grad(row.layout, ct, shard_stack.dtype)
