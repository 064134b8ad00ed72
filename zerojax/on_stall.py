"""Work to finish before a stalled process exits.

A train step that does not finish within its ``timeout_s`` ends the process (another
process has stalled or died, and this one waits for it in a collective). Before it exits,
it gives the work registered here a bounded time to complete: asynchronous checkpoint
saves register themselves (:mod:`zerojax.checkpoint.io`), so the step, which sits below
checkpoints, never imports them.
"""

from __future__ import annotations

from collections.abc import Callable

_FINISHERS: list[Callable[[float], list[str]]] = []


def register(finish: Callable[[float], list[str]]) -> Callable[[float], list[str]]:
    """Adds ``finish(timeout_s) -> lines``: it completes its work within ``timeout_s``
    seconds or abandons it, and returns one line per piece of work saying which."""
    if finish not in _FINISHERS:
        _FINISHERS.append(finish)
    return finish


def finish_all(timeout_s: float) -> list[str]:
    """Runs every registered finisher, each with ``timeout_s``; their lines, in order."""
    lines: list[str] = []
    for finish in list(_FINISHERS):
        lines += finish(timeout_s)
    return lines
