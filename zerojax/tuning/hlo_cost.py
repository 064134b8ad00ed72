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
missing iterations. The parse also sorts the matmul FLOPs by size (:func:`matmul_sizes`)
and the bytes by the working set of the instruction that moves them (:func:`memory_sizes`):
a measured device runs each at the rate measured for its size (a CPU moves a 256 KiB
working set from cache many times faster than 16 MiB from memory).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from zerojax.report import hlo
from zerojax.report.hlo import shape_bytes

__all__ = [
    "LoopCost",
    "extra_iterations",
    "loop_cost",
    "matmul_shapes",
    "matmul_sizes",
    "memory_sizes",
    "parsed_cost",
    "shape_bytes",
]

_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_LHS_BATCH = re.compile(r"lhs_batch_dims=\{([0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=[^_]+_([^-]+)->")

# One FLOP per output element (XLA's HloCostAnalysis; transcendentals are counted apart there).
_ELEMENTWISE = frozenset(
    {
        "add",
        "subtract",
        "multiply",
        "divide",
        "maximum",
        "minimum",
        "negate",
        "abs",
        "compare",
        "select",
        "and",
        "or",
        "xor",
        "not",
        "remainder",
        "clamp",
        "sign",
        "floor",
        "ceil",
        "round-nearest-afz",
        "round-nearest-even",
        "atan2",
        "power",
    }
)
# Instructions that move no data of their own.
_FREE = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "call",
        "conditional",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "add-dependency",
        "domain",
    }
)
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})


