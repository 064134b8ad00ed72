"""Which devices a collective of a compiled program spans, and over which mesh axes.

XLA prints a collective's device groups in one of three forms:

* explicit: ``replica_groups={{0,1,2,3},{4,5,6,7}}``;
* iota: ``replica_groups=[2,4]<=[8]`` or ``[4,2]<=[2,4]T(1,0)`` (``iota(prod(dims))``
  reshaped to ``dims``, transposed by the permutation, reshaped to ``[groups, size]``);
* mesh: ``replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}``
  (the devices laid out on a named grid; one group per position of the axes not listed).

The ids are the program's logical device ids: positions in its device assignment, which for
a step compiled over a mesh are positions in ``mesh.devices.flat``. So a group's mesh axes
are those whose coordinate varies among its members.
"""

from __future__ import annotations

import re

import numpy as np

_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(?(\[[0-9,]+\](?:T\([0-9,]+\))?)\)?)?"
    r"\s*\{([^}]*)\}"
)
_ARRAY = re.compile(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def replica_groups(attrs: str) -> list[list[int]] | None:
    """The device groups of one collective from the text after its opcode; None where the
    instruction lists none (a collective-permute lists pairs: :func:`permute_groups`).
    Raises ``ValueError`` for a form it does not know."""
    m = _EXPLICIT.search(attrs)
    if m:
        return [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    m = _IOTA.search(attrs)
    if m:
        shape = _ints(m.group(1))
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        return ids.reshape(shape).tolist()
    m = _MESH.search(attrs)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        if m.group(2):
            d = _ARRAY.match(m.group(2))
            ids = _iota(_ints(d.group(1)), _ints(d.group(2)) if d.group(2) else None).reshape(sizes)
        else:
            ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        over = [a.strip().strip("'") for a in m.group(3).split(",") if a.strip()]
        unknown = [a for a in over if a not in names]
        if unknown:
            raise ValueError(f"collective groups over axes {unknown} not in its mesh {names}: {attrs[:200]}")
        keep = [i for i, a in enumerate(names) if a not in over]
        moved = np.moveaxis(ids, [names.index(a) for a in over], list(range(len(names) - len(over), len(names))))
        size = int(np.prod([sizes[names.index(a)] for a in over])) if over else 1
        return moved.reshape(int(np.prod([sizes[i] for i in keep])) if keep else 1, size).tolist()
    if "replica_groups=" in attrs:
        raise ValueError(f"cannot read the replica groups of this collective: {attrs[:200]}")
    return None


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")


def permute_groups(attrs: str) -> list[list[int]] | None:
    """The device groups of a collective-permute: the sets of devices its
    ``source_target_pairs`` connect (a ring over a mesh axis: one group per ring). None
    where the instruction lists no pairs.

    Example:
      >>> permute_groups("%x), channel_id=1, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}")
      [[0, 1], [2, 3]]
    """
    m = _PAIRS.search(attrs)
    if m is None:
        if "source_target_pairs=" in attrs:
            raise ValueError(f"cannot read the source_target_pairs of this collective-permute: {attrs[:200]}")
        return None
    parent: dict[int, int] = {}

    def root(d: int) -> int:
        while parent.setdefault(d, d) != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    for a, b in re.findall(r"\{([0-9]+),([0-9]+)\}", m.group(1)):
        parent[root(int(a))] = root(int(b))
    groups: dict[int, list[int]] = {}
    for d in sorted(parent):
        groups.setdefault(root(d), []).append(d)
    return sorted(groups.values())


def group_axes(groups: list[list[int]], shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (of a mesh of this ``{name: size}`` shape, in order) whose coordinate
    varies within the groups: the axes the collective runs over."""
    names, sizes = list(shape), list(shape.values())
    total = int(np.prod(sizes))
    varies = set()
    for g in groups:
        if any(not 0 <= d < total for d in g):
            raise ValueError(f"device id out of the mesh's {total} devices in group {g}.")
        coords = np.array(np.unravel_index(g, sizes)).T
        varies |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
    return tuple(a for a in names if a in varies)
