"""Which attention a package model runs, chosen while tracing from static facts.

A model's ``attention="fused"`` (the default of :class:`zerojax.models.LlamaConfig` and
:class:`zerojax.models.gpt.GPTConfig`) takes:

* ``"auto"``: on a context mesh (a layout of 2+ devices handed in, or the step's context
  axis with 2+ devices in the mesh), ``zj.nn.dot_product_attention`` with ``method="auto"``
  (Ulysses or ring), as ``attention="auto"`` does;
* ``"cudnn"``: on a CUDA GPU where cuDNN's flash attention takes the call,
  ``jax.nn.dot_product_attention(..., implementation="cudnn")``: queries, keys and values
  bf16 or fp16, a head dimension that is a multiple of 8 and at most 128 (256 on compute
  capability 9.0 and later), causal, with one sliding window for every layer or none, and
  no key mask or segment ids (each of those would reach cuDNN as a ``[B, 1, T, S]`` bias,
  quadratic in memory again, and is left to the exact path);
* ``"einsum"``: the exact attention written with plain ops everywhere else (on a CPU, on
  a TPU, in float32, with a key mask, with packed segments, with per-layer windows), the
  model's numbers unchanged.

The choice is :func:`choose`, a pure function of those facts; the model runs it under
``jax.named_scope("attention_" + kind)``, so every op of the attention carries
``attention_einsum``, ``attention_cudnn`` or ``attention_auto`` in its HLO metadata (an
explicit ``attention=`` method runs under its own name: ``attention_ring``, ...), and
:func:`ran` reads which ran from a compiled program (cuDNN's by its ``__cudnn$fmha``
custom call).
Where ``"fused"`` falls back to the exact path on a GPU, the model warns once per reason,
naming the reason and the size of the scores it materialises.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.context.attention import METHODS
from zerojax.sharding import in_step
from zerojax.sharding.mesh import context_size

FUSED = "fused"
# What runs: the plain-ops attention, cuDNN's, or zj.nn.dot_product_attention with a method.
KINDS = ("einsum", "cudnn") + METHODS
SCOPES = {kind: f"attention_{kind}" for kind in KINDS}
CUDNN_CALL = "__cudnn$fmha"  # the prefix of cuDNN's fused attention custom calls in XLA
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Choice:
    """``kind``: one of :data:`KINDS`; ``reason``: why, in words."""

    kind: str
    reason: str


def max_head_dim(capability: tuple[int, int] | None) -> int:
    """The largest head dimension cuDNN's flash attention takes: 256 from compute capability
    9.0 (Hopper) on, 128 before (JAX's ``check_is_flash_attention``); 128 when unknown."""
    return 256 if capability is not None and tuple(capability) >= (9, 0) else 128


def choose(
    platform: str,
    dtype,
    head_dim: int,
    *,
    mask: bool = False,
    segments: bool = False,
    window: int | None = 0,
    context: bool = False,
    capability: tuple[int, int] | None = None,
) -> Choice:
    """The attention ``attention="fused"`` runs for causal self-attention.

    Args:
      platform: the backend, as :func:`platform` gives it (``"cuda"``, ``"rocm"``, ``"cpu"``,
        ``"tpu"``).
      dtype: the dtype of the queries, keys and values.
      head_dim: their head dimension.
      mask: whether a key mask (padding) is given.
      segments: whether segment ids (packed sequences) are given.
      window: the sliding window every layer shares (0: none), or None where the layers'
        windows differ (a value scanned with the layers, not a static argument).
      context: whether the sequence is split over a context axis of 2+ devices.
      capability: the GPU's compute capability, for the largest head dimension.

    Example:
      >>> import jax.numpy as jnp
      >>> choose("cuda", jnp.bfloat16, 128).kind, choose("cpu", jnp.bfloat16, 128).kind
      ('cudnn', 'einsum')
      >>> choose("cuda", jnp.bfloat16, 128, segments=True).reason
      'segment ids (packed sequences): cuDNN would take them as a [B, 1, T, S] bias'
    """
    if context:
        if window is None:
            return Choice("einsum", "per-layer windows: the context kernels take one window for every layer")
        return Choice("auto", "a context mesh: zj.nn.dot_product_attention (Ulysses or ring)")
    if platform != "cuda":
        return Choice("einsum", f"no fused attention kernel on {platform!r}")
    dt = jnp.dtype(dtype)
    if dt not in CUDNN_DTYPES:
        return Choice("einsum", f"{dt.name} attention: cuDNN's flash attention takes bfloat16 or float16")
    top = max_head_dim(capability)
    if head_dim % 8 or head_dim > top:
        return Choice("einsum", f"head_dim {head_dim}: cuDNN takes a multiple of 8 up to {top}")
    if segments:
        return Choice("einsum", "segment ids (packed sequences): cuDNN would take them as a [B, 1, T, S] bias")
    if mask:
        return Choice("einsum", "a key mask: cuDNN would take it as a [B, 1, T, S] bias")
    if window is None:
        return Choice("einsum", "per-layer windows: cuDNN takes one static window")
    return Choice("cudnn", "cuDNN flash attention (causal" + (f", window {window})" if window else ")"))


def platform() -> str:
    """The default backend's platform: ``"cuda"`` or ``"rocm"`` for a GPU, else JAX's name."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = jax.devices()[0].client.platform_version.lower()
    return "cuda" if "cuda" in version else "rocm" if "rocm" in version else "gpu"


def capability() -> tuple[int, int] | None:
    """The first device's compute capability, where it has one (a CUDA GPU)."""
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return tuple(int(x) for x in str(cc).split("."))[:2] if cc else None
    except ValueError:
        return None


def on_context_mesh(layout) -> bool:
    """Whether the sequence is split over 2+ context devices: by the layout handed in, or
    by the mesh in context, over the step's context axis (``ZeroConfig(axes={"context":
    ...})``; "context" outside a step)."""
    if layout is not None and getattr(layout, "c", 1) > 1:
        return True
    step = in_step.current()
    axis = step[0].config.axes.context if step is not None else "context"
    return context_size(jax.sharding.get_abstract_mesh(), axis) > 1


_WARNED: set[str] = set()


def warn_fallback(choice: Choice, plat: str, scores_bytes: int) -> None:
    """On a GPU, once per reason: the fused default runs the exact path, and its scores' size."""
    if choice.kind != "einsum" or plat not in ("cuda", "rocm", "gpu") or choice.reason in _WARNED:
        return
    _WARNED.add(choice.reason)
    warnings.warn(
        f"attention='fused' runs the exact einsum attention here ({choice.reason}), which materialises "
        f"{scores_bytes / 2**20:,.1f} MiB of scores per layer; see docs/hf_families.md (Attention: which kernel runs).",
        stacklevel=3,
    )


def ran(compiled) -> tuple[str, ...]:
    """Which attention a compiled program runs, of :data:`KINDS`: ``"cudnn"`` where it holds
    cuDNN's fused attention custom call, the others where its ops carry the models' scope
    names (``attention_einsum``, ...). ``compiled``: a ``jax.stages.Compiled`` (or its HLO
    text).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from zerojax.models import llama
      >>> cfg = llama.LlamaConfig(vocab=16, d_model=16, n_layers=1, n_heads=2, d_ff=16)
      >>> graphdef, params = llama.init(cfg)
      >>> f = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
      >>> ran(f.lower(params, jnp.zeros((1, 8), jnp.int32)).compile())   # on a CPU
      ('einsum',)
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    found = {k for k in KINDS if k != "cudnn" and re.search(SCOPES[k] + r"\b", text)}
    if CUDNN_CALL in text:
        found.add("cudnn")
    return tuple(k for k in KINDS if k in found)


def scores_bytes(b: int, heads: int, t: int, s: int, dtype) -> int:
    """Bytes of one layer's ``[B, N, T, S]`` scores in the exact path (at least float32)."""
    return b * heads * t * s * max(jnp.dtype(dtype).itemsize, np.dtype(np.float32).itemsize)
