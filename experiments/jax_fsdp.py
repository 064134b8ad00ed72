"""JAX's own FSDP recipe beside zerojax stage 3, on the experiments' GPT, in one process.

The recipe is written in plain JAX (explicit sharding; jax 0.10 and 0.12 alike): parameters and AdamW
state live sharded over the ``data`` axis, and each layer's weights are gathered where they
are used with ``jax.reshard(w, P(None, ..., reduced={"data"}))``. A ``reduced`` array is a
full copy whose gradient comes back ``unreduced`` (a per-device partial sum); the transpose
of the gather, a reshard back to the sharded spec, is the gradient's reduce-scatter
(docs: "Autodiff and sharding"). Two variants:

- ``reshard``: a ``lax.scan`` over the stacked layers gathers each layer in its body, under
  ``jax.checkpoint`` with a policy that saves every activation but the gathered weights, so
  backward gathers each layer again instead of keeping the whole model gathered.
- ``pipelined``: the pattern of JAX's ``tests/overlap_test.py::test_fsdp_pipeline_grad``,
  a ``custom_vjp`` over the layer scan that gathers layer i+1 while layer i computes,
  drops the gathered weights from the saved residuals (``vjp_fn.args_res``) and gathers
  them again, one layer ahead, in backward.

Elementwise ops refuse a ``reduced`` operand beside batch-sharded activations (biases,
LayerNorm scales, the position table), so those are broadcast to the activation's shape and
sharding with ``lax.broadcast_in_dim(..., out_sharding=...)`` (its transpose keeps the
gradient unreduced); the embedding lookup runs inside ``jax.shard_map`` (a gather from a
``reduced`` table beside sharded ids is refused in explicit mode).

The script first checks the recipe's losses against single-device optax on the same model
and batches, then times the recipe beside zerojax stage 3 (prefetch 0 and 1) and stage 0
(median ms/step after warm-up, runs interleaved round-robin) and reads each compiled
program's memory (argument + output - alias + temp per device) and collectives.

    python experiments/jax_fsdp.py [--steps 10 --warmup 2 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from functools import partial

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import harness  # noqa: E402
from experiments.progress import bar  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402

AXIS = "data"
MIB = 2**20
RECIPES = ("reshard", "pipelined")


# ----------------------------------------------------------------------------- sharding


def explicit_mesh(n: int | None = None):
    """A 1-D mesh over the first ``n`` devices with an Explicit ``data`` axis."""
    from jax.sharding import AxisType

    n = n or len(jax.devices())
    return jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])


def shard_spec(shape: tuple[int, ...], n: int, stacked: bool) -> P:
    """``P`` that splits the largest dim dividing by ``n`` (not the layer axis of a stacked
    leaf); leaves with no such dim stay replicated (none in the experiments' GPT)."""
    dims = [d for d in range(1 if stacked else 0, len(shape)) if shape[d] % n == 0]
    if not dims:
        return P()
    dim = max(dims, key=lambda d: (shape[d], -d))
    return P(*[AXIS if i == dim else None for i in range(len(shape))])


def param_specs(params: dict, n: int) -> dict:
    return {k: jax.tree.map(lambda x, s=(k == "blocks"): shard_spec(x.shape, n, s), v) for k, v in params.items()}


def gather(w):
    """The FSDP gather: a full copy on every device, ``reduced`` so its gradient comes back
    unreduced and is reduce-scattered by this reshard's transpose."""
    return jax.reshard(w, P(*(None,) * w.ndim, reduced={AXIS}))


def broadcast_to(v, like):
    """``v`` (reduced) broadcast over ``like``'s leading dims, with ``like``'s sharding:
    ``v + like`` itself is refused (reduced beside batch-sharded)."""
    return jax.lax.broadcast_in_dim(
        v, like.shape, tuple(range(like.ndim - v.ndim, like.ndim)), out_sharding=jax.typeof(like).sharding
    )


# ----------------------------------------------------------------------------- the model


def layer_norm(x, p, eps: float = 1e-6):
    """``nnx.LayerNorm`` (fast variance, epsilon 1e-6)."""
    mean = x.mean(-1, keepdims=True)
    var = jnp.maximum(0.0, (x * x).mean(-1, keepdims=True) - mean * mean)
    return (x - mean) * (jax.lax.rsqrt(var + eps) * broadcast_to(p["scale"], x)) + broadcast_to(p["bias"], x)


def linear(x, p):
    y = x @ p["kernel"]
    return y + broadcast_to(p["bias"], y) if "bias" in p else y


def block(x, w, n_heads: int):
    """zerojax/models/gpt.py's ``Block`` on gathered weights ``w``."""
    b, t, d = x.shape
    h = n_heads
    q, k, v = jnp.split(linear(layer_norm(x, w["ln1"]), w["qkv"]).reshape(b, t, 3 * h, d // h), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
    att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    x = x + linear(att.reshape(b, t, d), w["proj"])
    return x + linear(jax.nn.gelu(linear(layer_norm(x, w["ln2"]), w["fc"])), w["out"])


def embed(wte, wpe, ids):
    """Token + position embeddings of batch-sharded ``ids`` from gathered tables."""
    spec = P(*(None,) * wte.ndim, reduced={AXIS})
    x = jax.shard_map(lambda table, i: jnp.take(table, i, axis=0), in_specs=(spec, P(AXIS)), out_specs=P(AXIS))(
        wte, ids
    )
    return x + broadcast_to(wpe[: ids.shape[1]], x)


def pipelined_layers(f, x, ws):
    """``f`` over the stacked layer weights ``ws`` (sharded), the next layer's gather
    issued beside this layer's compute, forward and backward (JAX's overlap_test)."""
    return _pipe(f, x, ws)


def _ag(tree):
    return jax.tree.map(gather, tree)


def _rs(tree, like):
    """Unreduced layer gradients to the sharding of one layer's slice of ``like``."""
    return jax.tree.map(lambda g, w: jax.reshard(g, P(*tuple(jax.typeof(w).sharding.spec)[1:])), tree, like)


def _layer(ws, i):
    return jax.tree.map(lambda w: w[i], ws)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipe(f, x, ws):
    def body(carry, w_next_sharded):
        x, w = carry
        w_next = _ag(w_next_sharded)
        return (f(x, w), w_next), None

    (x, w), _ = jax.lax.scan(body, (x, _ag(_layer(ws, 0))), jax.tree.map(lambda w: w[1:], ws), unroll=2)
    return f(x, w)


def _pipe_fwd(f, x, ws):
    x, vjp_first = jax.vjp(f, x, _ag(_layer(ws, 0)))
    vjp_first.args_res[1] = None  # the gathered weights are gathered again in backward

    def body(carry, w_next_sharded):
        x, w = carry
        w_next = _ag(w_next_sharded)
        x, vjp = jax.vjp(f, x, w)
        vjp.args_res[1] = None
        return (x, w_next), vjp

    (x, w_last), vjps = jax.lax.scan(body, (x, _ag(_layer(ws, 1))), jax.tree.map(lambda w: w[2:], ws), unroll=2)
    x, vjp_last = jax.vjp(f, x, w_last)
    vjp_last.args_res[1] = None
    return x, (vjp_first, vjps, vjp_last, ws)


def _pipe_bwd(f, res, x_bar):
    vjp_first, vjps, vjp_last, ws = res
    vjp_last.args_res[1] = _ag(_layer(ws, -1))
    x_bar, w_last_bar = vjp_last(x_bar)

    def body(carry, vjp_and_w_prev_sharded):
        y_bar, w, w_next_bar = carry
        vjp, w_prev_sharded = vjp_and_w_prev_sharded
        w_prev = _ag(w_prev_sharded)  # gathered while this layer's backward runs
        vjp.args_res[1] = w
        x_bar, w_bar = vjp(y_bar)
        return (x_bar, w_prev, w_bar), _rs(w_next_bar, ws)

    (x_bar, w0, w1_bar), rest_bar = jax.lax.scan(
        body,
        (x_bar, _ag(_layer(ws, -2)), w_last_bar),
        (vjps, jax.tree.map(lambda w: w[:-2], ws)),
        reverse=True,
        unroll=2,
    )
    vjp_first.args_res[1] = w0
    x_bar, w0_bar = vjp_first(x_bar)
    ws_bar = jax.tree.map(
        lambda a, b, rest: jnp.concatenate([a[None], b[None], rest], axis=0), _rs(w0_bar, ws), _rs(w1_bar, ws), rest_bar
    )
    return x_bar, ws_bar


_pipe.defvjp(_pipe_fwd, _pipe_bwd)


def not_gathered(prim, *_, **__) -> bool:
    """Remat policy: save every value but the gathers' outputs, so backward gathers again.
    (``save_anything_except_these_names`` on a ``checkpoint_name`` of the gathered weight
    does not do it: the reshard's own output, equal to the named one, is saved instead.)"""
    return prim.name != "reshard"


def make_recipe_loss(cfg: gpt.GPTConfig, variant: str):
    """``loss(params, tokens)`` of the GPT on sharded pure-dict ``params``."""
    if variant not in RECIPES:
        raise ValueError(f"unknown recipe variant {variant!r}; expected one of {RECIPES}")
    f = partial(block, n_heads=cfg.n_heads)

    def layers(x, blocks):
        if variant == "pipelined":
            return pipelined_layers(f, x, blocks)

        @partial(jax.checkpoint, policy=not_gathered)
        def body(x, w_sharded):
            return f(x, _ag(w_sharded)), None

        return jax.lax.scan(body, x, blocks)[0]

    def loss(params, tokens):
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        x = layers(embed(gather(params["wte"]["embedding"]), gather(params["wpe"]), ids), params["blocks"])
        logits = linear(layer_norm(x, _ag(params["ln_f"])), _ag(params["head"]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss


def recipe_setup(cfg: gpt.GPTConfig, variant: str, params, tx, mesh, example_batch):
    """``(state, compiled step)``: ``state`` = (sharded params, sharded AdamW state); the step
    ``(params, opt_state, tokens) -> (params, opt_state, loss)`` donates its state."""
    pure = nnx.to_pure_dict(params)
    specs = param_specs(pure, mesh.devices.size)
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), pure, specs)
    loss_fn = make_recipe_loss(cfg, variant)

    def step(p, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(p, tokens)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    with jax.set_mesh(mesh):
        opt_state = jax.jit(tx.init)(sharded)
        tokens = place_tokens(example_batch, mesh)
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(sharded, opt_state, tokens).compile()
    return (sharded, opt_state), compiled


def place_tokens(batch, mesh):
    return jax.device_put(np.asarray(batch["tokens"]), NamedSharding(mesh, P(AXIS)))


# ----------------------------------------------------------------------------- check


def reference_losses(cfg, params, graphdef, tx, batches) -> list[float]:
    """Single-device optax on zerojax/models/gpt.py's NNX model: the loss at each step."""
    loss_fn = gpt.make_loss(graphdef)
    dev = jax.devices()[0]

    @jax.jit
    def step(p, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    p = jax.device_put(params, dev)
    opt_state = tx.init(p)
    out = []
    for b in batches:
        p, opt_state, loss = step(p, opt_state, jax.device_put(b, dev))
        out.append(float(loss))
    return out


def check(
    cfg: gpt.GPTConfig, steps: int = 5, batch_size: int = 32, lr: float = 1e-3, rtol: float = 1e-5, seed: int = 0
) -> dict:
    """Both recipe variants against single-device optax on the same GPT, AdamW and batches:
    the loss at each of ``steps`` steps and after the last update, within ``rtol``."""
    graphdef, params = gpt.init(cfg, seed)
    tx = optax.adamw(lr)
    stream = data.windows(data.stdlib_bytes(1 << 20), batch_size, cfg.seq_len, seed=seed)
    batches = [next(stream) for _ in range(steps + 1)]
    out = {"steps": steps, "rtol": rtol, "reference": reference_losses(cfg, params, graphdef, tx, batches)}
    mesh = explicit_mesh()
    for variant in RECIPES:
        (p, opt_state), step = recipe_setup(cfg, variant, params, tx, mesh, batches[0])
        losses = []
        for b in batches:
            p, opt_state, loss = step(p, opt_state, place_tokens(b, mesh))
            losses.append(float(loss))
        out[variant] = losses
        out[f"{variant}_max_rel"] = max(abs(a - r) / abs(r) for a, r in zip(losses, out["reference"]))
    out["ok"] = all(out[f"{v}_max_rel"] <= rtol for v in RECIPES)
    return out


def print_check(c: dict) -> None:
    print(
        f"Correctness: loss at each of {c['steps']} AdamW steps and after the last update, against "
        f"single-device optax on the same GPT and batches (tolerance {c['rtol']:g} relative)\n"
    )
    print("| step | single-device optax | " + " | ".join(RECIPES) + " |")
    print("|---|---|" + "---|" * len(RECIPES))
    for i, ref in enumerate(c["reference"]):
        print(
            f"| {i + 1 if i < c['steps'] else 'after'} | {ref:.7f} | "
            + " | ".join(f"{c[v][i]:.7f}" for v in RECIPES)
            + " |"
        )
    print("| max relative difference | | " + " | ".join(f"{c[f'{v}_max_rel']:.1e}" for v in RECIPES) + " |")
    print(f"\ncheck {'passed' if c['ok'] else 'FAILED'}\n")


# ----------------------------------------------------------------------------- comparison


def collectives(compiled) -> dict:
    """``{kind: (executions per step, MiB per device per step)}`` for all-gather,
    reduce-scatter and all-reduce (loop bodies counted per iteration)."""
    rep = zj.report.communication_report(compiled)
    out = {}
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        runs = [v for k, v in rep.items() if k.split(":")[0] == kind]
        out[kind] = (sum(r["count"] for r in runs), sum(r["bytes"] for r in runs) / MIB)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant, interleaved")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    ap.add_argument("--json", default=None, help="also write the results to this path")
    harness.add_gpt_args(ap, d_model=256, layers=8, batch=32)
    ap.add_argument("--check-steps", type=int, default=5)
    ap.add_argument("--check-only", action="store_true", help="run the correctness check and stop")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    result = {"config": vars(args), "jax": jax.__version__, "params": cfg.num_params()}
    c = check(cfg, steps=args.check_steps, batch_size=args.batch)
    print_check(c)
    result["check"] = c
    if not c["ok"]:
        raise SystemExit("the JAX FSDP recipe does not match single-device optax; not timing it")
    if args.check_only:
        return _dump(result, args.json)

    graphdef, params = gpt.init(cfg)
    tx = optax.adamw(1e-3)
    stream = data.windows(data.stdlib_bytes(1 << 20), args.batch, cfg.seq_len, seed=1)
    batches = [next(stream) for _ in range(args.warmup + args.steps)]
    xmesh, zmesh = explicit_mesh(), zj.make_mesh()
    zbatches = [{"tokens": jax.device_put(b["tokens"], NamedSharding(zmesh, P(AXIS)))} for b in batches]
    xbatches = [place_tokens(b, xmesh) for b in batches]
    names = [
        "JAX recipe: reshard per layer",
        "JAX recipe: pipelined (overlap_test)",
        "zerojax stage 3, prefetch 0",
        "zerojax stage 3, prefetch 1",
        "zerojax stage 0",
    ]
    progress = bar(len(names) * (1 + args.warmup + args.steps), "jax_fsdp")
    runs = []
    for name in names:
        progress.set_postfix_str(f"compiling {name}")
        if name.startswith("JAX"):
            variant = "pipelined" if "pipelined" in name else "reshard"
            state, compiled = recipe_setup(cfg, variant, params, tx, xmesh, batches[0])

            def run(state, i, compiled=compiled):
                p, o, loss = compiled(*state, xbatches[i])
                return (p, o), loss
        else:
            stage, pf = (0, 0) if "stage 0" in name else (3, int(name[-1]))
            zc = zj.ZeroConfig(stage=stage, prefetch=pf)
            state, zstep = harness.zero_setup(cfg, tx, mesh=zmesh, config=zc)
            compiled = zstep.lower(state, zbatches[0]).compile()

            def run(state, i, zstep=zstep):
                state, m = zstep(state, zbatches[i])
                return state, m["loss"]

        runs.append(
            {
                "name": name,
                "run": run,
                "state": state,
                "memory": zj.report.compiled_bytes(compiled),
                "collectives": collectives(compiled),
                "times": [],
                "losses": [],
            }
        )
        del compiled
        progress.update(1)
    for i in range(args.warmup + args.steps):  # round-robin: machine noise hits every variant alike
        for r in runs:
            progress.set_postfix_str(r["name"])
            t0 = time.perf_counter()
            r["state"], loss = r["run"](r["state"], i)
            loss = float(loss)
            if i >= args.warmup:
                r["times"].append(time.perf_counter() - t0)
            r["losses"].append(loss)
            progress.update(1)
    progress.close()

    print(
        f"GPT d{args.d_model} L{args.layers} ({cfg.num_params():,} parameters), batch {args.batch} x "
        f"{cfg.seq_len}, AdamW, {len(jax.devices())} x {jax.devices()[0].platform}, jax {jax.__version__}; "
        f"median of {args.steps} interleaved steps after {args.warmup} warm-up\n"
    )
    print(
        "| variant | ms/step | vs zerojax stage 3, prefetch 0 | compiled MiB/device | argument | output | "
        "alias | temp | all-gather | reduce-scatter | all-reduce | loss after "
        f"{args.warmup + args.steps} steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = statistics.median(runs[2]["times"])
    rows = []
    for r in runs:
        ms = 1e3 * statistics.median(r["times"])
        m, col = r["memory"], r["collectives"]
        print(
            f"| {r['name']} | {ms:.1f} | {ms / (1e3 * base):.2f} | {m['total'] / MIB:.2f} | "
            f"{m['argument'] / MIB:.2f} | {m['output'] / MIB:.2f} | {m['alias'] / MIB:.2f} | "
            f"{m['temp'] / MIB:.2f} | "
            + " | ".join(f"{n} × {mib:.2f} MiB" for n, mib in (col[k] for k in col))
            + f" | {r['losses'][-1]:.6f} |"
        )
        rows.append(
            {
                "name": r["name"],
                "ms_per_step": ms,
                "times_s": r["times"],
                "memory": m,
                "collectives": {k: {"count": n, "mib": mib} for k, (n, mib) in col.items()},
                "losses": r["losses"],
            }
        )
    result["rows"] = rows
    return _dump(result, args.json)


def _dump(result: dict, path: str | None) -> dict:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