class _Pricer:
    """FLOPs and bytes of one run of a computation, fusions priced through their bodies."""

    def __init__(self, program: hlo.Program):
        self.comps = program.computations
        self.shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in self.comps.items()}
        self._flops: dict[str, float] = {}
        self._dots: dict[str, list[float]] = {}
        self._kind: dict[str, dict[str, str]] = {}

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

    def dots(self, comp: str) -> list[tuple[float, float, tuple[int, int, int] | None]]:
        """``(FLOPs, side, (M, N, K))`` of each matmul (``dot``/``convolution``) one run of
        ``comp`` executes, fusions included: M, N, K per batch element of a dot (None for a
        convolution), side the smallest of them (a thin matmul runs far below a square one of
        the same FLOPs; a convolution's side is the cube root of its M·N·K)."""
        if comp not in self._dots:
            self._dots[comp] = []  # guards recursion
            out = []
            for ins in self.comps.get(comp, []):
                if ins.op == "fusion":
                    out += [d for c in ins.called("calls") for d in self.dots(c)]
                elif ins.op in ("dot", "convolution"):
                    flops = self.instr_flops(comp, ins)
                    mnk = self._dot_mnk(comp, ins)
                    side = float(max(min(mnk), 1)) if mnk else (max(flops, 2.0) / 2) ** (1 / 3)
                    out.append((flops, side, mnk))
            self._dots[comp] = out
        return self._dots[comp]

    def _dot_mnk(self, comp: str, ins: hlo.Instruction) -> tuple[int, int, int] | None:
        if ins.op != "dot" or len(ins.operands) < 2:
            return None
        lhs = hlo.shape_dims(self.shapes[comp].get(ins.operands[0], ""))
        rhs = hlo.shape_dims(self.shapes[comp].get(ins.operands[1], ""))
        if not lhs or not rhs:
            return None
        dims = lambda pattern: [
            int(d) for d in (pattern.search(ins.rest).group(1).split(",") if pattern.search(ins.rest) else []) if d
        ]
        k = math.prod(lhs[d] for d in dims(_CONTRACT))
        b = math.prod(lhs[d] for d in dims(_LHS_BATCH))
        m, n = math.prod(lhs) // max(k * b, 1), math.prod(rhs) // max(k * b, 1)
        return (max(m, 1), max(n, 1), max(k, 1))

    def flops(self, comp: str) -> float:
        if comp not in self._flops:
            self._flops[comp] = 0.0  # guards recursion
            self._flops[comp] = sum(self.instr_flops(comp, i) for i in self.comps.get(comp, []))
        return self._flops[comp]

    def _fusion_operand_bytes(self, fused: str, index: int, full: float) -> float:
        """Bytes a fusion reads of its ``index``-th operand: the slices taken where every
        use of the fused parameter slices it (a layer of a stacked weight) or is the buffer a
        ``dynamic-update-slice`` writes into in place (a scan saving a layer's activations into
        its stacked residuals: nothing of the buffer is read), else all of it. XLA's own
        ``cost_analysis()`` counts both so (a test compares them on loop-free programs)."""
        instrs = self.comps.get(fused, [])
        param = next((i.name for i in instrs if i.op == "parameter" and i.rest.startswith(f"{index})")), None)
        if param is None:
            return full
        users = [i for i in instrs if param in i.operands]
        in_place = lambda u: u.op == "dynamic-update-slice" and u.operands[0] == param and param not in u.operands[1:]
        if users and all((u.op in _SLICING and u.operands[0] == param) or in_place(u) for u in users):
            return sum(shape_bytes(u.shape) for u in users if not in_place(u))
        return full

    def instr_traffic(self, comp: str, ins: hlo.Instruction) -> list[tuple[float, float]]:
        """``(working set, bytes)`` of each part of what ``ins`` reads and writes; the bytes
        sum to its bytes accessed. The working set of a part is the instruction's own bytes,
        except where the part is read from (or written into) a buffer the computation got
        as an argument (a parameter or an element of the loop's state: weights, optimizer
        state, a stack of saved activations): then it is that whole buffer's size, since the
        bytes were last touched a loop iteration or a step ago and come from wherever a
        buffer of that size lives (on a CPU, memory rather than cache)."""
        if ins.op in _FREE:
            return []
        shapes, kinds = self.shapes[comp], self._kinds(comp)
        ops = ins.operands
        out = shape_bytes(ins.shape)
        parts: list[tuple[str | None, float]] = []  # (argument buffer read or written, bytes)
        arg = lambda o: o if kinds.get(o) in ("parameter", "get-tuple-element") else None
        if ins.op in _SLICING:
            parts = [(arg(ops[0]) if ops else None, out), (None, out)]
        elif ins.op == "dynamic-update-slice" and len(ops) > 1:
            update = shape_bytes(shapes.get(ops[1], ""))
            parts = [(arg(ops[1]), update), (arg(ops[0]), update)]
        elif ins.op == "fusion":
            fused = next(iter(ins.called("calls")), "")
            parts = [
                (arg(o), self._fusion_operand_bytes(fused, n, shape_bytes(shapes.get(o, ""))))
                for n, o in enumerate(ops)
            ]
            root = next((i for i in reversed(self.comps.get(fused, [])) if i.op != "parameter"), None)
            written = None
            if root is not None and root.op == "dynamic-update-slice" and len(root.operands) > 1:
                out = shape_bytes(self.shapes[fused].get(root.operands[1], ""))  # written in place
                index = self._param_index(fused, root.operands[0])
                written = arg(ops[index]) if index is not None and index < len(ops) else None
            parts.append((written, out))
        else:
            parts = [(None, out)] + [(arg(o), shape_bytes(shapes.get(o, ""))) for o in ops]
        own = sum(b for _, b in parts)
        return [(shape_bytes(shapes.get(buf, "")) if buf is not None else own, b) for buf, b in parts if b > 0]

    def instr_bytes(self, comp: str, ins: hlo.Instruction) -> float:
        return sum(b for _, b in self.instr_traffic(comp, ins))

    def _kinds(self, comp: str) -> dict[str, str]:
        if comp not in self._kind:
            self._kind[comp] = {i.name: i.op for i in self.comps.get(comp, [])}
        return self._kind[comp]

    def _param_index(self, fused: str, name: str) -> int | None:
        ins = next((i for i in self.comps.get(fused, []) if i.name == name and i.op == "parameter"), None)
        if ins is None:
            return None
        m = re.match(r"(\d+)\)", ins.rest)
        return int(m.group(1)) if m else None

    def bytes(self, comp: str) -> float:
        return sum(self.instr_bytes(comp, i) for i in self.comps.get(comp, []))


