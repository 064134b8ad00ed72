"""Everything zerojax reads of JAX's internals, in one place.

zerojax's passes over a traced loss (per-use gathering, the re-tracing passes, the
optimizer's update groups, the collectives check, the sequence-order check) walk its
program, the jaxpr, with :mod:`zerojax.sharding.walk`. Neither the walk nor the passes name
a JAX primitive, a primitive's parameter or a private JAX module: they ask this module,
which reads each construct in every supported release's form and answers in zerojax's own
terms (a :class:`Call`, a :class:`Scan`, a :class:`Dims` ...). The forms that differ:

============  ====================================  ===================================
construct     jax 0.10                              jax 0.11 - 0.12
============  ====================================  ===================================
sub-program   ``ClosedJaxpr(jaxpr, consts)``        ``Jaxpr`` carrying its ``consts``
scan split    ``num_consts``, ``num_carry``         ``ft_in`` (consts, carry, xs trees)
one equation  ``ClosedJaxpr(Jaxpr(...), [])``       ``Jaxpr(..., consts=[])``
custom rules  ``jvp_jaxpr_fun``, ``fwd_jaxpr_thunk``  the same
traced mesh   ``eqn.ctx.cur_abstract_mesh``         the same
constraint    ``sharding_constraint(sharding=NamedSharding)``  the same
gather        ``gather(dimension_numbers, slice_sizes, mode, fill_value)``  the same
manual region ``shard_map(jaxpr, in_specs, out_specs, newly_manual_axes)``  the same
============  ====================================  ===================================

The sections below: the primitives; the program form (sub-programs, literals, binding
one equation); the constructs with programs of their own (:func:`structure`); what
per-use gathering asks of an equation; the reads of single constructs (slices, sharding
constraints, gathers, collectives); how each primitive maps its operands' dimensions to
its outputs' (:func:`dims`, for dimension-wise analyses); source lines; and the two JAX
settings zerojax reads outside programs (a mesh's manual axes, the compilation cache's
write threshold).

Supporting a new JAX release means updating the functions here; ``tests/test_walk.py``
checks that no other module of zerojax names a JAX primitive, parameter or private
module. At import :func:`self_check` traces each construct and reads it through these
functions: a release that moves one fails there with one ``ImportError`` naming the JAX
version and the construct, instead of zerojax silently gathering whole parameters or
misreading a program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

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

# jax >= 0.11 merged ClosedJaxpr into Jaxpr (the name stays, as an alias).
_MERGED = jcore.ClosedJaxpr is jcore.Jaxpr

Jaxpr = jcore.Jaxpr  # for annotations elsewhere
Equation = jcore.JaxprEqn


def _unsupported(what: str, detail: str) -> ImportError:
    return ImportError(
        f"zerojax's reading of JAX programs does not recognise {what} in jax {jax.__version__}: {detail}. "
        "zerojax reads JAX's program form in zerojax/sharding/jax_compat.py; install a JAX release "
        "in the range pyproject.toml lists (jax>=0.10,<0.13)."
    )


def _primitives():
    from jax.extend.core import primitives

    missing = [name for name in NEEDED if not hasattr(primitives, name)]
    if missing:
        raise _unsupported("its primitives", f"jax.extend.core.primitives does not export {missing}")
    return primitives


P = _primitives()


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
        raise _unsupported("an open sub-program", "re-tracing it produced constants it cannot hold")
    return jaxpr


def sub_programs(eqn: Equation) -> Iterator[tuple[Jaxpr, tuple]]:
    """``(jaxpr, consts)`` of every program an equation runs (a body, each branch, a custom
    rule's primal), in any form; nothing for a plain equation."""
    for sub in jcore.jaxprs_in_params(eqn.params):
        yield open_jaxpr(sub)


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a value being traced (not a concrete array)."""
    return isinstance(x, jax.core.Tracer)


def distributed_client() -> Any:
    """The coordination service client ``jax.distributed.initialize`` starts (its key-value
    store: ``key_value_set``, ``key_value_dir_get``, ...), or None on one process without
    one. (JAX keeps it in ``jax._src.distributed``, the same on 0.10 and 0.12.)"""
    try:
        from jax._src import distributed
    except ImportError as e:
        raise _unsupported("its coordination service client", f"jax._src.distributed: {e}") from None
    state = getattr(distributed, "global_state", None)
    if state is None or not hasattr(state, "client"):
        raise _unsupported("its coordination service client", "jax._src.distributed.global_state.client")
    return state.client


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


_DEBUG_INFO = jcore.DebugInfo("zerojax per-use evaluation", None, None, None)


def bind(eqn: Equation, invals: Sequence[Any]) -> list[Any]:
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
        closed = jcore.ClosedJaxpr(
            jcore.Jaxpr([], variables, eqn.outvars, [eqn], eqn.effects, debug_info=_DEBUG_INFO), []
        )
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
    return eqn.ctx.cur_abstract_mesh


def _under_mesh(eqn: Equation, mesh: Any) -> Equation:
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
        eqn = _under_mesh(eqn, mesh(traced_mesh(eqn)))
    return bind(eqn, invals)


@dataclasses.dataclass(frozen=True)
class Unary:
    """A one-operand equation kept to apply later (to a value that does not exist yet):
    ``apply(x)`` binds it. ``slice_safe``: it commutes with taking one layer of a stack
    (an elementwise cast or copy)."""

    prim: Any
    params: Any
    slice_safe: bool

    def apply(self, x: Any) -> Any:
        return self.prim.bind(x, **self.params)


def unary_ops(fn: Callable, arg: jax.ShapeDtypeStruct) -> list[Unary]:
    """The equations of ``fn(arg)``, each a :class:`Unary` (``fn`` made of one-operand
    equations: ``jnp.expand_dims``, a reshape)."""
    return [_unary(e) for e in jax.make_jaxpr(fn)(arg).jaxpr.eqns]


def _unary(eqn: Equation) -> Unary:
    return Unary(eqn.primitive, dict(eqn.params), eqn.primitive in _SLICE_SAFE)


# ----------------------------------------------------------------------------------------
# Constructs with programs of their own.


@dataclasses.dataclass(frozen=True)
class Call:
    """An equation that runs one program on its operands and returns its outputs: an
    inlined call (``kind="call"``: ``jit``, ``closed_call``), a remat region
    (``"remat"``), a custom derivative's primal (``"custom_jvp"``, ``"custom_vjp"``; the
    rules are not in ``body``). ``name``: the call's name where it has one (a ``jit`` of
    ``jnp.cumsum`` is ``"cumsum"``)."""

    kind: str
    body: Jaxpr
    consts: tuple
    name: str = ""


@dataclasses.dataclass(frozen=True)
class Scan:
    """A ``scan`` equation's operands: ``consts + carry + xs``, body ``(consts, carry, x) ->
    (carry, y)``."""

    body: Jaxpr
    body_consts: tuple
    n_consts: int
    n_carry: int
    length: int
    reverse: bool
    unroll: int | bool

    kind = "scan"


@dataclasses.dataclass(frozen=True)
class Loop:
    """A ``while`` equation: operands ``cond_consts + body_consts + carry``; ``cond(consts,
    carry) -> bool``, ``body(consts, carry) -> carry``."""

    cond: Jaxpr
    cond_consts: tuple
    body: Jaxpr
    body_consts: tuple
    n_cond: int
    n_body: int

    kind = "while"


@dataclasses.dataclass(frozen=True)
class Branches:
    """A ``cond`` (``lax.cond``, ``lax.switch``): operands ``index, *args``, each branch
    ``(*args) -> outs``; the branches as ``(jaxpr, consts)``."""

    branches: tuple[tuple[Jaxpr, tuple], ...]

    kind = "cond"


@dataclasses.dataclass(frozen=True)
class ManualRegion:
    """A ``shard_map``: ``body`` runs once per device on its blocks. ``in_specs`` /
    ``out_specs``: per operand / output, per dimension, the mesh axes it is split over;
    ``axes``: the axes the region is manual over; ``source``: the file of the function the
    body was traced from (None where JAX did not record it)."""

    body: Jaxpr
    consts: tuple
    in_specs: tuple[tuple[tuple[str, ...], ...], ...]
    out_specs: tuple[tuple[tuple[str, ...], ...], ...]
    axes: frozenset[str]
    source: str | None

    kind = "shard_map"


@dataclasses.dataclass(frozen=True)
class Remat:
    """A ``checkpoint`` equation: its body and the options to rebuild it with."""

    body: Jaxpr
    body_consts: tuple
    prevent_cse: bool
    policy: Any


def call_body(eqn: Equation) -> tuple[Jaxpr, tuple]:
    """The body of an inlined call (``jit``, ``closed_call``)."""
    return open_jaxpr(eqn.params["jaxpr"])


def is_call(eqn: Equation) -> bool:
    """Whether ``eqn`` is an inlined call (``jit``, ``closed_call``)."""
    return eqn.primitive in _CALLS


def scan(eqn: Equation) -> Scan:
    p = eqn.params
    if "num_consts" in p:  # jax 0.10
        n_consts, n_carry = p["num_consts"], p["num_carry"]
    else:  # jax 0.11+: flat trees of (consts, carry, xs)
        consts_tree, carry_tree, _ = p["ft_in"].unpack()
        n_consts, n_carry = len(consts_tree), len(carry_tree)
    body, body_consts = open_jaxpr(p["jaxpr"])
    return Scan(body, body_consts, n_consts, n_carry, p["length"], p["reverse"], p["unroll"])


def is_scan(eqn: Equation) -> bool:
    return eqn.primitive is P.scan_p


def remat(eqn: Equation) -> Remat:
    body, consts = open_jaxpr(eqn.params["jaxpr"])
    return Remat(body, consts, eqn.params.get("prevent_cse", True), eqn.params.get("policy"))


def is_remat(eqn: Equation) -> bool:
    return eqn.primitive is P.remat_p


def _spec_dims(spec: Any, ndim: int) -> tuple[tuple[str, ...], ...]:
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(
        () if e is None or not isinstance(e, (str, tuple, list)) else (e,) if isinstance(e, str) else tuple(e)
        for e in entries[:ndim]
    )


def _region_source(body: Jaxpr) -> str | None:
    info = getattr(getattr(body, "debug_info", None), "func_src_info", None) or ""
    if " at " not in info:
        return None
    return info.rsplit(" at ", 1)[1].rsplit(":", 1)[0]


def manual_region(eqn: Equation) -> ManualRegion:
    p = eqn.params
    body, consts = open_jaxpr(p["jaxpr"])
    ins = tuple(_spec_dims(s, len(shape(v))) for s, v in zip(p["in_specs"], eqn.invars))
    outs = tuple(_spec_dims(s, len(shape(v))) for s, v in zip(p["out_specs"], eqn.outvars))
    axes = p.get("newly_manual_axes", p.get("axis_names", p.get("manual_axes")))
    if axes is None:
        raise KeyError("newly_manual_axes")
    return ManualRegion(body, consts, ins, outs, frozenset(axes), _region_source(body))


def is_manual_region(eqn: Equation) -> bool:
    """Whether ``eqn`` is a ``shard_map``: its body binds mesh axes of its own (a collective
    over them traces only inside it), so a re-trace binds it whole."""
    return eqn.primitive.name == "shard_map"


def structure(eqn: Equation) -> Call | Scan | Loop | Branches | ManualRegion | None:
    """The construct of an equation that runs programs of its own, read into zerojax's
    terms; None for a plain equation, and for one whose programs zerojax does not read
    (:func:`has_sub_programs` tells those apart)."""
    prim = eqn.primitive
    if prim in _CALLS:
        body, consts = call_body(eqn)
        return Call("call", body, consts, str(eqn.params.get("name", "")))
    if prim is P.remat_p:
        r = remat(eqn)
        return Call("remat", r.body, r.body_consts)
    if prim is P.custom_jvp_call_p or prim is P.custom_vjp_call_p:
        body, consts = open_jaxpr(eqn.params["call_jaxpr"])
        return Call("custom_jvp" if prim is P.custom_jvp_call_p else "custom_vjp", body, consts)
    if prim is P.scan_p:
        return scan(eqn)
    if prim is P.while_p:
        p = eqn.params
        cond, cond_consts = open_jaxpr(p["cond_jaxpr"])
        body, body_consts = open_jaxpr(p["body_jaxpr"])
        return Loop(cond, cond_consts, body, body_consts, p["cond_nconsts"], p["body_nconsts"])
    if prim is P.cond_p:
        return Branches(tuple(open_jaxpr(b) for b in eqn.params["branches"]))
    if is_manual_region(eqn):
        return manual_region(eqn)
    return None


def has_sub_programs(eqn: Equation) -> bool:
    """Whether ``eqn`` runs programs of its own (a loop, a branch, a custom rule, ...)."""
    return any(True for _ in jcore.jaxprs_in_params(eqn.params))


# ----------------------------------------------------------------------------------------
# What per-use gathering asks of an equation.

_CALLS = frozenset({P.jit_p, P.closed_call_p})
# Equations of one operand that only change a value's shape or dtype; a parameter passing
# through them stays pending and the equation is applied after materialisation.
_SHAPE_ONLY = frozenset(
    {
        P.reshape_p,
        P.transpose_p,
        P.convert_element_type_p,
        P.squeeze_p,
        P.broadcast_in_dim_p,
        P.copy_p,
        P.sharding_constraint_p,
    }
)
# Equations whose backward needs no operand values (only shapes or integer indices).
_NO_RESIDUALS = frozenset(
    {
        P.add_p,
        P.sub_p,
        P.add_jaxvals_p,
        P.neg_p,
        P.concatenate_p,
        P.pad_p,
        P.reduce_sum_p,
        P.slice_p,
        P.dynamic_slice_p,
        P.gather_p,
        P.select_n_p,
    }
)
# Elementwise shape-only equations that commute with slicing a stack of layers.
_SLICE_SAFE = frozenset({P.convert_element_type_p, P.copy_p})


def shape_only(eqn: Equation) -> Unary | None:
    """``eqn`` as a :class:`Unary` where it only changes its one operand's shape or dtype
    (a reshape, a transpose, a cast, a sharding constraint), else None."""
    if eqn.primitive in _SHAPE_ONLY and len(eqn.invars) == 1:
        return _unary(eqn)
    return None


def keeps_no_operands(eqn: Equation) -> bool:
    """Whether ``eqn``'s backward needs no operand values (an add, a slice, a sum, a
    gather: only shapes or integer indices), so it keeps no operand for backward."""
    return eqn.primitive in _NO_RESIDUALS


# ----------------------------------------------------------------------------------------
# Reads of single constructs.


@dataclasses.dataclass(frozen=True)
class Slice:
    start: tuple[int, ...]
    limit: tuple[int, ...]
    strides: tuple[int, ...] | None


def static_slice(eqn: Equation) -> Slice:
    p = eqn.params
    return Slice(tuple(p["start_indices"]), tuple(p["limit_indices"]), p.get("strides"))


def is_slice(eqn: Equation) -> bool:
    return eqn.primitive is P.slice_p


def is_constraint(eqn: Equation) -> bool:
    """Whether ``eqn`` is a ``jax.lax.with_sharding_constraint``."""
    return eqn.primitive is P.sharding_constraint_p


def constraint_spec(eqn: Equation) -> tuple[tuple[str, ...], Any]:
    """``(mesh axis names, PartitionSpec)`` of a ``sharding_constraint`` equation."""
    sharding = eqn.params.get("sharding")
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        raise ValueError(
            f"zerojax reads sharding constraints given as NamedSharding (a mesh and a PartitionSpec); "
            f"this one is a {type(sharding).__name__} ({where(eqn)}). Write it as "
            "jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(...))) or P(...)."
        )
    return tuple(mesh.axis_names), spec


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


def is_gather(eqn: Equation) -> bool:
    return eqn.primitive is P.gather_p


def has_batching_dims(eqn: Equation) -> bool:
    """Whether a ``gather`` has operand batching dimensions."""
    return bool(tuple(getattr(eqn.params["dimension_numbers"], "operand_batching_dims", ())))


def gather_form(eqn: Equation) -> str:
    """A gather's dimension numbers, for messages."""
    return str(eqn.params["dimension_numbers"])


