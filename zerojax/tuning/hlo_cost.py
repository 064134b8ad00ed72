"""FLOPs and bytes accessed of one execution of a compiled program, loops counted per iteration.

``compiled.cost_analysis()`` reports the program of one device (an SPMD program is
partitioned before it is analysed: a matmul split over 8 devices reports 1/8 of its
FLOPs, as :func:`step_cost`'s test checks), but it counts the body of a ``while`` loop
once, whatever its trip count: a ``scan`` over L layers, or over k accumulation
micro-batches, reports the FLOPs of one iteration (measured on jax 0.10 and 0.12, CPU).

This module reads the compiled HLO text, prices each computation that runs (dots at
2·M·N·K, elementwise and reduce operations at one FLOP per element, as XLA's
``HloCostAnalysis`` does; bytes as operands read plus outputs written, with slices of a
stacked operand counted as the slice), finds how many times each runs (``while`` trip
counts that XLA records as ``known_trip_count``), and adds the iterations that
``cost_analysis()`` leaves out to its own figures:

    flops = cost_analysis()["flops"] + Σ_loop bodies (runs − 1) · parsed FLOPs of the body

XLA's own count stays the figure for code outside loops; the parse only supplies the
missing iterations. The parse also sorts the matmul FLOPs by size (:func:`matmul_sizes`):
small matmuls run far below a device's peak, and the time model prices them at the rate a
matmul of their size was measured to reach.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from zerojax.report import hlo
from zerojax.report.hlo import shape_bytes

__all__ = ["LoopCost", "extra_iterations", "loop_cost", "matmul_sizes", "parsed_cost", "shape_bytes"]

_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=[^_]+_([^-]+)->")

# One FLOP per output element (XLA's HloCostAnalysis; transcendentals are counted apart there).
_ELEMENTWISE = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
                          "compare", "select", "and", "or", "xor", "not", "remainder", "clamp", "sign",
                          "floor", "ceil", "round-nearest-afz", "round-nearest-even", "atan2", "power"})
# Instructions that move no data of their own.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
                   "conditional", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
                   "domain"})
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})


class _Pricer:
    """FLOPs and bytes of one run of a computation, fusions priced through their bodies."""

    def __init__(self, program: hlo.Program):
        self.comps = program.computations
        self.shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in self.comps.items()}
        self._flops: dict[str, float] = {}
        self._dots: dict[str, list[float]] = {}

    def instr_flops(self, comp: str, ins: hlo.Instruction) -> float:
        if ins.op == "fusion":
            return sum(self.flops(c) for c in ins.called("calls"))
        out = hlo.shape_elements(ins.shape)
        if ins.op == "dot":
            ops = ins.operands
            lhs = hlo.shape_dims(self.shapes[comp].get(ops[0], "")) if ops else []
            m = _CONTRACT.search(ins.rest)
            k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if (m and lhs) else 1
            return 2.0 * out * k
        if ins.op == "convolution":
            ops = ins.operands
            rhs = hlo.shape_dims(self.shapes[comp].get(ops[1], "")) if len(ops) > 1 else []
            m = _DIM_LABELS.search(ins.rest)
            if rhs and m and "o" in m.group(1):
                k = math.prod(d for d, label in zip(rhs, m.group(1)) if label != "o")
                return 2.0 * out * k
            return 2.0 * out
        if ins.op in _ELEMENTWISE:
            return float(out)
        if ins.op in ("reduce", "reduce-window"):
            ops = ins.operands
            return float(hlo.shape_elements(self.shapes[comp].get(ops[0], ""))) if ops else 0.0
        return 0.0

    def dots(self, comp: str) -> list[float]:
        """FLOPs of each matmul (``dot``/``convolution``) one run of ``comp`` executes, fusions
        included."""
        if comp not in self._dots:
            self._dots[comp] = []  # guards recursion
            out = []
            for ins in self.comps.get(comp, []):
                if ins.op == "fusion":
                    out += [f for c in ins.called("calls") for f in self.dots(c)]
                elif ins.op in ("dot", "convolution"):
                    out.append(self.instr_flops(comp, ins))
            self._dots[comp] = out
        return self._dots[comp]

    def flops(self, comp: str) -> float:
        if comp not in self._flops:
            self._flops[comp] = 0.0  # guards recursion
            self._flops[comp] = sum(self.instr_flops(comp, i) for i in self.comps.get(comp, []))
        return self._flops[comp]

    def _fusion_operand_bytes(self, fused: str, index: int, full: float) -> float:
        """Bytes a fusion reads of its ``index``-th operand: the slices taken where every
        use of the fused parameter slices it (a layer of a stacked weight), else all of it."""
        instrs = self.comps.get(fused, [])
        param = next((i.name for i in instrs if i.op == "parameter" and i.rest.startswith(f"{index})")), None)
        if param is None:
            return full
        users = [i for i in instrs if param in i.operands]
        if users and all(u.op in _SLICING and u.operands[0] == param for u in users):
            return sum(shape_bytes(u.shape) for u in users)
        return full

    def instr_bytes(self, comp: str, ins: hlo.Instruction) -> float:
        if ins.op in _FREE:
            return 0.0
        shapes = self.shapes[comp]
        ops = ins.operands
        out = shape_bytes(ins.shape)
        if ins.op in _SLICING:
            return 2.0 * out
        if ins.op == "dynamic-update-slice" and len(ops) > 1:
            return 2.0 * shape_bytes(shapes.get(ops[1], ""))
        if ins.op == "fusion":
            fused = next(iter(ins.called("calls")), "")
            read = sum(self._fusion_operand_bytes(fused, n, shape_bytes(shapes.get(o, ""))) for n, o in enumerate(ops))
            root = next((i for i in reversed(self.comps.get(fused, [])) if i.op != "parameter"), None)
            if root is not None and root.op == "dynamic-update-slice" and len(root.operands) > 1:
                out = shape_bytes(self.shapes[fused].get(root.operands[1], ""))  # written in place
            return read + out
        return out + sum(shape_bytes(shapes.get(o, "")) for o in ops)

    def bytes(self, comp: str) -> float:
        return sum(self.instr_bytes(comp, i) for i in self.comps.get(comp, []))


@dataclasses.dataclass(frozen=True)
class LoopCost:
    """FLOPs and bytes accessed per device for one execution of a compiled program.

    ``xla_flops`` / ``xla_bytes`` are ``cost_analysis()``'s (loop bodies once);
    ``loop_flops`` / ``loop_bytes`` the iterations it leaves out, from the HLO text;
    ``flops`` / ``bytes`` their sums. ``matmuls`` splits the matmul FLOPs by size:
    ``(side, FLOPs)`` pairs, side the cube root of M·N·K (a square matmul's side), in
    quarter-octave bins, every run counted.
    """

    xla_flops: float
    xla_bytes: float
    loop_flops: float
    loop_bytes: float
    matmuls: tuple[tuple[float, float], ...] = ()

    @property
    def flops(self) -> float:
        return self.xla_flops + self.loop_flops

    @property
    def bytes(self) -> float:
        return self.xla_bytes + self.loop_bytes


def extra_iterations(hlo_text: str) -> tuple[float, float]:
    """``(flops, bytes)`` of the loop iterations that ``cost_analysis()`` does not count:
    Σ over computations that run more than once of (runs − 1) × their parsed cost."""
    program = hlo.parse(hlo_text)
    pricer = _Pricer(program)
    flops = bytes_ = 0.0
    for comp, n in program.runs.items():
        if n > 1:
            flops += (n - 1) * pricer.flops(comp)
            bytes_ += (n - 1) * pricer.bytes(comp)
    return flops, bytes_


def matmul_sizes(hlo_text: str) -> tuple[tuple[float, float], ...]:
    """The program's matmul FLOPs by size, every run counted: ``(side, FLOPs)`` pairs sorted
    by side, side = (M·N·K)^(1/3) rounded to a quarter octave.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from zerojax.tuning.hlo_cost import matmul_sizes
      >>> f = lambda a, b: (a @ b) @ b
      >>> matmul_sizes(jax.jit(f).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text())
      ((64.0, 1048576.0),)
    """
    program = hlo.parse(hlo_text)
    pricer = _Pricer(program)
    bins: dict[float, float] = defaultdict(float)
    for comp, n in program.runs.items():
        for flops in pricer.dots(comp):
            if flops > 0:
                side = 2.0 ** (round(4 * math.log2((flops / 2) ** (1 / 3))) / 4)
                bins[round(side, 3)] += n * flops
    return tuple(sorted(bins.items()))


def parsed_cost(hlo_text: str, *, per_iteration: bool = True) -> tuple[float, float]:
    """``(flops, bytes)`` of the whole program from the HLO text alone: every computation
    times its runs (``per_iteration=False``: once each, as ``cost_analysis()`` counts)."""
    program = hlo.parse(hlo_text)
    pricer = _Pricer(program)
    counts = program.runs
    weight = (lambda n: n) if per_iteration else (lambda n: 1)
    return (sum(weight(n) * pricer.flops(c) for c, n in counts.items()),
            sum(weight(n) * pricer.bytes(c) for c, n in counts.items()))


def loop_cost(compiled) -> LoopCost:
    """Per-device FLOPs and bytes accessed of one execution of ``compiled``, with every
    loop iteration counted (see the module docstring), and its matmuls by size.

    Example (a ``scan`` of 6 matmuls: ``cost_analysis()`` alone sees one):
      >>> import jax, jax.numpy as jnp
      >>> from zerojax.tuning.hlo_cost import loop_cost
      >>> def f(ws, x):
      ...     return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]
      >>> ws, x = jnp.ones((6, 64, 64)), jnp.ones((32, 64))
      >>> c = loop_cost(jax.jit(f).lower(ws, x).compile())
      >>> c.flops >= 6 * 2 * 32 * 64 * 64 > c.xla_flops
      True
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    text = compiled.as_text()
    flops, bytes_ = extra_iterations(text)
    return LoopCost(xla_flops=float(analysis.get("flops", 0.0)), xla_bytes=float(analysis.get("bytes accessed", 0.0)),
                    loop_flops=flops, loop_bytes=bytes_, matmuls=matmul_sizes(text))
