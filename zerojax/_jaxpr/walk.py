"""One walk over JAX programs (jaxprs), for every zerojax pass that reads or re-evaluates one.

zerojax traces a user's loss (or an optimizer's update) to a jaxpr and then walks it:

============================================  ==========  ==========================================
pass                                          kind        what it does at an equation
============================================  ==========  ==========================================
per-use gathering (``per_use.Evaluator``)     evaluate    keeps sharded parameters pending through
                                                          shape-only equations, slices stacks per
                                                          layer, rebuilds scans and remat regions
                                                          around pending values, gathers at a use
re-tracing (``retrace.Retracer``):            evaluate    binds every equation again, sub-programs
``foreign.Translator``, ``gathers.Rewriter``              re-traced; a hook replaces some equations
                                                          (a constraint translated, a gather
                                                          rewritten)
update groups (``offload._Reads``)            dataflow    which inputs each output reads (a bit set)
sequence order (``sequence_order._Tags``)     dataflow    which dimensions hold the permuted
                                                          sequence or an ``iota``'s order
partial collectives (``partial_axes``)        visit       every collective, at any depth
the program check (``check``)               visit       every equation, at any depth
============================================  ==========  ==========================================

What the walk owns, once for all of them:

* the traversal: :meth:`Walk.run` binds a program's constants and arguments to its
  variables, goes through its equations in order, reads literals, and returns its outputs;
  :func:`equations` visits every equation of a program and of the programs inside it;
* the access to sub-programs: :func:`zerojax.sharding.constructs.structure` reads a call,
  a remat region, a custom derivative's primal, a ``scan``, a ``while``, a ``cond`` and a
  ``shard_map`` into zerojax's terms, and :class:`Dataflow` recurses into each with the
  pass's facts (fixed points over loop carries, joins over branches);
* the evaluation of one equation: :class:`Evaluate` binds an equation as JAX would
  (:func:`zerojax.sharding.form.bind`) unless the pass replaces it.

A pass is a subclass that says what a value is and what it does differently at an
equation. The two evaluating passes differ in their hooks, not in the walk: per-use
gathering's values may be *pending* (storage shards plus the shape-only equations still to
apply), and at a ``scan`` or ``checkpoint`` it runs the body itself, with its own options
per body (a remat policy per layer, prefetch's order of gathers), through the same
:meth:`Walk.run`; the re-tracer's values are always plain, and it rewrites the parameters of
the equations it binds (sub-programs re-traced by the same walk) and, where a pass says so,
the mesh each is bound under. The dataflow passes differ in their facts and in which
constructs they follow (:attr:`Dataflow.follows`): the update groups follow calls only and
count a loop whole, the sequence-order check follows every construct.

Nothing here names a JAX primitive or parameter: the rest of :mod:`zerojax._jaxpr` does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from zerojax._jaxpr import constructs, form, lines
from zerojax._jaxpr.form import Equation, Jaxpr


def equations(jaxpr: Jaxpr) -> Iterator[Equation]:
    """Every equation of ``jaxpr`` and of the programs inside its equations (bodies,
    branches, custom derivatives' primals), depth first, each before the ones inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub, _ in form.sub_programs(eqn):
            yield from equations(sub)


class Walk:
    """Goes through a program's equations in order with an environment of values."""

    def run(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """The outputs of ``jaxpr`` on ``args`` (its constants ``consts``), each equation
        applied by :meth:`equation`."""
        env: dict[Any, Any] = {}

        def read(v):
            return self.literal(form.literal_value(v)) if form.is_literal(v) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def run_closed(self, closed: Any, args: Sequence[Any]) -> list[Any]:
        """:meth:`run` on a program in any of JAX's forms (closed, or open with no constants)."""
        jaxpr, consts = form.open_jaxpr(closed)
        return self.run(jaxpr, [self.constant(c) for c in consts], args)

    # What a pass says.
    def literal(self, value: Any) -> Any:
        """What a literal (a constant written into an equation) is to this pass."""
        return value

    def constant(self, value: Any) -> Any:
        """What a program constant is to this pass."""
        return value

    def equation(self, eqn: Equation, ins: list[Any]) -> list[Any]:
        """The outputs of ``eqn`` on ``ins``."""
        raise NotImplementedError


class Evaluate(Walk):
    """A walk that evaluates: values are arrays, tracers, or a pass's stand-ins for them.
    Every equation is bound as JAX binds it unless :meth:`replace` says otherwise."""

    def equation(self, eqn: Equation, ins: list[Any]) -> list[Any]:
        outs = self.replace(eqn, ins)
        return self.bind(eqn, ins) if outs is None else outs

    def replace(self, eqn: Equation, ins: list[Any]) -> list[Any] | None:
        """The outputs of ``eqn`` where this pass replaces it; None: bound (:meth:`bind`)."""
        return None

    def bind(self, eqn: Equation, ins: list[Any]) -> list[Any]:
        return form.bind(eqn, ins)


class Dataflow(Walk):
    """A walk that computes facts about values (which inputs a value reads, which of its
    dimensions hold what) instead of values. A plain equation goes to :meth:`primitive`;
    a construct with programs of its own goes to its method (:meth:`call`, :meth:`scan`,
    :meth:`loop`, :meth:`branches`, :meth:`region`) when its kind is in :attr:`follows`, and
    to :meth:`primitive` as a whole otherwise. The defaults run the sub-programs with the
    same facts, a loop's carry joined (:meth:`join`) until it stops changing."""

    # The constructs this pass looks into (:mod:`zerojax._jaxpr.constructs`' kinds).
    follows: frozenset[str] = frozenset(
        {"call", "remat", "custom_jvp", "custom_vjp", "scan", "while", "cond", "shard_map"}
    )
    max_rounds = 64  # a loop's fixed point: facts only grow, so this bounds a bug, not a program
    enclosing: tuple[Equation, ...] = ()  # the constructs being walked, outermost first

    def equation(self, eqn: Equation, ins: list[Any]) -> list[Any]:
        s = constructs.structure(eqn)
        if s is None or s.kind not in self.follows:
            return self.primitive(eqn, ins)
        outer, self.enclosing = self.enclosing, (*self.enclosing, eqn)
        try:
            if s.kind == "scan":
                return self.scan(eqn, s, ins)
            if s.kind == "while":
                return self.loop(eqn, s, ins)
            if s.kind == "cond":
                return self.branches(eqn, s, ins)
            if s.kind == "shard_map":
                return self.region(eqn, s, ins)
            return self.call(eqn, s, ins)
        finally:
            self.enclosing = outer

    def where(self, eqn: Equation) -> str:
        """The user's source line of ``eqn`` for messages, or where it has none (an
        equation inside a ``jit`` of a library function), the line of the innermost
        construct around it that has one."""
        for e in (eqn, *reversed(self.enclosing)):
            line = lines.user_line(e)
            if line:
                return line
        return lines.where(eqn)

    # What a pass says.
    def primitive(self, eqn: Equation, ins: list[Any]) -> list[Any]:
        """The facts of a plain equation's outputs (or of a construct not followed)."""
        raise NotImplementedError

    def join(self, a: Any, b: Any) -> Any:
        """The fact that holds where either ``a`` or ``b`` may (loops, branches)."""
        raise NotImplementedError

    def unstack(self, fact: Any) -> Any:
        """A scanned operand's fact for one iteration's slice (its leading dimension gone)."""
        return fact

    def stack(self, fact: Any) -> Any:
        """A scan output's fact, stacked over the iterations (a leading dimension added)."""
        return fact

    # The constructs.
    def call(self, eqn: Equation, c: constructs.Call, ins: list[Any]) -> list[Any]:
        return self.run(c.body, [self.constant(x) for x in c.consts], ins)

    def scan(self, eqn: Equation, s: constructs.Scan, ins: list[Any]) -> list[Any]:
        consts = [self.constant(x) for x in s.body_consts]
        fixed, carry = ins[: s.n_consts], ins[s.n_consts : s.n_consts + s.n_carry]
        xs = [self.unstack(x) for x in ins[s.n_consts + s.n_carry :]]
        carry, outs = self.fixed_point(
            lambda c: self._split(self.run(s.body, consts, [*fixed, *c, *xs]), s.n_carry), carry
        )
        return [*carry, *(self.stack(y) for y in outs)]

    def loop(self, eqn: Equation, w: constructs.Loop, ins: list[Any]) -> list[Any]:
        cond_in, body_in, carry = ins[: w.n_cond], ins[w.n_cond : w.n_cond + w.n_body], ins[w.n_cond + w.n_body :]
        cond_consts = [self.constant(x) for x in w.cond_consts]
        body_consts = [self.constant(x) for x in w.body_consts]

        def once(c):
            self.run(w.cond, cond_consts, [*cond_in, *c])
            return self.run(w.body, body_consts, [*body_in, *c]), None

        return self.fixed_point(once, carry)[0]

    def branches(self, eqn: Equation, b: constructs.Branches, ins: list[Any]) -> list[Any]:
        outs = None
        for jaxpr, consts in b.branches:
            got = self.run(jaxpr, [self.constant(x) for x in consts], ins[1:])
            outs = got if outs is None else [self.join(x, y) for x, y in zip(outs, got)]
        return outs

    def region(self, eqn: Equation, r: constructs.ManualRegion, ins: list[Any]) -> list[Any]:
        return self.run(r.body, [self.constant(x) for x in r.consts], ins)

    # Helpers.
    @staticmethod
    def _split(outs: list[Any], n: int) -> tuple[list[Any], list[Any]]:
        return outs[:n], outs[n:]

    def fixed_point(self, once, carry: list[Any]) -> tuple[list[Any], Any]:
        """``once(carry) -> (carry_out, other)`` run with ``carry`` joined with what comes
        out until it stops changing; returns that carry and the last ``other``."""
        carry = list(carry)
        for _ in range(self.max_rounds):
            out, other = once(carry)
            new = [self.join(a, b) for a, b in zip(carry, out, strict=True)]
            if new == carry:
                return carry, other
            carry = new
        raise RuntimeError(
            f"zerojax: a loop's facts did not settle in {self.max_rounds} rounds ({type(self).__name__})"
        )
