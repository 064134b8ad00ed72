"""Re-tracing a traced program equation by equation, with some equations replaced.

Two passes of zerojax evaluate a loss from its jaxpr rather than calling it: the translation
of a model's own sharding constraints onto zerojax's mesh (:mod:`zerojax.sharding.foreign`)
and the rewrite of gathers XLA's partitioner cannot split over a data x context x tensor
mesh (:mod:`zerojax.sharding.gathers`). Both are :class:`Retracer` passes on
:mod:`zerojax._jaxpr.walk`: every equation is bound again, in the trace they run in, and
every sub-program (a ``scan`` body, a ``checkpoint``, a custom derivative's primal and
rule) is re-traced by the same walk. A subclass says what it does differently with
:meth:`Retracer.replace` (an equation replaced), :meth:`Retracer.param` (a parameter
replaced) and :meth:`Retracer.mesh` (the abstract mesh an equation is bound under, by
default the one it was traced under). Everything read of JAX's program form goes through
:mod:`zerojax._jaxpr`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from zerojax._jaxpr import form, walk
from zerojax._jaxpr.form import Equation, Jaxpr


class Retracer(walk.Evaluate):
    """Re-traces programs equation by equation (see the module docstring)."""

    def program(self, closed: Any) -> Any:
        """``closed`` re-traced here, in the current trace's context."""
        jaxpr, consts = form.open_jaxpr(closed)
        return self._retrace(jaxpr, consts)

    def evaluate(self, closed: Any, args: Sequence[Any]) -> list[Any]:
        """The outputs of ``closed`` on ``args`` (flat), its equations evaluated here."""
        return self.run_closed(closed, args)

    # What a subclass changes (and ``replace``, from the walk).
    def param(self, name: str, value: Any) -> Any:
        """An equation parameter as this pass binds it (sub-programs aside)."""
        return value

    def mesh(self, traced: Any) -> Any:
        """The abstract mesh an equation is bound under, given the one it was traced under
        (JAX binds it again under that one unless a pass says otherwise)."""
        return traced

    # The walk's binding: parameters rewritten, sub-programs re-traced.
    def bind(self, eqn: Equation, ins: list[Any]) -> list[Any]:
        return form.rebind(eqn, ins, program=self._sub, rule=self._rule, param=self.param, mesh=self.mesh)

    def _retrace(self, jaxpr: Jaxpr, consts: Sequence[Any]) -> Any:
        avals = [form.shape_struct(v) for v in jaxpr.invars]
        return jax.make_jaxpr(lambda *args: self.run(jaxpr, consts, args))(*avals)

    def _sub(self, program: Any) -> Any:
        return form.like(program, self._retrace(*form.open_jaxpr(program)))

    def _rule(self, jaxpr: Jaxpr, consts: Sequence[Any]) -> tuple[Any, tuple]:
        return form.open_jaxpr(self._retrace(jaxpr, consts))