@dataclasses.dataclass(frozen=True)
class LoopCost:
    """FLOPs and bytes accessed per device for one execution of a compiled program.

    ``xla_flops`` / ``xla_bytes`` are ``cost_analysis()``'s (loop bodies once);
    ``loop_flops`` / ``loop_bytes`` the iterations it leaves out, from the HLO text;
    ``flops`` / ``bytes`` their sums. ``matmuls`` splits the matmul FLOPs by size:
    ``(side, FLOPs)`` pairs, side the smallest of M, N and K (:meth:`_Pricer.dots`), in
    quarter-octave bins, every run counted. ``memory`` splits the bytes by the working set
    of the instruction moving them: ``(bytes accessed by the instruction, bytes)`` pairs in
    octave bins, every run counted (the parse's own total, which may differ from ``bytes``
    by what XLA counts outside loops a little differently). ``shapes`` splits the dot FLOPs
    by shape: ``((M, N, K), FLOPs)`` pairs (:func:`matmul_shapes`).
    """

    xla_flops: float
    xla_bytes: float
    loop_flops: float
    loop_bytes: float
    matmuls: tuple[tuple[float, float], ...] = ()
    memory: tuple[tuple[float, float], ...] = ()
    shapes: tuple[tuple[tuple[int, int, int], float], ...] = ()

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
    by side, side = min(M, N, K) rounded to a quarter octave.

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
        for flops, side, _ in pricer.dots(comp):
            if flops > 0:
                bins[round(2.0 ** (round(4 * math.log2(side)) / 4), 3)] += n * flops
    return tuple(sorted(bins.items()))


def matmul_shapes(hlo_text: str) -> tuple[tuple[tuple[int, int, int], float], ...]:
    """The program's dot FLOPs by shape, every run counted: ``((M, N, K), FLOPs)`` pairs,
    M, N, K per batch element, sorted by shape. A measured device prices each at the rate a
    matmul of that very shape reached (:func:`zerojax.tuning.devices.measure_matmuls`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from zerojax.tuning.hlo_cost import matmul_shapes
      >>> f = lambda a, b: a @ b
      >>> matmul_shapes(jax.jit(f).lower(jnp.ones((32, 64)), jnp.ones((64, 16))).compile().as_text())
      (((32, 16, 64), 65536.0),)
    """
    program = hlo.parse(hlo_text)
    pricer = _Pricer(program)
    out: dict[tuple[int, int, int], float] = defaultdict(float)
    for comp, n in program.runs.items():
        for flops, _, mnk in pricer.dots(comp):
            if flops > 0 and mnk is not None:
                out[mnk] += n * flops
    return tuple(sorted(out.items()))


def memory_sizes(hlo_text: str) -> tuple[tuple[float, float], ...]:
    """The program's bytes accessed by working set, every run counted: ``(size, bytes)``
    pairs sorted by size, size the bytes one instruction (a fusion: all of it) reads and
    writes, or the size of the argument buffer a part is read from or written into
    (:meth:`_Pricer.instr_traffic`), rounded to an octave.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from zerojax.tuning.hlo_cost import memory_sizes
      >>> memory_sizes(jax.jit(lambda a: a * 2 + 1).lower(jnp.ones((64, 64))).compile().as_text())
      ((16384.0, 16384.0), (32768.0, 16384.0))

    (the 16 KiB argument read from where a buffer of its size lives, the 16 KiB result written
    by an instruction whose working set is 32 KiB in all).
    """
    program = hlo.parse(hlo_text)
    pricer = _Pricer(program)
    bins: dict[float, float] = defaultdict(float)
    for comp, n in program.runs.items():
        for ins in program.computations.get(comp, []):
            for size, b in pricer.instr_traffic(comp, ins):
                bins[2.0 ** round(math.log2(max(size, 1.0)))] += n * b
    return tuple(sorted(bins.items()))


def parsed_cost(hlo_text: str, *, per_iteration: bool = True) -> tuple[float, float]:
    """``(flops, bytes)`` of the whole program from the HLO text alone: every computation
    times its runs (``per_iteration=False``: once each, as ``cost_analysis()`` counts)."""
    program = hlo.parse(hlo_text)
    pricer = _Pricer(program)
    counts = program.runs
    weight = (lambda n: n) if per_iteration else (lambda n: 1)
    return (
        sum(weight(n) * pricer.flops(c) for c, n in counts.items()),
        sum(weight(n) * pricer.bytes(c) for c, n in counts.items()),
    )


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
    return LoopCost(
        xla_flops=float(analysis.get("flops", 0.0)),
        xla_bytes=float(analysis.get("bytes accessed", 0.0)),
        loop_flops=flops,
        loop_bytes=bytes_,
        matmuls=matmul_sizes(text),
        memory=memory_sizes(text),
        shapes=matmul_shapes(text),
    )
