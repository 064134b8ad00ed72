"""Deprecated: the layouts of a sequence over a context axis are :class:`zerojax.context.Layout`
values (``Layout(kind, C).order(T)``, ``.inverse``, ``.device_positions``, ``.check``,
``.permute``); ``zj.nn.global_positions`` stays where it is. These functions, which took the
layout by kind name, keep working for one release and warn."""

from __future__ import annotations

import warnings

from zerojax.context.layout import KINDS as LAYOUTS
from zerojax.context.layout import Layout, global_positions


def _moved(name: str, new: str) -> None:
    warnings.warn(
        f"zj.nn.context.{name} is deprecated: use zj.context.Layout(kind, C).{new}.", DeprecationWarning, stacklevel=3
    )


def check(seq_len: int, c: int, layout: str, what: str = "sequence length") -> None:
    _moved("check", "check(T)")
    Layout(layout, c).check(seq_len, what)


def order(seq_len: int, c: int, layout: str = "balanced"):
    _moved("order", "order(T)")
    return Layout(layout, c).order(seq_len)


def positions(seq_len: int, c: int, layout: str):
    _moved("positions", "device_positions(T)")
    return Layout(layout, c).device_positions(seq_len)


def inverse(seq_len: int, c: int, layout: str = "balanced"):
    _moved("inverse", "inverse(T)")
    return Layout(layout, c).inverse(seq_len)


def permute(x, dim: int, c: int):
    _moved("permute", "permute(x, dim)")
    return Layout("balanced", c).permute(x, dim)


__all__ = ["LAYOUTS", "Layout", "check", "global_positions", "inverse", "order", "permute", "positions"]