def take_along(eqn: Equation) -> TakeAlong | None:
    """A ``gather`` equation read as :class:`TakeAlong`, or None when it is another gather."""
    if not is_gather(eqn):
        return None
    dn, shape_ = eqn.params["dimension_numbers"], eqn.invars[0].aval.shape
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    if not batching or dn.offset_dims or len(dn.start_index_map) != 1:
        return None
    dim = dn.start_index_map[0]
    if tuple(dn.collapsed_slice_dims) != (dim,) or set(batching) | {dim} != set(range(len(shape_))):
        return None
    if any(s != 1 for s in eqn.params["slice_sizes"]) or eqn.invars[1].aval.shape[-1] != 1:
        return None
    mode = eqn.params["mode"]
    fill = "FILL" in getattr(mode, "name", str(mode)).upper()
    return TakeAlong(dim, tuple(zip(batching, dn.start_indices_batching_dims)), fill, eqn.params.get("fill_value"))


# Primitives that reduce or gather over named axes (axis_index only reads a device's position).
_NOT_COLLECTIVES = frozenset({"axis_index"})


def collective_axes(eqn: Equation) -> tuple[str, ...]:
    """The mesh axes a collective (``psum``, ``all_gather``, ...) names; () for anything
    else (``axis_index`` too: it reads a device's position, it moves nothing)."""
    if eqn.primitive.name in _NOT_COLLECTIVES:
        return ()
    names: list[str] = []
    for key in ("axes", "axis_name"):
        value = eqn.params.get(key)
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, str):
                names.append(v)
    return tuple(names)


