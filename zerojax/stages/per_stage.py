"""What differs between the ZeRO stages, in one place: one object per stage.

A state's fields mean the same thing at every stage (see :class:`zerojax.ZeroState`):
``params`` are the full parameters forward reads, replicated (stages 0–2), and ``master``
the fp32 master weights in sharded storage where they are kept apart from ``params``.
Each stage says:

* :meth:`Stage.fields`: the ``(params, master)`` fields that hold a set of fp32 masters
  (given in the stage's storage layouts, ``plan.master_layouts``);
* :meth:`Stage.masters`: the fp32 masters of a state, in those layouts (what the optimizer
  updates and checkpoints save);
* :meth:`Stage.grads`: the loss, aux, new model state and the gradient in the same
  layouts (frozen parameters, stored in ``state.frozen`` by ``plan.frozen_layouts``, are
  read but get no gradient);
* :meth:`Stage.field_shardings`: where ``params`` and ``master`` live;
* :meth:`Stage.forward`: what a forward-only pass (the eval step) reads, and how.

Initialisation, the optimizer step, evaluation and checkpoint restore are the same for
every stage: they go through these five. A new variant is a new class here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.sharding.param_sources import ParamSource
from zerojax.sharding.plan import ZeroPlan
from zerojax.stages.gradients import Loss, per_use_grads, replicated_grads

Leaves = list[jax.Array]


@dataclasses.dataclass(frozen=True)
class Forward:
    """What a forward pass reads: the state's ``field`` (``"params"`` or ``"master"``),
    with these per-device specs; trainable and frozen leaves are used pending from
    ``source`` / ``frozen_source``, or as they are (cast to the compute dtype) when None."""

    field: str
    specs: list
    source: ParamSource | None = None
    frozen_source: ParamSource | None = None


class Stage:
    """Base: the stage's four operations (see the module docstring)."""

    number: int

    def fields(self, plan: ZeroPlan, masters: Leaves) -> tuple[Leaves | None, Leaves | None]:
        raise NotImplementedError

    def field_shardings(self, plan: ZeroPlan) -> tuple[list[NamedSharding] | None, list[NamedSharding] | None]:
        raise NotImplementedError

    def masters(self, plan: ZeroPlan, params: Leaves | None, master: Leaves | None) -> Leaves:
        raise NotImplementedError

    def grads(
        self,
        loss: Loss,
        params: Leaves | None,
        masters: Leaves,
        frozen: Leaves,
        batch: Any,
        scale: jax.Array,
        rng: Any,
        model_state: Any,
    ):
        """``(loss, aux, model_state, grads)``: see :mod:`zerojax.stages.gradients`."""
        raise NotImplementedError

    def forward(self, plan: ZeroPlan) -> Forward:
        """Stages 0–2: the replicated ``params``, used as they are."""
        return Forward("params", [P()] * len(plan.master_layouts))


class Stage0(Stage):
    """Plain data parallelism: replicated fp32 params are the masters; gradients all-reduced."""

    number = 0

    def fields(self, plan, masters):
        return masters, None

    def field_shardings(self, plan):
        return plan.whole(plan.master_layouts), None

    def masters(self, plan, params, master):
        return params

    def grads(self, loss, params, masters, frozen, batch, scale, rng, model_state):
        compute = loss.plan.config.compute_dtype
        cast = lambda xs: [x.astype(compute) for x in xs]
        return replicated_grads(loss, scatter=False)(cast(params), cast(frozen), batch, scale, rng, model_state)


class _ReplicatedCopy(Stage):
    """Stages 1–2: forward reads a replicated copy in the compute dtype; the fp32 masters
    are sharded (kept in ``master`` with bf16/fp16 compute; with fp32 compute the copy *is*
    the masters and each device slices out the shard it owns, with no traffic)."""

    def fields(self, plan, masters):
        compute = jnp.dtype(plan.config.compute_dtype)
        on_device = masters
        if plan.master_memory is not None:  # offloaded masters: gather from a device copy (a no-op on the device)
            on_device = [jax.device_put(x, s) for x, s in zip(masters, plan.shardings(plan.master_layouts))]
        params = _all_gather(plan, on_device, compute if plan.config.mixed else None)
        return params, (masters if plan.config.mixed else None)

    def field_shardings(self, plan):
        master = plan.master_shardings() if plan.config.mixed else None
        return plan.whole(plan.master_layouts), master

    def masters(self, plan, params, master):
        if plan.config.mixed:
            return master
        return [
            jax.lax.with_sharding_constraint(l.to_storage(x), s)
            for l, x, s in zip(plan.master_layouts, params, plan.shardings(plan.master_layouts))
        ]


