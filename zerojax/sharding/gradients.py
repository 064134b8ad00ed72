"""Per-device loss and gradients for each ZeRO stage, with every collective explicit.

The user's loss runs inside ``jax.shard_map`` on each device's slice of the batch. What
crosses devices, and when, is chosen here:

* stage 0: full gradients, all-reduced (``psum``);
* stage 1: full gradients, reduce-scattered into each device's shard after backward;
* stage 2: each parameter's gradient is reduce-scattered where backward produces it
  (per layer inside ``scan``), so the full gradient is never live at once;
* stage 3: parameters are all-gathered where they are used, in forward and again in
  backward; the transpose of that gather reduce-scatters the gradient.

Gradients cross devices in ``reduce_dtype``. With ``grad_accum_steps = k`` each device
runs k micro-batches in a ``scan``; stages 2–3 reduce-scatter every micro-batch into a
sharded fp32 accumulator, stages 0–1 accumulate the full gradient and reduce once.

Each device back-propagates its local mean loss times ``scale / k`` (DeepSpeed's
semantics: backward runs at the full loss scale, whatever N is); the reduction averages
over the N devices (:func:`zerojax.sharding.collectives.reduce_grad`), so the result is
``scale`` times the gradient of the global-batch mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.sharding import collectives, outputs, per_use
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


def cast_batch(batch: Any, dtype) -> Any:
    """Floating batch leaves in the compute dtype; others unchanged."""
    return jax.tree.map(lambda b: b.astype(dtype) if jnp.issubdtype(b.dtype, jnp.floating) else b, batch)


def aux_plan(plan: ZeroPlan, loss_fn: Callable, batch: Any, aux_reduce: Any) -> outputs.Combine:
    """How the loss's aux combines, from its shapes on one device's micro-batch."""
    cfg = plan.config
    rows = lambda b: jax.ShapeDtypeStruct((b.shape[0] // (plan.n * cfg.grad_accum_steps),) + b.shape[1:], b.dtype)
    params = jax.tree.unflatten(plan.treedef, [jax.ShapeDtypeStruct(l.shape, cfg.compute_dtype)
                                               for l in plan.layouts])
    out = jax.eval_shape(lambda p, b: loss_fn(p, cast_batch(b, cfg.compute_dtype)), params,
                         jax.tree.map(rows, batch))
    _check_loss(out, True)
    return outputs.plan(aux_reduce, out[1])


def local_grads(plan: ZeroPlan, loss_fn: Callable, has_aux: bool, batch_spec: Any,
                aux: outputs.Combine | None = None) -> Callable:
    """Returns ``f(params_in, batch, scale) -> (loss, aux, grads)`` over global arrays.

    ``params_in``: the compute-dtype leaves (stages 0–1), ``(leaves, master storage)``
    (stage 2) or the fp32 master storage (stage 3). ``grads`` are fp32, averaged over the
    devices and still multiplied by ``scale``: replicated leaf-shaped arrays for stage 0,
    sharded storage from stage 1 on. ``aux`` says how the loss's aux combines.
    """
    cfg = plan.config
    axis, n, layouts, k = plan.axis, plan.n, plan.layouts, cfg.grad_accum_steps
    compute, reduce = jnp.dtype(cfg.compute_dtype), jnp.dtype(cfg.reduce_dtype)
    storage_specs = [l.partition_spec(axis) for l in layouts]
    full_specs = [P()] * len(layouts)
    unflat = lambda leaves: jax.tree.unflatten(plan.treedef, leaves)

    ctx = per_use.Context(scan_remat=cfg.remat)
    aux_spec = aux.specs(axis) if has_aux else P()

    def reduce_metrics(loss, aux_value):
        """Mean loss over the data axis (``loss`` is this device's mean); aux by its rules."""
        return jax.lax.pmean(loss, axis), (aux.over_devices(aux_value, axis) if has_aux else None)

    def accumulate(fn, batch):
        return _accumulate(fn, batch, k, aux if has_aux else None)

    def user_loss(leaves, batch):
        out = loss_fn(unflat(leaves), cast_batch(batch, compute))
        _check_loss(out, has_aux)
        loss, aux = (out[0], out[1]) if has_aux else (out, None)
        return loss.astype(jnp.float32), aux

    # The loss re-evaluated from its jaxpr: params may be pending, and every layer loop
    # becomes a remat region when a policy is configured.
    traced_loss = per_use.traced(user_loss, [jax.ShapeDtypeStruct(l.shape, compute) for l in layouts], ctx)

    direct_loss = traced_loss if cfg.remat.active else user_loss

    if plan.stage in (0, 1):
        def loss_and_grad(leaves, batch, scale):
            def f(leaves):
                loss, aux = direct_loss(leaves, batch)
                return loss * scale / k, (loss, aux)

            (_, (loss, aux)), g = jax.value_and_grad(f, has_aux=True)(leaves)
            return loss, aux, [x.astype(jnp.float32) for x in g]

        def reduce_all(grads):
            if plan.stage == 0:
                return [collectives.reduce_grad(g, axis, n, reduce) for g in grads]
            grads = per_use.after_all(grads)  # ZeRO-1: the whole gradient exists first
            return [collectives.reduce_grad(g, axis, n, reduce, l) for l, g in zip(layouts, grads)]

        def body(leaves, batch, scale):
            loss, aux, grads = accumulate(lambda b: loss_and_grad(leaves, b, scale), batch)
            return (*reduce_metrics(loss, aux), reduce_all(grads))

        grad_specs = full_specs if plan.stage == 0 else storage_specs
        return jax.shard_map(body, mesh=plan.mesh, in_specs=(full_specs, batch_spec, P()),
                             out_specs=(P(), aux_spec, grad_specs), check_vma=False)

    def per_use_loss(source, arrays, batch):
        pending = [per_use.Pending(arrays=a, layout=l, source=source, name=name)
                   for a, l, name in zip(arrays, layouts, plan.paths)]
        return traced_loss(pending, batch)

    def shard_grads(source, make_arrays, sinks, batch, scale):
        def f(sinks):
            loss, aux = per_use_loss(source, make_arrays(sinks), batch)
            return loss * scale / k, (loss, aux)

        (_, (loss, aux)), g = jax.value_and_grad(f, has_aux=True)(sinks)
        return loss, aux, [x.astype(jnp.float32) for x in g]

    if plan.stage == 2:
        source = per_use.Scattered(axis, n, cfg.reduce_dtype)

        def body(leaves, sinks, batch, scale):
            make = lambda sinks: [(x, s) for x, s in zip(leaves, sinks)]
            loss, aux, grads = accumulate(lambda b: shard_grads(source, make, sinks, b, scale), batch)
            return (*reduce_metrics(loss, aux), grads)

        return jax.shard_map(body, mesh=plan.mesh, in_specs=(full_specs, storage_specs, batch_spec, P()),
                             out_specs=(P(), aux_spec, storage_specs), check_vma=False)

    source = per_use.Gathered(axis, n, cfg.compute_dtype, cfg.reduce_dtype)

    def body(shards, batch, scale):
        make = lambda shards: [(s,) for s in shards]
        loss, aux, grads = accumulate(lambda b: shard_grads(source, make, shards, b, scale), batch)
        return (*reduce_metrics(loss, aux), grads)

    return jax.shard_map(body, mesh=plan.mesh, in_specs=(storage_specs, batch_spec, P()),
                         out_specs=(P(), aux_spec, storage_specs), check_vma=False)


def _accumulate(fn: Callable, batch: Any, k: int, aux: outputs.Combine | None):
    """Runs ``fn`` on k micro-batches of ``batch``, sums the gradients (fp32), averages the
    loss and combines the aux by its rules."""
    if k == 1:
        return fn(batch)
    micro = jax.tree.map(lambda b: b.reshape((k, b.shape[0] // k) + b.shape[1:]), batch)
    first = jax.tree.map(lambda b: b[0], micro)
    loss_s, aux_s, grads_s = jax.eval_shape(fn, first)
    zeros = [jnp.zeros(g.shape, g.dtype) for g in grads_s]

    def step(acc, mb):
        loss, aux, grads = fn(mb)
        return [a + g for a, g in zip(acc, grads)], (loss, aux)

    grads, (losses, auxes) = jax.lax.scan(step, zeros, micro)
    return jnp.mean(losses), (aux.over_micro_batches(auxes) if aux is not None else None), grads
