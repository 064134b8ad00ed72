"""The constructs of JAX's program form that zerojax reads, in zerojax's terms.

An equation that runs programs of its own (a call, a remat region, a custom derivative, a
``scan``, a ``while``, a ``cond``, a ``shard_map``) is read into a :class:`Call`,
:class:`Scan`, :class:`Loop`, :class:`Branches` or :class:`ManualRegion`
(:func:`structure`); per-use gathering asks which equations only change a value's shape
(:func:`shape_only`) or keep no operand for backward (:func:`keeps_no_operands`); and single
constructs are read where a pass needs them (a slice's bounds, a sharding constraint's
spec, a ``take_along_axis`` gather, a collective's axes). Everything is read through
:mod:`zerojax._jaxpr.form`'s primitives and checked by :mod:`zerojax._jaxpr.check`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from zerojax._jaxpr.form import Equation, Jaxpr, P, open_jaxpr, shape, sub_programs
from zerojax._jaxpr.lines import where


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
    return any(True for _ in sub_programs(eqn))


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
