"""Progress bars for long command-line work (tqdm, on stderr so that output stays clean).

A bar shows on a terminal and stays quiet otherwise: ``disable=None`` (the default) turns
it off when stderr is not a TTY (output piped or captured) or when the ``CI`` environment
variable is set to anything but ``""``, ``"0"`` or ``"false"``. ``disable=False`` always
shows it, ``disable=True`` never.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def quiet() -> bool:
    """Whether a bar with ``disable=None`` stays hidden: stderr is not a terminal, or the
    ``CI`` environment variable is set (to anything but ``""``, ``"0"``, ``"false"``).

    Example:
      >>> from zerojax.progress import quiet
      >>> quiet() in (True, False)  # True under pytest, which captures stderr
      True
    """
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false")
    isatty = getattr(sys.stderr, "isatty", None)
    return ci or not (callable(isatty) and isatty())


def bar(total: int | None, desc: str, *, unit: str = "it", disable: bool | None = None) -> Any:
    """A tqdm bar of ``total`` units on stderr; call ``.update(n)``, ``.set_postfix_str(s)``
    and ``.close()`` (or use it as a context manager). ``disable=None``: hidden unless stderr
    is a terminal and not in CI (:func:`quiet`); a hidden bar accepts the same calls.

    Example:
      >>> from zerojax.progress import bar
      >>> with bar(3, "work") as b:  # on stderr, where a terminal shows it
      ...     b.set_postfix_str("step 1")
      ...     b.update(3)
    """
    from tqdm import tqdm

    hidden = quiet() if disable is None else bool(disable)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, disable=hidden)


def progress(
    iterable: Iterable[T], desc: str, total: int | None = None, *, unit: str = "it", disable: bool | None = None
) -> Iterator[T]:
    """``iterable``'s items, with a progress bar of ``total`` items (default: ``len(iterable)``
    where it has one) while they are consumed; the items are unchanged. ``disable`` as for
    :func:`bar`: by default shown on a terminal only.

    Example:
      >>> from zerojax.progress import progress
      >>> list(progress(range(3), "configurations"))
      [0, 1, 2]
    """
    hidden = quiet() if disable is None else bool(disable)
    if hidden:
        yield from iterable
        return
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with bar(total, desc, unit=unit, disable=False) as b:
        for item in iterable:
            yield item
            b.update(1)
