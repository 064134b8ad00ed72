"""Which parameters are the layer stack a pipeline splits, chosen when the state is planned.

On a mesh with a pipeline axis (``zj.make_mesh(pipeline=P)``) the parameters the loss's
layer ``scan`` iterates over (stacked ``[L, ...]``) are split over that axis by their layers:
stage ``p`` holds layers ``[p·L/P, (p+1)·L/P)``, and ZeRO shards them over the data axes
within the stage. Every other parameter (embeddings, the final norm, the head) is held by
every stage, ZeRO-sharded over its data axes.

The state is planned before the loss is known, so the stack is chosen from the parameters
alone: the leaves under ``ZeroConfig.pipeline.stack`` (a path prefix), or, by default, the
leaves of two or more dimensions that share the leading dimension most of them share (on a
tie, the dimension whose leaves hold the most elements: a stack is most of a model). The
train step then checks the choice against the loss (:mod:`zerojax.pipeline`): a leaf chosen
that the layer scan does not iterate over, or one it iterates over that was not chosen, is
refused with the ``stack=`` to write. Nothing is guessed silently.
"""

from __future__ import annotations

import collections
import math
from typing import Any


def stack_splits(
    paths: list[str], shapes: list[tuple[int, ...]], splits: tuple[tuple[int, str], ...], stages: int, config: Any
) -> list[tuple[int, str]]:
    """``splits`` (per parameter ``(dim, axis)`` of its tensor or expert split, or ``(-1,
    "")``) with the layer stack's parameters split on dimension 0 over the pipeline axis.

    Example:
      >>> import zerojax as zj
      >>> paths = ["['blocks']['w']", "['blocks']['b']", "['embed']", "['norm']"]
      >>> shapes = [(4, 8, 8), (4, 8), (16, 8), (8,)]
      >>> stack_splits(paths, shapes, ((-1, ""),) * 4, 2, zj.ZeroConfig())
      [(0, 'pipeline'), (0, 'pipeline'), (-1, ''), (-1, '')]
    """
    axis = config.axes.pipeline
    prefix = config.pipeline.stack
    if prefix is not None:
        chosen = [p.startswith(prefix) for p in paths]
        if not any(chosen):
            raise ValueError(
                f"ZeroConfig.pipeline.stack={prefix!r} matches no parameter; the paths are "
                f"{_few(paths)}. Give the prefix of the layer stack's paths."
            )
    else:
        chosen = _by_leading_dim(paths, shapes)
    out = []
    for path, shape, split, c in zip(paths, shapes, splits, chosen):
        if not c:
            out.append(split)
            continue
        if not shape or shape[0] % stages:
            raise ValueError(
                f"params{path} is in the layer stack (shape {shape}) but its {shape[0] if shape else 0} layers do "
                f"not split into {stages} pipeline stages. Use a pipeline degree that divides the layer count "
                f"(zj.make_mesh(pipeline=P)), or a layer count that {stages} divides."
            )
        if split[0] >= 0:
            raise ValueError(
                f"params{path} is in the layer stack and is also split over {split[1]!r} (dimension {split[0]}); "
                f"a layer stack's parameter split over a second axis is not built yet beside a pipeline. Train "
                f"on a mesh without the {split[1]!r} axis (zj.make_mesh(pipeline=P)), or without the pipeline."
            )
        out.append((0, axis))
    return out


def _by_leading_dim(paths: list[str], shapes: list[tuple[int, ...]]) -> list[bool]:
    """The leaves of two or more dimensions with the leading dimension most of them share,
    then most elements; a tie on both is refused (the stack is ambiguous)."""
    rank: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
    for s in shapes:
        if len(s) >= 2:
            rank[s[0]][0] += 1
            rank[s[0]][1] += math.prod(s)
    if not rank:
        raise ValueError(
            "a pipeline mesh needs a layer stack (parameters stacked [L, ...] that the loss scans over), and "
            f"params has no leaf of two or more dimensions (paths {_few(paths)})."
        )
    order = sorted(rank, key=lambda d: tuple(rank[d]), reverse=True)
    if len(order) > 1 and rank[order[0]] == rank[order[1]]:
        tied = sorted(d for d in order if rank[d] == rank[order[0]])
        raise ValueError(
            f"the layer stack is ambiguous: leading dimensions {tied} are each shared by {rank[order[0]][0]} "
            f"parameters of {rank[order[0]][1]} elements. Name the stack: ZeroConfig(pipeline={{'stack': "
            "\"['blocks']\"}}) (the path prefix of the stacked layers)."
        )
    return [len(s) >= 2 and s[0] == order[0] for s in shapes]


def _few(paths: list[str]) -> str:
    return ", ".join(paths[:6]) + (f", ... ({len(paths)} in all)" if len(paths) > 6 else "")
