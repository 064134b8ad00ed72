"""Reading a compiled program's HLO text: computations, instructions and their data
dependencies (enough to tell whether a gather waits for a layer's matmul)."""

from __future__ import annotations

import dataclasses
import re

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z\-]+)\((.*)$")
_REF = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    op: str
    operands: list[str]
    calls: list[str]


def computations(text: str) -> dict[str, dict[str, Instruction]]:
    comps: dict[str, dict[str, Instruction]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = comps.setdefault(m.group(1), {})
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            name, shape, op, rest = m.groups()
            args = rest.split("),")[0]  # the operand list, before the attributes
            current[name] = Instruction(name, shape, op, _REF.findall(args), _CALLS.findall(rest))
    return comps


def loop_bodies(text: str) -> list[str]:
    return sorted({b for line in text.splitlines() if " while(" in line for b in _WHILE_BODY.findall(line)})


def has_matmul(comps: dict, name: str, depth: int = 0) -> bool:
    comp = comps.get(name, {})
    return depth < 8 and any(i.op == "dot" or (i.op in ("fusion", "call") and any(has_matmul(comps, c, depth + 1)
                                                                                  for c in i.calls))
                             for i in comp.values())


def matmuls(comps: dict, body: str) -> list[str]:
    """Instructions of ``body`` that are, or contain, a matmul."""
    return [i.name for i in comps[body].values()
            if i.op == "dot" or (i.op in ("fusion", "call") and any(has_matmul(comps, c) for c in i.calls))]


def gathers(comps: dict, body: str, shape: str = "") -> list[str]:
    """All-gathers of ``body`` (whose result type starts with ``shape``, if given)."""
    return [i.name for i in comps[body].values()
            if i.op in ("all-gather", "all-gather-start") and i.shape.startswith(shape)]


def reaches(comps: dict, body: str, src: str, dst: str) -> bool:
    """Whether ``dst`` uses ``src``, directly or through other instructions of ``body``."""
    instrs, seen, todo = comps[body], set(), [dst]
    while todo:
        name = todo.pop()
        if name == src:
            return True
        if name in seen or name not in instrs:
            continue
        seen.add(name)
        todo.extend(instrs[name].operands)
    return False


def independent(comps: dict, body: str, a: str, b: str) -> bool:
    return not reaches(comps, body, a, b) and not reaches(comps, body, b, a)
