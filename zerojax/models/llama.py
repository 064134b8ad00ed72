"""The Llama family in Flax NNX: Llama 2 / 3.x, Mistral, Qwen2 / Qwen2.5 and Qwen3 (dense)
as one model, their differences as :class:`LlamaConfig` fields, computing what Hugging
Face's ``LlamaForCausalLM`` (``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``) computes.

Token embedding, a stack of pre-RMSNorm blocks (GQA attention with rotate-half RoPE,
SwiGLU MLP; created with ``nnx.vmap``, run with ``nnx.scan``), a final RMSNorm and a head
(its own, or the embedding's transpose with ``tie_embeddings``). What differs between the
families, each a field:

=================================  =======================================================
``rope_scaling``                   Llama 3.1+ (``llama3``), ``linear``, ``yarn`` (Qwen2.5 long)
``sliding_window``, ``window_layers``  Mistral (every layer), Qwen2 / Qwen3 (some layers)
``tie_embeddings``                 Llama 3.2 1B/3B, Qwen2.5 0.5B-3B, Qwen3 0.6B-4B
``qkv_bias``                       Qwen2 / Qwen2.5 (q, k, v)
``qkv_bias`` + ``o_bias``          ``attention_bias`` of Llama and Qwen3
``mlp_bias``                       Llama's ``mlp_bias``
``qk_norm``                        Qwen3: RMSNorm over each head of q and k, before RoPE
``head_dim``                       Mistral, Qwen3 (not ``d_model / n_heads``)
``n_experts``, ``top_k``, ...      Mixtral, Qwen3-MoE, Qwen2-MoE: routed experts in place of the MLP
``shared_d_ff``, ``shared_gate``    Qwen2-MoE: a (gated) shared expert beside them
=================================  =======================================================

:func:`zerojax.models.from_hf` reads a checkpoint's ``config.json`` into a config and the
map of its tensors.

Parameters (``L`` layers, ``H``/``K`` query/KV heads of ``hd`` features, ``d`` model, ``F``
MLP, ``V`` vocab), with the Hugging Face tensor each one is (torch ``nn.Linear`` weights are
``[out, in]``: kernels are their transposes; ``blocks.*`` stacks ``model.layers.{i}.*``
along a leading layer axis)::

    embed.embedding          [V, d]          model.embed_tokens.weight
    blocks.attn_norm.scale   [L, d]          model.layers.{i}.input_layernorm.weight
    blocks.q.kernel          [L, d, H*hd]    model.layers.{i}.self_attn.q_proj.weight.T
    blocks.k.kernel          [L, d, K*hd]    model.layers.{i}.self_attn.k_proj.weight.T
    blocks.v.kernel          [L, d, K*hd]    model.layers.{i}.self_attn.v_proj.weight.T
    blocks.o.kernel          [L, H*hd, d]    model.layers.{i}.self_attn.o_proj.weight.T
    blocks.mlp_norm.scale    [L, d]          model.layers.{i}.post_attention_layernorm.weight
    blocks.gate.kernel       [L, d, F]       model.layers.{i}.mlp.gate_proj.weight.T
    blocks.up.kernel         [L, d, F]       model.layers.{i}.mlp.up_proj.weight.T
    blocks.down.kernel       [L, F, d]       model.layers.{i}.mlp.down_proj.weight.T
    norm.scale               [d]             model.norm.weight
    head.kernel              [d, V]          lm_head.weight.T   (none with tie_embeddings)

A mixture of experts (``n_experts > 0``) has, in place of ``gate``/``up``/``down`` (``E``
experts of ``Fe = moe_d_ff`` features; Qwen3-MoE's ``mlp.gate`` / ``mlp.experts.{j}.*_proj``,
Mixtral's ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.{j}.w1|w3|w2``)::

    blocks.moe.router.kernel [L, d, E]       model.layers.{i}.mlp.gate.weight.T
    blocks.moe.gate          [L, E, d, Fe]   model.layers.{i}.mlp.experts.{j}.gate_proj.weight.T
    blocks.moe.up            [L, E, d, Fe]   model.layers.{i}.mlp.experts.{j}.up_proj.weight.T
    blocks.moe.down          [L, E, Fe, d]   model.layers.{i}.mlp.experts.{j}.down_proj.weight.T

with ``shared_d_ff`` a shared expert ``blocks.moe.shared.{gate,up,down}.kernel``
(``mlp.shared_expert.*_proj.weight.T``) and with ``shared_gate`` its gate
``blocks.moe.shared_gate.kernel`` ``[L, d, 1]`` (``mlp.shared_expert_gate.weight.T``, Qwen2-MoE);
the expert dimension annotated ``"expert"`` (split over ``zj.make_mesh(expert=E)``), run by
``zj.nn.routed_experts`` (softmax router, top-k, ``norm_topk_prob``); the model's
load-balancing loss is Hugging Face's (``E · Σ fᵢ · Pᵢ`` over the tokens of every layer
together), added by :func:`make_loss` times ``router_aux_loss_coef``.

with ``blocks.X.bias`` (``..._proj.bias``) for the biases the config turns on,
``blocks.q_norm.scale`` / ``blocks.k_norm.scale`` ``[L, hd]`` (``self_attn.q_norm.weight``)
with ``qk_norm``, and with ``lora_rank = r`` ``blocks.X.lora.lora_a`` ``[L, in, r]`` and
``blocks.X.lora.lora_b`` ``[L, r, out]`` (``nnx.LoRAParam``) on each block linear ``X``.

Precision: norms, RoPE angles and softmax are computed in float32, or in the compute dtype
where that is wider (a float64 model is float64 throughout, which is how the tests show the
math equals transformers' to 1e-9). Each block tags its attention and MLP outputs
(``checkpoint_name``: ``attn_out``, ``mlp_out``) for name-based remat policies;
``LlamaConfig.remat`` rematerializes each block.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zerojax import nn as znn
from zerojax import remat as zremat
from zerojax.models import attention_choice as zattn
from zerojax.models import building
from zerojax.models import rope as zrope
from zerojax.models.rope import RopeScaling
from zerojax.moe.experts import routed_experts

ATTENTION = (zattn.FUSED, "einsum") + znn.METHODS  # LlamaConfig.attention's values


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Size and variant of the model; the names in comments are Hugging Face's config fields.

    Example:
      >>> cfg = LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
      ...                   tie_embeddings=True, sliding_window=8)
      >>> cfg.hd, cfg.kv_heads, cfg.layer_windows()
      (8, 2, (8, 8))
    """

    vocab: int = 256  # vocab_size
    d_model: int = 128  # hidden_size
    n_layers: int = 4  # num_hidden_layers
    n_heads: int = 4  # num_attention_heads
    n_kv_heads: int = 0  # num_key_value_heads; 0: n_heads (no GQA)
    head_dim: int = 0  # head_dim; 0: d_model // n_heads
    d_ff: int = 344  # intermediate_size
    rms_eps: float = 1e-6  # rms_norm_eps
    rope_theta: float = 10000.0  # rope_parameters["rope_theta"] (rope_theta)
    rope_scaling: RopeScaling | None = None  # rope_parameters' rope_type and its values
    seq_len: int = 64  # max_position_embeddings (the training length; RoPE has no table)
    qkv_bias: bool = False  # biases on q, k and v (Qwen2; Llama's and Qwen3's attention_bias)
    o_bias: bool = False  # a bias on o (Llama's and Qwen3's attention_bias; never in Qwen2)
    mlp_bias: bool = False  # mlp_bias: biases on gate, up and down
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    tie_embeddings: bool = False  # tie_word_embeddings: the head is the embedding's transpose
    # sliding_window: a query attends to itself and the sliding_window - 1 keys before it
    # (transformers: key index > query index - sliding_window); 0: no window.
    sliding_window: int = 0
    # layer_types: which layers use the window (True: "sliding_attention"); None: every layer
    # (Mistral) when sliding_window > 0.
    window_layers: tuple[bool, ...] | None = None
    remat: str = "none"  # a zerojax.remat policy name, applied per block
    lora_rank: int = 0  # > 0: LoRA adapters (nnx.LoRALinear) on every block's linear layers
    # Megatron annotations (nnx.with_partitioning): q/k/v, gate/up and the head column-parallel
    # (output features over "tensor"), o and down row-parallel (input features over "tensor").
    tensor_parallel: bool = False
    # "fused": chosen while tracing (zerojax.models.attention_choice.choose): cuDNN's flash attention
    # on a CUDA GPU where it takes the call, zj.nn.dot_product_attention on a context mesh, the
    # exact "einsum" elsewhere (a CPU, float32, a key mask, segment ids, per-layer windows).
    # "einsum": attention written with plain ops; "auto" / "ulysses" / "ring" / "xla":
    # zj.nn.dot_product_attention with that method (Ulysses or ring over a context axis).
    attention: str = "fused"
    attention_block: int = 512  # block_size of zj.nn.dot_product_attention: keys per chunk
    dtype: str = "float32"  # compute dtype (norms, RoPE and softmax at least float32)
    param_dtype: str = "float32"
    # Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is n_experts routed experts.
    n_experts: int = 0  # num_experts (Qwen3-MoE), num_local_experts (Mixtral); 0: a dense MLP
    top_k: int = 0  # num_experts_per_tok
    moe_d_ff: int = 0  # moe_intermediate_size (Qwen3-MoE); 0: d_ff (Mixtral's intermediate_size)
    norm_topk_prob: bool = True  # the kept probabilities rescaled to sum to one (Mixtral: always)
    router_aux_loss_coef: float = 0.0  # make_loss adds it times the load-balancing loss
    capacity_factor: float | None = None  # None: dropless (as transformers); see zj.nn.routed_experts
    # A shared expert beside the routed ones (Qwen2-MoE): a SwiGLU MLP of shared_d_ff features
    # every token goes through, times sigmoid(h @ shared_gate) with shared_gate (Qwen2-MoE's).
    shared_d_ff: int = 0  # shared_expert_intermediate_size; 0: none
    shared_gate: bool = False
    expert_method: str = "ragged"  # zj.nn.routed_experts' method

    def __post_init__(self) -> None:
        zremat.resolve(self.remat)  # unknown names raise here, with the valid ones
        if self.attention not in ATTENTION:
            raise ValueError(f"LlamaConfig.attention must be one of {ATTENTION}, got {self.attention!r}.")
        for name in ("lora_rank", "sliding_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LlamaConfig.{name} must be an int >= 0, got {value!r}.")
        for name in ("vocab", "d_model", "n_layers", "n_heads", "d_ff", "seq_len", "attention_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}.")
        for name in ("n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LlamaConfig.{name} must be an int >= 0 (0: default), got {value!r}.")
        for name in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_embeddings", "tensor_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LlamaConfig.{name} must be a bool, got {getattr(self, name)!r}.")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ValueError(
                f"LlamaConfig.d_model ({self.d_model}) must divide by n_heads ({self.n_heads}), or give head_dim."
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"LlamaConfig.n_heads ({self.n_heads}) must divide by n_kv_heads ({self.kv_heads}).")
        if self.hd % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.hd}.")
        if not self.rms_eps > 0 or not self.rope_theta > 0:
            raise ValueError(
                f"LlamaConfig.rms_eps and rope_theta must be > 0, got {self.rms_eps!r}, {self.rope_theta!r}."
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(
                f"LlamaConfig.rope_scaling must be a zj.models.RopeScaling or None, got {self.rope_scaling!r}."
            )
        if self.window_layers is not None:
            layers = tuple(self.window_layers)
            if len(layers) != self.n_layers or not all(isinstance(x, bool) for x in layers):
                raise ValueError(
                    f"LlamaConfig.window_layers must be None or {self.n_layers} bools (one per layer), "
                    f"got {self.window_layers!r}."
                )
            if any(layers) and not self.sliding_window:
                raise ValueError(
                    "LlamaConfig.window_layers marks windowed layers but sliding_window is 0; give the window's size."
                )
            object.__setattr__(self, "window_layers", layers)
        windows = set(self.layer_windows())
        if self.attention in znn.METHODS and len(windows) > 1:
            raise ValueError(
                f"LlamaConfig.attention={self.attention!r} takes one window for every layer (a static "
                f"argument of zj.nn.dot_product_attention), but the layers' windows differ "
                f"({self.layer_windows()}); use attention='einsum' for per-layer windows."
            )
        for name in ("dtype", "param_dtype"):
            jnp.dtype(getattr(self, name))  # unknown names raise here
        for name in ("n_experts", "top_k", "moe_d_ff", "shared_d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LlamaConfig.{name} must be an int >= 0, got {value!r}.")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"LlamaConfig.top_k must be in 1..n_experts ({self.n_experts}) for a mixture of experts, "
                f"got {self.top_k!r}."
            )
        if not self.n_experts and (self.top_k or self.moe_d_ff or self.shared_d_ff or self.shared_gate):
            raise ValueError(
                "LlamaConfig.top_k / moe_d_ff / shared_d_ff / shared_gate describe routed experts; give "
                "n_experts too (or leave them 0)."
            )
        if self.shared_gate and not self.shared_d_ff:
            raise ValueError("LlamaConfig.shared_gate gates a shared expert: give shared_d_ff too.")
        if self.n_experts and (self.lora_rank or self.tensor_parallel):
            raise ValueError(
                "LlamaConfig: a mixture of experts with lora_rank or tensor_parallel is not supported yet."
            )
        if not isinstance(self.shared_gate, bool):
            raise TypeError(f"LlamaConfig.shared_gate must be a bool, got {self.shared_gate!r}.")
        if not isinstance(self.norm_topk_prob, bool):
            raise TypeError(f"LlamaConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}.")
        if (
            isinstance(self.router_aux_loss_coef, bool)
            or not isinstance(self.router_aux_loss_coef, (int, float))
            or self.router_aux_loss_coef < 0
        ):
            raise ValueError(
                f"LlamaConfig.router_aux_loss_coef must be a number >= 0, got {self.router_aux_loss_coef!r}."
            )
        if self.expert_method not in ("ragged", "dense"):
            raise ValueError(f"LlamaConfig.expert_method must be 'ragged' or 'dense', got {self.expert_method!r}.")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def expert_d_ff(self) -> int:
        """Each routed expert's hidden features."""
        return self.moe_d_ff or self.d_ff

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (keys a query sees, itself included; 0: no window)."""
        if not self.sliding_window:
            return (0,) * self.n_layers
        layers = self.window_layers if self.window_layers is not None else (True,) * self.n_layers
        return tuple(self.sliding_window if w else 0 for w in layers)

    def num_params(self) -> int:
        d, L, V, F = self.d_model, self.n_layers, self.vocab, self.d_ff
        q, kv = self.n_heads * self.hd, self.kv_heads * self.hd
        mlp = 3 * d * F + (2 * F + d) * self.mlp_bias
        if self.n_experts:
            mlp = (
                d * self.n_experts
                + 3 * self.n_experts * d * self.expert_d_ff
                + 3 * d * self.shared_d_ff
                + d * self.shared_gate
            )
        block = (
            2 * d
            + d * (q + 2 * kv)
            + q * d
            + mlp
            + (q + 2 * kv) * self.qkv_bias
            + d * self.o_bias
            + 2 * self.hd * self.qk_norm
        )
        return V * d + L * block + d + d * V * (not self.tie_embeddings)


def _wide(dtype) -> jnp.dtype:
    """The precision of norms, RoPE and softmax: float32, or the compute dtype if wider."""
    return jnp.promote_types(dtype, jnp.float32)


def _split(cfg: LlamaConfig, kernel: tuple) -> dict:
    """``nnx.Linear`` keywords annotating its kernel (and bias) for tensor parallelism."""
    if not cfg.tensor_parallel:
        return {}
    # A bias is split like the output features: over "tensor" for a column-parallel layer,
    # whole for a row-parallel one (added after the reduction).
    return {
        "kernel_init": nnx.with_partitioning(nnx.initializers.lecun_normal(), kernel),
        "bias_init": nnx.with_partitioning(nnx.initializers.zeros_init(), (kernel[1],)),
    }


class RMSNorm(nnx.Module):
    """Hugging Face's ``LlamaRMSNorm``: ``x * rsqrt(mean(x²) + eps)`` in float32 (or wider),
    cast back to ``x.dtype``, times ``scale`` (initialised to ones)."""

    def __init__(self, d: int, eps: float, param_dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((d,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(_wide(x.dtype))
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * y.astype(x.dtype)


def rope(
    positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None, dtype=jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` ``[batch, seq, head_dim]`` (see :func:`zerojax.models.rope.cos_sin`)."""
    return zrope.cos_sin(positions, head_dim, theta, scaling, _wide(dtype))


