"""A decoder written the way MaxText writes it, trained under zerojax with its own sharding.

The model carries logical axis names on every parameter (``nnx.Param(..., out_sharding=
("embed", "mlp"))``), constrains its activations to a mesh of its own with MaxText's logical
rules (``with_sharding_constraint(x, NamedSharding(model_mesh, logical_to_mesh_axes(...)))``),
and runs its layers with ``nnx.scan`` over ``nnx.remat`` blocks. zerojax takes it unchanged
with ``ZeroConfig(axes={"model_axes": AXIS_MAP, "rules": RULES})``: the rules as MaxText gives them,
and the model mesh's axes mapped onto zerojax's (``fsdp``, ``fsdp_transpose`` and ``data``
onto "data", ``tensor`` onto "tensor").

For stages 0-3 on 8 simulated CPU devices, without and with tensor parallelism (T=2), the
script trains 3 SGD steps and prints the largest parameter difference from the same steps
on the model's own terms (plain ``jax.jit``, its constraints on its mesh), the losses, and
the per-device state bytes from the arrays against zerojax's formula.

    python experiments/maxtext_style.py
"""

from __future__ import annotations

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402

# The model's own mesh and logical rules, as MaxText's base config writes them (a subset).
MODEL_MESH = jax.make_mesh(
    (1, 4, 2, 1), ("data", "fsdp", "fsdp_transpose", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 4
)
RULES = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose")),
    ("activation_length", None),
    ("activation_embed", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("embed", ("fsdp", "fsdp_transpose")),
    ("mlp", ("fsdp_transpose", "tensor")),
    ("heads", "tensor"),
    ("kv", None),
    ("vocab", "tensor"),
    ("norm", None),
    ("layers", None),
)
AXIS_MAP = {"data": "data", "fsdp": "data", "fsdp_transpose": "data", "tensor": "tensor"}
VOCAB, EMBED, HEADS, KV, MLP, LAYERS, SEQ = 32, 16, 4, 4, 32, 2, 8


def constrain(x, names):
    """MaxText's ``nn.with_logical_constraint``: logical names -> the model's mesh axes."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(MODEL_MESH, nn.logical_to_mesh_axes(names, RULES)))


def param(rngs, shape, names, scale=1.0):
    init = nnx.initializers.normal(scale / np.sqrt(shape[0]))
    return nnx.Param(init(rngs.params(), shape), out_sharding=names)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.Param(jnp.ones((EMBED,)), out_sharding=("norm",))
        self.wq = param(rngs, (EMBED, HEADS * KV), ("embed", "heads"))
        self.wk = param(rngs, (EMBED, HEADS * KV), ("embed", "heads"))
        self.wv = param(rngs, (EMBED, HEADS * KV), ("embed", "heads"))
        self.wo = param(rngs, (HEADS * KV, EMBED), ("heads", "embed"))
        self.wi = param(rngs, (EMBED, MLP), ("embed", "mlp"))
        self.wout = param(rngs, (MLP, EMBED), ("mlp", "embed"))

    def __call__(self, x):
        b, t, _ = x.shape
        x = constrain(x, ("activation_batch", "activation_length", "activation_embed"))
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.norm[...]
        q, k, v = (
            constrain(
                (h @ w[...]).reshape(b, t, HEADS, KV),
                ("activation_batch", "activation_length", "activation_heads", "activation_kv"),
            )
            for w in (self.wq, self.wk, self.wv)
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(KV)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, HEADS * KV)
        x = x + constrain(att @ self.wo[...], ("activation_batch", "activation_length", "activation_embed"))
        mlp = constrain(jax.nn.silu(x @ self.wi[...]), ("activation_batch", "activation_length", "activation_mlp"))
        return x + mlp @ self.wout[...]


class Decoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = param(rngs, (VOCAB, EMBED), ("vocab", "embed"), scale=np.sqrt(VOCAB))

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def layers(rngs):
            return Block(rngs)

        self.layers = layers(rngs)
        self.head = param(rngs, (EMBED, VOCAB), ("embed", "vocab"))

    def __call__(self, tokens):
        x = constrain(self.embed[...][tokens], ("activation_batch", "activation_length", "activation_embed"))

        @nnx.remat
        def block(b, x):
            return b(x)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(b, x):
            return block(b, x)

        return constrain(run(self.layers, x) @ self.head[...], ("activation_batch", "activation_length", None))


def build():
    with nnx.use_eager_sharding(False):
        return nnx.split(Decoder(nnx.Rngs(0)), nnx.Param)


def make_loss(graphdef):
    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    return loss_fn


def data(k: int = 2):
    return [{"tokens": jax.random.randint(jax.random.key(i), (16, SEQ + 1), 0, VOCAB)} for i in range(k)]


def reference(loss_fn, params, tx, batches):
    """The model on its own terms: plain jax.jit, its constraints on its own mesh."""
    opt = tx.init(params)

    @jax.jit
    def step(p, o, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    losses = []
    for b in batches:
        params, opt, loss = step(params, opt, b)
        losses.append(float(loss))
    return params, losses


def main(argv=None) -> list[dict]:
    graphdef, params = build()
    loss_fn, tx, batches = make_loss(graphdef), optax.sgd(0.3), data(3)
    ref, ref_losses = reference(loss_fn, jax.tree.map(jnp.asarray, params), tx, batches)
    psi = sum(x.size for x in jax.tree.leaves(params))
    rows = []
    for tensor in (1, 2):
        mesh = zj.make_mesh(tensor=tensor)
        for stage in range(4):
            cfg = zj.ZeroConfig(stage=stage, axes={"model_axes": AXIS_MAP, "rules": RULES})
            state = zj.init_state(params, tx, mesh=mesh, config=cfg)
            step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
            losses = []
            for b in batches:
                state, m = step(state, b)
                losses.append(float(m["loss"]))
            err = max(
                float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(jax.tree.leaves(zj.gather_params(state)), jax.tree.leaves(ref))
            )
            unsplit = sum(l.size for l in state.plan.layouts if not l.tp)
            rows.append(
                {
                    "tensor": tensor,
                    "stage": stage,
                    "err": err,
                    "losses": losses,
                    "state": zj.report.state_bytes_per_device(state)["total"],
                    "formula": zj.report.zero_formula_bytes(
                        psi,
                        8 // tensor,
                        stage,
                        opt_bytes=0,
                        tensor=tensor,
                        tensor_replicated=unsplit if tensor > 1 else 0,
                    ),
                    "split": sum(l.tp for l in state.plan.layouts),
                }
            )
    print(
        f"MaxText-style decoder ({psi:,} parameters, {LAYERS} scanned remat'd layers), SGD, 3 steps, 8 x "
        f"{jax.devices()[0].platform}, jax {jax.__version__}"
    )
    print(f"axis_map = {AXIS_MAP}")
    print(
        "axis_rules = MaxText's (embed -> (fsdp, fsdp_transpose), mlp -> (fsdp_transpose, tensor), heads -> "
        "tensor, vocab -> tensor, ...)\n"
    )
    print(f"reference losses (plain jax.jit on the model's mesh): {', '.join(f'{x:.6f}' for x in ref_losses)}\n")
    print(
        "| data x tensor | stage | weights split over tensor | max abs param diff | losses | "
        "state bytes/device (arrays) | formula |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {8 // r['tensor']} x {r['tensor']} | {r['stage']} | {r['split']} | {r['err']:.1e} | "
            f"{', '.join(f'{x:.6f}' for x in r['losses'])} | {r['state']:,} | {r['formula']:,.0f} |"
        )
    return rows


if __name__ == "__main__":
    main()
