"""The layer scan of a loss, and which of its operands come from the batch or the key.

A pipeline splits the one ``scan`` of a loss that iterates over the layer stack (the
parameters :mod:`zerojax.sharding.stack_leaves` split over the pipeline axis). This
dataflow pass over the loss's jaxpr tags every value with where it comes from: the batch
(:data:`BATCH`), the step's key (:data:`KEY`), the model state (:data:`STATE`), or a stack
parameter itself (``("stack", i)``, kept through casts only). At the scan that takes the
stack parameters as scanned operands it records the tags of every operand and output
(:class:`LayerScan`); a stack parameter used anywhere else is recorded as a stray use,
with its source line. :func:`find` returns the one layer scan or refuses the loss with the
fix, before anything compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zerojax._jaxpr import constructs, walk
from zerojax._jaxpr.form import Equation

BATCH, KEY, STATE = "batch", "key", "state"


def stack_tag(i: int) -> tuple[str, int]:
    return ("stack", i)


def stacks_in(fact: frozenset) -> set[int]:
    return {t[1] for t in fact if isinstance(t, tuple)}


@dataclasses.dataclass(frozen=True)
class LayerScan:
    """The layer scan: its equation, its :class:`~zerojax._jaxpr.constructs.Scan` reading,
    the tags of its operands (``consts + carry + xs``) and of its outputs (``carry + ys``,
    after the carry's fixed point), and the user's line."""

    eqn: Equation
    scan: constructs.Scan
    ins: tuple[frozenset, ...]
    outs: tuple[frozenset, ...]
    where: str

    def stack_operand(self, k: int) -> int | None:
        """The stack parameter that operand ``k`` is (cast at most), or None."""
        s = stacks_in(self.ins[k])
        return next(iter(s)) if s else None


class _Facts(walk.Dataflow):
    def __init__(self) -> None:
        self.scans: list[LayerScan] = []
        self.strays: list[tuple[int, str]] = []

    def literal(self, value: Any) -> frozenset:
        return frozenset()

    def constant(self, value: Any) -> frozenset:
        return frozenset()

    def join(self, a: frozenset, b: frozenset) -> frozenset:
        return a | b

    def unstack(self, fact: frozenset) -> frozenset:
        return frozenset(t for t in fact if not isinstance(t, tuple))

    def primitive(self, eqn: Equation, ins: list) -> list:
        union = frozenset().union(*ins) if ins else frozenset()
        unary = constructs.shape_only(eqn)
        if unary is not None and unary.slice_safe:  # a cast keeps a stack parameter what it is
            return [union] * len(eqn.outvars)
        for i in sorted(stacks_in(union)):
            self.strays.append((i, self.where(eqn)))
        return [self.unstack(union)] * len(eqn.outvars)

    def scan(self, eqn: Equation, s: constructs.Scan, ins: list) -> list:
        xs = ins[s.n_consts + s.n_carry :]
        if not any(stacks_in(x) for x in xs):
            return super().scan(eqn, s, ins)
        for f in ins[: s.n_consts + s.n_carry]:
            for i in sorted(stacks_in(f)):
                self.strays.append((i, self.where(eqn)))
        clean = [self.unstack(f) for f in ins[: s.n_consts + s.n_carry]] + list(xs)
        outs = super().scan(eqn, s, clean)
        self.scans.append(LayerScan(eqn, s, tuple(ins), tuple(outs), self.where(eqn)))
        return outs

    def region(self, eqn: Equation, r: Any, ins: list) -> list:
        for f in ins:
            for i in sorted(stacks_in(f)):
                self.strays.append((i, self.where(eqn)))
        return super().region(eqn, r, [self.unstack(f) for f in ins])


def find(closed: Any, facts: list[frozenset], paths: list[str]) -> LayerScan:
    """The one layer scan of ``closed`` (the loss's jaxpr), its flat inputs tagged ``facts``;
    ``paths[i]`` names stack parameter ``i`` in messages. Refused with the fix: no layer scan,
    more than one, a stack parameter used outside it or not scanned by it."""
    f = _Facts()
    f.run_closed(closed, facts)
    if f.strays:
        i, line = f.strays[0]
        raise ValueError(
            f"params{paths[i]} is split over the pipeline axis as part of the layer stack, but the loss uses it "
            f"outside the layer scan at {line}. A pipeline runs the layers the loss scans over (jax.lax.scan, "
            f"nnx.scan, nn.scan over parameters stacked [L, ...]); name the stack's parameters with "
            f"ZeroConfig(pipeline={{'stack': \"['...']\"}}) if this one is not a layer's, or use the stack only "
            "inside the scan."
        )
    if not f.scans:
        raise ValueError(
            "the loss has no layer scan over the stacked parameters "
            f"({', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''}): on a pipeline mesh the loss must run its "
            "layers with a scan over parameters stacked [L, ...] (jax.lax.scan, nnx.scan, nn.scan). Stack the "
            "layers and scan over them, or train on a mesh without a pipeline axis."
        )
    if len(f.scans) > 1:
        raise ValueError(
            f"the loss has {len(f.scans)} scans over the stacked parameters ({f.scans[0].where}; "
            f"{f.scans[1].where}); a pipeline splits one layer stack. Stacks of different layer types are not "
            "built yet: scan one stack, or train without a pipeline axis."
        )
    scan = f.scans[0]
    seen = {scan.stack_operand(k) for k in range(len(scan.ins))} - {None}
    missing = sorted(set(range(len(paths))) - seen)
    if missing:
        raise ValueError(
            f"params{paths[missing[0]]} is split over the pipeline axis as part of the layer stack, but the "
            f"layer scan at {scan.where} does not iterate over it. Name the stack's parameters with "
            "ZeroConfig(pipeline={'stack': \"['...']\"})."
        )
    return scan
