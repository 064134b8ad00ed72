"""Everything zerojax reads of JAX's program representation (jaxprs), in one place.

Per-use gathering (:mod:`zerojax.sharding.per_use`) re-evaluates a traced loss equation
by equation, so it reads a few constructs of JAX's internal program form: the body of a
call, the split of a ``scan``'s operands, a ``checkpoint``'s options, a ``slice``'s bounds,
and how to evaluate one equation. Their parameters move between JAX releases; this module
holds one small function per construct, each reading every supported release's form:

============  ====================================  ===================================
construct     jax 0.10                              jax 0.11 - 0.12
============  ====================================  ===================================
sub-program   ``ClosedJaxpr(jaxpr, consts)``        ``Jaxpr`` carrying its ``consts``
scan split    ``num_consts``, ``num_carry``         ``ft_in`` (consts, carry, xs trees)
one equation  ``ClosedJaxpr(Jaxpr(...), [])``       ``Jaxpr(..., consts=[])``
custom rules  ``jvp_jaxpr_fun``, ``fwd_jaxpr_thunk``  the same
constraint    ``sharding_constraint(sharding=NamedSharding)``  the same
gather        ``gather(dimension_numbers, slice_sizes, mode, fill_value)``  the same
manual region ``shard_map(jaxpr, ...)``             the same
============  ====================================  ===================================

Supporting a new JAX release means updating the functions below; nothing else in
zerojax names a JAX primitive parameter. At import :func:`self_check` traces each construct
and runs it through these functions: a release that moves one fails there with one
``ImportError`` naming the JAX version and the construct, instead of zerojax silently
gathering whole parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

# The primitives zerojax dispatches on, by their names in jax.extend.core.primitives.
NEEDED = ("jit_p", "closed_call_p", "scan_p", "remat_p", "slice_p", "reshape_p", "transpose_p",
          "convert_element_type_p", "squeeze_p", "broadcast_in_dim_p", "copy_p", "add_p", "sub_p",
          "add_jaxvals_p", "neg_p", "concatenate_p", "pad_p", "reduce_sum_p", "dynamic_slice_p",
          "gather_p", "select_n_p", "sharding_constraint_p")

# jax >= 0.11 merged ClosedJaxpr into Jaxpr (the name stays, as an alias).
_MERGED = jcore.ClosedJaxpr is jcore.Jaxpr


def _unsupported(what: str, detail: str) -> ImportError:
    return ImportError(
        f"zerojax's per-use gathering does not recognise {what} in jax {jax.__version__}: {detail}. "
        "zerojax reads JAX's program form in zerojax/sharding/jax_compat.py; install a JAX release "
        "in the range pyproject.toml lists (jax>=0.10,<0.13).")


def _primitives():
    from jax.extend.core import primitives

    missing = [name for name in NEEDED if not hasattr(primitives, name)]
    if missing:
        raise _unsupported("its primitives", f"jax.extend.core.primitives does not export {missing}")
    return primitives


P = _primitives()


def open_jaxpr(program: Any) -> tuple[jcore.Jaxpr, tuple]:
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
        raise _unsupported("an open sub-program", "re-tracing it produced constants it cannot hold")
    return jaxpr


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


def constraint_spec(eqn: jcore.JaxprEqn) -> tuple[tuple[str, ...], Any]:
    """``(mesh axis names, PartitionSpec)`` of a ``sharding_constraint`` equation."""
    sharding = eqn.params.get("sharding")
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        raise ValueError(f"zerojax reads sharding constraints given as NamedSharding (a mesh and a PartitionSpec); "
                         f"this one is a {type(sharding).__name__} ({where(eqn)}). Write it as "
                         "jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(...))) or P(...).")
    return tuple(mesh.axis_names), spec


def _library_file(path: str) -> bool:
    """Whether ``path`` is zerojax's, Flax's or optax's own code (not the user's)."""
    import os

    import flax
    import optax

    import zerojax

    roots = [os.path.dirname(m.__file__) for m in (zerojax, flax, optax)]
    return any(os.path.abspath(path).startswith(r + os.sep) for r in roots)


def where(eqn: jcore.JaxprEqn, frames: int = 4) -> str:
    """The user's source lines of an equation, for messages: the innermost user frame and
    the ones that called it (a helper, then the layer that called the helper), as a
    traceback would show them, up to ``frames``. JAX's own frames are left out by JAX,
    zerojax's, Flax's and optax's here. (``user_frames`` is JAX-internal: where it moves,
    the public one-line summary is used.)"""
    try:
        from jax._src import source_info_util as internal

        chain = [f for f in internal.user_frames(eqn.source_info.traceback) if not _library_file(f.file_name)]
        if chain:
            return ", called from ".join(f"{f.file_name}:{f.start_line} ({f.function_name})" for f in chain[:frames])
    except Exception:  # noqa: BLE001 - a message helper: never fail the error it decorates
        pass
    from jax.extend import source_info_util

    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001
        return "unknown source line"


def call_body(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, tuple]:
    """The body of an inlined call (``jit``, ``closed_call``)."""
    return open_jaxpr(eqn.params["jaxpr"])


@dataclasses.dataclass(frozen=True)
class Scan:
    """A ``scan`` equation's operands: ``consts + carry + xs``, body ``(consts, carry, x) ->
    (carry, y)``."""

    body: jcore.Jaxpr
    body_consts: tuple
    n_consts: int
    n_carry: int
    length: int
    reverse: bool
    unroll: int | bool


def scan(eqn: jcore.JaxprEqn) -> Scan:
    p = eqn.params
    if "num_consts" in p:  # jax 0.10
        n_consts, n_carry = p["num_consts"], p["num_carry"]
    else:  # jax 0.11+: flat trees of (consts, carry, xs)
        consts_tree, carry_tree, _ = p["ft_in"].unpack()
        n_consts, n_carry = len(consts_tree), len(carry_tree)
    body, body_consts = open_jaxpr(p["jaxpr"])
    return Scan(body, body_consts, n_consts, n_carry, p["length"], p["reverse"], p["unroll"])


@dataclasses.dataclass(frozen=True)
class Remat:
    """A ``checkpoint`` equation: its body and the options to rebuild it with."""

    body: jcore.Jaxpr
    body_consts: tuple
    prevent_cse: bool
    policy: Any


def remat(eqn: jcore.JaxprEqn) -> Remat:
    body, consts = open_jaxpr(eqn.params["jaxpr"])
    return Remat(body, consts, eqn.params.get("prevent_cse", True), eqn.params.get("policy"))


@dataclasses.dataclass(frozen=True)
class Slice:
    start: tuple[int, ...]
    limit: tuple[int, ...]
    strides: tuple[int, ...] | None


def static_slice(eqn: jcore.JaxprEqn) -> Slice:
    p = eqn.params
    return Slice(tuple(p["start_indices"]), tuple(p["limit_indices"]), p.get("strides"))


def has_sub_programs(eqn: jcore.JaxprEqn) -> bool:
    """Whether ``eqn`` runs programs of its own (a loop, a branch, a custom rule, ...)."""
    return any(True for _ in jcore.jaxprs_in_params(eqn.params))


_DEBUG_INFO = jcore.DebugInfo("zerojax per-use evaluation", None, None, None)


def bind(eqn: jcore.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Evaluates one equation on ``invals`` the way JAX evaluates a jaxpr (its own
    ``jaxpr_as_fun``), through a one-equation program."""
    variables, values = [], []
    for v, x in zip(eqn.invars, invals):
        if isinstance(v, jcore.Literal) or any(v is u for u in variables):
            continue
        variables.append(v)
        values.append(x)
    if _MERGED:
        closed = jcore.Jaxpr([], variables, eqn.outvars, [eqn], eqn.effects, debug_info=_DEBUG_INFO, consts=[])
    else:
        closed = jcore.ClosedJaxpr(jcore.Jaxpr([], variables, eqn.outvars, [eqn], eqn.effects,
                                               debug_info=_DEBUG_INFO), [])
    return list(jcore.jaxpr_as_fun(closed)(*values))


