"""Models that carry their own sharding: constraints written against the model's mesh.

MaxText, Levanter-style code and hand-written GSPMD models constrain their activations (and
sometimes their weights) with ``jax.lax.with_sharding_constraint(x, NamedSharding(mesh,
P(...)))`` against a mesh of their own (MaxText's ``data``, ``fsdp``, ``fsdp_transpose``,
``tensor``, ...). Inside the train step's ``shard_map`` (manual over zerojax's data axes)
such a constraint cannot run: its mesh is not the step's, and it names axes that are manual
there. With ``ZeroConfig(axes={"model_axes": {"fsdp": "data", "data": "data", "tensor": "tensor"}})``
zerojax instead

1. traces the loss once *outside* the ``shard_map``, on one device's micro-batch, with the
   data axes bound by name (so a ``psum`` over ``"data"`` in the model still traces), where
   the model's constraints are legal; then
2. inside the ``shard_map`` re-traces that program (:class:`Translator`), every constraint
   translated through ``axes.model_axes`` onto zerojax's mesh: an axis mapped to a data axis (or to
   None) is dropped, since each device already holds its rows of the batch and ZeRO places
   the parameters; an axis mapped to the tensor axis is kept, as a constraint on the step's
   own mesh, so activation constraints over "tensor" still steer XLA's partitioner. A
   constraint left with no axis is removed. Shardings the model's mesh left in other
   equations' parameters (a ``broadcast_in_dim`` of zeros, a ``dot_general``'s output) are
   cleared; every equation is bound under the step's mesh, not the one it was traced under
   (JAX records that with each equation and binds it again under it: no mesh outside the
   step, or the model's where JAX entered a value's mesh itself, as vmap does to broadcast an
   unbatched operand); and every sub-program (a ``scan`` body, a ``checkpoint``, a custom
   derivative's primal and rule) is re-traced the same way, so no value of the step carries
   the model's mesh.

A constraint naming an axis neither ``axes.model_axes`` nor zerojax's mesh knows raises a
``ValueError`` naming the equation's source line and the mapping to add. Everything this
module reads of JAX's program form goes through :mod:`zerojax._jaxpr`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._jaxpr import check, constructs, lines, settings
from zerojax._jaxpr.form import Equation
from zerojax._jaxpr.retrace import Retracer
from zerojax.sharding.plan import ZeroPlan


def trace(fn: Callable, args: Sequence[Any], plan: ZeroPlan) -> tuple[Any, Any]:
    """``(program, output shapes)`` of ``fn(*args)`` traced outside the step's ``shard_map``,
    with its manual axes bound by name (``args``: one device's shapes). Refused where
    zerojax reads no program (the translation reads it)."""
    check.require(
        f"ZeroConfig(axes={{'model_axes': {dict(plan.config.axes.model_axes)!r}}}) (a model with its own mesh)",
        "Remove the model's own sharding constraints (with_sharding_constraint, logical axis constraints) and the "
        "model_axes setting.",
    )
    axis_env = [(a, int(plan.mesh.shape[a])) for a in plan.mesh.axis_names if a in plan.manual_axes]
    return jax.make_jaxpr(fn, axis_env=axis_env, return_shape=True)(*args)


class Translator(Retracer):
    """Re-traces a program made by :func:`trace` inside the step's ``shard_map`` (see the
    module docstring)."""

    def __init__(self, plan: ZeroPlan):
        cfg = plan.config
        self.axis_map = dict(cfg.axes.model_axes or ())
        self.manual = plan.manual_axes
        self.tensor = cfg.axes.tensor if cfg.axes.tensor in plan.mesh.axis_names else None
        self.known = set(plan.mesh.axis_names) | {cfg.axes.tensor}
        self.mesh_axes = tuple(plan.mesh.axis_names)

    def replace(self, eqn: Equation, invals: list[Any]) -> list[Any] | None:
        if constructs.is_constraint(eqn):
            return [self._constrain(eqn, invals[0])]
        if constructs.is_call(eqn):  # inlined: no call keeps the model's mesh
            return self.run(*constructs.call_body(eqn), invals)
        return None

    def param(self, name: str, value: Any) -> Any:
        if isinstance(value, NamedSharding) and value.mesh.abstract_mesh != jax.sharding.get_abstract_mesh():
            return None  # an output sharding inferred from the model's mesh: the step's context decides
        return value

    def mesh(self, traced: Any) -> Any:
        # Outside the step an equation was traced under no mesh, or under the model's, which
        # JAX enters from a value's sharding (vmap broadcasting an unbatched operand, as
        # jax.nn.dot_product_attention's masks): bound so again, a broadcast or iota whose
        # sharding param was cleared would take the model's mesh from it. Here it is bound
        # under the step's, as if traced inside it. A shard_map body keeps its own.
        if settings.manual_axes(traced):
            return traced
        return jax.sharding.get_abstract_mesh()

    # Constraints.
    def _constrain(self, eqn: Equation, x: jax.Array) -> jax.Array:
        axes, spec = constructs.constraint_spec(eqn)
        kept = [self._entry(e, eqn, axes) for e in spec]
        if all(k is None for k in kept):
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), P(*kept)))

    def _entry(self, entry: Any, eqn: Equation, model_axes: tuple[str, ...]) -> Any:
        names = () if entry is None or entry is P.UNCONSTRAINED else (entry,) if isinstance(entry, str) else entry
        kept = []
        for name in names:
            target = (
                self.axis_map[name]
                if name in self.axis_map
                else name
                if name in self.known
                else _unknown(name, eqn, model_axes, self.mesh_axes, self.tensor)
            )
            if target is not None and target not in self.manual and target in (self.tensor,):
                kept.append(target)
        return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def _unknown(
    name: str, eqn: Equation, model_axes: tuple[str, ...], mesh_axes: tuple[str, ...], tensor: str | None
) -> None:
    raise ValueError(
        f"the model constrains a value to mesh axis {name!r} (its mesh has axes {model_axes}) at "
        f"{lines.where(eqn)}, and neither ZeroConfig.axes.model_axes nor zerojax's mesh {mesh_axes} knows that "
        f"axis. Map it: axes={{'model_axes': {{{name!r}: 'data'}}}} for a batch or FSDP axis, "
        f"{{{name!r}: {tensor or 'tensor'!r}}} for a tensor-parallel one, or {{{name!r}: None}} to drop it."
    )
