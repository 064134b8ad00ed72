"""Collectives of a compiled program, read from its HLO text.

Each collective is listed with its dtype and the bytes of the full (unsharded) buffer it
moves per device, counted as many times as it runs: an instruction inside a ``while``
loop body (a ``scan`` over layers) runs once per iteration, using the trip count XLA
records. In the ZeRO paper's units an all-gather or a reduce-scatter of a buffer of Ψ
elements moves Ψ, an all-reduce 2Ψ (reduce-scatter + all-gather).
"""

from __future__ import annotations

import dataclasses

from zerojax.report import hlo
from zerojax.report.replica_groups import group_axes, permute_groups, replica_groups

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Async starts whose result is an (operands, results, ...) tuple: the results are element 1.
_OPERANDS_FIRST = ("all-gather-start", "collective-permute-start")


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
        runs over, from its device groups (see :mod:`zerojax.report.replica_groups`)."""
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


def collectives(hlo_text: str) -> list[Collective]:
    """Parses ``compiled.as_text()`` into the collectives of one execution (which
    computations run, and how often, as :mod:`zerojax.report.hlo` reads them)."""
    program = hlo.parse(hlo_text)
    found: list[Collective] = []
    for _, ins, runs in program.executed():
        kind = ins.op.removesuffix("-start")
        if kind not in COLLECTIVES:
            continue
        shape = ins.shape
        if ins.op in _OPERANDS_FIRST and shape.startswith("("):
            shape = hlo.tuple_elements(shape)[1]
        nbytes = int(hlo.shape_bytes(shape))
        if kind == "collective-permute":
            groups = permute_groups(ins.rest)
        else:
            groups = replica_groups(ins.rest)
        groups = None if groups is None else tuple(tuple(g) for g in groups)
        if kind == "reduce-scatter":  # count the input buffer (the full gradient)
            if not groups:
                raise ValueError(f"cannot read the replica groups of a reduce-scatter: {ins.rest[:200]}")
            nbytes *= len(groups[0])
        found.append(Collective(kind=kind, dtype=hlo.shape_dtype(shape), bytes=nbytes, count=runs, groups=groups))
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
