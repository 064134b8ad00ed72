"""JAX's program form, read in zerojax's terms: sub-programs, literals, binding equations.

zerojax's passes over a traced loss (per-use gathering, the re-tracing passes, the
optimizer's update groups, the collectives check, the sequence-order check) walk its
program, the jaxpr, with :mod:`zerojax._jaxpr.walk`. Neither the walk nor the passes name
a JAX primitive, a primitive's parameter or a private JAX module: they ask this package,
which reads each construct in every known release's form and answers in zerojax's own
terms. The forms that differ:

============  ====================================  ===================================
construct     jax 0.10                              jax 0.11 - 0.12
============  ====================================  ===================================
sub-program   ``ClosedJaxpr(jaxpr, consts)``        ``Jaxpr`` carrying its ``consts``
scan split    ``num_consts``, ``num_carry``         ``ft_in`` (consts, carry, xs trees)
one equation  ``ClosedJaxpr(Jaxpr(...), [])``       ``Jaxpr(..., consts=[])``
custom rules  ``jvp_jaxpr_fun``, ``fwd_jaxpr_thunk``  the same
traced mesh   ``eqn.ctx.cur_abstract_mesh``         0.12.0 the same; 0.12.1 ``eqn.ctx.configs``
                                                    (read through ``eqn.ctx.manager`` on all)
constraint    ``sharding_constraint(sharding=NamedSharding)``  the same
gather        ``gather(dimension_numbers, slice_sizes, mode, fill_value)``  the same
manual region ``shard_map(jaxpr, in_specs, out_specs, newly_manual_axes)``  the same
============  ====================================  ===================================

This module holds the program form itself; :mod:`zerojax._jaxpr.constructs` reads the
constructs (calls, loops, slices, gathers ...), :mod:`zerojax._jaxpr.rules` how each
primitive maps dimensions, :mod:`zerojax._jaxpr.lines` source lines, and
:mod:`zerojax._jaxpr.check` checks all of it the first time a program is read.

Importing this module never fails, whatever the JAX release: a name JAX no longer exports
is replaced by a placeholder no equation matches, and the check reports it. Nothing here
is read before :func:`zerojax._jaxpr.check.reading` has said the release's form is known.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

try:  # public since jax 0.4.36; a release without it fails the check, not the import
    from jax.extend import core as jcore
except ImportError:  # pragma: no cover - exercised by the check's tests through monkeypatch
    jcore = None

# The primitives zerojax dispatches on, by their names in jax.extend.core.primitives.
NEEDED = (
    "jit_p",
    "closed_call_p",
    "scan_p",
    "remat_p",
    "slice_p",
    "reshape_p",
    "transpose_p",
    "convert_element_type_p",
    "squeeze_p",
    "broadcast_in_dim_p",
    "copy_p",
    "add_p",
    "sub_p",
    "add_jaxvals_p",
    "neg_p",
    "concatenate_p",
    "pad_p",
    "reduce_sum_p",
    "dynamic_slice_p",
    "gather_p",
    "select_n_p",
    "sharding_constraint_p",
    "custom_jvp_call_p",
    "custom_vjp_call_p",
    "while_p",
    "cond_p",
    "dot_general_p",
    "iota_p",
)


class Unsupported(RuntimeError):
    """A construct of JAX's program form that zerojax does not read in this JAX release."""

    def __init__(self, what: str, detail: str):
        self.what, self.detail = what, detail
        super().__init__(
            f"zerojax's reading of JAX programs does not recognise {what} in jax {jax.__version__}: {detail}. "
            "zerojax reads JAX's program form in zerojax/_jaxpr/; set ZEROJAX_NO_PROGRAM_READING=1 to train "
            "through the path that reads no program (the README's 'JAX versions' says what it changes)."
        )


