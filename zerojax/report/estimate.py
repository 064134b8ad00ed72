"""Closed-form per-device memory of model states, before anything is compiled.

Two models side by side:

* the ZeRO paper's (mixed precision: fp16 params 2Ψ, fp16 grads 2Ψ, K·Ψ optimizer state with
  K = 12 for Adam: fp32 master, m, v): (2+2+K)Ψ, (2+2)Ψ + KΨ/N, 2Ψ + (2+K)Ψ/N, (2+2+K)Ψ/N;
* DeepSpeed's estimators (``estimate_zero2/3_model_states_mem_needs``): ZeRO-2 2Ψ + 18Ψ/N
  (CPU offload: 2Ψ on the GPU, Ψ·max(4·GPUs, 16)·1.5 on the host); ZeRO-3
  4·largest_layer + 18Ψ/N (optimizer offload: 4·largest_layer + 2Ψ/N; both offloaded:
  4·largest_layer), largest_layer in parameters.

For the persistent bytes of a zerojax state (gradients are transient in JAX) see
:func:`zerojax.zero_formula_bytes`; for the compiled step's own figure, ahead of time,
:func:`zerojax.compiled_bytes` on ``train_step.lower(state, batch).compile()``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

ADDITIONAL_BUFFER_FACTOR = 1.5  # DeepSpeed's default


def paper_bytes(num_params: float, n: int, stage: int, k: int = 12) -> float:
    """The ZeRO paper's model-state bytes per device (mixed-precision Adam: K = 12).

    Example:
      >>> from zerojax.report.estimate import paper_bytes
      >>> [round(paper_bytes(7.5e9, 64, s) / 1e9, 1) for s in range(4)]
      [120.0, 31.4, 16.6, 1.9]
    """
    psi = float(num_params)
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return (2 + 2) * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise ValueError(f"stage must be 0..3, got {stage!r}")


@dataclasses.dataclass(frozen=True)
class DeepSpeedEstimate:
    """Bytes per GPU (and per host for CPU offload) from DeepSpeed's estimator formulas."""

    gpu: float
    cpu: float | None  # host bytes (ZeRO-2 optimizer offload); None where not modelled here
    offload: str  # "none", "optimizer", "optimizer+params"


def deepspeed_bytes(num_params: float, n: int, stage: int, *, largest_layer: float = 0.0,
                    offload: str = "none", gpus_per_node: int | None = None) -> DeepSpeedEstimate:
    """DeepSpeed's estimate for ZeRO-2 or ZeRO-3 (it has none for stages 0 and 1)."""
    psi = float(num_params)
    if stage == 2:
        if offload == "none":
            return DeepSpeedEstimate(2 * psi + 18 * psi / n, 0.0, offload)
        if offload == "optimizer":
            total = n if gpus_per_node is None else gpus_per_node
            return DeepSpeedEstimate(2 * psi, psi * max(4 * total, 16) * ADDITIONAL_BUFFER_FACTOR, offload)
    elif stage == 3:
        layer = 4 * float(largest_layer)
        if offload == "none":
            return DeepSpeedEstimate(layer + 18 * psi / n, 0.0, offload)
        if offload == "optimizer":
            return DeepSpeedEstimate(layer + 2 * psi / n, None, offload)
        if offload == "optimizer+params":
            return DeepSpeedEstimate(layer, None, offload)
    else:
        raise ValueError(f"DeepSpeed estimates ZeRO-2 and ZeRO-3 only, got stage {stage!r}.")
    raise ValueError(f"offload must be 'none', 'optimizer' or (stage 3) 'optimizer+params', got {offload!r}.")


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """Sizes of a GPT (the experiments' GPT layout: untied head, learned positions)."""

    vocab: int
    seq_len: int
    d_model: int
    n_layers: int
    mlp_ratio: int = 4

    def block_params(self) -> int:
        d, m = self.d_model, self.mlp_ratio
        return 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * m * d + m * d) + (m * d * d + d)

    def num_params(self) -> int:
        d, V = self.d_model, self.vocab
        return V * d + self.seq_len * d + self.n_layers * self.block_params() + 2 * d + d * V

    def largest_layer_params(self) -> int:
        """The largest module's own parameters, as DeepSpeed counts a layer: the embedding
        or head (vocab × d_model) or the MLP's first linear (d_model × 4·d_model + bias)."""
        d, m = self.d_model, self.mlp_ratio
        return max(self.vocab * d, self.seq_len * d, m * d * d + m * d)