class MoE(nnx.Module):
    """Routed experts in place of the MLP (Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``, Mixtral's
    ``MixtralSparseMoeBlock``): a router ``[d, E]`` and ``E`` SwiGLU experts stacked on a
    leading expert dimension annotated ``"expert"``, run by ``zj.nn.routed_experts``.
    Returns the output and its :class:`zerojax.moe.MoEStats`; ``mask`` (``bool[batch, seq]``,
    False: padding) leaves padding out of the routing and of the load-balancing loss."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, e, f = cfg.d_model, cfg.n_experts, cfg.expert_d_ff
        pdt = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.router = nnx.Linear(d, e, use_bias=False, dtype=jnp.dtype(cfg.dtype), param_dtype=pdt, rngs=rngs)
        init = nnx.with_partitioning(
            nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,)), ("expert", None, None)
        )
        self.gate = nnx.Param(init(rngs.params(), (e, d, f), pdt))
        self.up = nnx.Param(init(rngs.params(), (e, d, f), pdt))
        self.down = nnx.Param(init(rngs.params(), (e, f, d), pdt))
        if cfg.shared_d_ff:
            kw = dict(use_bias=False, dtype=jnp.dtype(cfg.dtype), param_dtype=pdt, rngs=rngs)
            self.shared = SwiGLU(d, cfg.shared_d_ff, kw)
            if cfg.shared_gate:
                self.shared_gate = nnx.Linear(d, 1, **kw)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None):
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        logits = self.router(x)
        y, stats = routed_experts(
            x,
            logits,
            self.up[...].astype(dt),
            self.down[...].astype(dt),
            self.gate[...].astype(dt),
            top_k=cfg.top_k,
            normalize=cfg.norm_topk_prob,
            capacity_factor=cfg.capacity_factor,
            method=cfg.expert_method,
            token_mask=mask,
        )
        if cfg.shared_d_ff:
            shared = self.shared(x)
            y = y + (jax.nn.sigmoid(self.shared_gate(x)) * shared if cfg.shared_gate else shared)
        return y, stats


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``: a shared expert (Qwen2-MoE's ``shared_expert``)."""

    def __init__(self, d: int, f: int, kw: dict):
        self.gate, self.up, self.down = nnx.Linear(d, f, **kw), nnx.Linear(d, f, **kw), nnx.Linear(f, d, **kw)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, q, kv, F = cfg.d_model, cfg.n_heads * cfg.hd, cfg.kv_heads * cfg.hd, cfg.d_ff
        pdt = jnp.dtype(cfg.param_dtype)
        kw = dict(use_bias=False, dtype=jnp.dtype(cfg.dtype), param_dtype=pdt, rngs=rngs)
        linear = (
            (lambda i, o, **k: nnx.LoRALinear(i, o, lora_rank=cfg.lora_rank, **{**kw, **k}))
            if cfg.lora_rank
            else (lambda i, o, **k: nnx.Linear(i, o, **{**kw, **k}))
        )
        col, row = _split(cfg, (None, "tensor")), _split(cfg, ("tensor", None))
        self.cfg = cfg
        self.attn_norm = RMSNorm(d, cfg.rms_eps, pdt)
        self.q = linear(d, q, use_bias=cfg.qkv_bias, **col)
        self.k = linear(d, kv, use_bias=cfg.qkv_bias, **col)
        self.v = linear(d, kv, use_bias=cfg.qkv_bias, **col)
        self.o = linear(q, d, use_bias=cfg.o_bias, **row)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.hd, cfg.rms_eps, pdt)
            self.k_norm = RMSNorm(cfg.hd, cfg.rms_eps, pdt)
        self.mlp_norm = RMSNorm(d, cfg.rms_eps, pdt)
        if cfg.n_experts:
            self.moe = MoE(cfg, rngs)
        else:
            self.gate = linear(d, F, use_bias=cfg.mlp_bias, **col)
            self.up = linear(d, F, use_bias=cfg.mlp_bias, **col)
            self.down = linear(F, d, use_bias=cfg.mlp_bias, **row)

    def attention(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array | None,
        window: jax.Array,
        layout=None,
        segments: jax.Array | None = None,
    ) -> jax.Array:
        b, t, _ = x.shape
        cfg = self.cfg
        h, kv, hd = cfg.n_heads, cfg.kv_heads, cfg.hd
        q, k = self.q(x).reshape(b, t, h, hd), self.k(x).reshape(b, t, kv, hd)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = zrope.rotate(q, cos, sin), zrope.rotate(k, cos, sin)
        v = self.v(x).reshape(b, t, kv, hd)
        kind = self.attention_kind(q, mask, segments, layout)
        with jax.named_scope(zattn.SCOPES[kind]):  # the compiled program says which ran
            if kind == "einsum":  # the exact attention with plain ops, scores in float32 at least
                wide = _wide(q.dtype)
                g = q.reshape(b, t, kv, h // kv, hd)  # query head kv * (h // kv) + g reads KV head kv
                scores = jnp.einsum("bqkgd,bskd->bkgqs", g, k).astype(wide) / math.sqrt(hd)
                qi, ki = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
                allowed = (qi >= ki) & ((window == 0) | (ki > qi - window))  # transformers' sliding window
                allowed = allowed[None, None, None]
                if mask is not None:  # padded keys get no attention
                    allowed = allowed & mask[:, None, None, None, :].astype(bool)
                if segments is not None:  # packed sequences: each token sees its own document only
                    allowed = allowed & (segments[:, None, None, :, None] == segments[:, None, None, None, :])
                scores = jnp.where(allowed, scores, jnp.finfo(wide).min)
                probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
                out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
            elif kind == "cudnn":
                w = cfg.layer_windows()[0]
                out = jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, local_window_size=(w - 1, 0) if w else None, implementation="cudnn"
                )
            else:
                keys = None if mask is None else mask[:, None, None, :].astype(bool)
                w = cfg.layer_windows()[0]
                out = znn.dot_product_attention(
                    q,
                    k,
                    v,
                    mask=keys,
                    is_causal=True,
                    method=kind,
                    block_size=cfg.attention_block,
                    layout=layout,
                    segment_ids=segments,
                    local_window_size=(w - 1, 0) if w else None,
                )
        return self.o(out.reshape(b, t, h * hd))

    def attention_kind(self, q: jax.Array, mask, segments, layout) -> str:
        """What runs (``zerojax.models.attention_choice.KINDS``): the configured method, or for
        ``"fused"`` the choice from the static facts of this trace."""
        cfg = self.cfg
        if cfg.attention != zattn.FUSED:
            return cfg.attention
        windows = set(cfg.layer_windows())
        plat = zattn.platform()
        choice = zattn.choose(
            plat,
            q.dtype,
            cfg.hd,
            mask=mask is not None,
            segments=segments is not None,
            window=windows.pop() if len(windows) == 1 else None,
            context=zattn.on_context_mesh(layout),
            capability=zattn.capability(),
        )
        b, t = q.shape[:2]
        zattn.warn_fallback(choice, plat, zattn.scores_bytes(b, cfg.n_heads, t, t, q.dtype))
        return choice.kind

    def __call__(self, x, cos, sin, mask=None, window=None, layout=None, segments=None):
        window = jnp.zeros((), jnp.int32) if window is None else window
        x = x + checkpoint_name(self.attention(self.attn_norm(x), cos, sin, mask, window, layout, segments), "attn_out")
        h = self.mlp_norm(x)
        if self.cfg.n_experts:  # (x, (fractions, mean probs, z-loss, counts, dropped)) for the layer loop
            y, st = self.moe(h, mask)  # padding (mask False) is not routed, as HF's loss leaves it out
            return x + checkpoint_name(y, "mlp_out"), (st.fractions, st.mean_probs, st.z_loss, st.counts, st.dropped)
        return x + checkpoint_name(self.down(jax.nn.silu(self.gate(h)) * self.up(h)), "mlp_out")


