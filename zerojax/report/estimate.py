"""Closed-form per-device memory of model states, before anything is compiled.

Three models side by side:

* the ZeRO paper's (mixed precision: fp16 params 2Ψ, fp16 grads 2Ψ, K·Ψ optimizer state with
  K = 12 for Adam: fp32 master, m, v): (2+2+K)Ψ, (2+2)Ψ + KΨ/N, 2Ψ + (2+K)Ψ/N, (2+2+K)Ψ/N;
* DeepSpeed's estimators (``estimate_zero2/3_model_states_mem_needs``): ZeRO-2 2Ψ + 18Ψ/N
  (CPU offload: 2Ψ on the GPU, Ψ·max(4·GPUs, 16)·1.5 on the host); ZeRO-3
  4·largest_layer + 18Ψ/N (optimizer offload: 4·largest_layer + 2Ψ/N; both offloaded:
  4·largest_layer), largest_layer in parameters;
* zerojax's own (:func:`zerojax.report.zero_formula_bytes`): the persistent bytes of a zerojax
  state, fp32 masters plus the optimizer's state (:data:`OPTIMIZER_BYTES` per parameter)
  plus a compute-dtype copy of the parameters where a stage keeps one (fp32 Adam: 12Ψ,
  4Ψ + 8Ψ/N, 4Ψ + 8Ψ/N, 12Ψ/N); gradients are transient in JAX (the step's temporaries)
  and not counted.

For the compiled step's own figure, ahead of time, see :func:`zerojax.report.step_memory` or :func:`zerojax.report.compiled_bytes` on
``train_step.lower(state, batch).compile()``.

Model shapes (:data:`MODELS`, ``zerojax estimate --model``) compute Ψ from the architecture:
:class:`GPTShape` (GPT-2 / GPT-3 layout) and :class:`LlamaShape` (Llama / Mistral layout).
"""

from __future__ import annotations

import dataclasses
import decimal
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from zerojax.report.memory import zero_formula_bytes

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


