"""Logical axis names to mesh axes, resolved as Flax resolves them.

Flax has two resolutions, and a model gets the one of the API that annotated it:

* **linen** (``nn.with_logical_partitioning`` boxes, ``nn.logical_to_mesh_axes``,
  ``nn.with_logical_constraint``): the rules are in order of precedence. For each rule in
  turn, a dimension named by it that is still unassigned takes its mesh axes, unless one
  of them is already taken by another dimension of the same array; a name that occurs in
  no applicable rule is not split. A name given twice in one annotation is an error. A
  box's own ``rules`` replace the context's.
* **NNX** (``nnx.with_partitioning`` names under ``nnx.logical_axis_rules`` or a
  Variable's ``sharding_rules``, ``nnx.get_partition_spec``): the rules are a table, so
  a name given twice takes its *last* rule, whatever the other dimensions use; the
  Variable's own rules are added to the context's and may not contradict them.

``nn.Partitioned`` boxes (``nn.with_partitioning``) name mesh axes: no rule applies. A
``tensor_specs`` tree (plain JAX) is resolved as linen resolves.

:func:`resolve` gives, per dimension, the rule's target (``None``, an axis, or a tuple of
axes) or :data:`UNRULED` where no rule names the dimension (its name is then a mesh axis
or a model axis of ``ZeroConfig.axes.model_axes``, which :mod:`zerojax.sharding.annotations`
checks). Keep Flax's semantics here and nowhere else.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

LINEN, NNX, MESH = "linen", "nnx", "mesh"
STYLES = (LINEN, NNX, MESH)


class _Unruled:
    def __repr__(self) -> str:
        return "UNRULED"


UNRULED = _Unruled()  # no rule names this dimension


@dataclasses.dataclass(frozen=True)
class Annotation:
    """One parameter's annotation: a name (or None, or a tuple of names) per dimension,
    the Flax API that wrote it (``style``), and its own rules (a linen box's ``rules``, an
    NNX Variable's ``sharding_rules``; None: none)."""

    names: tuple
    style: str = LINEN
    rules: tuple | None = None

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"Annotation.style must be one of {STYLES}, got {self.style!r}.")
        object.__setattr__(self, "names", tuple(self.names))
        if self.rules is not None:
            object.__setattr__(self, "rules", tuple((k, v) for k, v in self.rules))


def _leaves(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, (tuple, list)):
        return [a for y in x for a in _leaves(y)]
    return [x]


def _linen(names: tuple, rules: tuple) -> list:
    """Flax linen's priority resolution (``flax.linen.spmd._logical_to_mesh_axes``)."""
    named = {k for k, _ in rules}
    counts = collections.Counter(n for n in names if isinstance(n, str) and n in named)
    dups = [n for n, c in counts.items() if c > 1]  # (a mesh axis twice is refused later, as a split)
    if dups:
        raise ValueError(
            f"the annotation {names} names {dups} on more than one dimension; Flax refuses it too "
            f"('Dimensions occur more than once'). Give each dimension its own logical name."
        )
    out: list = [UNRULED if isinstance(n, str) else n for n in names]
    for logical, target in rules:
        if logical not in names:
            continue
        pos = names.index(logical)
        taken = {a for x in out if x is not UNRULED for a in _leaves(x)}
        if out[pos] is UNRULED and not taken.intersection(_leaves(target)):
            out[pos] = target
    # A name that rules exist for but none could take is not split, as in Flax.
    return [None if x is UNRULED and n in named else x for x, n in zip(out, names)]


def _nnx(names: tuple, context: tuple, local: tuple | None) -> list:
    """Flax NNX's table resolution (``flax.core.spmd.composite_rules`` then
    ``from_sharding_rules``)."""
    table = {k: v for k, v in context}
    for k, v in local or ():
        if k in table and table[k] != v:
            raise ValueError(
                f"the annotation {names} has its own rule ({k!r}, {v!r}), which contradicts "
                f"ZeroConfig.axes.rules' ({k!r}, {table[k]!r}); Flax refuses it too ('Inconsistent "
                f"logical axis annotations'). Make them agree."
            )
        table[k] = v
    return [table[n] if isinstance(n, str) and n in table else (UNRULED if isinstance(n, str) else n) for n in names]


def resolve(annotation: Annotation, rules: tuple) -> list:
    """Per dimension of ``annotation``: its mesh target under ``rules`` (the context's,
    ``ZeroConfig.axes.rules``), or :data:`UNRULED`.

    Example:
      >>> resolve(Annotation(("x", "y")), (("x", "tensor"), ("x", None), ("y", "tensor")))
      ['tensor', None]
      >>> resolve(Annotation(("x", "y"), style="nnx"), (("x", "tensor"), ("x", None), ("y", "tensor")))
      [None, 'tensor']
    """
    names = annotation.names
    if annotation.style == MESH:
        return [UNRULED if isinstance(n, str) else n for n in names]
    if annotation.style == NNX:
        return _nnx(names, tuple(rules), annotation.rules)
    return _linen(names, tuple(rules) if annotation.rules is None else annotation.rules)
