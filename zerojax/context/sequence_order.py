"""Refusing a loss that would be silently wrong on a sequence the balanced layout permutes.

With ``ZeroConfig(context={"layout": "balanced"})`` the train step hands the loss each batch
leaf's sequence dimension permuted into ring attention's balanced order
(:meth:`zerojax.context.Layout.order`). What the loss does along that dimension decides whether
it is still exact:

* exact: elementwise ops (the permuted dimension meets the same permuted dimension, or a
  value constant along it), reductions over it that are commutative and associative (a sum
  or a max does not see the order; a scatter-add, ``jax.ops.segment_sum``, sums what lands
  on one index in no order; a ``scan`` whose changing carries only accumulate, ``c + f(x)``
  or ``max(c, f(x))``, and that nothing else reads), contractions where both operands hold
  the same permuted dimension (attention's ``probs @ v`` over keys), gathers that index
  other dimensions (a token embedding, optax's integer-label cross-entropy picking each
  target's logit), the kernels of ``zj.nn.dot_product_attention``, which know the layout,
  and computations that declare themselves maps over rows in any order (:func:`rows`:
  dropless ``zj.nn.routed_experts``);
* silently wrong: anything that moves, picks or combines positions along it (a slice such
  as ``logits[:, :-1]``, a pad, a concatenation, ``jnp.roll``, a reverse, ``jnp.cumsum``, a
  sort, a gather or dynamic slice along it, a convolution or window over it, ``argmax``
  over it, a scan whose outputs or other carries read a carry, a plain scatter whose last
  write wins, a scatter told its indices are sorted), a contraction of it with a dimension
  that is not permuted (a token-mixing matmul), computations over rows that depend on their
  order (``routed_experts`` with a capacity), and values in natural order meeting it: an
  index (an ``iota``: ``jnp.arange(T)`` positions into RoPE, a causal mask
  ``jnp.tril(jnp.ones((T, T)))``), a parameter or batch leaf the step does not permute (a
  learned position table sliced ``table[:T]``), or what a slice, pad, concatenation or
  cumulative op makes along a dimension. (``zj.nn.global_positions(T)`` is a constant of
  the layout's order, so its positions, and ``table[global_positions(T, layout)]``, are
  right.)

:func:`check_sequence_order` is a dataflow pass on :mod:`zerojax._jaxpr.walk`: each
value carries, per dimension, a set of tags, ``"permuted"`` (holds the permuted sequence),
``"iota"`` (holds an index in natural order) and ``"natural"`` (varies along it in natural
order: every dimension of an input that holds no permuted one, and what a slice, pad,
concatenation or cumulative op makes), propagated through every equation by how
:func:`zerojax._jaxpr.rules.dims` says the equation maps dimensions (a reshape that merges
or splits a permuted dimension keeps every part tagged; merged with it, another
dimension's natural order is not one along the sequence), into and out of
calls, remat regions, custom derivatives' primals, scan and while bodies (carries to a
fixed point) and cond branches. Inside a ``shard_map`` the tags also record which mesh axes
a dimension is split over, so a collective that sums or moves blocks of the sequence
across devices is refused and one that gathers or scatters them in order is not (the
sequence-parallel matmuls of :mod:`zerojax.nn.megatron`); the regions
``zj.nn.dot_product_attention`` makes are taken as layout-aware (each output dimension
split over the region's axes carries the tags of the inputs' split dimensions), except for
a mask or bias handed to them that was built over the sequence in natural order
(``nn.make_causal_mask``): the kernels read it by the permuted indices.

It refuses with a ``ValueError`` naming the op, the line of the user's code that made it
and the fix. An equation whose primitive zerojax does not know is refused when a permuted
dimension reaches it (never guessed exact); the elementwise ones it knows are
``rules.ELEMENTWISE``. Not detected: positions built by a loop counter, a table in natural
order captured as a constant (untagged, like the constant ``global_positions`` returns,
where a parameter is not), and an ``iota`` that passes through an unknown primitive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zerojax._jaxpr import check, constructs, form, rules, walk
from zerojax._jaxpr.form import Equation
from zerojax.context.layout import KERNEL_SCOPE

PERMUTED = "permuted"
IOTA = "iota"
NATURAL = "natural"  # varies along the dimension in natural order: a parameter, an unpermuted leaf

FIX = (
    "Give shifted targets in the batch (separate inputs and targets leaves, not tokens[:, :-1] and "
    "tokens[:, 1:] in the loss); build positions with zj.nn.global_positions instead of jnp.arange; use "
    "zj.nn.dot_product_attention for attention and its causal mask; or train with "
    "context={'layout': 'contiguous'}."
)

Tags = tuple[frozenset, ...] | None  # per dimension; None: nothing tagged


def check_sequence_order(closed_jaxpr: Any, permuted_dims: Sequence[frozenset[int]], *, what: str = "the loss") -> None:
    """Refuses (``ValueError``) a program that would be silently wrong on inputs whose
    dimensions ``permuted_dims[i]`` (one set per flat input of ``closed_jaxpr``, negative
    counting from the end) hold a sequence in the balanced layout's order; returns None
    for an exact one. ``what`` names the program in the message (``"loss_fn"``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def loss(x):
      ...     return jnp.mean(x ** 2)            # exact on any order
      >>> check_sequence_order(jax.make_jaxpr(loss)(jnp.ones((2, 8))), [frozenset({1})])
      >>> def shifted(x):
      ...     return jnp.mean(x[:, 1:] - x[:, :-1])
      >>> check_sequence_order(jax.make_jaxpr(shifted)(jnp.ones((2, 8))), [frozenset({1})])
      Traceback (most recent call last):
      ...
      ValueError: the loss would be silently wrong...

    Where zerojax reads no program (:func:`zerojax._jaxpr.check.reading`) it refuses to
    check (:class:`zerojax._jaxpr.check.ProgramReadingRequired`) rather than pass a program
    it cannot read.
    """
    check.require("check_sequence_order", "Lay the sequence out contiguously, which needs no order check.")
    jaxpr, consts = form.open_jaxpr(closed_jaxpr)
    if len(permuted_dims) != len(jaxpr.invars):
        raise ValueError(
            f"check_sequence_order: {len(permuted_dims)} sets of permuted dimensions for a program of "
            f"{len(jaxpr.invars)} inputs; give one (possibly empty) per flat input."
        )
    args = []
    for k, (v, dims) in enumerate(zip(jaxpr.invars, permuted_dims)):
        n = len(form.shape(v))
        dims = {int(d) for d in dims}
        if any(not -n <= d < n for d in dims):
            raise ValueError(
                f"check_sequence_order: input {k} has shape {form.shape(v)}, no dimension "
                f"{sorted(d for d in dims if not -n <= d < n)}."
            )
        if dims:
            args.append(_make([frozenset({PERMUTED}) if d in {x % n for x in dims} else frozenset() for d in range(n)]))
        else:  # a parameter, a batch leaf the step does not permute: its values are in natural order
            args.append(_make([frozenset({NATURAL})] * n))
    _Tags(what).run(jaxpr, [None] * len(consts), args)


# ----------------------------------------------------------------------------------------
# Tags.


def _make(dims: Sequence[frozenset]) -> Tags:
    return tuple(dims) if any(dims) else None


def _at(tags: Tags, d: int) -> frozenset:
    return frozenset() if tags is None or d >= len(tags) else tags[d]


def _full(tags: Tags, ndim: int) -> list[frozenset]:
    return [frozenset()] * ndim if tags is None else list(tags)


def _order(tags: frozenset) -> frozenset:
    """The tags that say what order a dimension is in (not where its blocks live)."""
    return frozenset(t for t in tags if t in (PERMUTED, IOTA, NATURAL))


def _natural(tags: frozenset) -> frozenset:
    """Of ``tags``, the ones that say the values follow the natural order."""
    return tags & {IOTA, NATURAL}


NATURAL_FIX = (
    "A table indexed by position (a learned position embedding sliced table[:T]) must be indexed by each "
    "token's position in the layout: table[zj.nn.global_positions(T, layout)], or by positions given in the "
    "batch (the step permutes them with the tokens); a per-example batch leaf must not be combined with "
    "the sequence along it; or train with context={'layout': 'contiguous'}."
)
ROWS_FIX = (
    "Route dropless (capacity_factor=None: each token's result is its own, whatever the tokens' order), "
    "or train with context={'layout': 'contiguous'}."
)
SCAN_FIX = (
    "Reduce over the sequence with an order-free op (a sum, a max, jax.ops.segment_sum), or let the scan "
    "only accumulate into its carry; or train with context={'layout': 'contiguous'}."
)


def _split_over(tags: frozenset, axes) -> bool:
    return any(("split", a) in tags for a in axes)


class _Tags(walk.Dataflow):
    """The dataflow pass (see the module docstring)."""

    def __init__(self, what: str):
        self.what = what
        self.calls: list[str] = []  # names of the calls being walked, for messages

    # Facts of constants: nothing tagged.
    def literal(self, value: Any) -> Tags:
        return None

    def constant(self, value: Any) -> Tags:
        return None

    def join(self, a: Tags, b: Tags) -> Tags:
        if a is None or b is None:
            return b if a is None else a
        return tuple(x | y for x, y in zip(a, b))

    def unstack(self, tags: Tags) -> Tags:
        return None if tags is None else _make(tags[1:])

    # Refusals.
    def refuse(self, eqn: Equation, detail: str, fix: str = FIX) -> None:
        inside = f" (inside {self.calls[-1]!r})" if self.calls and self.calls[-1] else ""
        raise ValueError(
            f"{self.what} would be silently wrong with ZeroConfig(context={{'layout': 'balanced'}}): the step hands it each "
            f"batch sequence permuted into ring attention's balanced order (zj.context.Layout.order), and at "
            f"{self.where(eqn)}{inside} '{form.name(eqn)}' {detail}. {fix}"
        )

    def _operand(self, eqn: Equation, i: int) -> str:
        return form.type_name(eqn.invars[i])

    @staticmethod
    def _natural_what(tags: frozenset) -> str:
        if IOTA in tags:
            return (
                "an index in natural order (an iota: jnp.arange, jnp.tril, jnp.triu, a mask or positions built "
                "over the sequence length)"
            )
        return (
            "values in natural order along it (a parameter, a batch leaf the step does not permute, or "
            "what a slice, pad, concatenation or cumulative op made of one)"
        )

    @staticmethod
    def _natural_fix(tags: frozenset) -> str:
        return FIX if IOTA in tags else NATURAL_FIX

    # Plain equations.
    def primitive(self, eqn: Equation, ins: list[Tags]) -> list[Tags]:
        d = rules.dims(eqn)
        if d is None:
            if rules.no_outputs(eqn):
                return []
            for i, t in enumerate(ins):
                for k, tags in enumerate(_full(t, len(form.shape(eqn.invars[i])))):
                    if PERMUTED in tags:
                        self.refuse(
                            eqn,
                            f"is an operation zerojax does not know the dimensions of, applied to "
                            f"dimension {k} of a {self._operand(eqn, i)} value, which holds the permuted "
                            "sequence; zerojax refuses rather than guess that it is exact there",
                        )
            return [None] * len(eqn.outvars)
        if all(t is None for t in ins) and not d.iota and not d.mixed:
            return [None] * len(eqn.outvars)
        tag = lambda i, k: _at(ins[i], k)
        accounted: set[tuple[int, int]] = set(d.reduced)

        for i, k in d.mixed:
            accounted.add((i, k))
            if PERMUTED in tag(i, k):
                self.refuse(
                    eqn, f"{d.what} dimension {k} of a {self._operand(eqn, i)} value, which holds the permuted sequence"
                )
        for group in d.contracted:
            accounted.update(group)
            perm = [PERMUTED in tag(i, k) for i, k in group]
            if any(perm) and not all(perm):
                (pi, pk), (oi, ok) = group[perm.index(True)], group[perm.index(False)]
                self.refuse(
                    eqn,
                    f"contracts dimension {pk} of a {self._operand(eqn, pi)} value, which holds the "
                    f"permuted sequence, with dimension {ok} of a {self._operand(eqn, oi)} value, which "
                    "does not (a matmul over positions is exact only between two values both holding "
                    "the permuted sequence there)",
                )
            if any(perm) and any(IOTA in tag(i, k) for i, k in group):
                self.refuse(
                    eqn,
                    "contracts the permuted sequence with an index in natural order (an iota: "
                    "jnp.arange, jnp.tril, jnp.triu)",
                )
        for group in d.combined:
            accounted.update(group)
            if any(PERMUTED in tag(i, k) for i, k in group):
                for i, k in group:
                    if _natural(tag(i, k)) and PERMUTED not in tag(i, k):
                        self.refuse(
                            eqn,
                            f"sums the permuted sequence by {self._natural_what(tag(i, k))} (dimension {k} "
                            f"of a {self._operand(eqn, i)} value): each position's value and its index must "
                            "travel together",
                            self._natural_fix(tag(i, k)),
                        )
        outs: list[list[frozenset]] = []
        for o, sources in enumerate(d.out):
            dims = []
            for k, src in enumerate(sources):
                accounted.update(src)
                tags = frozenset().union(*(tag(i, j) for i, j in src)) if src else frozenset()
                operands = {i for i, _ in src}
                if len(src) > 1 and len(operands) == 1:
                    # several dimensions of one value merged into one (a reshape): a natural
                    # order along one of them is not an order along the permuted one
                    if PERMUTED in tags:
                        tags = tags - {IOTA, NATURAL}
                elif PERMUTED in tags and _natural(tags):
                    ordered = [(i, j) for i, j in src if _natural(tag(i, j))]
                    if IOTA in tags or any(PERMUTED in tag(i, j) for i, j in ordered) or len(operands) > 1:
                        i, j = ordered[0]
                        self.refuse(
                            eqn,
                            f"combines the permuted sequence with {self._natural_what(tag(i, j))} (dimension "
                            f"{j} of a {self._operand(eqn, i)} value) at dimension {k} of its "
                            f"{form.type_name(eqn.outvars[o])} result",
                            self._natural_fix(tag(i, j)),
                        )
                dims.append(tags)
            outs.append(dims)
        for i, k in d.mixed:  # moving or combining positions puts the values in an order of their own
            if PERMUTED not in tag(i, k):
                for o, sources in enumerate(d.out):
                    for kk, src in enumerate(sources):
                        if (i, k) in src:
                            outs[o][kk] = outs[o][kk] | {NATURAL}
        for o, k in d.iota:
            outs[o][k] = outs[o][k] | {IOTA}
            if PERMUTED in outs[o][k]:
                self.refuse(eqn, "combines the permuted sequence with an index in natural order")
        if d.collective is not None:
            self._collective(eqn, d, ins, outs)
        for i, t in enumerate(ins):
            for k, tags in enumerate(_full(t, len(form.shape(eqn.invars[i])))):
                if PERMUTED in tags and (i, k) not in accounted:
                    self.refuse(
                        eqn,
                        f"drops or moves dimension {k} of a {self._operand(eqn, i)} value, which holds "
                        "the permuted sequence, in a way zerojax does not follow",
                    )
        return [_make(dims) for dims in outs]

    def _collective(self, eqn: Equation, d: rules.Dims, ins: list[Tags], outs: list[list[frozenset]]) -> None:
        """A collective inside a ``shard_map``: blocks of the sequence may be summed or moved
        across devices (refused) or gathered and scattered in device order (kept)."""
        c = d.collective
        axes = c.axes
        blocks = [
            (i, k)
            for i, t in enumerate(ins)
            for k, tags in enumerate(_full(t, 0))
            if PERMUTED in tags and _split_over(tags, axes)
        ]
        joined = set()
        for o, k in c.joins:
            src = d.out[o][k]
            if not src:  # a new dimension of the devices' blocks (an untiled all_gather)
                if blocks:
                    outs[o][k] = outs[o][k] | {PERMUTED}
                    joined.update(blocks)
                continue
            for i, j in src:
                tags = _at(ins[i], j)
                if PERMUTED in tags and not all(("split", a) in tags for a in axes):
                    self.refuse(
                        eqn,
                        f"joins the devices' blocks along dimension {j} of a {self._operand(eqn, i)} "
                        f"value, which holds the whole permuted sequence on each device (not split "
                        f"over {axes})",
                    )
                joined.add((i, j))
            outs[o][k] = frozenset(t for t in outs[o][k] if not (isinstance(t, tuple) and t[1] in axes))
        for o, k in c.splits:
            outs[o][k] = outs[o][k] | {("split", a) for a in axes}
        left = [b for b in blocks if b not in joined]
        if left and (c.combines or c.moves or c.joins):
            i, k = left[0]
            how = "reduces across devices" if c.combines else "moves between devices" if c.moves else "stacks"
            self.refuse(
                eqn,
                f"{how} blocks of dimension {k} of a {self._operand(eqn, i)} value, which holds the "
                f"permuted sequence split over {axes}: it mixes different positions",
            )

    # Constructs.
    def call(self, eqn: Equation, c: constructs.Call, ins: list[Tags]) -> list[Tags]:
        if c.name.startswith((ROWS_ANY_ORDER, ROWS_IN_ORDER)):
            return self._rows(eqn, c, ins)
        self.calls.append(c.name)
        try:
            return super().call(eqn, c, ins)
        finally:
            self.calls.pop()

    def scan(self, eqn: Equation, s: constructs.Scan, ins: list[Tags]) -> list[Tags]:
        xs = ins[s.n_consts + s.n_carry :]
        lead = frozenset().union(*(_order(_at(t, 0)) for t in xs))
        why = _carries_in_order(s.body, s.n_consts, s.n_carry) if PERMUTED in lead and s.n_carry else None
        if why:
            i = next(i for i, t in enumerate(xs) if PERMUTED in _at(t, 0)) + s.n_consts + s.n_carry
            self.refuse(
                eqn,
                f"loops over dimension 0 of a {self._operand(eqn, i)} value, which holds the permuted "
                f"sequence, carrying state from one position to the next ({why}; a carry that only "
                "accumulates, c + f(x), max(c, f(x)), and that nothing else reads, is exact)",
                SCAN_FIX,
            )
        outs = super().scan(eqn, s, ins)
        ys = outs[s.n_carry :]
        ranks = [len(form.shape(v)) for v in eqn.outvars[s.n_carry :]]
        return [*outs[: s.n_carry], *(_make([lead, *_full(y, n - 1)]) for y, n in zip(ys, ranks))]

    def _rows(self, eqn: Equation, c: constructs.Call, ins: list[Tags]) -> list[Tags]:
        """A computation over rows (:func:`rows`): read whole, as it declares itself."""
        what = c.name.split(":", 1)[1] if ":" in c.name else "a computation over rows"
        shapes = [form.shape(v) for v in eqn.invars]
        n = shapes[0][0] if shapes and shapes[0] else None
        lead = frozenset()
        for i, t in enumerate(ins):
            for k, tags in enumerate(_full(t, len(shapes[i]))):
                if PERMUTED not in tags:
                    continue
                if k != 0 or shapes[i][0] != n:
                    self.refuse(
                        eqn,
                        f"({what}) is given a {self._operand(eqn, i)} value whose dimension {k} holds the "
                        f"permuted sequence; it maps rows (dimension 0, {n} of them) only",
                    )
                if c.name.startswith(ROWS_IN_ORDER):
                    self.refuse(
                        eqn,
                        f"({what}) depends on the order of its rows, and dimension 0 of a "
                        f"{self._operand(eqn, i)} value it is given holds the permuted sequence",
                        ROWS_FIX,
                    )
                lead = frozenset({PERMUTED})
        if not lead:
            lead = frozenset().union(*(_order(_at(t, 0)) for t, sh in zip(ins, shapes) if sh and sh[0] == n))
        outs = [form.shape(v) for v in eqn.outvars]
        return [_make([lead] + [frozenset()] * (len(sh) - 1)) if sh and sh[0] == n else None for sh in outs]

    def region(self, eqn: Equation, r: constructs.ManualRegion, ins: list[Tags]) -> list[Tags]:
        if KERNEL_SCOPE in form.scope(eqn):  # zj.nn.dot_product_attention's kernel: it knows the layout
            self._natural_mask(eqn, ins)
            split = frozenset().union(
                *(
                    _order(_at(t, k))
                    for t, spec in zip(ins, r.in_specs)
                    for k, axes in enumerate(spec)
                    if set(axes) & r.axes
                )
            )
            return [_make([split if set(axes) & r.axes else frozenset() for axes in spec]) for spec in r.out_specs]
        body_in = [
            _make([_at(t, k) | {("split", a) for a in axes} for k, axes in enumerate(spec)])
            for t, spec in zip(ins, r.in_specs)
        ]
        outs = self.run(r.body, [None] * len(r.consts), body_in)
        whole = lambda tags: frozenset(x for x in tags if not (isinstance(x, tuple) and x[1] in r.axes))
        return [None if t is None else _make([whole(tags) for tags in t]) for t in outs]

    def _natural_mask(self, eqn: Equation, ins: list[Tags]) -> None:
        """A layout-aware kernel reads a mask or bias by the loss's (permuted) indices: one
        built over the sequence in natural order (an ``iota``: ``nn.make_causal_mask``,
        ``jnp.tril``) and holding nothing permuted would be read wrong. Such an input is
        told apart from the queries (whose head dimension may hold RoPE's ``iota``) by
        holding no permuted dimension, and from other inputs by its ``iota`` dimension
        having the sequence's length."""
        shapes = [form.shape(v) for v in eqn.invars]
        lengths = {shapes[i][k] for i, t in enumerate(ins) for k, tags in enumerate(_full(t, 0)) if PERMUTED in tags}
        for i, t in enumerate(ins):
            tags = _full(t, 0)
            if tags and not any(PERMUTED in x for x in tags):
                for k, x in enumerate(tags):
                    if _natural(x) and shapes[i][k] in lengths:
                        self.refuse(
                            eqn,
                            f"(zj.nn.dot_product_attention's kernel) is given a {self._operand(eqn, i)} "
                            f"mask or bias whose dimension {k} was built over the sequence in natural "
                            "order (an iota: nn.make_causal_mask, jnp.tril; or a parameter); the kernel "
                            "reads it by the permuted indices. Pass is_causal=True instead, or give the "
                            "mask in the batch",
                        )


# ----------------------------------------------------------------------------------------
# Computations over rows, declared.

ROWS_ANY_ORDER = "zerojax_rows_in_any_order"
ROWS_IN_ORDER = "zerojax_rows_in_order"


def rows(fn: Any, *, order_free: bool, what: str) -> Any:
    """``fn`` as one call that :func:`check_sequence_order` reads as what it declares, not
    equation by equation: ``fn(*args)`` maps row ``r`` (dimension 0) of its arguments with
    the first argument's rows to row ``r`` of its outputs with as many (other outputs: a
    reduction over the rows). ``order_free``: the rows may come in any order (each row's
    result is the same: dropless ``zj.nn.routed_experts``, whose dispatch sorts the rows by
    expert and back); otherwise the result depends on their order (a capacity that keeps an
    expert's first assignments), and permuted rows are refused. ``what`` names it in the
    check's messages. Traced programs only: called on arrays, ``fn`` runs as it is."""
    import jax

    from zerojax._jaxpr import settings

    def call(*args):
        return fn(*args)

    call.__name__ = f"{ROWS_ANY_ORDER if order_free else ROWS_IN_ORDER}:{what}"

    def run(*args):
        if any(settings.is_tracer(a) for a in jax.tree.leaves(args)):
            return jax.jit(call)(*args)
        return fn(*args)

    return run


# ----------------------------------------------------------------------------------------
# Scans over the sequence.

# Primitives that fold a value into an accumulator commutatively and associatively.
_ACCUMULATE = frozenset({"add", "add_any", "mul", "max", "min", "and", "or"})
_PASS_THROUGH = frozenset({"convert_element_type", "copy", "copy_p"})


def _carries_in_order(body: Any, n_consts: int, n_carry: int) -> str | None:
    """Why a ``scan`` body's carries make its result depend on the order of its iterations,
    or None where they cannot: each carry that changes is only accumulated into (``c = c ⊕
    f(consts, x)`` for one commutative, associative ``⊕``: a sum, a product, a maximum),
    and nothing else (the stacked outputs, another carry) reads a changing carry."""
    carries = list(body.invars[n_consts : n_consts + n_carry])
    outs = list(body.outvars[:n_carry])
    seeds = {v: c for c, v in enumerate(carries) if outs[c] is not v}  # a carry handed on as it is: a constant
    dep: dict[Any, frozenset] = {v: frozenset({c}) for v, c in seeds.items()}
    made: dict[Any, Equation] = {}
    read = lambda v: frozenset() if form.is_literal(v) else dep.get(v, frozenset())
    for eqn in body.eqns:
        d = frozenset().union(*(read(v) for v in eqn.invars))
        for o in eqn.outvars:
            dep[o], made[o] = d, eqn
    if any(read(y) for y in body.outvars[n_carry:]):
        return "an output it stacks reads its carry"
    for c, v in enumerate(outs):
        if carries[c] not in seeds:
            continue
        op = None
        while v is not carries[c]:
            eqn = None if form.is_literal(v) else made.get(v)
            if eqn is not None and form.name(eqn) in _PASS_THROUGH and len(eqn.invars) == 1:
                v = eqn.invars[0]  # a cast of the accumulator (a weak type made strong)
                continue
            if eqn is None or form.name(eqn) not in _ACCUMULATE or len(eqn.invars) != 2:
                return f"carry {c} is not a sum, product, maximum or minimum of itself and the iteration's values"
            if op is not None and form.name(eqn) != op:
                return f"carry {c} mixes '{op}' and '{form.name(eqn)}'"
            op = form.name(eqn)
            a, b = eqn.invars
            if read(a) and read(b):
                return f"carry {c} is combined with a value that reads a carry"
            v = a if read(a) else b
            if read(v) != frozenset({c}):
                return f"carry {c} reads another carry"
    return None