def deepspeed_bytes(
    num_params: float,
    n: int,
    stage: int,
    *,
    largest_layer: float = 0.0,
    offload: str = "none",
    gpus_per_node: int | None = None,
) -> DeepSpeedEstimate:
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
    """Sizes of a GPT (the experiments' GPT layout: LayerNorms with biases, biased linears,
    learned positions, an untied head; ``tied=True`` shares the head with the token
    embedding, as GPT-2 and GPT-3 do).

    Example:
      >>> from zerojax.report.estimate import GPTShape
      >>> GPTShape(vocab=50257, seq_len=1024, d_model=768, n_layers=12, tied=True).num_params()  # GPT-2
      124439808
    """

    vocab: int
    seq_len: int
    d_model: int
    n_layers: int
    mlp_ratio: int = 4
    tied: bool = False

    def block_params(self) -> int:
        d, m = self.d_model, self.mlp_ratio
        return 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * m * d + m * d) + (m * d * d + d)

    def num_params(self) -> int:
        d, V = self.d_model, self.vocab
        head = 0 if self.tied else d * V
        return V * d + self.seq_len * d + self.n_layers * self.block_params() + 2 * d + head

    def largest_layer_params(self) -> int:
        """The largest module's own parameters, as DeepSpeed counts a layer: the embedding
        or head (vocab × d_model) or the MLP's first linear (d_model × 4·d_model + bias)."""
        d, m = self.d_model, self.mlp_ratio
        return max(self.vocab * d, self.seq_len * d, m * d * d + m * d)


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Sizes of a Llama-style decoder: RMSNorm (a scale, no bias) before attention, before
    the MLP and at the end; grouped-query attention without biases (``n_kv_heads`` key/value
    heads shared by ``n_heads`` query heads; rotary positions have no parameters); a SwiGLU
    MLP (gate, up and down projections, ``d_model x d_ff`` each); a head tied to the token
    embedding or not (``tied``). ``head_dim`` defaults to ``d_model // n_heads``.

    Example (Llama 3 8B; Meta's published count is 8,030,261,248):
      >>> from zerojax.report.estimate import LlamaShape
      >>> LlamaShape(vocab=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336).num_params()
      8030261248
    """

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    tied: bool = False
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LlamaShape.{name} must be a positive int, got {v!r}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads} (grouped-query attention)."
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"n_heads {self.n_heads} must divide d_model {self.d_model}, or give head_dim.")

    def _head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def block_params(self) -> int:
        """One decoder layer: q and o projections, k and v for the key/value heads, the
        three SwiGLU projections and two RMSNorm scales."""
        d, hd = self.d_model, self._head_dim()
        attention = 2 * d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd
        return attention + 3 * d * self.d_ff + 2 * d

    def num_params(self) -> int:
        d, V = self.d_model, self.vocab
        return V * d * (1 if self.tied else 2) + self.n_layers * self.block_params() + d

    def largest_layer_params(self) -> int:
        """The largest module's own parameters, as DeepSpeed counts a layer: the embedding
        or head (vocab x d_model), an MLP projection (d_model x d_ff) or the query
        projection (d_model x n_heads·head_dim)."""
        d = self.d_model
        return max(self.vocab * d, d * self.d_ff, d * self.n_heads * self._head_dim())


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
    "gpt3-175b": GPTShape(vocab=50257, seq_len=2048, d_model=12288, n_layers=96, tied=True),
    "llama2-7b": LlamaShape(vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008),
    "llama2-13b": LlamaShape(vocab=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, d_ff=13824),
    "llama2-70b": LlamaShape(vocab=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672),
    "llama3-8b": LlamaShape(vocab=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336),
    "llama3-70b": LlamaShape(vocab=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672),
    "llama3.2-1b": LlamaShape(vocab=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, tied=True),
    "mistral-7b": LlamaShape(vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336),
}
"""Model shapes by name (``zerojax estimate --model NAME``). The ``gpt*`` entries up to
``gpt-7.5b`` are the experiments' GPT (untied head); ``gpt3-175b`` ties it, as GPT-3 does; the
Llama and Mistral entries use their published configurations (``config.json``)."""

# Optimizer state bytes per trainable parameter (fp32 state), as zerojax keeps it.
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "adafactor": 0}

_OPTIMIZER_NOTES = {
    "adam": "Adam's m and v in fp32",
    "adamw": "AdamW's m and v in fp32",
    "sgd": "plain SGD, optax.sgd without momentum, keeps none; momentum would add 4",
    "adafactor": (
        "Adafactor's factored second moments, taken as ~0, a lower bound: a (rows, cols) matrix keeps "
        "4·(rows + cols) bytes, vectors and small matrices 4 per parameter, which Ψ alone does not tell"
    ),
}


def optimizer_bytes(optimizer: str) -> int:
    """Bytes of optimizer state per trainable parameter that zerojax keeps for ``optimizer``
    (``adam``, ``adamw``: 8; ``sgd``, taken without momentum: 0; ``adafactor``: ~0, its
    factored moments are not a per-parameter cost).

    Example:
      >>> from zerojax.report.estimate import optimizer_bytes
      >>> optimizer_bytes("adamw"), optimizer_bytes("sgd")
      (8, 0)
    """
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_BYTES)}, got {optimizer!r}.")
    return OPTIMIZER_BYTES[optimizer]


_SUFFIXES = {"": 0, "k": 3, "m": 6, "b": 9, "t": 12}
_COUNT = re.compile(r"(?P<num>(?:\d+(?:_\d+)*(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)(?P<suffix>[kmbt]?)", re.IGNORECASE)
COUNT_FORMS = "a number with an optional K/M/B/T suffix (case-insensitive): 7B, 1.3b, 350M, 125k, 1.5e9, 7_000_000"


def parse_count(text: str, *, allow_zero: bool = False) -> int:
    """A parameter count from text: ``7B``, ``1.3b``, ``350M``, ``125k``, ``1.5e9``,
    ``7_000_000`` (K, M, B, T: thousand, million, billion, trillion; any case). Raises
    ``ValueError`` naming the text for anything else, or a count that is not a positive whole
    number (zero allowed with ``allow_zero``).

    Example:
      >>> from zerojax.report.estimate import parse_count
      >>> [parse_count(s) for s in ("7B", "1.3b", "350M", "125k", "7.5e9", "7_000_000")]
      [7000000000, 1300000000, 350000000, 125000, 7500000000, 7000000]
    """
    if not isinstance(text, str):
        raise TypeError(f"a parameter count is parsed from a str, got {type(text).__name__} {text!r}.")
    m = _COUNT.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a parameter count; give {COUNT_FORMS}.")
    try:
        value = decimal.Decimal(m["num"]).scaleb(_SUFFIXES[m["suffix"].lower()])
    except decimal.DecimalException:
        raise ValueError(f"{text!r} is not a parameter count; give {COUNT_FORMS}.") from None
    if value > 10**18:
        raise ValueError(f"{text!r} is more than 10^18 parameters; give a parameter count, e.g. 7B.")
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is {value.normalize():f} parameters, not a whole number.")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{text!r}: a parameter count must be {'>= 0' if allow_zero else 'positive'}.")
    return int(value)


def table(
    num_params: float,
    n: int,
    largest_layer: float = 0.0,
    replicas: int = 1,
    *,
    compute_dtype: str = "float32",
    optimizer: str = "adam",
    tensor: int = 1,
    pipeline: int = 1,
    stack_params: float = 0.0,
) -> str:
    """The paper's table, DeepSpeed's estimates and zerojax's own per-device state as text
    (what ``zerojax estimate`` prints), with a line per column saying what it assumes.

    The paper's column is always mixed-precision Adam (K = 12) and DeepSpeed's its fp16
    Adam estimator; ``compute_dtype`` (float32, bfloat16, float16) and ``optimizer``
    (:data:`OPTIMIZER_BYTES`) set zerojax's column (:func:`zerojax.report.zero_formula_bytes`).

    With ``replicas=R`` (hybrid sharding) the state is sharded over a group of ``N/R``
    devices: the formulas take ``N/R``, and the lines after the table give the gradient
    all-reduce across groups, the only traffic that leaves a group.

    With ``tensor=T`` (tensor parallelism beside ZeRO) the ZeRO formulas take the ``N/(R·T)``
    devices of a data group and each device holds 1/T of every parameter (taken as all
    split: the paper's and DeepSpeed's columns with Ψ/T, zerojax's with ``tensor=T``).

    With ``pipeline=P`` (``zj.make_mesh(pipeline=P)``) the layer stack's ``stack_params``
    are split over ``P`` stages and ZeRO-sharded over the ``N/(R·T·P)`` data devices of a
    stage; the other ``Ψ - stack_params`` (embeddings, head) are held by every stage,
    ZeRO-sharded over its data devices (docs/pipeline.md). Every column counts a device's
    share so: the paper's and DeepSpeed's formulas applied to each part (DeepSpeed's own
    pipeline engine refuses ZeRO-2 and -3).

    Example:
      >>> from zerojax.report.estimate import table
      >>> print(table(1e9, 16, replicas=2).splitlines()[0])
      Model states per device, Ψ = 1,000,000,000 parameters, N = 16 devices in 2 replica groups of 8
      >>> print("\\n".join(table(7.5e9, 64).splitlines()[2:7]))
      stage   ZeRO paper (K=12)   DeepSpeed estimator  zerojax (float32, adam)
          0            120.0 GB                     -                  90.0 GB
          1             31.4 GB                     -                  30.9 GB
          2             16.6 GB               17.1 GB                  30.9 GB
          3              1.9 GB                2.1 GB                   1.4 GB
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 or n % replicas:
        raise ValueError(f"replicas must be a positive int dividing the {n} devices, got {replicas!r}.")
    if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1 or (n // replicas) % tensor:
        raise ValueError(
            f"tensor must be a positive int dividing the {n // replicas} devices of a replica group, got {tensor!r}."
        )
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1 or (n // replicas) % pipeline:
        raise ValueError(f"pipeline must be a positive int dividing the {n // replicas} devices, got {pipeline!r}.")
    if pipeline > 1 and not 0 < stack_params <= num_params:
        raise ValueError(
            f"pipeline={pipeline} needs the layer stack's parameter count (stack_params, at most Ψ = "
            f"{num_params:,.0f}), got {stack_params!r}: the stack splits over the stages, the rest does not."
        )
    if (n // replicas) % (tensor * pipeline):
        raise ValueError(f"tensor x pipeline = {tensor * pipeline} must divide the {n // replicas} devices.")
    opt_bytes = optimizer_bytes(optimizer)
    shard = n // (replicas * tensor * pipeline)
    gb = lambda b: f"{b / 1e9:,.1f} GB"
    where = f"N = {n} devices" + (f" in {replicas} replica groups of {n // replicas}" if replicas > 1 else "")
    if tensor > 1:
        where += f", tensor parallel T = {tensor} (ZeRO over {shard} devices per data group)"
    if pipeline > 1:
        where += (
            f", {pipeline} pipeline stages of {stack_params / pipeline:,.0f} stack parameters each "
            f"(ZeRO over {shard} devices per stage)"
        )
    full_psi, num_params, largest_layer = num_params, num_params / tensor, largest_layer / tensor
    # (per device) the stack's share on its stage, and the rest, held by every stage
    parts = [num_params] if pipeline == 1 else [stack_params / tensor / pipeline, (full_psi - stack_params) / tensor]
    ours = f"zerojax ({compute_dtype}, {optimizer})"
    lines = [
        f"Model states per device, Ψ = {full_psi:,.0f} parameters, {where}",
        "",
        f"{'stage':>5}  {'ZeRO paper (K=12)':>18}  {'DeepSpeed estimator':>20}  {ours:>{len(ours)}}",
    ]
    for s in range(4):
        # (DeepSpeed's gathered layer counted once)
        ds = (
            gb(
                sum(
                    deepspeed_bytes(p, shard, s, largest_layer=largest_layer * (i == 0)).gpu
                    for i, p in enumerate(parts)
                )
            )
            if s >= 2
            else "-"
        )
        zj = gb(sum(zero_formula_bytes(p, shard, s, compute_dtype=compute_dtype, opt_bytes=opt_bytes) for p in parts))
        paper = gb(sum(paper_bytes(p, shard, s) for p in parts))
        lines.append(f"{s:>5}  {paper:>18}  {ds:>20}  {zj:>{len(ours)}}")
    lines += ["", *assumptions(compute_dtype, optimizer)]
    lines.append(
        f"DeepSpeed ZeRO-3 uses 4 x largest layer = {gb(4 * largest_layer)}"
        if largest_layer
        else "DeepSpeed ZeRO-3 without --largest-layer counts no gathered layer."
    )
    if replicas > 1:
        lines.append(
            f"Across replica groups, per device and step: an all-reduce of a buffer of Ψ/{shard} gradient elements "
            f"({gb(2 * num_params / shard)} in fp16, {gb(4 * num_params / shard)} in fp32; "
            f"a 1-D mesh runs every gather and reduce-scatter across all {n} devices)."
        )
    return "\n".join(lines)


OFFLOADS = ("none", "optimizer", "optimizer+params")


def tier_bytes(
    num_params: float,
    n: int,
    stage: int,
    *,
    offload: str = "none",
    nvme: bool = False,
    compute_dtype: str = "float32",
    opt_bytes: int = 8,
    ratio: float = 1.0,
) -> dict[str, float]:
    """zerojax's persistent state per device in each memory tier: ``device``, ``host`` and
    ``disk`` (:func:`zerojax.report.zero_formula_bytes` split by where it lives).

    ``ratio`` (``Offload.ratio``, a partial offload) keeps that share of what offloading the
    optimizer moves (its state, and the masters kept apart at stages 1–2 in bf16/fp16) in
    host memory (the state on disk with ``nvme``) and the rest on the device; a run takes whole groups of leaves, so its share
    (``state.plan.offload_split.share``) can be larger.

    ``offload`` ("none", "optimizer", "optimizer+params": ``ZeroConfig.offload``'s
    ``optimizer`` and ``params``) moves state to the host as zero_formula_bytes says; with
    ``nvme`` (``ZeroConfig(offload={"optimizer": True, "nvme": ...})``) the optimizer state
    (``opt_bytes``·Ψ/N) is on disk instead, and the host keeps what else was offloaded (the
    masters kept apart at stages 1–2 in bf16/fp16, the stage-3 masters with "params"). A
    step writes the next version beside the current one before switching, so the disk
    holds up to twice ``disk`` (:mod:`zerojax.nvme.store`); the host also holds the tier's
    buffers (``buffer_count·buffer_size`` per process, not per device). A 0-d parameter's
    master and moments stay in memory whole (a few bytes, not in Ψ/N).

    Example:
      >>> from zerojax.report.estimate import tier_bytes
      >>> {k: v / 1e9 for k, v in tier_bytes(8e9, 8, 3, offload="optimizer", nvme=True).items()}
      {'device': 4.0, 'host': 0.0, 'disk': 8.0}
    """
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}.")
    if nvme and offload == "none":
        raise ValueError(
            "nvme=True keeps the optimizer state on disk: give offload='optimizer' (or 'optimizer+params')."
        )
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}.")
    if ratio < 1 and offload == "none":
        raise ValueError(
            f"ratio={ratio} splits offloaded optimizer state: give offload='optimizer' (or 'optimizer+params')."
        )
    kw = dict(compute_dtype=compute_dtype, opt_bytes=opt_bytes, offload_params=offload == "optimizer+params")
    tiers = lambda opt: [
        zero_formula_bytes(num_params, n, stage, memory=m, offload_optimizer=opt, **kw) for m in ("device", "host")
    ]
    device, host = tiers(offload != "none")
    if ratio < 1:  # what offloading the optimizer moves: that share of it stays in host memory
        moved = host - tiers(False)[1]
        device, host = device + (1 - ratio) * moved, host - (1 - ratio) * moved
    disk = ratio * opt_bytes * num_params / n if nvme else 0.0
    return {"device": device, "host": host - disk, "disk": disk}


def tier_table(
    num_params: float,
    n: int,
    *,
    offload: str,
    nvme: bool = False,
    compute_dtype: str = "float32",
    optimizer: str = "adam",
    buffers: tuple[int, int] = (4, 100_000_000),
    ratio: float = 1.0,
) -> str:
    """What ``zerojax estimate --offload ... [--nvme | --ratio r]`` adds: :func:`tier_bytes` per stage.

    Example:
      >>> from zerojax.report.estimate import tier_table
      >>> print(tier_table(8e9, 8, offload="optimizer", nvme=True).splitlines()[5])
          3        4.0 GB        0.0 GB  8.0 GB (16.0 GB while a step writes)
    """
    opt_bytes = optimizer_bytes(optimizer)
    gb = lambda b: f"{b / 1e9:,.1f} GB"
    where = ("NVMe" if nvme else "host memory") + ("" if ratio == 1 else f", ratio {ratio:g} (Offload.ratio)")
    lines = [
        f"Memory tiers per device, zerojax ({compute_dtype}, {optimizer}), offload {offload} to {where}:",
        "",
        f"{'stage':>5}  {'device':>12}  {'host':>12}  {'disk':>12}",
    ]
    for s in range(1, 4):
        if offload == "optimizer+params" and s != 3:
            continue
        t = tier_bytes(
            num_params, n, s, offload=offload, nvme=nvme, compute_dtype=compute_dtype, opt_bytes=opt_bytes, ratio=ratio
        )
        disk = f"{gb(t['disk'])} ({gb(2 * t['disk'])} while a step writes)" if nvme else gb(0)
        lines.append(f"{s:>5}  {gb(t['device']):>12}  {gb(t['host']):>12}  {disk:>12}")
    if nvme:
        count, size = buffers
        lines += [
            "",
            f"Host buffers of the NVMe tier: {count} x {size:,} bytes = {gb(count * size)} per process "
            "(NVMe.buffer_count x NVMe.buffer_size), whatever the model size.",
        ]
    return "\n".join(lines)


def assumptions(compute_dtype: str = "float32", optimizer: str = "adam") -> list[str]:
    """One line per column of :func:`table`: what its bytes count.

    Example:
      >>> from zerojax.report.estimate import assumptions
      >>> print(assumptions("bfloat16", "sgd")[2])
      zerojax: the state kept between steps: fp32 masters (4 bytes per parameter), a replicated bfloat16 copy for forward at stages 1-2 (2 bytes), optimizer state 0 bytes per parameter (plain SGD, optax.sgd without momentum, keeps none; momentum would add 4); gradients are the step's temporaries, not counted (zj.report.step_memory gives the compiled step's total).
    """
    if compute_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"compute_dtype must be 'float32', 'bfloat16' or 'float16', got {compute_dtype!r}.")
    copy = (
        "" if compute_dtype == "float32" else f", a replicated {compute_dtype} copy for forward at stages 1-2 (2 bytes)"
    )
    return [
        "ZeRO paper: mixed-precision Adam: fp16 parameters and gradients (2 + 2 bytes per parameter), "
        "K = 12 bytes of optimizer state (fp32 master, m, v).",
        "DeepSpeed estimator: estimate_zero2/3_model_states_mem_needs (fp16 parameters, 18 bytes per parameter "
        "sharded); it has no estimate for stages 0 and 1.",
        f"zerojax: the state kept between steps: fp32 masters (4 bytes per parameter){copy}, optimizer state "
        f"{optimizer_bytes(optimizer)} bytes per parameter ({_OPTIMIZER_NOTES[optimizer]}); gradients are the step's temporaries, "
        "not counted (zj.report.step_memory gives the compiled step's total).",
    ]
