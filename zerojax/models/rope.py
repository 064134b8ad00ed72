"""Rotary position embeddings (RoPE) and the scalings checkpoints use to stretch them.

The rotate-half layout of Hugging Face's Llama family: the two halves of a head share the
frequencies ``inv_freq[i] = theta ** (-2i / head_dim)``, and a position ``p`` rotates by
``p * inv_freq``. Long-context checkpoints rescale the frequencies (:class:`RopeScaling`):

- ``"linear"``: every frequency divided by ``factor``;
- ``"llama3"`` (Llama 3.1 - 3.3): wavelengths longer than
  ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, shorter than
  ``... / high_freq_factor`` kept, the ones between interpolated smoothly;
- ``"yarn"`` (Qwen2.5's long-context setting, DeepSeek): NTK-by-parts interpolation between
  the original and the divided frequencies over a ramp of dimensions set by ``beta_fast`` /
  ``beta_slow``, and cos / sin multiplied by an attention factor
  (``0.1 * mscale * ln(factor) + 1`` unless given).

The frequencies are computed in float64 with NumPy (they depend on the config only) and the
angles in the compute precision (float32, or float64 for a float64 model): the formulas are
transformers' ``modeling_rope_utils`` (``_compute_llama3_parameters``,
``_compute_linear_scaling_rope_parameters``, ``_compute_yarn_parameters``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE's frequencies (Hugging Face's ``rope_parameters``).

    Attributes:
      kind: ``"linear"``, ``"llama3"`` or ``"yarn"``.
      factor: the context extension factor (all kinds).
      original_max_position_embeddings: the pretraining context (``llama3``, ``yarn``).
      low_freq_factor, high_freq_factor: ``llama3``'s band edges.
      beta_fast, beta_slow: ``yarn``'s ramp (default 32 and 1).
      mscale, mscale_all_dim: ``yarn``'s attention factor from two scales (DeepSeek).
      attention_factor: ``yarn``'s cos / sin multiplier, given (else from ``factor``).
      truncate: ``yarn``: round the ramp's ends to whole dimensions (default True).

    Example:
      >>> s = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192,
      ...                 low_freq_factor=1.0, high_freq_factor=4.0)
      >>> f = inv_freq(128, 500000.0, s)
      >>> bool(f[0] == inv_freq(128, 500000.0)[0]), bool(f[-1] * 8 == inv_freq(128, 500000.0)[-1])
      (True, True)
    """

    kind: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"RopeScaling.kind must be one of {KINDS}, got {self.kind!r}.")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be a number > 0, got {self.factor!r}.")
        if self.kind in ("llama3", "yarn"):
            omp = self.original_max_position_embeddings
            if isinstance(omp, bool) or not isinstance(omp, int) or omp < 1:
                raise ValueError(
                    f"RopeScaling({self.kind!r}) needs original_max_position_embeddings, a positive int, got {omp!r}."
                )
        if self.kind == "llama3":
            lo, hi = self.low_freq_factor, self.high_freq_factor
            if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and 0 < lo < hi):
                raise ValueError(
                    f"RopeScaling('llama3') needs 0 < low_freq_factor < high_freq_factor, got {lo!r} and {hi!r}."
                )
        if self.kind == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"RopeScaling('yarn') needs beta_fast > beta_slow > 0, got {self.beta_fast!r} and {self.beta_slow!r}."
            )

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (1 but for ``yarn``)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim))
        return _yarn_mscale(self.factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """float64 ``[head_dim // 2]``: the rotation per position of each frequency pair."""
    freq = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return freq
    if scaling.kind == "linear":
        return freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(freq, scaling)
    return _yarn(head_dim, float(theta), scaling)


def _llama3(freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = np.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: RopeScaling) -> np.ndarray:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # the share of the original frequency
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def cos_sin(
    positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None, dtype=jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` ``[..., head_dim]`` in ``dtype`` for integer ``positions`` ``[...]``:
    both halves of the head repeat the frequencies (rotate-half layout), times the
    scaling's cos / sin factor.

    Example:
      >>> import jax.numpy as jnp
      >>> cos, sin = cos_sin(jnp.arange(3), 4, 10000.0)
      >>> cos.shape, float(cos[0, 0]), float(sin[1, 0]) == float(jnp.sin(1.0))
      ((3, 4), 1.0, True)
    """
    freq = jnp.asarray(inv_freq(head_dim, theta, scaling), dtype)
    angles = positions.astype(dtype)[..., None] * freq
    emb = jnp.concatenate([angles, angles], axis=-1)
    factor = 1.0 if scaling is None else scaling.cos_sin_factor
    if factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * jnp.asarray(factor, dtype), jnp.sin(emb) * jnp.asarray(factor, dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` for ``x`` ``[batch, seq, heads, head_dim]`` and
    ``cos`` / ``sin`` ``[batch, seq, head_dim]`` (cast to ``x``'s dtype first, as
    transformers does)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos[:, :, None].astype(x.dtype), sin[:, :, None].astype(x.dtype)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
