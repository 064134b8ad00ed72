"""Values read out of a DeepSpeed config and checked as DeepSpeed checks them: numbers,
flags and sections. An ``"auto"`` left in is refused with a message that says how to fill
it (``translate(..., auto={...})``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _number(value: Any, key: str, *, integer: bool = False, minimum: float | None = None, strict: bool = False) -> Any:
    if value == "auto":
        raise ValueError(
            f"DeepSpeed key {key!r} is 'auto', a placeholder the Hugging Face Trainer fills in; "
            "give its value (translate(..., auto={...}) fills it)."
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"DeepSpeed key {key!r} must be a number, got {value!r}.")
    if integer:
        if float(value) != int(value):
            raise ValueError(f"DeepSpeed key {key!r} must be a whole number, got {value!r}.")
        value = int(value)
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"DeepSpeed key {key!r} must be {'>' if strict else '>='} {minimum}, got {value!r}.")
    return value


def _flag(value: Any, key: str) -> bool:
    if value == "auto":
        raise ValueError(
            f"DeepSpeed key {key!r} is 'auto', a placeholder the Hugging Face Trainer fills in; "
            "give true or false (translate(..., auto={...}) fills it)."
        )
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed key {key!r} must be true or false, got {value!r}.")
    return value


def _section(ds: dict, key: str) -> dict:
    value = ds.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"DeepSpeed key {key!r} must be an object, got {value!r}.")
    return dict(value)