class _Absent:
    """Stands for a primitive this JAX does not export: no equation's primitive is it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: not exported by jax {jax.__version__}>"


class _Primitives:
    """``jax.extend.core.primitives``' primitives that zerojax dispatches on, by name
    (:data:`NEEDED`); ``missing`` names those this JAX does not export."""

    def __init__(self):
        try:
            from jax.extend.core import primitives
        except ImportError:  # pragma: no cover - a JAX without the module
            primitives = None
        self.missing = tuple(n for n in NEEDED if not hasattr(primitives, n))
        for n in NEEDED:
            setattr(self, n, getattr(primitives, n, None) or _Absent(n))


P = _Primitives()

# jax >= 0.11 merged ClosedJaxpr into Jaxpr (the name stays, as an alias).
_MERGED = getattr(jcore, "ClosedJaxpr", None) is getattr(jcore, "Jaxpr", False)

# For annotations elsewhere (``Any`` where this JAX lacks them).
Jaxpr = getattr(jcore, "Jaxpr", Any)
Equation = getattr(jcore, "JaxprEqn", Any)


def _debug_info() -> Any:
    return jcore.DebugInfo("zerojax per-use evaluation", None, None, None)


def name(eqn: Equation) -> str:
    """The primitive's name, for messages (``"cumsum"``, ``"gather"``)."""
    return eqn.primitive.name


# ----------------------------------------------------------------------------------------
# The program form.


def open_jaxpr(program: Any) -> tuple[Jaxpr, tuple]:
    """``(jaxpr, consts)`` of a sub-program, as ``eval_jaxpr`` takes them: a 0.10
    ``ClosedJaxpr``, a 0.11+ ``Jaxpr`` with its consts, or an open ``Jaxpr`` (no consts)."""
    if not _MERGED and isinstance(program, jcore.ClosedJaxpr):
        return program.jaxpr, tuple(program.consts)
    consts = getattr(program, "consts", None) if _MERGED else None
    return program, tuple(consts or ())


def is_program(value: Any) -> bool:
    """Whether an equation parameter is a sub-program (a body, a branch, a custom rule's primal)."""
    return isinstance(value, jcore.Jaxpr) or (not _MERGED and isinstance(value, jcore.ClosedJaxpr))


def like(program: Any, new: Any) -> Any:
    """``new`` (what ``jax.make_jaxpr`` returns) in the form of the sub-program ``program``
    it replaces: closed where it was closed, open (no constants) where it was open."""
    if _MERGED or isinstance(program, jcore.ClosedJaxpr):
        return new
    jaxpr, consts = open_jaxpr(new)
    if consts:
        raise Unsupported("an open sub-program", "re-tracing it produced constants it cannot hold")
    return jaxpr


def sub_programs(eqn: Equation) -> Iterator[tuple[Jaxpr, tuple]]:
    """``(jaxpr, consts)`` of every program an equation runs (a body, each branch, a custom
    rule's primal), in any form; nothing for a plain equation."""
    for sub in jcore.jaxprs_in_params(eqn.params):
        yield open_jaxpr(sub)


def scope(eqn: Equation) -> str:
    """The ``jax.named_scope`` names an equation was traced under, ``"a/b"`` (relative to
    the equation that runs its program, for an equation of a sub-program)."""
    return str(getattr(eqn.source_info, "name_stack", ""))


def programs_in(value: Any) -> Iterator[Jaxpr]:
    """The jaxprs in one parameter value (a program, or a tuple of them), opened."""
    if is_program(value):
        yield open_jaxpr(value)[0]
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from programs_in(v)


def is_literal(v: Any) -> bool:
    """Whether an equation operand is a literal (a constant written into the program)."""
    return isinstance(v, jcore.Literal)


def literal_value(v: Any) -> Any:
    return v.val


def shape(v: Any) -> tuple[int, ...]:
    """The shape of a program variable or literal."""
    return tuple(getattr(v.aval, "shape", ()))


def type_name(v: Any) -> str:
    """A program variable's type as JAX prints it, for messages (``float32[2,16]``)."""
    dtype = getattr(getattr(v.aval, "dtype", None), "name", "?")
    return f"{dtype}[{','.join(map(str, shape(v)))}]"


def shape_struct(v: Any) -> jax.ShapeDtypeStruct:
    """A program variable's abstract value as a ``ShapeDtypeStruct`` (weak types kept)."""
    return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))


