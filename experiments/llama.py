"""A Llama-architecture Flax NNX model, computing what Hugging Face's ``LlamaForCausalLM``
computes: token embedding, a stack of pre-RMSNorm blocks (GQA attention with rotate-half
RoPE, SwiGLU MLP; created with ``nnx.vmap``, run with ``nnx.scan``), a final RMSNorm and
an untied head. No biases (``LlamaConfig.qkv_bias`` adds Qwen2's q/k/v biases).

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
    head.kernel              [d, V]          lm_head.weight.T

With ``qkv_bias``: ``blocks.{q,k,v}.bias`` ``[L, H*hd]``/``[L, K*hd]`` (``...{q,k,v}_proj.bias``).
With ``lora_rank = r``: each block linear ``X`` above also has ``blocks.X.lora.lora_a``
``[L, in, r]`` and ``blocks.X.lora.lora_b`` ``[L, r, out]`` (``nnx.LoRAParam``).

Each block tags its attention and MLP outputs (``checkpoint_name``: ``attn_out``,
``mlp_out``) for name-based remat policies; ``LlamaConfig.remat`` rematerializes each block.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import zerojax as zj


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Size of the model; the names in comments are Hugging Face ``LlamaConfig``'s."""

    vocab: int = 256  # vocab_size
    d_model: int = 128  # hidden_size
    n_layers: int = 4  # num_hidden_layers
    n_heads: int = 4  # num_attention_heads
    n_kv_heads: int = 0  # num_key_value_heads; 0: n_heads (no GQA)
    head_dim: int = 0  # head_dim; 0: d_model // n_heads
    d_ff: int = 344  # intermediate_size
    rms_eps: float = 1e-6  # rms_norm_eps
    rope_theta: float = 10000.0  # rope_theta (rope_parameters["rope_theta"])
    seq_len: int = 64  # max_position_embeddings (the training length; RoPE has no table)
    qkv_bias: bool = False  # attention_bias for q/k/v only (Qwen2); o never has one
    remat: str = "none"  # a zerojax.remat policy name, applied per block
    lora_rank: int = 0  # > 0: LoRA adapters (nnx.LoRALinear) on every block's linear layers
    # Megatron annotations (nnx.with_partitioning): q/k/v, gate/up and the head column-parallel
    # (output features over "tensor"), o and down row-parallel (input features over "tensor").
    tensor_parallel: bool = False
    # "einsum": attention written with plain ops; "auto" / "ulysses" / "ring" / "xla":
    # zj.nn.dot_product_attention with that method (Ulysses or ring over a context axis).
    attention: str = "einsum"
    attention_block: int = 512  # block_size of zj.nn.dot_product_attention: keys per chunk
    dtype: str = "float32"  # compute dtype (norms, RoPE and softmax are float32 regardless)
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        zj.remat.resolve(self.remat)  # unknown names raise here, with the valid ones
        if self.attention not in ("einsum",) + zj.nn.METHODS:
            raise ValueError(f"LlamaConfig.attention must be 'einsum' or one of {zj.nn.METHODS}, got "
                             f"{self.attention!r}.")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"LlamaConfig.lora_rank must be an int >= 0, got {self.lora_rank!r}.")
        for name in ("vocab", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}.")
        for name in ("n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"LlamaConfig.{name} must be an int >= 0 (0: default), got {value!r}.")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ValueError(f"LlamaConfig.d_model ({self.d_model}) must divide by n_heads "
                             f"({self.n_heads}), or give head_dim.")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"LlamaConfig.n_heads ({self.n_heads}) must divide by n_kv_heads ({self.kv_heads}).")
        if self.hd % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.hd}.")
        if not self.rms_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig.rms_eps and rope_theta must be > 0, got {self.rms_eps!r}, {self.rope_theta!r}.")
        for name in ("dtype", "param_dtype"):
            jnp.dtype(getattr(self, name))  # unknown names raise here

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def num_params(self) -> int:
        d, L, V, F, q, kv = self.d_model, self.n_layers, self.vocab, self.d_ff, self.n_heads * self.hd, self.kv_heads * self.hd
        block = 2 * d + d * (q + 2 * kv) + q * d + 3 * d * F + (q + 2 * kv) * self.qkv_bias
        return V * d + L * block + d + d * V