class Llama(nnx.Module):
    """``Llama(cfg, rngs)(tokens, positions=None, mask=None, layout=None) -> logits``
    (``cfg.dtype`` ``[batch, seq, vocab]``): ``tokens`` ``int32[batch, seq]``; ``positions``
    ``int[batch, seq]`` (default ``zj.nn.global_positions(seq, layout)``: ``arange(seq)`` as
    Hugging Face's forward without ``position_ids``, padding or not, in the sequence's
    layout); ``mask`` ``bool[batch, seq]``: False keys get no attention (Hugging Face's
    ``attention_mask``); ``layout``: the :class:`zerojax.context.Layout` the train step
    hands its loss (``with_layout=True``), for the attention kernel and the positions;
    ``segment_ids`` ``int[batch, seq]``: packed sequences, each token attending only to the
    tokens of its own document (give ``positions`` that restart at each document, as
    Hugging Face's ``DataCollatorWithFlattening`` does). A query with no unmasked key at or
    before it (left padding) has meaningless output, as in Hugging Face.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> cfg = LlamaConfig(vocab=32, d_model=16, n_layers=2, n_heads=2, d_ff=24, tie_embeddings=True)
      >>> model = Llama(cfg, nnx.Rngs(0))
      >>> model(jnp.zeros((1, 5), jnp.int32)).shape
      (1, 5, 32)
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dt, param_dtype=pdt, rngs=rngs)

        layer = zremat.nnx_module(Block, cfg.remat)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def blocks(rngs):
            return layer(cfg, rngs)

        self.blocks = blocks(rngs)
        self.norm = RMSNorm(cfg.d_model, cfg.rms_eps, pdt)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(
                cfg.d_model,
                cfg.vocab,
                use_bias=False,
                dtype=dt,
                param_dtype=pdt,
                rngs=rngs,
                **{k: v for k, v in _split(cfg, (None, "tensor")).items() if k == "kernel_init"},
            )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        mask: jax.Array | None = None,
        layout=None,
        segment_ids: jax.Array | None = None,
        return_stats: bool = False,
    ):
        cfg = self.cfg
        if positions is None:
            positions = znn.global_positions(tokens.shape[1], layout)[None]  # jnp.arange, in the layout
        cos, sin = rope(positions, cfg.hd, cfg.rope_theta, cfg.rope_scaling, jnp.dtype(cfg.dtype))
        windows = cfg.layer_windows()
        if len(set(windows)) == 1:  # one window for every layer: a constant of the loop
            per_layer, window = None, jnp.asarray(windows[0], jnp.int32)
        else:  # scanned with the layers; as floats (exact integers), since per-use prefetch
            # runs layer loops whose scanned values are all floating
            per_layer, window = jnp.asarray(np.asarray(windows, np.float32)), None

        @nnx.scan(
            in_axes=(nnx.Carry, 0, None, None, None, 0, None),
            out_axes=nnx.Carry,
            transform_metadata={nnx.PARTITION_NAME: None},
        )
        def run(carry, block, cos, sin, mask, scanned, segments):
            if not cfg.n_experts:
                return block(carry, cos, sin, mask, window if scanned is None else scanned, layout, segments)
            x, sums = carry  # the experts' statistics summed over the layers, in the carry
            x, stats = block(x, cos, sin, mask, window if scanned is None else scanned, layout, segments)
            return x, tuple(a + b.astype(a.dtype) for a, b in zip(sums, stats))

        x = self.embed(tokens)
        if cfg.n_experts:
            e = cfg.n_experts
            zeros = (
                jnp.zeros((e,), jnp.float32),
                jnp.zeros((e,), jnp.float32),
                jnp.zeros((), jnp.float32),
                jnp.zeros((e,), jnp.int32),
                jnp.zeros((), jnp.float32),
            )
            x, sums = run((x, zeros), self.blocks, cos, sin, mask, per_layer, segment_ids)
        else:
            x = run(x, self.blocks, cos, sin, mask, per_layer, segment_ids)
        x = self.norm(x)
        logits = self.embed.attend(x) if cfg.tie_embeddings else self.head(x)
        if not return_stats:
            return logits
        if not cfg.n_experts:
            return logits, {}
        f, p, z, counts, dropped = sums
        n = cfg.n_layers
        # Hugging Face's load_balancing_loss_func: f and P over every layer's tokens together.
        return logits, {
            "load_balancing_loss": e * jnp.sum((f / n) * (p / n)),
            "z_loss": z / n,
            "expert_counts": counts.astype(jnp.float32),
            "dropped": dropped / n,
        }


def init(cfg: LlamaConfig, seed: int = 0):
    """``(graphdef, params)`` of a fresh model (``nnx.Param`` leaves, LoRA's included),
    built by one compiled program per (config, seed)."""
    return building.built(Llama, cfg, seed)


def init_abstract(cfg: LlamaConfig):
    """``(graphdef, params)`` with ``jax.ShapeDtypeStruct`` leaves: nothing is allocated."""
    return building.abstract(Llama, cfg)


# How make_loss(..., with_stats=True)'s statistics of a mixture of experts combine in the step
# (aux_reduce=): each is a mean over the devices' values (the expert counts and the dropped
# fraction are global already, summed over the data axes inside the model; each device's
# load-balancing term averages to the global loss) and over the micro-batches.
STATS_REDUCE = {k: "mean" for k in ("cross_entropy", "dropped", "expert_counts", "load_balancing_loss", "z_loss")}


def make_loss(graphdef, *, with_stats: bool = False):
    """Next-token cross-entropy: ``loss_fn(params, {"tokens": int32[B, T + 1]})``; an optional
    ``"mask": bool[B, T + 1]`` masks padded keys and averages the loss over the targets whose
    mask is True. The form whose sequence splits over a context axis (and the only one the
    balanced layout takes, since the targets are not a shift of the inputs there):
    ``{"inputs", "targets"}`` ``int32[B, T]`` with optional ``"mask"`` (the inputs' keys),
    ``"weights"`` (per-target weights normalised over the global batch,
    ``m * (m.size / m.sum())``: the loss is their mean, the global masked mean on any number
    of devices), ``"positions"`` and ``"segment_ids"`` (packed sequences, with positions
    restarting at each document). ``layout``: the step's sequence layout
    (``make_train_step(..., with_layout=True)``), handed to the model.

    A mixture of experts adds ``router_aux_loss_coef`` times its load-balancing loss (as
    transformers does with ``output_router_logits``); ``with_stats=True`` returns
    ``(loss, stats)`` (``make_train_step(..., has_aux=True, aux_reduce=STATS_REDUCE)``): the
    cross-entropy, the load-balancing and z losses, the assignments per expert over the
    global (micro-)batch summed over the layers (float32; with accumulation, the mean over
    the micro-batches), and the dropped fraction."""

    def loss_fn(params, batch, layout=None):
        if "inputs" in batch:  # the form whose sequence splits over a context axis
            inputs, targets, mask, weight = batch["inputs"], batch["targets"], batch.get("mask"), batch.get("weights")
        else:
            tokens, full = batch["tokens"], batch.get("mask")
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            mask, weight = (None, None) if full is None else (full[:, :-1], full[:, 1:])
        model = nnx.merge(graphdef, params)
        logits, stats = model(
            inputs,
            positions=batch.get("positions"),
            mask=mask,
            layout=layout,
            segment_ids=batch.get("segment_ids"),
            return_stats=True,
        )
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        if weight is None:
            loss = losses.mean()
        else:
            weight = weight.astype(jnp.float32)
            if "inputs" in batch:  # weights normalised over the global batch (the README's recipe)
                loss = (losses * weight).mean()
            else:
                loss = (losses * weight).sum() / jnp.maximum(weight.sum(), 1.0)
        total = loss
        if stats and model.cfg.router_aux_loss_coef:
            total = loss + model.cfg.router_aux_loss_coef * stats["load_balancing_loss"]
        return (total, {"cross_entropy": loss, **stats}) if with_stats else total

    return loss_fn


def is_lora(params):
    """``trainable=`` mask of a LoRA fine-tune: the adapters train, the base is frozen."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "lora" in jax.tree_util.keystr(path), params)
