"""How each JAX primitive maps its operands' dimensions to its outputs' (:func:`dims`).

Passes that follow dimensions through a program (the sequence-order check of a context
layout that moves the sequence) ask :func:`dims` what an equation does to each operand
dimension, in zerojax's terms (:class:`Dims`, :class:`Collective`): aligned index by index,
contracted, reduced, mixed (moved, picked or combined along), an ``iota``'s index, or
exchanged across devices. The table is an allow-list: a primitive not in it is unknown
(``None``), and an analysis must not guess what it does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from zerojax._jaxpr.constructs import static_slice
from zerojax._jaxpr.form import Equation, shape


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
    ``combined``: groups of operand dimensions aligned index by index and reduced together
    in an order-independent way (a scatter-add's updates and the indices that say where
    each goes: ``jax.ops.segment_sum``), the result holding none of them.
    ``mixed``: operand dimensions along which the equation moves, picks or combines
    positions (a slice that cuts, a pad, a concatenation, a reverse, a cumulative op, a
    sort, a gather's indexed dimension, a window, an argmax) — ``what`` says how.
    ``iota``: ``(output, dimension)`` pairs holding their index (``lax.iota``,
    ``jnp.arange``). ``collective``: what it does across devices, if anything. An operand
    dimension in none of these is dropped (a squeezed dimension of size one)."""

    out: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    contracted: tuple[tuple[tuple[int, int], ...], ...] = ()
    reduced: tuple[tuple[int, int], ...] = ()
    combined: tuple[tuple[tuple[int, int], ...], ...] = ()
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


# Scatters that combine the updates landing on one index with a commutative, associative
# operation: which update comes first does not change the result.
_COMBINING_SCATTERS = frozenset(
    {
        "scatter-add",
        "scatter_add",
        "scatter-mul",
        "scatter_mul",
        "scatter-min",
        "scatter_min",
        "scatter-max",
        "scatter_max",
    }
)


def _scatter(eqn: Equation) -> Dims:
    dn = eqn.params["dimension_numbers"]
    # Each update's place comes from its own index, so the updates' scattered dimensions
    # (and the indices' dimensions beside them) are reduced in no particular order where
    # the scatter combines what lands on one index; not where it overwrites (a plain
    # scatter: the last write wins), nor where it tells XLA the indices are sorted.
    combining = eqn.primitive.name in _COMBINING_SCATTERS and not eqn.params.get("indices_are_sorted", False)
    combined = []
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
        elif combining:
            combined.append(((1, j), (2, u)))
        else:
            mixed.append((2, u))
            mixed.append((1, j))
    return Dims(
        (tuple(tuple(per_dim[d]) for d in range(len(operand))),),
        combined=tuple(combined),
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