def from_params(params: Any, *, stacked: Sequence[str] = ()) -> tuple[int, int]:
    """``(Ψ, largest layer)`` of a parameter tree, counted as DeepSpeed's ``model_to_params``
    counts a torch model: a layer is one module's own parameters, i.e. the leaves that share
    a parent path. Leaves may be arrays or ``jax.ShapeDtypeStruct``.

    ``stacked`` names path entries under which every leaf carries a leading layer axis
    (layers created with ``nnx.vmap`` / ``nn.scan``); such a module counts one layer's slice.

    Example:
      >>> import jax
      >>> from zerojax.report.estimate import from_params
      >>> tree = {"embed": {"embedding": jax.ShapeDtypeStruct((1000, 64), "float32")},
      ...         "blocks": {"mlp": {"kernel": jax.ShapeDtypeStruct((12, 64, 256), "float32"),
      ...                            "bias": jax.ShapeDtypeStruct((12, 256), "float32")}}}
      >>> from_params(tree, stacked=["blocks"])
      (263680, 64000)
    """
    layers: dict[tuple[str, ...], int] = defaultdict(int)
    total = 0
    for path, leaf in _flatten_with_path(params):
        shape = tuple(getattr(leaf, "shape", ()))
        size = math.prod(shape)
        total += size
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        if len(keys) > 1 and keys[-1] == "value":  # nnx.Param's own attribute
            keys = keys[:-1]
        module = tuple(keys[:-1])
        if any(k in stacked for k in module) and shape:
            size //= shape[0]
        layers[module] += size
    if not layers:
        raise ValueError("params has no leaves; pass the model's parameter tree.")
    return total, max(layers.values())


def _flatten_with_path(params: Any):
    import jax

    return jax.tree_util.tree_flatten_with_path(params)[0]


MODELS = {
    "gpt-tiny": GPTShape(vocab=256, seq_len=64, d_model=128, n_layers=4),
    "gpt2-small": GPTShape(vocab=50257, seq_len=1024, d_model=768, n_layers=12),
    "gpt2-medium": GPTShape(vocab=50257, seq_len=1024, d_model=1024, n_layers=24),
    "gpt2-large": GPTShape(vocab=50257, seq_len=1024, d_model=1280, n_layers=36),
    "gpt2-xl": GPTShape(vocab=50257, seq_len=1024, d_model=1600, n_layers=48),
    "gpt-7.5b": GPTShape(vocab=50257, seq_len=2048, d_model=4096, n_layers=37),
}


def table(num_params: float, n: int, largest_layer: float = 0.0, replicas: int = 1) -> str:
    """The paper's table and DeepSpeed's estimates as text (what ``zerojax estimate`` prints).

    With ``replicas=R`` (hybrid sharding) the state is sharded over a group of ``N/R``
    devices: the formulas take ``N/R``, and the lines after the table give the gradient
    all-reduce across groups, the only traffic that leaves a group.

    Example:
      >>> from zerojax.report.estimate import table
      >>> print(table(1e9, 16, replicas=2).splitlines()[0])
      Model states per device, Ψ = 1,000,000,000 parameters, N = 16 devices in 2 replica groups of 8
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 or n % replicas:
        raise ValueError(f"replicas must be a positive int dividing the {n} devices, got {replicas!r}.")
    shard = n // replicas
    gb = lambda b: f"{b / 1e9:,.1f} GB"
    where = f"N = {n} devices" + (f" in {replicas} replica groups of {shard}" if replicas > 1 else "")
    lines = [f"Model states per device, Ψ = {num_params:,.0f} parameters, {where}",
             "", f"{'stage':>5}  {'ZeRO paper (K=12)':>18}  {'DeepSpeed estimator':>20}"]
    for s in range(4):
        ds = gb(deepspeed_bytes(num_params, shard, s, largest_layer=largest_layer).gpu) if s >= 2 else "-"
        lines.append(f"{s:>5}  {gb(paper_bytes(num_params, shard, s)):>18}  {ds:>20}")
    lines.append("")
    lines.append(f"DeepSpeed ZeRO-3 uses 4 x largest layer = {gb(4 * largest_layer)}"
                 if largest_layer else "DeepSpeed ZeRO-3 without --largest-layer counts no gathered layer.")
    if replicas > 1:
        lines.append(f"Across replica groups, per device and step: an all-reduce of a buffer of Ψ/{shard} gradient elements "
                     f"({gb(2 * num_params / shard)} in fp16, {gb(4 * num_params / shard)} in fp32; "
                     f"a 1-D mesh runs every gather and reduce-scatter across all {n} devices).")
    return "\n".join(lines)
