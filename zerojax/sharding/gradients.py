"""Per-device loss and gradients, with every collective explicit.

The user's loss runs inside ``jax.shard_map`` on each device's slice of the batch. Two
programs compute gradients; each ZeRO stage (:mod:`zerojax.sharding.stages`) uses one:

* :func:`replicated_grads`: the full parameters are resident; backward produces full
  gradients, which are then reduced: all-reduced (stage 0) or, once the whole gradient
  exists, reduce-scattered into each device's shard (stage 1);
* :func:`per_use_grads`: the loss is re-evaluated from its jaxpr with each parameter
  *pending* (:mod:`zerojax.sharding.per_use`) and a source saying what a use does: stage 2
  reduce-scatters each gradient where backward produces it (per layer inside ``scan``),
  stage 3 all-gathers each parameter where it is used, in forward and again in backward.

Gradients cross devices in ``reduce_dtype``. With ``grad_accum_steps = k`` each device
runs k micro-batches in a ``scan``; per-use gradients reduce-scatter every micro-batch into
a sharded fp32 accumulator, replicated ones accumulate the full gradient and reduce once.

Each device back-propagates its local mean loss times ``scale / k`` (DeepSpeed's
semantics: backward runs at the full loss scale, whatever N is); the reduction averages
over the N devices (:func:`zerojax.sharding.collectives.reduce_grad`), so the result is
``scale`` times the gradient of the global-batch mean.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Loss:
    """The user's loss as the gradient programs call it: on parameter leaves in the compute
    dtype and one device's micro-batch, returning ``(fp32 loss, aux)``."""

    plan: ZeroPlan
    fn: Callable
    has_aux: bool
    aux: outputs.Combine | None  # how aux combines (has_aux only)

    @classmethod
    def build(cls, plan: ZeroPlan, fn: Callable, has_aux: bool, batch: Any, aux_reduce: Any) -> Loss:
        loss = cls(plan, fn, has_aux, None)
        if not has_aux:
            return loss
        cfg = plan.config
        rows = lambda b: jax.ShapeDtypeStruct((b.shape[0] // (plan.n * cfg.grad_accum_steps),) + b.shape[1:],
                                              b.dtype)
        out = jax.eval_shape(lambda p, b: fn(plan.unflatten(p), cast_batch(b, cfg.compute_dtype)),
                             loss.param_shapes, jax.tree.map(rows, batch))
        _check_loss(out, True)
        return dataclasses.replace(loss, aux=outputs.plan(aux_reduce, out[1]))

    @property
    def param_shapes(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(l.shape, self.plan.config.compute_dtype) for l in self.plan.layouts]

    def __call__(self, leaves: list, batch: Any) -> tuple[jax.Array, Any]:
        out = self.fn(self.plan.unflatten(leaves), cast_batch(batch, self.plan.config.compute_dtype))
        _check_loss(out, self.has_aux)
        loss, aux = (out[0], out[1]) if self.has_aux else (out, None)
        return loss.astype(jnp.float32), aux

    def traced(self) -> Callable:
        """The loss re-evaluated from its jaxpr: parameters may be pending, and every layer
        loop becomes a remat region when a policy is configured."""
        return per_use.traced(self, self.param_shapes, per_use.Context(scan_remat=self.plan.config.remat))

    # Across devices and micro-batches.
    def aux_spec(self, axis: str) -> Any:
        return self.aux.specs(axis) if self.has_aux else P()

    def reduce_metrics(self, loss: jax.Array, aux: Any) -> tuple[jax.Array, Any]:
        """Mean loss over the data axis (``loss`` is this device's mean); aux by its rules."""
        axis = self.plan.axis
        return jax.lax.pmean(loss, axis), (self.aux.over_devices(aux, axis) if self.has_aux else None)

    def accumulate(self, fn: Callable, batch: Any):
        """Runs ``fn`` on k micro-batches of ``batch``, sums the gradients (fp32), averages
        the loss and combines the aux by its rules."""
        k = self.plan.config.grad_accum_steps
        if k == 1:
            return fn(batch)
        micro = jax.tree.map(lambda b: b.reshape((k, b.shape[0] // k) + b.shape[1:]), batch)
        _, _, grads_s = jax.eval_shape(fn, jax.tree.map(lambda b: b[0], micro))

        def step(acc, mb):
            loss, aux, grads = fn(mb)
            return [a + g for a, g in zip(acc, grads)], (loss, aux)

        zeros = [jnp.zeros(g.shape, g.dtype) for g in grads_s]
        grads, (losses, auxes) = jax.lax.scan(step, zeros, micro)
        return jnp.mean(losses), (self.aux.over_micro_batches(auxes) if self.has_aux else None), grads


def replicated_grads(loss: Loss, *, scatter: bool) -> Callable:
    """``f(leaves, batch, scale) -> (loss, aux, grads)`` for resident, replicated parameter
    leaves in the compute dtype. ``grads`` are fp32, averaged over the devices, times
    ``scale``: full and replicated (``scatter=False``: all-reduce), or each device's shard of
    the masters' storage (``scatter=True``: reduce-scatter once the whole gradient exists)."""
    plan = loss.plan
    axis, n, k = plan.axis, plan.n, plan.config.grad_accum_steps
    reduce = plan.config.reduce_dtype
    direct = loss.traced() if plan.config.remat.active else loss

    def loss_and_grad(leaves, batch, scale):
        def f(leaves):
            value, aux = direct(leaves, batch)
            return value * scale / k, (value, aux)

        (_, (value, aux)), g = jax.value_and_grad(f, has_aux=True)(leaves)
        return value, aux, [x.astype(jnp.float32) for x in g]

    def reduce_all(grads):
        if not scatter:
            return [collectives.reduce_grad(g, axis, n, reduce) for g in grads]
        grads = per_use.after_all(grads)  # ZeRO-1: the whole gradient exists first
        return [collectives.reduce_grad(g, axis, n, reduce, l) for l, g in zip(plan.master_layouts, grads)]

    def body(leaves, batch, scale):
        value, aux, grads = loss.accumulate(lambda b: loss_and_grad(leaves, b, scale), batch)
        return (*loss.reduce_metrics(value, aux), reduce_all(grads))

    full = [P()] * len(plan.layouts)
    grad_specs = [l.partition_spec(axis) for l in plan.master_layouts] if scatter else full

    def run(leaves, batch, scale):
        batch_spec = jax.tree.map(lambda _: P(axis), batch)
        return jax.shard_map(body, mesh=plan.mesh, in_specs=(full, batch_spec, P()),
                             out_specs=(P(), loss.aux_spec(axis), grad_specs), check_vma=False)(leaves, batch, scale)

    return run


def per_use_grads(loss: Loss, source: per_use.Gathered | per_use.Scattered) -> Callable:
    """``f(resident, sinks, batch, scale) -> (loss, aux, grads)``: the loss evaluated with
    every parameter pending, made of ``(*resident[i], sinks[i])`` as ``source`` needs
    (stage 3: ``resident=[]``, the sinks are the master shards; stage 2: ``resident`` are
    the full compute-dtype leaves). ``grads`` come out shaped like the
    sinks: each device's shard of the masters' storage, fp32, averaged, times ``scale``."""
    plan = loss.plan
    axis, k = plan.axis, plan.config.grad_accum_steps
    traced = loss.traced()
    layouts = plan.master_layouts

    def shard_grads(resident, sinks, batch, scale):
        def f(sinks):
            arrays = [(r, s) for r, s in zip(resident, sinks)] if resident else [(s,) for s in sinks]
            pending = [per_use.Pending(arrays=a, layout=l, source=source, name=name)
                       for a, l, name in zip(arrays, layouts, plan.paths)]
            value, aux = traced(pending, batch)
            return value * scale / k, (value, aux)

        (_, (value, aux)), g = jax.value_and_grad(f, has_aux=True)(sinks)
        return value, aux, [x.astype(jnp.float32) for x in g]

    def body(resident, sinks, batch, scale):
        value, aux, grads = loss.accumulate(lambda b: shard_grads(resident, sinks, b, scale), batch)
        return (*loss.reduce_metrics(value, aux), grads)

    storage = [l.partition_spec(axis) for l in layouts]

    def run(resident, sinks, batch, scale):
        batch_spec = jax.tree.map(lambda _: P(axis), batch)
        resident_spec = [P()] * len(resident)
        return jax.shard_map(body, mesh=plan.mesh, in_specs=(resident_spec, storage, batch_spec, P()),
                             out_specs=(P(), loss.aux_spec(axis), storage), check_vma=False)(
            resident, sinks, batch, scale)

    return run