# ----------------------------------------------------------------------------------------
# How each primitive maps its operands' dimensions to its outputs'.


@dataclasses.dataclass(frozen=True)
class Collective:
    """What a collective does across the devices of ``axes`` (inside a ``shard_map``).
    ``combines``: values at the same index on every device are reduced together (``psum``,
    ``pmax``, a reduce-scatter); ``moves``: blocks change devices (``ppermute``);
    ``joins``: ``(output, dimension)`` made whole from every device's block, in device order
    (a tiled ``all_gather``, ``all_to_all``'s concatenated dimension); ``splits``: ``(output,
    dimension)`` left split into blocks over ``axes`` (a reduce-scatter, ``all_to_all``'s
    split dimension)."""

    axes: tuple[str, ...]
    combines: bool = False
    moves: bool = False
    joins: tuple[tuple[int, int], ...] = ()
    splits: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Dims:
    """How an equation's output dimensions come from its operands' dimensions, in zerojax's
    terms (JAX-independent), for passes that follow dimensions through a program.

    ``out[k][d]``: the ``(operand, dimension)`` pairs output ``k``'s dimension ``d`` is
    aligned with, index by index (an elementwise op's operands; a transpose's source; the
    operand dimensions a reshape merges into it). ``contracted``: groups of operand
    dimensions summed over together (a ``dot_general``'s contracting pairs).
    ``reduced``: operand dimensions reduced in an order-independent way (a sum, a max).
    ``mixed``: operand dimensions along which the equation moves, picks or combines
    positions (a slice that cuts, a pad, a concatenation, a reverse, a cumulative op, a
    sort, a gather's indexed dimension, a window, an argmax) — ``what`` says how.
    ``iota``: ``(output, dimension)`` pairs holding their index (``lax.iota``,
    ``jnp.arange``). ``collective``: what it does across devices, if anything. An operand
    dimension in none of these is dropped (a squeezed dimension of size one)."""

    out: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    contracted: tuple[tuple[tuple[int, int], ...], ...] = ()
    reduced: tuple[tuple[int, int], ...] = ()
    mixed: tuple[tuple[int, int], ...] = ()
    iota: tuple[tuple[int, int], ...] = ()
    what: str = ""
    collective: Collective | None = None


