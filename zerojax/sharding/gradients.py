"""Per-device loss and gradients for each ZeRO stage, with every collective explicit.

The user's loss runs inside ``jax.shard_map`` on each device's slice of the batch. What
crosses devices, and when, is chosen here:

* stage 0: full gradients, all-reduced (``psum``);
* stage 1: full gradients, reduce-scattered into each device's shard after backward;
* stage 2: each parameter's gradient is reduce-scattered where backward produces it
  (per layer inside ``scan``), so the full gradient is never live at once;
* stage 3: parameters are all-gathered where they are used, in forward and again in
  backward; the transpose of that gather reduce-scatters the gradient.

Each device's loss is its local mean divided by the device count, so the reduced
gradient is the gradient of the global-batch mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.sharding import per_use
from zerojax.sharding.plan import ZeroPlan


def _check_loss(out: Any, has_aux: bool) -> None:
    loss = out[0] if has_aux else out
    if has_aux and not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(
            f"loss_fn was declared has_aux=True but returned {type(out).__name__}; "
            "return (loss, aux)."
        )
    shape = getattr(loss, "shape", None)
    if shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        hint = " If it returns (loss, aux), pass has_aux=True." if isinstance(loss, tuple) else ""
        raise ValueError(
            f"loss_fn must return a floating scalar, got {type(loss).__name__} with shape "
            f"{shape} and dtype {getattr(loss, 'dtype', None)}. Reduce it (e.g. jnp.mean)."
            + hint
        )


def _split(out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
    return (out[0], out[1]) if has_aux else (out, None)


def local_grads(
    plan: ZeroPlan, loss_fn: Callable, has_aux: bool, batch_spec: Any
) -> Callable[..., tuple[jax.Array, Any, list[jax.Array]]]:
    """Returns ``f(params_in, batch) -> (loss, aux, grads)`` over global arrays.

    ``params_in`` is the list of parameter leaves (stages 0–1), of ``(leaves, storage)``
    (stage 2) or of storage arrays (stage 3). ``grads`` are replicated leaf-shaped arrays
    for stage 0 and sharded storage-shaped arrays from stage 1 on.
    """
    axis, n, layouts = plan.axis, plan.n, plan.layouts
    storage_specs = [l.partition_spec(axis) for l in layouts]
    full_specs = [P()] * len(layouts)
    unflat = lambda leaves: jax.tree.unflatten(plan.treedef, leaves)

    def reduce_metrics(loss, aux):
        loss = jax.lax.psum(loss, axis)  # loss was already divided by n
        aux = jax.tree.map(lambda a: jax.lax.pmean(a, axis), aux)
        return loss, aux

    def user_loss(leaves, batch):
        out = loss_fn(unflat(leaves), batch)
        _check_loss(out, has_aux)
        loss, aux = _split(out, has_aux)
        return loss / n, aux

    if plan.stage in (0, 1):

        def body(leaves, batch):
            (loss, aux), grads = jax.value_and_grad(user_loss, has_aux=True)(leaves, batch)
            if plan.stage == 0:
                grads = [jax.lax.psum(g, axis) for g in grads]
            else:  # ZeRO-1: the whole gradient exists before any of it is reduced
                grads = per_use.after_all(grads)
                grads = [l.scatter(g, axis) for l, g in zip(layouts, grads)]
            return (*reduce_metrics(loss, aux), grads)

        grad_specs = full_specs if plan.stage == 0 else storage_specs
        return jax.shard_map(
            body, mesh=plan.mesh, in_specs=(full_specs, batch_spec),
            out_specs=(P(), P(), grad_specs), check_vma=False,
        )

    def per_use_loss(sources, arrays, batch):
        leaves_sds = [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in layouts]
        batch_sds = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype), batch)
        closed, out_shape = jax.make_jaxpr(user_loss, return_shape=True)(leaves_sds, batch_sds)
        pending = [per_use.Pending(arrays=a, layout=l, source=sources)
                   for a, l in zip(arrays, layouts)]
        outs = per_use.call_per_use(closed, pending, jax.tree.leaves(batch))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    if plan.stage == 2:
        source = per_use.Scattered(axis)

        def body(leaves, sinks, batch):
            def f(sinks):
                return per_use_loss(source, [(x, s) for x, s in zip(leaves, sinks)], batch)

            (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(sinks)
            return (*reduce_metrics(loss, aux), grads)

        return jax.shard_map(
            body, mesh=plan.mesh, in_specs=(full_specs, storage_specs, batch_spec),
            out_specs=(P(), P(), storage_specs), check_vma=False,
        )

    source = per_use.Gathered(axis)

    def body(shards, batch):
        def f(shards):
            return per_use_loss(source, [(s,) for s in shards], batch)

        (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(shards)
        return (*reduce_metrics(loss, aux), grads)

    return jax.shard_map(
        body, mesh=plan.mesh, in_specs=(storage_specs, batch_spec),
        out_specs=(P(), P(), storage_specs), check_vma=False,
    )
