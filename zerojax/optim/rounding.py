"""Casting fp32 values down to a narrower storage dtype: round to nearest, or stochastically.

Stochastic rounding to bf16 keeps an fp32 value's upper 16 bits and rounds up with
probability equal to the discarded lower 16 bits' share of one bf16 ulp: add 16 uniform
random bits to the fp32 bit pattern, then truncate. The rounded value's expectation is the
fp32 value, so updates smaller than half an ulp still move a bf16 master on average
(round to nearest drops them every time).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from zerojax.optim.rounding import stochastic_round
  >>> x = jnp.full((4096,), 1.0 + 2.0**-9, jnp.float32)   # a quarter of the bf16 ulp above 1
  >>> float(x.astype(jnp.bfloat16)[0])                      # round to nearest: the step is lost
  1.0
  >>> r = stochastic_round(x, jax.random.key(0)).astype(jnp.float32)
  >>> bool(jnp.abs(r.mean() - (1.0 + 2.0**-9)) < 2e-4)       # unbiased
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stochastic_round(x: jax.Array, key: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to bfloat16 stochastically with ``key``: each element rounds
    up with probability equal to its distance from the bf16 value below, in ulps. Non-finite
    values round to nearest (they stay inf or nan)."""
    if jnp.dtype(x.dtype) != jnp.float32:
        raise TypeError(f"stochastic_round rounds float32 values to bfloat16, got {x.dtype}.")
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    out = jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)  # exact: low bits are zero
    return jnp.where(jnp.isfinite(x), out, x.astype(jnp.bfloat16))


def round_to(x: jax.Array, dtype, key: jax.Array | None) -> jax.Array:
    """``x`` in ``dtype``: stochastically rounded with ``key`` where narrowing fp32 to bf16
    with a key, cast (round to nearest) otherwise."""
    if key is not None and jnp.dtype(dtype) == jnp.bfloat16 and jnp.dtype(x.dtype) == jnp.float32:
        return stochastic_round(x, key)
    return x.astype(dtype)