def _ndims(eqn: Equation) -> list[int]:
    return [len(shape(v)) for v in eqn.invars]


def _out_ndims(eqn: Equation) -> list[int]:
    return [len(shape(v)) for v in eqn.outvars]


def _aligned(eqn: Equation, operands: Sequence[int] | None = None) -> tuple:
    """Each output's dimension ``d`` aligned with dimension ``d`` of every operand of the
    output's rank (rank-0 operands broadcast)."""
    ins = _ndims(eqn)
    ops = range(len(ins)) if operands is None else operands
    return tuple(tuple(tuple((i, d) for i in ops if ins[i] == n) for d in range(n)) for n in _out_ndims(eqn))


def _elementwise(eqn: Equation) -> Dims:
    return Dims(_aligned(eqn))


def _one_to_one(eqn: Equation) -> Dims:
    """Output ``k`` is operand ``k`` (a barrier, a device transfer)."""
    return Dims(tuple(tuple(((k, d),) for d in range(n)) for k, n in enumerate(_out_ndims(eqn))))


def _fresh(eqn: Equation) -> Dims:
    """Outputs that carry nothing of their operands' dimensions (random bits, a device index)."""
    return Dims(tuple(tuple(() for _ in range(n)) for n in _out_ndims(eqn)))


def _along(eqn: Equation, dims_of: Callable[[int], Sequence[int]], what: str, operands=None) -> Dims:
    ins = _ndims(eqn)
    ops = range(len(ins)) if operands is None else operands
    mixed = tuple((i, d) for i in ops for d in dims_of(i) if d < ins[i])
    return Dims(_aligned(eqn, ops), mixed=mixed, what=what)


def _bitcast(eqn: Equation) -> Dims:
    """A bitcast between types of different widths adds or drops a last dimension."""
    n = min(_ndims(eqn)[0], _out_ndims(eqn)[0])
    return Dims((tuple(((0, d),) if d < n else () for d in range(_out_ndims(eqn)[0])),))


def _transpose(eqn: Equation) -> Dims:
    return Dims((tuple(((0, d),) for d in eqn.params["permutation"]),))


def _broadcast(eqn: Equation) -> Dims:
    src, out = shape(eqn.invars[0]), shape(eqn.outvars[0])
    back = {o: i for i, o in enumerate(eqn.params["broadcast_dimensions"])}
    return Dims((tuple(((0, back[d]),) if d in back and src[back[d]] == out[d] else () for d in range(len(out))),))


def _squeeze(eqn: Equation) -> Dims:
    gone = {d % len(shape(eqn.invars[0])) for d in eqn.params["dimensions"]}
    kept = [d for d in range(len(shape(eqn.invars[0]))) if d not in gone]
    return Dims((tuple(((0, d),) for d in kept),))


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """For a reshape of shape ``src`` to ``dst``: per ``dst`` dimension, the ``src``
    dimensions whose elements it holds (a merge gets all the merged ones, each part of a
    split gets the split one; dimensions of size one get none)."""
    out: list[tuple[int, ...]] = [() for _ in dst]
    i = j = 0
    while i < len(src) or j < len(dst):
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i >= len(src) or j >= len(dst):
            break
        gi, gj, a, b = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                gi.append(i)
                a *= src[i]
                i += 1
            else:
                gj.append(j)
                b *= dst[j]
                j += 1
        group = tuple(d for d in gi if src[d] != 1)
        for d in gj:
            if dst[d] != 1:
                out[d] = group
    return tuple(out)


def _reshape(eqn: Equation) -> Dims:
    src, dst = shape(eqn.invars[0]), shape(eqn.outvars[0])
    order = eqn.params.get("dimensions")
    if order is not None:  # a transpose first (older releases)
        groups = reshape_groups([src[d] for d in order], dst)
        groups = tuple(tuple(order[d] for d in g) for g in groups)
    else:
        groups = reshape_groups(src, dst)
    return Dims((tuple(tuple((0, d) for d in g) for g in groups),))


def _reduce(eqn: Equation, positional: bool = False) -> Dims:
    axes = {int(a) for a in eqn.params["axes"]}
    n = _ndims(eqn)[0]
    kept = tuple(((0, d),) for d in range(n) if d not in axes)
    gone = tuple((0, d) for d in sorted(axes))
    if positional:
        return Dims((kept,), mixed=gone, what="returns the index of its pick along")
    return Dims((kept,), reduced=gone)


