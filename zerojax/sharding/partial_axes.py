"""Collectives in the user's loss that cover only part of the batch.

On a hybrid mesh (``zj.make_mesh(replicas=R)``) the batch is split over two axes,
``("replica", "data")``. A collective inside the loss that names only one of them, such as
``nn.BatchNorm(axis_name="data")``, reduces within each replica group: its statistics are
those of 1/R of the batch, and nothing fails. The step traces the loss anyway, so it looks
at every collective the loss makes and warns about those.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from zerojax._jaxpr import check, constructs, form, walk


class PartialBatchCollective(UserWarning):
    """A collective in the loss names only some of the mesh axes the batch is split over."""


def collectives(jaxpr: Any) -> Iterator[tuple[str, tuple[str, ...]]]:
    """``(primitive name, mesh axes)`` of every collective in ``jaxpr`` and the jaxprs inside it."""
    for eqn in walk.equations(jaxpr):
        names = constructs.collective_axes(eqn)
        if names:
            yield form.name(eqn), names


def warn_partial(fn: Callable, mesh: Any, batch_axes: tuple[str, ...], args: tuple, what: str = "loss_fn") -> None:
    """Traces ``fn(*args)`` with ``mesh``'s axes bound and warns (:class:`PartialBatchCollective`)
    about each collective that names some but not all of ``batch_axes`` (nothing where
    zerojax reads no program: :func:`zerojax._jaxpr.check.reading`)."""
    if isinstance(batch_axes, str) or len(batch_axes) < 2 or not check.reading():
        return
    run = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=frozenset(batch_axes), check_vma=False)
    jaxpr = jax.make_jaxpr(run)(*args).jaxpr
    seen = set()
    for prim, names in collectives(jaxpr):
        covered = set(names) & set(batch_axes)
        if covered and covered != set(batch_axes) and (prim, names) not in seen:
            seen.add((prim, names))
            warnings.warn(
                f"{what} makes a {prim} over mesh axes {names}, but the batch is split over {tuple(batch_axes)}: it "
                f"reduces within each group of the {', '.join(a for a in batch_axes if a not in names)} axis, over "
                f"part of the batch (a BatchNorm with axis_name={names[0]!r} normalises each replica group on its "
                f"own). Name every batch axis, e.g. axis_name={tuple(batch_axes)!r}, if you mean the global batch. "
                "Integer leaves of a model state are taken from the first device, whatever the others hold.",
                PartialBatchCollective,
                stacklevel=2,
            )
