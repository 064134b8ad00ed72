"""The memory budget per device: parsed, checked for a plausible unit, less the margin.

A budget is bytes (an int) or a string with a unit: ``"80GiB"``, ``"16GB"``, ``"512 MiB"``,
``"1.5TB"`` (powers of 1024 for ``KiB``/``MiB``/``GiB``/``TiB``, of 1000 for
``KB``/``MB``/``GB``/``TB``; ``B`` or no unit: bytes). Anything under 1 MiB or over 1 TiB
is refused: no accelerator has that little or that much memory, and such a figure is almost
always a number in the wrong unit (``80`` meaning 80 GiB) or the memory of all devices
together.

The margin (default 10%) covers what a compiled program's ``memory_analysis()`` does not
count: the allocator's fragmentation, communication buffers (NCCL's), the runtime's own
workspace. A plan's predicted device bytes are the compiled bytes × (1 + margin), and it
fits when that is at most the budget.
"""

from __future__ import annotations

import math
import re

MIB, TIB = 2**20, 2**40
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_FORM = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
FORMS = "bytes as an int, or a string with a unit: '80GiB', '16GB', '512MiB'"


def parse_memory(memory: int | float | str) -> int:
    """Bytes per device from an int or a string with a unit; a clear error for anything
    else, or for a figure outside 1 MiB .. 1 TiB.

    Example:
      >>> from zerojax.tuning import parse_memory
      >>> parse_memory("80GiB"), parse_memory("16GB"), parse_memory(2**30)
      (85899345920, 16000000000, 1073741824)
      >>> parse_memory(80)
      Traceback (most recent call last):
      ...
      ValueError: memory=80 is 80 B per device, under 1 MiB: ... '80GiB' ...
      >>> parse_memory("640GB")
      640000000000
      >>> parse_memory("8TB")
      Traceback (most recent call last):
      ...
      ValueError: memory='8TB' is 7.28 TiB per device, more than any accelerator has (the largest known, ...
    """
    value = _bytes(memory, "memory", "device")
    if value > TIB:
        from zerojax.tuning.devices import KNOWN

        largest = max(KNOWN.values(), key=lambda s: s.memory_bytes)
        raise ValueError(
            f"memory={memory!r} is {value / TIB:.2f} TiB per device, more than any accelerator has "
            f"(the largest known, {largest.name}, has {largest.memory_bytes / 1e9:.0f} GB). Give the "
            f"memory of one device, not of all of them: {FORMS}."
        )
    return int(value)


def parse_host_memory(memory: int | float | str) -> int:
    """Host bytes per device (``zj.autotune``'s ``host_memory``) from an int or a string with
    a unit, as :func:`parse_memory` reads them; at least 1 MiB, with no upper bound (a host
    can hold terabytes).

    Example:
      >>> from zerojax.tuning.budget import parse_host_memory
      >>> parse_host_memory("2TiB") == 2 * 2**40
      True
    """
    return int(_bytes(memory, "host_memory", "host"))


def _bytes(memory: int | float | str, name: str, what: str) -> float:
    """The bytes ``memory`` gives, at least 1 MiB (``name``: the argument, for messages)."""
    if isinstance(memory, bool):
        raise TypeError(f"{name} must be {FORMS}, got {memory!r}.")
    if isinstance(memory, str):
        m = _FORM.fullmatch(memory)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}={memory!r} is not a size; give {FORMS}.")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    elif isinstance(memory, (int, float)):
        value = float(memory)
    else:
        raise TypeError(f"{name} must be {FORMS}, got {type(memory).__name__} {memory!r}.")
    if not math.isfinite(value) or value < MIB:
        raise ValueError(
            f"{name}={memory!r} is {value:,.0f} B per device, under 1 MiB: a budget is bytes per "
            f"device; give {FORMS} (e.g. '80GiB' for an 80 GiB {what})."
        )
    return value


def check_margin(margin: float) -> float:
    """The margin as a float in [0, 1); a clear error otherwise."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(
            f"margin must be a fraction in [0, 1) (0.1: 10% above the compiled bytes for allocator "
            f"fragmentation and communication buffers), got {margin!r}."
        )
    return float(margin)


def usable(budget: int, margin: float) -> float:
    """The largest compiled byte count that fits ``budget`` with ``margin`` added."""
    return budget / (1.0 + margin)


def fmt_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``: binary units, three significant figures.

    Example:
      >>> from zerojax.tuning.budget import fmt_bytes
      >>> fmt_bytes(3 * 2**29), fmt_bytes(12.3 * 2**20), fmt_bytes(512)
      ('1.50 GiB', '12.3 MiB', '512 B')
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.2f} {unit}" if abs(v) < 10 else f"{v:.1f} {unit}" if abs(v) < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"
