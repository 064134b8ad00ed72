"""One reader of a compiled program's HLO text (``compiled.as_text()``).

The communication report (:mod:`zerojax.report.comm`), the autotuner's cost model
(:mod:`zerojax.tuning.hlo_cost`) and the tests that check a program's structure all read
the program through this module, so they agree on what runs and how often.

What runs, decided once (:attr:`Program.runs`, the executions of each computation per
execution of the entry computation):

* the ``ENTRY`` computation runs once;
* a ``while`` loop's body runs ``known_trip_count`` times per run of its caller, its
  condition ``trip + 1`` times (XLA records the trip count of a ``scan``; a loop without
  one counts once, the least it runs);
* a ``call``'s computation, an ``async-start``'s wrapped computation and each branch of a
  ``conditional`` run once per run of their caller (a branch's count is an upper bound);
* a fusion's computation is part of its ``fusion`` instruction: it is not a separate
  execution (its instructions are listed in :attr:`Program.fused`, priced or searched
  through the fusion);
* a reduction body (the ``to_apply`` of ``all-reduce``, ``reduce-scatter``, ``reduce``,
  ``scatter``, ``sort``, ``map`` ...) is applied element by element inside its instruction
  and never counts as an execution.

The opcodes and attribute names this relies on are the ones above; a text with no
``ENTRY`` computation, or a control-flow instruction naming a computation the text does
not define, raises a ``ValueError`` naming it rather than being read wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import defaultdict

# Bytes per element of each HLO element type.
DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "f8e3m4": 1,
    "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
    "s2": 0.25,
    "u2": 0.25,
    "s1": 0.125,
    "u1": 0.125,
    "token": 0,
}

_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ATTR = {
    name: re.compile(rf"\b{name}=%?([\w.\-]+)")
    for name in ("body", "condition", "to_apply", "calls", "true_computation", "false_computation")
}
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")

# Control flow: the computations an instruction of this opcode executes, by attribute.
_CONTROL = {
    "while": ("body", "condition"),
    "call": ("to_apply", "calls"),
    "conditional": ("true_computation", "false_computation", "branch_computations"),
    "async-start": ("calls",),
}


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, result shape (as printed), opcode, and the rest of the
    line (operands and attributes)."""

    name: str
    shape: str
    op: str
    rest: str

    @functools.cached_property
    def operands(self) -> tuple[str, ...]:
        """Names of the instructions this one reads, in order."""
        depth, end = 1, len(self.rest)
        for i, ch in enumerate(self.rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                end = i
                break
        return tuple(_OPERAND.findall(self.rest[:end]))

    def called(self, *attributes: str) -> tuple[str, ...]:
        """The computations named by these attributes (``body``, ``calls``, ...,
        ``branch_computations``)."""
        out = []
        for name in attributes:
            if name == "branch_computations":
                for group in _BRANCHES.findall(self.rest):
                    out += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
            else:
                out += _ATTR[name].findall(self.rest)
        return tuple(out)

    @property
    def trip_count(self) -> int | None:
        """A ``while`` loop's ``known_trip_count``; None where XLA recorded none."""
        m = _TRIP.search(self.rest)
        return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class Program:
    """The computations of one compiled program and how often each runs.

    Example (a ``scan`` over 3 layers: the loop body runs 3 times, its condition 4):
      >>> import jax, jax.numpy as jnp
      >>> from zerojax.report import hlo
      >>> f = lambda ws, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
      >>> prog = hlo.parse(jax.jit(f).lower(jnp.ones((3, 8, 8)), jnp.ones((2, 8))).compile().as_text())
      >>> [prog.runs[b] for b in prog.loop_bodies()]
      [3]
      >>> sorted(prog.runs.values())
      [1, 3, 4]
    """

    computations: dict[str, tuple[Instruction, ...]]
    entry: str

    def instructions(self, computation: str) -> dict[str, Instruction]:
        """``{name: instruction}`` of one computation."""
        return {i.name: i for i in self.computations[computation]}

    @functools.cached_property
    def runs(self) -> dict[str, int]:
        """Executions of each computation per execution of the entry computation (fused
        computations and reduction bodies excluded; see the module docstring)."""
        out: dict[str, int] = defaultdict(int)

        def visit(name: str, times: int, depth: int) -> None:
            if depth > 256:
                raise ValueError(f"HLO control flow nests deeper than 256 computations at {name!r}.")
            out[name] += times
            for ins in self.computations[name]:
                attributes = _CONTROL.get(ins.op)
                if attributes is None:
                    continue
                for attr in attributes:
                    for callee in ins.called(attr):
                        if callee not in self.computations:
                            raise ValueError(
                                f"{ins.op} {ins.name!r} calls {callee!r} ({attr}=), which the "
                                "HLO text does not define; pass the whole compiled.as_text()."
                            )
                        n = 1
                        if ins.op == "while":
                            trip = ins.trip_count or 1
                            n = trip + 1 if attr == "condition" else trip
                        visit(callee, times * n, depth + 1)

        visit(self.entry, 1, 0)
        return dict(out)

    @functools.cached_property
    def fused(self) -> frozenset[str]:
        """Computations that are the body of a ``fusion`` instruction."""
        return frozenset(
            c for instrs in self.computations.values() for i in instrs if i.op == "fusion" for c in i.called("calls")
        )

    def executed(self):
        """``(computation, instruction, runs)`` for every instruction of every computation
        that runs (fusion bodies are reached through their fusion)."""
        for comp, n in self.runs.items():
            for ins in self.computations[comp]:
                yield comp, ins, n

    def loop_bodies(self) -> list[str]:
        """The body computations of the program's ``while`` loops."""
        return sorted(
            {b for instrs in self.computations.values() for i in instrs if i.op == "while" for b in i.called("body")}
        )

    def contains_matmul(self, computation: str, _depth: int = 0) -> bool:
        """Whether ``computation`` has a ``dot``, directly or in a fusion or call."""
        return _depth < 16 and any(
            i.op == "dot"
            or (
                i.op in ("fusion", "call")
                and any(self.contains_matmul(c, _depth + 1) for c in i.called("calls", "to_apply"))
            )
            for i in self.computations.get(computation, ())
        )

    def matmuls(self, computation: str) -> list[str]:
        """Instructions of ``computation`` that are, or contain, a matmul."""
        return [
            i.name
            for i in self.computations[computation]
            if i.op == "dot"
            or (i.op in ("fusion", "call") and any(self.contains_matmul(c) for c in i.called("calls", "to_apply")))
        ]

    def gathers(self, computation: str, shape: str = "") -> list[str]:
        """All-gathers of ``computation`` (whose result type starts with ``shape``, if given)."""
        return [
            i.name
            for i in self.computations[computation]
            if i.op in ("all-gather", "all-gather-start") and i.shape.startswith(shape)
        ]

    def reaches(self, computation: str, src: str, dst: str) -> bool:
        """Whether ``dst`` uses ``src``, directly or through other instructions of ``computation``."""
        instrs, seen, todo = self.instructions(computation), set(), [dst]
        while todo:
            name = todo.pop()
            if name == src:
                return True
            if name in seen or name not in instrs:
                continue
            seen.add(name)
            todo.extend(instrs[name].operands)
        return False

    def independent(self, computation: str, a: str, b: str) -> bool:
        """Whether neither of two instructions uses the other (XLA may run them concurrently)."""
        return not self.reaches(computation, a, b) and not self.reaches(computation, b, a)


@functools.lru_cache(maxsize=32)
def parse(hlo_text: str) -> Program:
    """The :class:`Program` of ``compiled.as_text()`` (cached: the report, the cost model and
    a test often read the same text)."""
    if not isinstance(hlo_text, str):
        raise TypeError(f"parse() takes HLO text (compiled.as_text()), got {type(hlo_text).__name__}.")
    comps: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(Instruction(*m.groups()))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text().")
    return Program({k: tuple(v) for k, v in comps.items()}, entry)


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (``"(f32[2], (s32[], u8[4]))"`` →
    ``["f32[2]", "(s32[], u8[4])"]``); an array shape is its own one element."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            part = shape[start:i].strip()
            if part:
                out.append(part)
            start = i + 1
            if depth == 0:
                break
    return out


def _elements(dims: str) -> int:
    return math.prod(int(d) for d in dims.split(",") if d) if dims else 1


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (a tuple's arrays summed).

    Example:
      >>> from zerojax.report.hlo import shape_bytes
      >>> shape_bytes("(f32[4,128]{1,0}, bf16[8]{0}, s32[])")
      2068.0
    """
    total = 0.0
    for dt, dims in _ARRAY.findall(shape):
        if dt not in DTYPE_BYTES:
            raise ValueError(
                f"unknown HLO element type {dt!r} in shape {shape!r}; add it to zerojax.report.hlo.DTYPE_BYTES."
            )
        total += DTYPE_BYTES[dt] * _elements(dims)
    return total


def shape_elements(shape: str) -> int:
    """Elements of the first array of an HLO shape (0 if it has none)."""
    found = _ARRAY.search(shape)
    return _elements(found.group(2)) if found else 0


def shape_dims(shape: str) -> list[int]:
    """Dimensions of the first array of an HLO shape."""
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def shape_dtype(shape: str) -> str:
    """Element type of the first array of an HLO shape ("" if it has none)."""
    found = _ARRAY.search(shape)
    return found.group(1) if found else ""
