"""Re-tracing a traced program equation by equation, with some equations replaced.

Two passes of zerojax evaluate a loss from its jaxpr rather than calling it: the translation
of a model's own sharding constraints onto zerojax's mesh (:mod:`zerojax.sharding.foreign`)
and the rewrite of gathers XLA's partitioner cannot split over a data x context x tensor
mesh (:mod:`zerojax.sharding.gathers`). Both walk the program the same way: every equation
is bound again, in the trace they run in, and every sub-program (a ``scan`` body, a
``checkpoint``, a custom derivative's primal and rule) is re-traced by the same walk. A
subclass says what it does differently with :meth:`Retracer.equation` (an equation
replaced) and :meth:`Retracer.param` (a parameter replaced). Everything read of JAX's
program form goes through :mod:`zerojax.sharding.jax_compat`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from zerojax.sharding import jax_compat


class Retracer:
    """Re-traces programs equation by equation (see the module docstring)."""

    def program(self, closed: Any) -> Any:
        """``closed`` re-traced here, in the current trace's context."""
        jaxpr, consts = jax_compat.open_jaxpr(closed)
        return self._retrace(jaxpr, consts)

    def evaluate(self, closed: Any, args: Sequence[Any]) -> list[Any]:
        """The outputs of ``closed`` on ``args`` (flat), its equations evaluated here."""
        return self._eval(*jax_compat.open_jaxpr(closed), args)

    # What a subclass changes.
    def equation(self, eqn: jcore.JaxprEqn, invals: list[Any]) -> list[Any] | None:
        """The outputs of ``eqn`` where this pass replaces it; None: bound as it is (its
        sub-programs re-traced)."""
        return None

    def param(self, name: str, value: Any) -> Any:
        """An equation parameter as this pass binds it (sub-programs aside)."""
        return value

    # The walk.
    def _retrace(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any]) -> Any:
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
                 for v in jaxpr.invars]
        return jax.make_jaxpr(lambda *args: self._eval(jaxpr, consts, args))(*avals)

    def _sub(self, program: Any) -> Any:
        return jax_compat.like(program, self._retrace(*jax_compat.open_jaxpr(program)))

    def _rule(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any]) -> tuple[Any, tuple]:
        return jax_compat.open_jaxpr(self._retrace(jaxpr, consts))

    def _eval(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            outs = self.equation(eqn, invals)
            if outs is None:
                outs = jax_compat.bind(eqn.replace(params=self._params(eqn)), invals)
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _params(self, eqn: jcore.JaxprEqn) -> dict:
        out = {}
        for k, v in eqn.params.items():
            v = self.param(k, v)
            if k in jax_compat.RULE_THUNKS:
                v = jax_compat.wrap_rule(v, self._rule)
            elif jax_compat.is_program(v):
                v = self._sub(v)
            elif isinstance(v, (tuple, list)) and v and all(jax_compat.is_program(x) for x in v):
                v = type(v)(self._sub(x) for x in v)
            out[k] = v
        return out
