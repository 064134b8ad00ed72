"""A GPT-style Flax NNX model: token + position embeddings, a stack of pre-norm blocks
(created with ``nnx.vmap``, run with ``nnx.scan``), a final norm and an untied head.

Each block tags its attention and MLP outputs (``checkpoint_name``: ``attn_out``,
``mlp_out``) for name-based remat policies; ``GPTConfig.remat`` rematerializes each block.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zerojax import nn as znn
from zerojax import remat as zremat
from zerojax.models import attention_choice as zattn
from zerojax.models import building

ATTENTION = (zattn.FUSED, "einsum")  # GPTConfig.attention's values


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Size of the model. ``vocab=256`` is byte-level text."""

    vocab: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    remat: str = "none"  # a zerojax.remat policy name, applied per block
    dropout: float = 0.0  # residual dropout of each block's attention and MLP outputs
    lora_rank: int = 0  # > 0: LoRA adapters (nnx.LoRALinear) on every block's linear layers
    # Megatron annotations (nnx.with_partitioning): q/k/v, the MLP's first layer and the head
    # column-parallel (output features over "tensor"), the attention projection and the MLP's
    # second layer row-parallel (input features over "tensor"); make_mesh(tensor=T) uses them.
    tensor_parallel: bool = False
    # Megatron's sequence parallelism: the residual stream (and so LayerNorms, dropout and the
    # residual adds) split along the sequence over "tensor" (znn.sequence_parallel); the
    # identity on a mesh without a tensor axis.
    sequence_parallel: bool = False
    # With sequence_parallel: Megatron's collectives written out around the tensor-parallel
    # matmuls (znn.column_parallel gathers the sequence once for q, k and v and again for
    # the MLP, znn.row_parallel reduce-scatters onto the sequence split); False: the values
    # marked only (znn.tensor_parallel), the collectives left to XLA's partitioner. LoRA
    # layers (lora_rank > 0) are always marked only.
    sp_matmuls: bool = True
    # "fused": chosen while tracing (zerojax.models.attention_choice.choose): cuDNN's flash attention
    # on a CUDA GPU where it takes the call (bf16/fp16, head dim a multiple of 8 up to 128 or
    # 256), zj.nn.dot_product_attention on a context mesh, the exact "einsum" elsewhere.
    attention: str = "fused"

    def __post_init__(self) -> None:
        zremat.resolve(self.remat)  # unknown names raise here, with the valid ones
        if self.attention not in ATTENTION:
            raise ValueError(f"GPTConfig.attention must be one of {ATTENTION}, got {self.attention!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}.")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"GPTConfig.lora_rank must be an int >= 0, got {self.lora_rank!r}.")
        for name in ("vocab", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}.")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must divide by n_heads ({self.n_heads}).")

    def num_params(self) -> int:
        d, L, V, T, m = self.d_model, self.n_layers, self.vocab, self.seq_len, self.mlp_ratio
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * m * d + m * d) + (m * d * d + d)
        return V * d + T * d + L * block + 2 * d + d * V

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward, no recompute): 6 per weight of
        every matmul (the blocks' and the head's; the embeddings are lookups) plus causal
        attention's scores and mixing, counted in full as in the PaLM paper's MFU:
        12 · layers · seq_len · d_model."""
        d, L, V, T, m = self.d_model, self.n_layers, self.vocab, self.seq_len, self.mlp_ratio
        matmul = L * (3 * d * d + d * d + 2 * m * d * d) + d * V
        return 6 * matmul + 12 * L * T * d


def _split(cfg: GPTConfig, kernel: tuple, bias: tuple | None = None) -> dict:
    """``nnx.Linear`` keywords annotating its kernel (and bias) for tensor parallelism."""
    if not cfg.tensor_parallel:
        return {}
    out = {"kernel_init": nnx.with_partitioning(nnx.initializers.lecun_normal(), kernel)}
    if bias is not None:
        out["bias_init"] = nnx.with_partitioning(nnx.initializers.zeros_init(), bias)
    return out


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.attention_mode = cfg.attention
        linear = (
            (lambda i, o, **kw: nnx.LoRALinear(i, o, lora_rank=cfg.lora_rank, rngs=rngs, **kw))
            if cfg.lora_rank
            else (lambda i, o, **kw: nnx.Linear(i, o, rngs=rngs, **kw))
        )
        col, row = _split(cfg, (None, "tensor"), ("tensor",)), _split(cfg, ("tensor", None))
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.tensor_parallel = cfg.tensor_parallel
        if cfg.tensor_parallel:  # one projection each, so that a tensor shard holds whole heads
            self.q, self.k, self.v = (linear(d, d, **col) for _ in range(3))
        else:
            self.qkv = linear(d, 3 * d)
        self.proj = linear(d, d, **row)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc = linear(d, cfg.mlp_ratio * d, **col)
        self.out = linear(cfg.mlp_ratio * d, d, **row)
        self.drop = nnx.Dropout(cfg.dropout)
        keep = lambda x, **_: x
        self.split = znn.sequence_parallel if cfg.sequence_parallel else keep
        self.cols = znn.tensor_parallel if cfg.sequence_parallel else keep  # gather the sequence, not the weight
        self.sp_matmuls = cfg.tensor_parallel and cfg.sequence_parallel and cfg.sp_matmuls and not cfg.lora_rank

    def column(self, x: jax.Array, *layers: nnx.Linear) -> tuple[jax.Array, ...]:
        """Column-parallel ``layers`` on the sequence-split ``x``: one gather for all."""
        return znn.column_parallel(x, tuple(l.kernel[...] for l in layers), tuple(l.bias[...] for l in layers))

    def row(self, x: jax.Array, layer: nnx.Linear) -> jax.Array:
        """Row-parallel ``layer``: born split along the sequence with explicit collectives."""
        if self.sp_matmuls:
            return znn.row_parallel(x, layer.kernel[...], layer.bias[...])
        return layer(x)

    def attention(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads
        if self.sp_matmuls:
            q, k, v = (y.reshape(b, t, h, d // h) for y in self.column(x, self.q, self.k, self.v))
        elif self.tensor_parallel:
            q, k, v = (self.cols(f(x).reshape(b, t, h, d // h), dim=2) for f in (self.q, self.k, self.v))
        else:
            q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * h, d // h), 3, axis=2)
        kind = self.attention_kind(q)
        with jax.named_scope(zattn.SCOPES[kind]):  # the compiled program says which ran
            if kind == "cudnn":
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            elif kind == "einsum":
                scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
                causal = jnp.tril(jnp.ones((t, t), bool))
                scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
                out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
            else:
                out = znn.dot_product_attention(q, k, v, is_causal=True, method=kind)
        return self.row(out.reshape(b, t, d), self.proj)

    def attention_kind(self, q: jax.Array) -> str:
        """What runs (``zerojax.models.attention_choice.KINDS``): ``"einsum"``, or for ``"fused"`` the
        choice from the static facts of this trace."""
        if self.attention_mode != zattn.FUSED:
            return self.attention_mode
        b, t, h, hd = q.shape
        plat = zattn.platform()
        choice = zattn.choose(plat, q.dtype, hd, context=zattn.on_context_mesh(None), capability=zattn.capability())
        zattn.warn_fallback(choice, plat, zattn.scores_bytes(b, h, t, t, q.dtype))
        return choice.kind

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """``key``: this layer's dropout key (None: no dropout)."""
        keys = (None, None) if key is None else jax.random.split(key)
        drop = lambda y, k: y if k is None else self.drop(y, rngs=k)
        x = self.split(x + drop(checkpoint_name(self.attention(self.ln1(x)), "attn_out"), keys[0]))
        if self.sp_matmuls:
            hidden = jax.nn.gelu(self.column(self.ln2(x), self.fc)[0])
        else:
            hidden = self.cols(jax.nn.gelu(self.fc(self.ln2(x))))
        return self.split(x + drop(checkpoint_name(self.row(hidden, self.out), "mlp_out"), keys[1]))


