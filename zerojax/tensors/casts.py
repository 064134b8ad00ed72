"""The one checked cast between a checkpoint's dtypes and a model's, both ways.

:func:`check_cast` refuses, from the dtypes alone, a cast that changes what a value is: a
float into an integer or bool (truncated), an integer into bool, a signed integer into an
unsigned one (negatives wrap), an integer into a narrower one (large values wrap), and an
integer into a float whose significand cannot hold every value (rounded). :func:`cast`
runs that check, casts, and refuses finite values the target's range turns into inf (a
float32 value above 65504 into float16), naming the value and the fix. Float-to-float
casts round (a bf16 run keeps the bf16 rounding of fp32 weights): that is the point of
them, not an error.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def as_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a dtype, a name (``"bfloat16"`` included) or a jax dtype."""
    return BFLOAT16 if str(dtype) == "bfloat16" else np.dtype(dtype)


def is_float(dtype: Any) -> bool:
    d = as_dtype(dtype)
    return np.issubdtype(d, np.floating) or _ml_float(d)


def _ml_float(d: np.dtype) -> bool:
    """ml_dtypes' floats (bfloat16, float8_*) are not numpy floating subtypes."""
    try:
        ml_dtypes.finfo(d)
        return True
    except (ValueError, TypeError):
        return False


def _kind(d: np.dtype) -> str:
    if d == np.bool_:
        return "b"
    if is_float(d):
        return "f"
    return d.kind  # "i", "u", ...


def check_cast(name: str, src: Any, dst: Any, *, what: str = "its checkpoint tensor") -> None:
    """Refuses a cast of ``src`` values into a ``dst`` parameter that loses what a value is
    (see the module docstring), raising ``TypeError`` naming ``name``, both dtypes and the fix.

    Example:
      >>> check_cast("w", np.int8, np.int32)            # widening: fine
      >>> check_cast("w", np.int32, np.uint32)
      Traceback (most recent call last):
      ...
      TypeError: parameter 'w' is uint32 but its checkpoint tensor is int32: negative values would wrap around; ...
    """
    src, dst = as_dtype(src), as_dtype(dst)
    if src == dst:
        return
    sk, dk = _kind(src), _kind(dst)
    head = f"parameter {name!r} is {dst} but {what} is {src}: "
    if sk == "f" and dk != "f":
        raise TypeError(head + "a float tensor would be truncated; make the parameter a float.")
    if sk in "iu" and dk == "b":
        raise TypeError(head + "every nonzero value would become True; make the parameter an integer.")
    if sk == "i" and dk == "u":
        raise TypeError(head + f"negative values would wrap around; make the parameter {src}.")
    if sk in "iu" and dk in "iu" and not np.can_cast(src, dst, "safe"):
        raise TypeError(
            head + f"values beyond {dst}'s range would wrap around; make the parameter {src} "
            "(64-bit integers need jax.config.update('jax_enable_x64', True))."
        )
    if sk in "iu" and dk == "f":
        bits = np.iinfo(src).bits - (sk == "i")
        if bits > int(ml_dtypes.finfo(dst).nmant) + 1:
            raise TypeError(
                head + f"integers above 2**{int(ml_dtypes.finfo(dst).nmant) + 1} would be rounded; "
                f"make the parameter {src}."
            )


def narrows_range(src: Any, dst: Any) -> bool:
    """Whether finite values of ``src`` can overflow ``dst`` (float32/bfloat16 -> float16)."""
    try:
        return float(ml_dtypes.finfo(as_dtype(src)).max) > float(ml_dtypes.finfo(as_dtype(dst)).max)
    except (ValueError, TypeError):
        return False


def cast(name: str, x: np.ndarray, dtype: Any, *, fix: str) -> np.ndarray:
    """``x`` in ``dtype``, refusing (``ValueError``) finite values that become inf, with a
    message naming ``name`` (e.g. ``"parameter 'w'"``), the largest value, and ``fix``.
    Callers check the dtypes (:func:`check_cast`) once, before the values.

    Example:
      >>> cast("parameter 'w'", np.array([1.0, 7e4], np.float32), np.float16, fix="keep it float32.")
      Traceback (most recent call last):
      ...
      ValueError: parameter 'w' has values up to 7e+04, beyond float16's range (65504); keep it float32.
    """
    dtype = as_dtype(dtype)
    x = np.asarray(x)
    if x.dtype == dtype:
        return x
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(dtype)
    if narrows_range(x.dtype, dtype):
        wide = x.astype(np.float32) if x.dtype.itemsize < 4 else x
        finite = np.isfinite(wide)
        if not np.array_equal(finite, np.isfinite(y)):
            big = float(np.abs(wide[finite]).max())
            raise ValueError(
                f"{name} has values up to {big:.4g}, beyond {dtype}'s range "
                f"({float(ml_dtypes.finfo(dtype).max):.6g}); {fix}"
            )
    return y