@dataclasses.dataclass(frozen=True)
class TakeAlong:
    """A gather that picks one element along operand dimension ``dim`` for each index,
    every other operand dimension a batching dimension: ``jnp.take_along_axis`` (optax's
    integer-label cross-entropy picks each target's logit so). ``pairs``: (operand
    dimension, indices dimension) of each batching dimension; the indices' last dimension
    is the index vector (size 1). ``fill``: an out-of-range index gives ``fill_value``
    (else it is clamped)."""

    dim: int
    pairs: tuple[tuple[int, int], ...]
    fill: bool
    fill_value: Any


def is_gather(eqn: jcore.JaxprEqn) -> bool:
    return eqn.primitive is P.gather_p


def has_batching_dims(eqn: jcore.JaxprEqn) -> bool:
    """Whether a ``gather`` has operand batching dimensions."""
    return bool(tuple(getattr(eqn.params["dimension_numbers"], "operand_batching_dims", ())))


def take_along(eqn: jcore.JaxprEqn) -> TakeAlong | None:
    """A ``gather`` equation read as :class:`TakeAlong`, or None when it is another gather."""
    if not is_gather(eqn):
        return None
    dn, shape = eqn.params["dimension_numbers"], eqn.invars[0].aval.shape
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    if not batching or dn.offset_dims or len(dn.start_index_map) != 1:
        return None
    dim = dn.start_index_map[0]
    if tuple(dn.collapsed_slice_dims) != (dim,) or set(batching) | {dim} != set(range(len(shape))):
        return None
    if any(s != 1 for s in eqn.params["slice_sizes"]) or eqn.invars[1].aval.shape[-1] != 1:
        return None
    mode = eqn.params["mode"]
    fill = "FILL" in getattr(mode, "name", str(mode)).upper()
    return TakeAlong(dim, tuple(zip(batching, dn.start_indices_batching_dims)), fill, eqn.params.get("fill_value"))