class GPT(nnx.Module):
    """``GPT(cfg, rngs)(tokens) -> logits``; ``tokens`` is ``int32[batch, time]``."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.wpe = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model)))

        layer = zremat.nnx_module(Block, cfg.remat)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def blocks(rngs):
            return layer(cfg, rngs)

        self.blocks = blocks(rngs)
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs, **_split(cfg, (None, "tensor")))

    def __call__(self, tokens: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """``key``: dropout key (None, or ``cfg.dropout == 0``: no dropout)."""
        if self.cfg.sequence_parallel:  # the lookups too: never the whole sequence's embeddings on a device
            tokens = znn.sequence_parallel(tokens)
        x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
        if self.cfg.sequence_parallel:
            x = znn.sequence_parallel(x)
        if key is None or not self.cfg.dropout:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: None})
            def run(x, block):
                return block(x)

            return self.logits(run(x, self.blocks))

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: None})
        def run_dropout(x, block, key):
            return block(x, key)

        keys = jax.random.split(key, self.cfg.n_layers)
        return self.logits(run_dropout(x, self.blocks, keys))

    def logits(self, x: jax.Array) -> jax.Array:
        """The head (column-parallel over the vocabulary): with sequence parallelism's
        matmuls, the sequence gathered inside the matmul only."""
        cfg = self.cfg
        if cfg.tensor_parallel and cfg.sequence_parallel and cfg.sp_matmuls:
            return znn.column_parallel(self.ln_f(x), self.head.kernel[...])
        return self.head(self.ln_f(x))


def init(cfg: GPTConfig, seed: int = 0):
    """``(graphdef, params)`` of a fresh model: ``params`` is what zerojax shards (with
    ``tensor_parallel``, annotated as metadata only: zerojax places the arrays). The
    parameters are built by one compiled program per (config, seed), not op by op: the same
    random draws (the initialisers' arithmetic rounds within 1e-8), in half the time."""
    return building.built(GPT, cfg, seed)


def init_abstract(cfg: GPTConfig):
    """``(graphdef, params)`` with ``jax.ShapeDtypeStruct`` leaves: nothing is allocated, for
    planning with ``step_memory`` models larger than the machine."""
    return building.abstract(GPT, cfg)


def make_loss(graphdef, with_rng: bool = False):
    """Next-token cross-entropy: ``loss_fn(params, {"tokens": int32[B, T + 1]})`` (or
    ``{"inputs": int32[B, T], "targets": int32[B, T]}``, the form whose sequence splits
    over a context axis), or with
    ``with_rng`` ``loss_fn(params, batch, rng)`` (dropout, for
    ``make_train_step(..., with_rng=True)``)."""

    def loss_fn(params, batch, rng=None):
        if "inputs" in batch:  # {"inputs", "targets"}: int32[B, T] each (a split sequence's form)
            inputs, targets = batch["inputs"], batch["targets"]
        else:
            inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        logits = nnx.merge(graphdef, params)(inputs, rng)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    if with_rng:
        return loss_fn
    return lambda params, batch: loss_fn(params, batch)


def is_lora(params):
    """``trainable=`` mask of a LoRA fine-tune: the adapters train, the base is frozen."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "lora" in jax.tree_util.keystr(path), params)