def bind(eqn: Equation, invals: Sequence[Any]) -> list[Any]:
    """Evaluates one equation on ``invals`` the way JAX evaluates a jaxpr (its own
    ``jaxpr_as_fun``), through a one-equation program."""
    variables, values = [], []
    for v, x in zip(eqn.invars, invals):
        if isinstance(v, jcore.Literal) or any(v is u for u in variables):
            continue
        variables.append(v)
        values.append(x)
    info = _debug_info()
    if _MERGED:
        closed = jcore.Jaxpr([], variables, eqn.outvars, [eqn], eqn.effects, debug_info=info, consts=[])
    else:
        closed = jcore.ClosedJaxpr(jcore.Jaxpr([], variables, eqn.outvars, [eqn], eqn.effects, debug_info=info), [])
    return list(jcore.jaxpr_as_fun(closed)(*values))


# Parameters of ``custom_jvp_call`` / ``custom_vjp_call`` that trace a rule lazily: called
# with flags, they return ``(jaxpr, consts, *rest)``.
RULE_THUNKS = ("jvp_jaxpr_fun", "fwd_jaxpr_thunk")


def wrap_rule(thunk: Any, rebuild) -> Any:
    """A rule thunk whose program is passed through ``rebuild(jaxpr, consts) -> (jaxpr, consts)``."""
    import jax.extend.linear_util as lu

    def traced(*flags):
        jaxpr, consts, *rest = thunk.call_wrapped(*flags)
        return (*rebuild(jaxpr, consts), *rest)

    return lu.wrap_init(traced, debug_info=thunk.debug_info)


def traced_mesh(eqn: Equation) -> Any:
    """The abstract mesh ``eqn`` was traced under (``jax.sharding.get_abstract_mesh()`` then).

    JAX records it with every equation and binds the equation again under it (its
    ``eval_jaxpr`` enters the equation's context). It is the trace's mesh, or one JAX itself
    entered from a value's sharding (vmap broadcasting an unbatched operand, a
    ``reshard``), or a ``shard_map`` body's (its manual axes)."""
    with eqn.ctx.manager:  # JAX's own way back into the equation's settings (0.10: a slot; 0.12.1: a tuple)
        return jax.sharding.get_abstract_mesh()


def under_mesh(eqn: Equation, mesh: Any) -> Equation:
    """``eqn`` recorded as traced under ``mesh`` (its other context settings kept)."""
    if mesh == traced_mesh(eqn):
        return eqn
    with eqn.ctx.manager, jax.sharding.use_abstract_mesh(mesh):
        ctx = type(eqn.ctx)()  # JAX's equation context, read from the settings in force
    return eqn.replace(ctx=ctx)


def rebind(
    eqn: Equation,
    invals: Sequence[Any],
    *,
    program: Callable[[Any], Any],
    rule: Callable[[Jaxpr, tuple], tuple[Any, tuple]],
    param: Callable[[str, Any], Any],
    mesh: Callable[[Any], Any] | None = None,
) -> list[Any]:
    """Binds ``eqn`` on ``invals`` with its parameters rewritten: each sub-program through
    ``program(sub) -> sub`` (tuples of them too), each lazily traced custom rule through
    ``rule(jaxpr, consts) -> (jaxpr, consts)``, every other parameter through
    ``param(name, value) -> value``; and under the abstract mesh ``mesh(traced) -> mesh``
    of the one it was traced under (:func:`traced_mesh`), where given."""
    params = {}
    for k, v in eqn.params.items():
        v = param(k, v)
        if k in RULE_THUNKS:
            v = wrap_rule(v, rule)
        elif is_program(v):
            v = program(v)
        elif isinstance(v, (tuple, list)) and v and all(is_program(x) for x in v):
            v = type(v)(program(x) for x in v)
        params[k] = v
    eqn = eqn.replace(params=params)
    if mesh is not None:
        eqn = under_mesh(eqn, mesh(traced_mesh(eqn)))
    return bind(eqn, invals)