def _split(cfg: LlamaConfig, kernel: tuple) -> dict:
    """``nnx.Linear`` keywords annotating its kernel (and bias) for tensor parallelism."""
    if not cfg.tensor_parallel:
        return {}
    out = {"kernel_init": nnx.with_partitioning(nnx.initializers.lecun_normal(), kernel)}
    if kernel[1] is not None:  # column-parallel: a bias is split like the output features
        out["bias_init"] = nnx.with_partitioning(nnx.initializers.zeros_init(), (kernel[1],))
    return out


class RMSNorm(nnx.Module):
    """Hugging Face's ``LlamaRMSNorm``: ``x * rsqrt(mean(x²) + eps)`` in float32, cast back to
    ``x.dtype``, times ``scale`` (initialised to ones)."""

    def __init__(self, d: int, eps: float, param_dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((d,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * y.astype(x.dtype)


def rope(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)``, float32 ``[batch, seq, head_dim]``: the two halves of the head repeat
    the frequencies ``theta ** (-2i / head_dim)`` (rotate-half layout, not interleaved)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin``; ``x`` is ``[b, t, heads, hd]``."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos[:, :, None].astype(x.dtype), sin[:, :, None].astype(x.dtype)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, q, kv, F = cfg.d_model, cfg.n_heads * cfg.hd, cfg.kv_heads * cfg.hd, cfg.d_ff
        kw = dict(use_bias=False, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        linear = (lambda i, o, **k: nnx.LoRALinear(i, o, lora_rank=cfg.lora_rank, **{**kw, **k})) \
            if cfg.lora_rank else (lambda i, o, **k: nnx.Linear(i, o, **{**kw, **k}))
        col, row = _split(cfg, (None, "tensor")), _split(cfg, ("tensor", None))
        self.cfg = cfg
        self.attn_norm = RMSNorm(d, cfg.rms_eps, jnp.dtype(cfg.param_dtype))
        self.q = linear(d, q, use_bias=cfg.qkv_bias, **col)
        self.k = linear(d, kv, use_bias=cfg.qkv_bias, **col)
        self.v = linear(d, kv, use_bias=cfg.qkv_bias, **col)
        self.o = linear(q, d, **row)
        self.mlp_norm = RMSNorm(d, cfg.rms_eps, jnp.dtype(cfg.param_dtype))
        self.gate = linear(d, F, **col)
        self.up = linear(d, F, **col)
        self.down = linear(F, d, **row)

    def attention(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array | None) -> jax.Array:
        b, t, _ = x.shape
        h, kv, hd = self.cfg.n_heads, self.cfg.kv_heads, self.cfg.hd
        q = _rotate(self.q(x).reshape(b, t, h, hd), cos, sin)
        k = _rotate(self.k(x).reshape(b, t, kv, hd), cos, sin)
        v = self.v(x).reshape(b, t, kv, hd)
        if self.cfg.attention != "einsum":
            keys = None if mask is None else mask[:, None, None, :].astype(bool)
            out = zj.nn.dot_product_attention(q, k, v, mask=keys, is_causal=True, method=self.cfg.attention,
                                              block_size=self.cfg.attention_block)
            return self.o(out.reshape(b, t, h * hd))
        q = q.reshape(b, t, kv, h // kv, hd)  # query head kv * (h // kv) + g reads KV head kv
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / math.sqrt(hd)
        allowed = jnp.tril(jnp.ones((t, t), bool))[None, None, None]
        if mask is not None:  # padded keys get no attention
            allowed = allowed & mask[:, None, None, None, :].astype(bool)
        scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
        return self.o(out.reshape(b, t, h * hd))

    def __call__(self, x, cos, sin, mask=None):
        x = x + checkpoint_name(self.attention(self.attn_norm(x), cos, sin, mask), "attn_out")
        h = self.mlp_norm(x)
        return x + checkpoint_name(self.down(jax.nn.silu(self.gate(h)) * self.up(h)), "mlp_out")


class Llama(nnx.Module):
    """``Llama(cfg, rngs)(tokens, positions=None, mask=None) -> logits`` (``float32``-or-
    ``cfg.dtype`` ``[batch, seq, vocab]``): ``tokens`` ``int32[batch, seq]``; ``positions``
    ``int[batch, seq]`` (default ``arange(seq)``, as Hugging Face's forward without
    ``position_ids``, padding or not); ``mask`` ``bool[batch, seq]``: False keys get no
    attention (Hugging Face's ``attention_mask``). A query with no unmasked key at or before
    it (left padding) has meaningless output, as in Hugging Face."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dt, param_dtype=pdt, rngs=rngs)

        layer = zj.remat.nnx_module(Block, cfg.remat)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def blocks(rngs):
            return layer(cfg, rngs)

        self.blocks = blocks(rngs)
        self.norm = RMSNorm(cfg.d_model, cfg.rms_eps, pdt)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dt, param_dtype=pdt, rngs=rngs,
                               **_split(cfg, (None, "tensor")))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, mask: jax.Array | None = None):
        if positions is None:
            positions = zj.nn.global_positions(tokens.shape[1])[None]  # jnp.arange, but in the step's layout
        cos, sin = rope(positions, self.cfg.hd, self.cfg.rope_theta)

        @nnx.scan(in_axes=(nnx.Carry, 0, None, None, None), out_axes=nnx.Carry,
                  transform_metadata={nnx.PARTITION_NAME: None})
        def run(x, block, cos, sin, mask):
            return block(x, cos, sin, mask)

        return self.head(self.norm(run(self.embed(tokens), self.blocks, cos, sin, mask)))


def init(cfg: LlamaConfig, seed: int = 0):
    """``(graphdef, params)`` of a fresh model (``nnx.Param`` leaves, LoRA's included),
    built by one compiled program per (config, seed), as ``experiments.gpt.init``."""
    graphdef, build = _init_program(cfg, seed)
    return graphdef, build()


@functools.lru_cache(maxsize=None)
def _init_program(cfg: LlamaConfig, seed: int):
    def build():
        with nnx.use_eager_sharding(False):
            return nnx.split(Llama(cfg, nnx.Rngs(seed)), nnx.Param)[1]

    return init_abstract(cfg)[0], jax.jit(build)


def init_abstract(cfg: LlamaConfig):
    """``(graphdef, params)`` with ``jax.ShapeDtypeStruct`` leaves: nothing is allocated."""
    with nnx.use_eager_sharding(False):
        return nnx.split(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))), nnx.Param)


def make_loss(graphdef):
    """Next-token cross-entropy: ``loss_fn(params, {"tokens": int32[B, T + 1]})``, as
    ``experiments.gpt.make_loss``; an optional ``"mask": bool[B, T + 1]`` masks padded keys
    and averages the loss over the targets whose mask is True. The form whose sequence
    splits over a context axis: ``{"inputs", "targets"}`` ``int32[B, T]`` with optional
    ``"mask"`` (the inputs' keys), ``"weights"`` (per-target weights normalised over the
    global batch, ``m * (m.size / m.sum())``: the loss is their mean, the global masked mean
    on any number of devices) and ``"positions"``."""

    def loss_fn(params, batch):
        if "inputs" in batch:  # the form whose sequence splits over a context axis
            inputs, targets, mask, weight = batch["inputs"], batch["targets"], batch.get("mask"), batch.get("weights")
        else:
            tokens, full = batch["tokens"], batch.get("mask")
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            mask, weight = (None, None) if full is None else (full[:, :-1], full[:, 1:])
        logits = nnx.merge(graphdef, params)(inputs, positions=batch.get("positions"), mask=mask)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        if weight is None:
            return losses.mean()
        weight = weight.astype(jnp.float32)
        if "inputs" in batch:  # weights normalised over the global batch (the README's recipe)
            return (losses * weight).mean()
        return (losses * weight).sum() / jnp.maximum(weight.sum(), 1.0)

    return loss_fn


def is_lora(params):
    """``trainable=`` mask of a LoRA fine-tune: the adapters train, the base is frozen."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "lora" in jax.tree_util.keystr(path), params)


def config_from_hf(path: str, **overrides) -> LlamaConfig:
    """The ``LlamaConfig`` of a Hugging Face ``config.json`` (a file, or the folder holding
    it): transformers 5 writes ``rope_parameters: {rope_theta}``, earlier releases a
    top-level ``rope_theta``. ``overrides`` (``remat``, ``lora_rank``, ``seq_len``, ...) win."""
    import json
    import os

    with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
        c = json.load(f)
    if c.get("model_type") not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"{path!r} is a {c.get('model_type')!r} config, not llama/mistral/qwen2.")
    if c.get("tie_word_embeddings"):
        raise ValueError(f"{path!r} ties the head to the embedding; this Llama has an untied head.")
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    kw = dict(vocab=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
              n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads") or 0,
              head_dim=c.get("head_dim") or 0, d_ff=c["intermediate_size"], rms_eps=c["rms_norm_eps"],
              rope_theta=float(theta), seq_len=c.get("max_position_embeddings", 64),
              qkv_bias=bool(c.get("attention_bias")) or c.get("model_type") == "qwen2")
    return LlamaConfig(**{**kw, **overrides})