def _generic_reduce(eqn: Equation) -> Dims:
    axes = {int(a) for a in eqn.params["dimensions"]}
    k = len(eqn.outvars)
    n = _ndims(eqn)[0]
    kept = tuple(tuple((i, d) for i in range(k)) for d in range(n) if d not in axes)
    return Dims(
        tuple(kept for _ in range(k)),
        mixed=tuple((i, d) for i in range(k) for d in sorted(axes)),
        what="reduces, with a computation of its own, along",
    )


def _slice(eqn: Equation) -> Dims:
    s, full = static_slice(eqn), shape(eqn.invars[0])
    strides = s.strides or (1,) * len(full)
    cut = [d for d in range(len(full)) if (s.start[d], s.limit[d], strides[d]) != (0, full[d], 1)]
    return _along(eqn, lambda i: cut if i == 0 else (), "slices")


def _pad(eqn: Equation) -> Dims:
    cfg = eqn.params["padding_config"]
    padded = [d for d, (lo, hi, interior) in enumerate(cfg) if (lo, hi, interior) != (0, 0, 0)]
    return _along(eqn, lambda i: padded if i == 0 else (), "pads", operands=(0, 1))


def _dynamic_slice(eqn: Equation) -> Dims:
    full = shape(eqn.invars[0])
    cut = [d for d, n in enumerate(eqn.params["slice_sizes"]) if n != full[d]]
    return _along(eqn, lambda i: cut if i == 0 else (), "slices (a dynamic slice) along", operands=(0,))


def _dynamic_update(eqn: Equation) -> Dims:
    full, part = shape(eqn.invars[0]), shape(eqn.invars[1])
    cut = [d for d in range(len(full)) if part[d] != full[d]]
    return _along(eqn, lambda i: cut if i < 2 else (), "writes a part (a dynamic update slice) along", operands=(0, 1))


def _windowed(eqn: Equation) -> Dims:
    p = eqn.params
    n = len(p["window_dimensions"])
    trivial = lambda d: (
        p["window_dimensions"][d] == 1
        and p["window_strides"][d] == 1
        and tuple(p["padding"][d]) == (0, 0)
        and p.get("base_dilation", (1,) * n)[d] == 1
        and p.get("window_dilation", (1,) * n)[d] == 1
    )
    moved = [d for d in range(n) if not trivial(d)]
    k = len(eqn.outvars)
    return _along(eqn, lambda i: moved if i < k else (), "reduces windows along", operands=range(k))


def _gather(eqn: Equation) -> Dims:
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    operand, indices, out = shape(eqn.invars[0]), shape(eqn.invars[1]), shape(eqn.outvars[0])
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
    offset_dims = tuple(dn.offset_dims)
    window = [d for d in range(len(operand)) if d not in dn.collapsed_slice_dims and d not in batching]
    indexed = [
        d for d in range(len(operand)) if d not in batching and (d in dn.start_index_map or sizes[d] != operand[d])
    ]
    idx_dims = list(range(len(indices) - 1))  # the last is the index vector
    batch_out = [d for d in range(len(out)) if d not in offset_dims]
    dims: list[tuple] = [() for _ in out]
    for o, d in zip(offset_dims, window):
        dims[o] = ((0, d),) if d not in indexed else ()
    pair = dict(zip(idx_batching, batching))
    for o, j in zip(batch_out, idx_dims):
        dims[o] = ((1, j),) + (((0, pair[j]),) if j in pair else ())
    return Dims((tuple(dims),), mixed=tuple((0, d) for d in indexed), what="gathers (indexes) along")


def _scatter(eqn: Equation) -> Dims:
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = (shape(v) for v in eqn.invars[:3])
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    window_src = [d for d in range(len(operand)) if d not in dn.inserted_window_dims and d not in batching]
    windows = dict(zip(dn.update_window_dims, window_src))  # update dim -> operand dim
    picked = {d for d in range(len(operand)) if d in dn.scatter_dims_to_operand_dims or d in dn.inserted_window_dims}
    mixed = [(0, d) for d in sorted(picked) if d not in batching]
    mixed += [(2, u) for u, d in windows.items() if updates[u] != operand[d]]
    mixed += [(0, d) for u, d in windows.items() if updates[u] != operand[d]]
    scatter_dims = [u for u in range(len(updates)) if u not in dn.update_window_dims]
    idx_dims = list(range(len(indices) - 1))
    pair = dict(zip(idx_batching, batching))
    per_dim: dict[int, list] = {d: [(0, d)] for d in range(len(operand))}
    for u, d in windows.items():
        if updates[u] == operand[d]:
            per_dim[d].append((2, u))
    for u, j in zip(scatter_dims, idx_dims):
        if j in pair:
            per_dim[pair[j]] += [(1, j), (2, u)]
        else:
            mixed.append((2, u))
            mixed.append((1, j))
    return Dims(
        (tuple(tuple(per_dim[d]) for d in range(len(operand))),),
        mixed=tuple(mixed),
        what="scatters (writes by index) along",
    )


def _dot_general(eqn: Equation) -> Dims:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    nl, nr = _ndims(eqn)[:2]
    free_l = [d for d in range(nl) if d not in lc and d not in lb]
    free_r = [d for d in range(nr) if d not in rc and d not in rb]
    out = [((0, a), (1, b)) for a, b in zip(lb, rb)] + [((0, d),) for d in free_l] + [((1, d),) for d in free_r]
    return Dims((tuple(out),), contracted=tuple(((0, a), (1, b)) for a, b in zip(lc, rc)))


def _conv(eqn: Equation) -> Dims:
    p = eqn.params
    dn = p["dimension_numbers"]
    lhs, rhs, out = tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)
    kernel = shape(eqn.invars[1])
    n = len(lhs) - 2
    ones = (1,) * n
    spatial_moves = [
        s
        for s in range(n)
        if kernel[rhs[2 + s]] != 1
        or p["window_strides"][s] != 1
        or tuple(p["padding"][s]) != (0, 0)
        or tuple(p.get("lhs_dilation") or ones)[s] != 1
        or tuple(p.get("rhs_dilation") or ones)[s] != 1
    ]
    dims: list[tuple] = [() for _ in range(len(out))]
    dims[out[0]] = ((0, lhs[0]),) if p.get("batch_group_count", 1) == 1 else ()
    dims[out[1]] = ((1, rhs[0]),)
    for s in range(n):
        dims[out[2 + s]] = () if s in spatial_moves else ((0, lhs[2 + s]),)
    mixed = [(0, lhs[2 + s]) for s in spatial_moves] + [(1, rhs[2 + s]) for s in range(n)]
    if p.get("batch_group_count", 1) != 1:
        mixed.append((0, lhs[0]))
    return Dims((tuple(dims),), contracted=(((0, lhs[1]), (1, rhs[1])),), mixed=tuple(mixed), what="convolves along")


