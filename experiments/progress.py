"""The progress bar every experiment script shows (tqdm, on stderr so tables stay clean).

The bars themselves are :mod:`zerojax.progress`'s; an experiment's bar shows by
default even when stderr is not a terminal (its log then records the run's pace), and
``bar(..., disable=None)`` hides it off a terminal and in CI, as the command line does.
"""

from __future__ import annotations

from zerojax.progress import bar as _bar
from zerojax.progress import progress

__all__ = ["bar", "progress"]


def bar(total: int, desc: str, disable: bool | None = False):
    """A tqdm bar of ``total`` runs; ``bar.set_postfix_str`` says what is being measured."""
    return _bar(total, desc, unit="run", disable=disable)