def is_manual_region(eqn: jcore.JaxprEqn) -> bool:
    """Whether ``eqn`` is a ``shard_map``: its body binds mesh axes of its own (a collective
    over them traces only inside it), so a re-trace binds it whole."""
    return eqn.primitive.name == "shard_map"


def _custom_vjp_example():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))
    return f


def self_check() -> None:
    """Traces each construct zerojax rewrites and reads it through this module, so that a
    JAX release that moves one fails at import, naming the construct."""
    x = jax.ShapeDtypeStruct((3, 2), jnp.float32)  # abstract: importing must not start a backend

    def scanned(x):
        w = x[1] * 2.0  # a loop constant computed in the trace (a concrete array would start a backend)
        return jax.lax.scan(lambda c, r: (c * w + r, jnp.sum(r)), x[0], x)[0]

    def checks():
        yield "jax.jit", lambda x: jax.jit(jnp.sin)(x), P.jit_p, lambda e: call_body(e)[0].eqns
        yield ("jax.lax.scan", scanned, P.scan_p,
               lambda e: (s := scan(e)) and (s.n_consts, s.n_carry, s.length) == (1, 1, 3)
               and len(s.body.invars) == 3 and len(s.body.outvars) == 2)
        yield ("jax.checkpoint", lambda x: jax.checkpoint(jnp.sin)(x), P.remat_p,
               lambda e: (r := remat(e)) and r.body.eqns and isinstance(r.prevent_cse, bool))
        yield ("slicing (x[0])", lambda x: x[0], P.slice_p,
               lambda e: static_slice(e).limit == (1, 2))
        yield ("jax.custom_jvp (jax.nn.relu)", jax.nn.relu, None,
               lambda e: e.primitive.name == "custom_jvp_call" and RULE_THUNKS[0] in e.params
               and is_program(e.params["call_jaxpr"]))
        yield ("jax.custom_vjp", _custom_vjp_example(), None,
               lambda e: e.primitive.name == "custom_vjp_call" and RULE_THUNKS[1] in e.params
               and is_program(e.params["call_jaxpr"]))

        idx = lambda x: jnp.zeros((3, 1), jnp.int32)
        yield ("jnp.take_along_axis", lambda x: jnp.take_along_axis(x, idx(x), axis=-1, mode="fill"), P.gather_p,
               lambda e: (t := take_along(e)) and (t.dim, t.pairs, t.fill) == (1, ((0, 0),), True)
               and has_batching_dims(e))
        from jax.sharding import AbstractMesh, AxisType

        mesh = AbstractMesh((1,), ("zerojax_check",), axis_types=(AxisType.Auto,))
        yield ("jax.shard_map", jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=jax.P("zerojax_check"),
                                              out_specs=jax.P("zerojax_check")), None,
               lambda e: is_manual_region(e) and is_program(e.params["jaxpr"]))

    def flat(eqns):  # nested calls too: jnp functions run as jitted sub-programs
        for e in eqns:
            yield e
            for sub in jcore.jaxprs_in_params(e.params):
                yield from flat(open_jaxpr(sub)[0].eqns)

    for what, fn, prim, ok in checks():
        eqns = [e for e in flat(jax.make_jaxpr(fn)(x).jaxpr.eqns) if prim is None or e.primitive is prim]
        if not eqns:
            raise _unsupported(what, f"it no longer traces to the primitive {prim.name!r}")
        prim = prim or eqns[0].primitive
        try:
            good = bool(ok(eqns[0]))
        except (KeyError, AttributeError, TypeError, ValueError) as e:
            raise _unsupported(what, f"primitive {prim.name!r} has parameters {sorted(eqns[0].params)}, "
                                     f"read as {type(e).__name__}: {e}") from e
        if not good:
            raise _unsupported(what, f"primitive {prim.name!r} has parameters {sorted(eqns[0].params)} "
                                     "that read differently than expected")