def _iota(eqn: Equation) -> Dims:
    return Dims(tuple(tuple(() for _ in range(n)) for n in _out_ndims(eqn)), iota=((0, eqn.params["dimension"]),))


def _split(eqn: Equation) -> Dims:
    axis = eqn.params["axis"]
    return _along(eqn, lambda i: (axis,) if len(eqn.params["sizes"]) > 1 else (), "splits", operands=(0,))


def _top_k(eqn: Equation) -> Dims:
    axis = eqn.params.get("axis", _ndims(eqn)[0] - 1)
    return _along(eqn, lambda i: (axis,), "picks its top k along", operands=(0,))


def _sort(eqn: Equation) -> Dims:
    return _along(eqn, lambda i: (eqn.params["dimension"],), "sorts along")


def _axes_of(eqn: Equation, key: str = "axis_name") -> tuple[str, ...]:
    value = eqn.params.get(key)
    return tuple(v for v in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(v, str))


def _combining(eqn: Equation) -> Dims:
    return dataclasses.replace(_one_to_one(eqn), collective=Collective(_axes_of(eqn, "axes"), combines=True))


def _all_gather(eqn: Equation) -> Dims:
    p, n = eqn.params, _ndims(eqn)[0]
    d, axes = p["all_gather_dimension"], _axes_of(eqn)
    if p["tiled"]:
        return Dims((tuple(((0, k),) for k in range(n)),), collective=Collective(axes, joins=((0, d),)))
    # a new dimension d of the devices' blocks, in device order
    dims = [((0, k),) for k in range(n)]
    dims.insert(d, ())
    return Dims((tuple(dims),), collective=Collective(axes, joins=((0, d),)))


def _reduce_scatter(eqn: Equation) -> Dims:
    p, n = eqn.params, _ndims(eqn)[0]
    d, axes = p["scatter_dimension"], _axes_of(eqn)
    if p["tiled"]:
        return Dims((tuple(((0, k),) for k in range(n)),), collective=Collective(axes, combines=True, splits=((0, d),)))
    return Dims(
        (tuple(((0, k),) for k in range(n) if k != d),),
        mixed=((0, d),),
        what="scatters over devices along",
        collective=Collective(axes, combines=True),
    )


def _all_to_all(eqn: Equation) -> Dims:
    p, n = eqn.params, _ndims(eqn)[0]
    axes = _axes_of(eqn)
    if not p.get("tiled", False):
        return Dims(
            (tuple(((0, k),) for k in range(n)),),
            mixed=((0, p["split_axis"]), (0, p["concat_axis"])),
            what="exchanges (an untiled all-to-all) along",
            collective=Collective(axes, moves=True),
        )
    return Dims(
        (tuple(((0, k),) for k in range(n)),),
        collective=Collective(axes, joins=((0, p["concat_axis"]),), splits=((0, p["split_axis"]),)),
    )


def _ppermute(eqn: Equation) -> Dims:
    return dataclasses.replace(_one_to_one(eqn), collective=Collective(_axes_of(eqn), moves=True))


# Primitives whose outputs are their operands' values index by index: the allow-list of
# elementwise ones (zerojax never assumes an unlisted primitive is elementwise).
ELEMENTWISE = frozenset(
    {
        "abs",
        "acos",
        "acosh",
        "add",
        "add_any",
        "and",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "bessel_i0e",
        "bessel_i1e",
        "cbrt",
        "ceil",
        "clamp",
        "clz",
        "complex",
        "conj",
        "convert_element_type",
        "copy",
        "copy_p",
        "cos",
        "cosh",
        "digamma",
        "div",
        "eq",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "ge",
        "gt",
        "igamma",
        "igammac",
        "imag",
        "integer_pow",
        "is_finite",
        "le",
        "lgamma",
        "log",
        "log1p",
        "log2",
        "logistic",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "neg",
        "nextafter",
        "not",
        "one_minus_square",
        "or",
        "polygamma",
        "population_count",
        "pow",
        "real",
        "reduce_precision",
        "rem",
        "round",
        "rsqrt",
        "select_n",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "stop_gradient",
        "sub",
        "tan",
        "tanh",
        "xor",
        "zeta",
        "regularized_incomplete_beta",
        # the value unchanged, only where it lives or what it is called
        "name",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "pvary",
        "pcast",
        "pbroadcast",
    }
)
# Outputs that hold nothing of their operands' order: random bits (drawn per index, not
# per position), a device's index, tokens.
FRESH = frozenset(
    {
        "random_bits",
        "random_seed",
        "random_split",
        "random_fold_in",
        "random_wrap",
        "random_unwrap",
        "threefry2x32",
        "rng_bit_generator",
        "rng_uniform",
        "axis_index",
        "create_token",
        "after_all",
        "platform_index",
    }
)

