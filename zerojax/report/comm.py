"""Collectives of a compiled program, read from its HLO text.

Each collective is listed with its dtype and the bytes of the full (unsharded) buffer it
moves per device, counted as many times as it runs: an instruction inside a ``while``
loop body (a ``scan`` over layers) runs once per iteration, using the trip count XLA
records. In the ZeRO paper's units an all-gather or a reduce-scatter of a buffer of Ψ
elements moves Ψ, an all-reduce 2Ψ (reduce-scatter + all-gather).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import numpy as np

from zerojax.report.groups import group_axes, replica_groups

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "f8e4m3fn": 1, "f8e5m2": 1}
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z\-]+)\((.*)$")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, dtype, bytes per run, and how often it runs."""

    kind: str
    dtype: str
    bytes: int  # of the full buffer: output of all-gather, input of reduce-scatter
    count: int  # executions per step
    groups: tuple[tuple[int, ...], ...] | None = None  # device groups (logical ids); None: not listed

    @property
    def group_size(self) -> int | None:
        return len(self.groups[0]) if self.groups else None

    def axes(self, mesh) -> tuple[str, ...]:
        """The axes of ``mesh`` (the mesh the program was compiled over) this collective
        runs over, from its device groups (see :mod:`zerojax.report.groups`)."""
        if self.groups is None:
            raise ValueError(f"this {self.kind} lists no device groups; its mesh axes are unknown.")
        return group_axes([list(g) for g in self.groups], dict(mesh.shape))

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count

    @property
    def zero_units_bytes(self) -> int:
        """Bytes in the paper's accounting (all-reduce = reduce-scatter + all-gather)."""
        return self.total_bytes * (2 if self.kind == "all-reduce" else 1)


def _shape_bytes(text: str) -> tuple[str, int]:
    arrays = _ARRAY.findall(text)
    total, dtype = 0, ""
    for dt, dims in arrays:
        if dt not in _DTYPE_BYTES:
            continue
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _DTYPE_BYTES[dt]
        dtype = dtype or dt
    return dtype, total


def collectives(hlo_text: str) -> list[Collective]:
    """Parses ``compiled.as_text()`` into the collectives of one execution."""
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text().")

    # How many times each computation runs per execution of the entry computation.
    runs: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64 or name not in comps:
            return
        runs[name] += times
        for line in comps[name]:
            trip = 1
            m = _TRIP.search(line)
            if " while(" in line:
                trip = int(m.group(1)) if m else 1
            callees = _CALLS.findall(line)
            for b in _BRANCHES.findall(line):
                callees += [c.strip().lstrip("%") for c in b.split(",") if c.strip()]
            for callee in callees:
                if " all-reduce(" in line or " reduce-scatter(" in line or "-start(" in line:
                    continue  # reduction bodies (to_apply) are not separate executions
                visit(callee, times * trip, depth + 1)

    visit(entry, 1)
    found: list[Collective] = []
    for name, lines in comps.items():
        if not runs.get(name):
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            shape, op, rest = m.groups()
            kind = op.removesuffix("-start")
            if kind not in COLLECTIVES or op.endswith("-done"):
                continue
            dtype, nbytes = _shape_bytes(shape)
            groups = replica_groups(rest)
            groups = None if groups is None else tuple(tuple(g) for g in groups)
            if kind == "reduce-scatter":  # count the input buffer (the full gradient)
                if not groups:
                    raise ValueError(f"cannot read the replica groups of a reduce-scatter: {rest[:200]}")
                nbytes *= len(groups[0])
            found.append(Collective(kind=kind, dtype=dtype, bytes=nbytes, count=runs[name], groups=groups))
    return found


def communication_report(compiled, mesh=None) -> dict[str, dict]:
    """Bytes per device per step by collective kind and dtype, from a compiled step.

    Returns ``{kind: {"count": runs, "bytes": payload bytes, "zero_bytes": paper units}}``
    plus a ``"total"`` entry. Given the ``mesh`` the step was compiled over, it also has
    ``"by_axis"``: the same counts per set of mesh axes a collective runs over (``"data"``,
    ``"replica"``, ``"replica+data"``; a hybrid mesh's data axis stays inside a group;
    ``"tensor"``: tensor parallelism's activation all-reduces, ``zj.make_mesh(tensor=T)``).

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> from zerojax.report.comm import communication_report
      >>> mesh, cfg, tx = zj.make_mesh(), zj.ZeroConfig(stage=1), optax.sgd(0.1)
      >>> params = {"w": jnp.zeros((64, 64))}
      >>> loss_fn = lambda p, b: jnp.mean(jnp.tanh(b @ p["w"]))
      >>> state = zj.init_state(params, tx, mesh=mesh, config=cfg)
      >>> step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
      >>> rep = communication_report(step.lower(state, jnp.ones((8, 64))).compile())
      >>> rep["total"]["zero_bytes"] // (64 * 64 * 4)   # 2Ψ for stage 1
      2
      >>> sorted(k for k in rep if k != "total")
      ['all-gather:f32', 'all-reduce:f32', 'reduce-scatter:f32']

      Per mesh axis, on a hybrid mesh (only gradient shards, Ψ/(N/R), cross groups):
      >>> mesh = zj.make_mesh(replicas=2)
      >>> state = zj.init_state(params, tx, mesh=mesh, config=cfg)
      >>> step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
      >>> rep = communication_report(step.lower(state, jnp.ones((8, 64))).compile(), mesh=mesh)
      >>> rep["by_axis"]["replica"]["bytes"] == 64 * 64 * 4 // 4
      True
    """
    text = compiled.as_text() if hasattr(compiled, "as_text") else str(compiled)
    found = collectives(text)
    report: dict[str, dict] = _tally(found, lambda c: f"{c.kind}:{c.dtype}")
    report["total"] = {k: sum(r[k] for r in report.values()) for k in ("count", "bytes", "zero_bytes")}
    if mesh is not None:
        report["by_axis"] = _tally(found, lambda c: "+".join(c.axes(mesh)) or "none")
    return report


def _tally(found: list[Collective], key) -> dict[str, dict[str, int]]:
    """Runs, bytes and paper-unit bytes of ``found``, summed per ``key(collective)``."""
    out: dict[str, dict[str, int]] = {}
    for c in found:
        r = out.setdefault(key(c), {"count": 0, "bytes": 0, "zero_bytes": 0})
        r["count"] += c.count
        r["bytes"] += c.total_bytes
        r["zero_bytes"] += c.zero_units_bytes
    return out