class Stage1(_ReplicatedCopy):
    """ZeRO-1: the whole gradient, reduce-scattered after backward."""

    number = 1

    def grads(self, loss, params, masters, frozen, batch, scale, rng, model_state):
        compute = loss.plan.config.compute_dtype
        frozen = [x.astype(compute) for x in frozen]
        return replicated_grads(loss, scatter=True)(params, frozen, batch, scale, rng, model_state)


class Stage2(_ReplicatedCopy):
    """ZeRO-2: each parameter's gradient reduce-scattered where backward produces it."""

    number = 2

    def grads(self, loss, params, masters, frozen, batch, scale, rng, model_state):
        cfg = loss.plan.config
        source = ParamSource.scattered(
            cfg.axes.data, loss.plan.world, cfg.collectives.reduce_dtype, loss.plan.replica, cfg.reduce_block
        )
        return per_use_grads(loss, source)(
            params, _device_sinks(loss.plan, masters), frozen, batch, scale, rng, model_state
        )


class Stage3(Stage):
    """ZeRO-3: only the sharded masters exist; each use gathers its parameter."""

    number = 3

    def fields(self, plan, masters):
        return None, masters

    def field_shardings(self, plan):
        return None, plan.master_shardings()

    def masters(self, plan, params, master):
        return master

    def forward(self, plan):
        """The master shards, each gathered where it is used (from host memory too)."""
        return Forward(
            "master",
            [l.partition_spec(plan.axis) for l in plan.master_layouts],
            _gathered(plan),
            ParamSource.frozen(plan.axis, plan.config.compute_dtype),
        )

    def grads(self, loss, params, masters, frozen, batch, scale, rng, model_state):
        plan = loss.plan
        frozen_source = ParamSource.frozen(plan.axis, plan.config.compute_dtype)
        if plan.master_memory is None:
            return per_use_grads(loss, _gathered(plan), frozen_source)(
                [], masters, frozen, batch, scale, rng, model_state
            )
        # Parameters in host memory: each use moves its shard to the device and gathers it
        # there; the gradient is reduce-scattered into a device-resident shard.
        return per_use_grads(loss, _gathered(plan, host=True), frozen_source)(
            masters, _device_sinks(plan, masters), frozen, batch, scale, rng, model_state
        )


def _gathered(plan: ZeroPlan, host: bool = False) -> ParamSource:
    cfg = plan.config
    return ParamSource.gathered(
        cfg.axes.data,
        plan.world,
        cfg.compute_dtype,
        cfg.collectives.reduce_dtype,
        cfg.quant_block,
        plan.replica,
        host=host,
        reduce_block=cfg.reduce_block,
    )


STAGES: dict[int, Stage] = {s.number: s for s in (Stage0(), Stage1(), Stage2(), Stage3())}


def stage_of(plan: ZeroPlan) -> Stage:
    return STAGES[plan.stage]


def _device_sinks(plan: ZeroPlan, masters: Leaves) -> Leaves:
    """What gradients are reduce-scattered into: the masters themselves, or, where they are
    in host memory, device-resident zeros of their shape (gradients are made on the device)."""
    if plan.master_memory is None:
        return masters
    return [
        jax.device_put(jnp.zeros(x.shape, x.dtype), s) if plan.master_memory_of(i) is not None else x
        for i, (x, s) in enumerate(zip(masters, plan.shardings(plan.master_layouts)))
    ]


def _all_gather(plan: ZeroPlan, storage: Leaves, dtype) -> Leaves:
    """Sharded storage -> full, replicated leaves, cast to ``dtype`` (if given) before the
    gather so that a bf16/fp16 copy moves half the bytes."""
    layouts = plan.master_layouts
    cast = (lambda s: s.astype(dtype)) if dtype is not None else (lambda s: s)
    return jax.shard_map(
        lambda shards: [l.gather(cast(s), plan.axis) for l, s in zip(layouts, shards)],
        mesh=plan.mesh,
        in_specs=([l.partition_spec(plan.axis) for l in layouts],),
        out_specs=[P()] * len(layouts),
        axis_names=plan.manual_axes,
        check_vma=False,
    )(storage)