_DIMS: dict[str, Callable[[Equation], Dims]] = {
    **{n: _elementwise for n in ELEMENTWISE},
    **{n: _fresh for n in FRESH},
    "optimization_barrier": _one_to_one,
    "device_put": _one_to_one,
    "bitcast_convert_type": _bitcast,
    "transpose": _transpose,
    "broadcast_in_dim": _broadcast,
    "squeeze": _squeeze,
    "reshape": _reshape,
    "reduce_sum": _reduce,
    "reduce_max": _reduce,
    "reduce_min": _reduce,
    "reduce_prod": _reduce,
    "reduce_and": _reduce,
    "reduce_or": _reduce,
    "reduce_xor": _reduce,
    "argmax": lambda e: _reduce(e, positional=True),
    "argmin": lambda e: _reduce(e, positional=True),
    "reduce": _generic_reduce,
    "slice": _slice,
    "pad": _pad,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update,
    "concatenate": lambda e: _along(e, lambda i: (e.params["dimension"],), "concatenates along"),
    "rev": lambda e: _along(e, lambda i: tuple(e.params["dimensions"]), "reverses"),
    **{
        n: (lambda what: lambda e: _along(e, lambda i: (e.params["axis"],), what))(what)
        for n, what in (
            ("cumsum", "sums cumulatively along"),
            ("cumprod", "multiplies cumulatively along"),
            ("cummax", "takes a cumulative maximum along"),
            ("cummin", "takes a cumulative minimum along"),
            ("cumlogsumexp", "takes a cumulative logsumexp along"),
        )
    },
    "sort": _sort,
    "top_k": _top_k,
    "split": _split,
    "reduce_window_sum": _windowed,
    "reduce_window_max": _windowed,
    "reduce_window_min": _windowed,
    "reduce_window": _windowed,
    "gather": _gather,
    "scatter": _scatter,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter-mul": _scatter,
    "scatter_mul": _scatter,
    "scatter-min": _scatter,
    "scatter_min": _scatter,
    "scatter-max": _scatter,
    "scatter_max": _scatter,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "iota": _iota,
    "psum": _combining,
    "psum_invariant": _combining,
    "pmax": _combining,
    "pmin": _combining,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "psum_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "ppermute": _ppermute,
}


def dims(eqn: Equation) -> Dims | None:
    """How ``eqn`` maps its operands' dimensions to its outputs' (:class:`Dims`); None for
    a primitive zerojax does not know (an analysis must not guess what it does)."""
    rule = _DIMS.get(eqn.primitive.name)
    if rule is None:
        return None
    return rule(eqn)


def no_outputs(eqn: Equation) -> bool:
    """Whether ``eqn`` returns nothing (a debug print, a callback run for its effect)."""
    return not eqn.outvars


# ----------------------------------------------------------------------------------------
# Source lines.


def _library_file(path: str) -> bool:
    """Whether ``path`` is zerojax's, Flax's or optax's own code (not the user's). The
    reference models (``zerojax/models``) count as the user's: a message points at the
    model line that did it."""
    import os

    import flax
    import optax

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # zerojax/
    roots = [package] + [os.path.dirname(m.__file__) for m in (flax, optax)]
    path = os.path.abspath(path)
    if path.startswith(os.path.join(package, "models") + os.sep):
        return False
    return any(path.startswith(r + os.sep) for r in roots)


def user_line(eqn: Equation, frames: int = 4) -> str | None:
    """The user's source lines of an equation, for messages: the innermost user frame and
    the ones that called it (a helper, then the layer that called the helper), as a
    traceback would show them, up to ``frames``. JAX's own frames are left out by JAX,
    zerojax's, Flax's and optax's here. None where no frame is the user's (an equation
    inside a ``jit`` of a library function is traced without its callers' frames).
    (``user_frames`` is JAX-internal: where it moves, this is None.)"""
    try:
        from jax._src import source_info_util as internal

        chain = [f for f in internal.user_frames(eqn.source_info.traceback) if not _library_file(f.file_name)]
        if chain:
            return ", called from ".join(f"{f.file_name}:{f.start_line} ({f.function_name})" for f in chain[:frames])
    except Exception:  # noqa: BLE001 - a message helper: never fail the error it decorates
        pass
    return None


def where(eqn: Equation, frames: int = 4) -> str:
    """:func:`user_line`, or where there is none, JAX's public one-line summary."""
    line = user_line(eqn, frames)
    if line:
        return line
    from jax.extend import source_info_util

    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001
        return "unknown source line"


def source_files(eqn: Equation) -> tuple[str, ...]:
    """The files of every frame that made ``eqn`` (JAX's own included), innermost first;
    () where JAX kept no traceback."""
    try:
        tb = eqn.source_info.traceback
        return tuple(f.file_name for f in tb.frames) if tb is not None else ()
    except Exception:  # noqa: BLE001 - a traceback JAX did not keep reads as none
        return ()


# ----------------------------------------------------------------------------------------
# Settings outside programs.


def manual_axes(mesh: Any) -> frozenset[str]:
    """The axes of ``mesh`` (an abstract mesh, as ``jax.sharding.get_abstract_mesh()``
    returns) that are manual where it is read: inside a ``shard_map`` over them."""
    return frozenset(getattr(mesh, "manual_axes", ()) or ())


def _min_compile_time_setting():
    try:  # the per-thread setting JAX compares a compile's duration with before it writes
        from jax._src.config import persistent_cache_min_compile_time_secs
    except ImportError as e:  # pragma: no cover - a JAX without it
        raise ImportError(
            "zerojax needs jax._src.config.persistent_cache_min_compile_time_secs to keep CPU steps out of "
            "the compilation cache; this JAX lacks it. Use a jax in the range pyproject.toml names."
        ) from e
    return persistent_cache_min_compile_time_secs


_MIN_COMPILE_TIME = _min_compile_time_setting()


def no_cache_writes():
    """A context in which compiles on this thread write nothing to JAX's persistent
    compilation cache (its minimum compile time for a write, set to infinity)."""
    import math

    return _MIN_COMPILE_TIME(math.inf)


# ----------------------------------------------------------------------------------------
# The import-time check.


def _custom_vjp_example():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))
    return f


def _checks():
    """``(construct, function of an f32[3, 2], its primitive (or the primitive's name), check of
    the first such equation)``."""

    def scanned(x):
        w = x[1] * 2.0  # a loop constant computed in the trace (a concrete array would start a backend)
        return jax.lax.scan(lambda c, r: (c * w + r, jnp.sum(r)), x[0], x)[0]

    yield (
        "jax.jit",
        lambda x: jax.jit(jnp.sin)(x),
        P.jit_p,
        lambda e: (s := structure(e)).kind == "call" and s.body.eqns,
    )
    yield (
        "jax.lax.scan",
        scanned,
        P.scan_p,
        lambda e: (
            (s := scan(e))
            and (s.n_consts, s.n_carry, s.length) == (1, 1, 3)
            and len(s.body.invars) == 3
            and len(s.body.outvars) == 2
        ),
    )
    yield (
        "jax.checkpoint",
        lambda x: jax.checkpoint(jnp.sin)(x),
        P.remat_p,
        lambda e: (r := remat(e)) and r.body.eqns and isinstance(r.prevent_cse, bool),
    )
    yield (
        "slicing (x[0])",
        lambda x: x[0],
        P.slice_p,
        lambda e: static_slice(e).limit == (1, 2) and dims(e).mixed == ((0, 0),),
    )
    yield (
        "jax.custom_jvp (jax.nn.relu)",
        jax.nn.relu,
        P.custom_jvp_call_p,
        lambda e: RULE_THUNKS[0] in e.params and structure(e).kind == "custom_jvp",
    )
    yield (
        "jax.custom_vjp",
        _custom_vjp_example(),
        P.custom_vjp_call_p,
        lambda e: RULE_THUNKS[1] in e.params and structure(e).kind == "custom_vjp",
    )
    looped = lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))
    yield (
        "jax.lax.while_loop",
        looped,
        P.while_p,
        lambda e: (s := structure(e)) and (s.n_cond, s.n_body) == (0, 0) and len(s.body.invars) == 2,
    )
    yield (
        "jax.lax.cond",
        lambda x: jax.lax.cond(x[0, 0] > 0, jnp.sin, jnp.cos, x),
        P.cond_p,
        lambda e: len(structure(e).branches) == 2,
    )

    idx = lambda x: jnp.zeros((3, 1), jnp.int32)
    yield (
        "jnp.take_along_axis",
        lambda x: jnp.take_along_axis(x, idx(x), axis=-1, mode="fill"),
        P.gather_p,
        lambda e: (
            (t := take_along(e))
            and (t.dim, t.pairs, t.fill) == (1, ((0, 0),), True)
            and has_batching_dims(e)
            and dims(e).mixed == ((0, 1),)
            and dims(e).out[0][0] == ((1, 0), (0, 0))
        ),
    )
    yield (
        "jnp.einsum",
        lambda x: jnp.einsum("ab,cb->ac", x, x),
        P.dot_general_p,
        lambda e: dims(e).contracted == (((0, 1), (1, 1)),) and dims(e).out[0] == (((0, 0),), ((1, 0),)),
    )
    yield ("jnp.arange", lambda x: x + jnp.arange(2), P.iota_p, lambda e: dims(e).iota == ((0, 0),))
    yield ("reshape", lambda x: x.reshape(6), P.reshape_p, lambda e: dims(e).out[0] == (((0, 0), (0, 1)),))
    yield (
        "broadcasting",
        lambda x: jax.lax.broadcast_in_dim(x, (3, 4, 2), (0, 2)),
        P.broadcast_in_dim_p,
        lambda e: dims(e).out[0] == (((0, 0),), (), ((0, 1),)),
    )
    yield (
        "jnp.concatenate",
        lambda x: jnp.concatenate([x, x]),
        P.concatenate_p,
        lambda e: dims(e).mixed == ((0, 0), (1, 0)),
    )
    yield ("jnp.pad", lambda x: jnp.pad(x, ((0, 0), (1, 0))), P.pad_p, lambda e: dims(e).mixed == ((0, 1),))
    yield ("jnp.sum", lambda x: jnp.sum(x, 0), P.reduce_sum_p, lambda e: dims(e).reduced == ((0, 0),))
    yield "jnp.cumsum", lambda x: jnp.cumsum(x, 0), "cumsum", lambda e: dims(e).mixed == ((0, 0),)
    from jax.sharding import AbstractMesh, AxisType

    mesh = AbstractMesh((1,), ("zerojax_check",), axis_types=(AxisType.Auto,))

    def under_mesh(x):
        with jax.sharding.use_abstract_mesh(mesh):
            return jnp.sin(x)

    no_mesh = AbstractMesh((), ())
    yield (
        "the mesh an equation was traced under",
        under_mesh,
        "sin",
        lambda e: traced_mesh(e) == mesh and traced_mesh(_under_mesh(e, no_mesh)) == no_mesh,
    )

    gathered = lambda x: jax.lax.all_gather(x, "zerojax_check", axis=0, tiled=True) * 2
    yield (
        "jax.shard_map",
        jax.shard_map(gathered, mesh=mesh, in_specs=jax.P("zerojax_check"), out_specs=jax.P("zerojax_check")),
        "shard_map",
        lambda e: (
            (r := structure(e)).kind == "shard_map"
            and r.in_specs == ((("zerojax_check",), ()),)
            and r.axes == {"zerojax_check"}
            and r.source
            and r.source.endswith("jax_compat.py")
        ),
    )
    yield (
        "jax.lax.all_gather",
        jax.shard_map(gathered, mesh=mesh, in_specs=jax.P("zerojax_check"), out_specs=jax.P("zerojax_check")),
        "all_gather",
        lambda e: dims(e).collective.joins == ((0, 0),) and collective_axes(e) == ("zerojax_check",),
    )


def self_check() -> None:
    """Traces each construct zerojax reads and reads it through this module, so that a
    JAX release that moves one fails at import, naming the construct."""
    from zerojax.sharding import walk  # imports this module: only here, once both exist

    x = jax.ShapeDtypeStruct((3, 2), jnp.float32)  # abstract: importing must not start a backend
    for what, fn, prim, ok in _checks():
        found = walk.equations(jax.make_jaxpr(fn)(x).jaxpr)  # nested calls too: jnp functions run as jitted programs
        match = (
            (lambda e: True)
            if prim is None
            else (lambda e: name(e) == prim)
            if isinstance(prim, str)
            else (lambda e: e.primitive is prim)
        )
        eqns = [e for e in found if match(e)]
        if not eqns:
            raise _unsupported(what, f"it no longer traces to the primitive {getattr(prim, 'name', prim)!r}")
        eqn = eqns[0]
        try:
            good = bool(ok(eqn))
        except (KeyError, AttributeError, TypeError, ValueError, IndexError) as e:
            raise _unsupported(
                what, f"primitive {name(eqn)!r} has parameters {sorted(eqn.params)}, read as {type(e).__name__}: {e}"
            ) from e
        if not good:
            raise _unsupported(
                what, f"primitive {name(eqn)!r} has parameters {sorted(eqn.params)} that read differently than expected"
            )
