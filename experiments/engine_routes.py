"""Two ways to gather ZeRO-3 parameters where a model uses them, measured side by side.

* zerojax's own: the loss is traced to a jaxpr and re-evaluated with each parameter
  pending (zerojax/sharding/per_use.py, which reads JAX's program form only through
  zerojax/_jaxpr/);
* quax (custom array types through unmodified code): each sharded parameter is a
  ``quax.ArrayValue`` whose ``materialise`` is the all-gather; quax's interpreter decides
  where it materialises.

Both run the experiments' GPT at stage 3 with SGD in one process (jax >= 0.11, quax
installed): compile time, step time (median, interleaved), compiled bytes per device
(argument + output - alias + temp), the collectives in the compiled program, and the
loss after the timed steps. A last check runs a loss with a ``jax.custom_vjp`` (as fused
attention kernels and remat helpers have) through each route.

    pip install quax && python experiments/engine_routes.py [--d-model 64 --layers 2 --steps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import harness  # noqa: E402
from experiments.progress import bar  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402

MIB = 2**20
LR = 0.1


def quax_route(loss_fn, params, mesh):
    """``(step, shards)``: stage 3 through quax. Leaves whose last dim divides the device
    count are stored split along it (this sketch leaves the others replicated)."""
    try:
        import equinox as eqx
        import quax
    except ImportError as e:
        raise SystemExit(f"experiments/engine_routes.py needs quax (pip install quax): {e}") from e
    n = mesh.shape["data"]

    class Sharded(quax.ArrayValue):
        shard: jax.Array
        full_shape: tuple = eqx.field(static=True)

        def aval(self):
            return jax.core.ShapedArray(self.full_shape, self.shard.dtype)

        def materialise(self):
            return jax.lax.all_gather(self.shard, "data", axis=self.shard.ndim - 1, tiled=True)

    leaves, tree = jax.tree.flatten(params)
    split = [x.ndim >= 1 and x.shape[-1] % n == 0 for x in leaves]
    specs = [P(*([None] * (x.ndim - 1)), "data") if s else P() for x, s in zip(leaves, split)]

    def body(shards, batch):
        vals = [Sharded(s, x.shape) if sp else s for s, x, sp in zip(shards, leaves, split)]
        value, grads = jax.value_and_grad(quax.quaxify(lambda v: loss_fn(jax.tree.unflatten(tree, v), batch)))(vals)
        # A Sharded leaf's gradient is a Sharded of its shard's gradient: the transpose of the
        # all-gather, which sums over devices (divide for the mean); the others are all-reduced.
        grads = [g.shard / n if sp else jax.lax.pmean(g, "data") for g, sp in zip(grads, split)]
        return [s - LR * g for s, g in zip(shards, grads)], jax.lax.pmean(value, "data")

    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(specs, {"tokens": P("data")}), out_specs=(specs, P()), check_vma=False
        ),
        donate_argnums=0,
    )
    shards = [jax.device_put(x, jax.sharding.NamedSharding(mesh, s)) for x, s in zip(leaves, specs)]
    return step, shards


def collectives(text: str) -> str:
    return ", ".join(f"{text.count(k + '(')} {k}" for k in ("all-gather", "reduce-scatter", "all-reduce"))


def compiled_mib(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes) / MIB


def custom_vjp_check(mesh) -> dict[str, str]:
    """A loss with a ``jax.custom_vjp`` (a gradient clip) through each route."""

    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))
    params = {"w": jnp.ones((16, 16))}
    loss = lambda p, b: jnp.mean(clip_grad(b["tokens"].astype(jnp.float32)[:, :16] @ p["w"]))
    batch = {"tokens": jnp.ones((8, 17), jnp.int32)}
    out = {}
    try:
        step, shards = quax_route(loss, params, mesh)
        step(shards, batch)
        out["quax"] = "runs"
    except NotImplementedError as e:
        out["quax"] = f"NotImplementedError: {str(e).split(' to handle')[0]}"
    cfg = zj.ZeroConfig(stage=3)
    state = zj.init_state(params, optax.sgd(LR), mesh=mesh, config=cfg)
    zj.make_train_step(loss, optax.sgd(LR), mesh=mesh, config=cfg)(state, batch)
    out["zerojax"] = "runs"
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per route, interleaved")
    args = ap.parse_args(argv)
    cfg = gpt.GPTConfig(seq_len=32, d_model=args.d_model, n_layers=args.layers, n_heads=max(1, args.d_model // 32))
    graphdef, params = gpt.init(cfg)
    loss_fn, mesh = gpt.make_loss(graphdef), zj.make_mesh()
    batch = next(data.windows(data.stdlib_bytes(1 << 18), args.batch, cfg.seq_len))
    progress = bar(2 + 2 * (args.steps + 1) + 1, "engine routes")

    routes = {}
    t = time.perf_counter()
    state, zstep = harness.zero_setup(cfg, optax.sgd(LR), mesh=mesh, config=zj.ZeroConfig(stage=3))
    zc = zstep.lower(state, batch).compile()
    routes["zerojax"] = {
        "compile_s": time.perf_counter() - t,
        "mib": compiled_mib(zc),
        "hlo": collectives(zc.as_text()),
    }
    progress.update()
    t = time.perf_counter()
    qstep, shards = quax_route(loss_fn, params, mesh)
    qc = qstep.lower(shards, batch).compile()
    routes["quax"] = {"compile_s": time.perf_counter() - t, "mib": compiled_mib(qc), "hlo": collectives(qc.as_text())}
    progress.update()

    live = {"zerojax": (state, None), "quax": (shards, None)}  # each route's state, carried between calls

    def route(name, step):
        def run():
            live[name] = step(live[name][0], batch)
            return live[name][1]

        return run

    times = harness.side_by_side({"zerojax": route("zerojax", zstep), "quax": route("quax", qstep)}, args.steps)
    progress.update(2 * (args.steps + 1))
    routes["zerojax"]["loss"], routes["quax"]["loss"] = float(live["zerojax"][1]["loss"]), float(live["quax"][1])
    for name in routes:
        routes[name]["ms"] = harness.median_ms(times[name])
    checks = custom_vjp_check(mesh)
    progress.update()
    progress.close()

    print(
        f"GPT d_model {args.d_model}, {args.layers} layers, {cfg.num_params():,} params, batch {args.batch}x"
        f"{cfg.seq_len}, SGD, stage 3, 8 CPU devices, jax {jax.__version__}\n"
    )
    print("| route | compile s | ms/step | compiled MiB/device | collectives in the step | loss | custom_vjp |")
    print("|---|---|---|---|---|---|---|")
    for name, r in routes.items():
        print(
            f"| {name} | {r['compile_s']:.1f} | {r['ms']:.1f} | {r['mib']:.2f} | {r['hlo']} | {r['loss']:.5f} | "
            f"{checks[name]} |"
        )
    return {"routes": routes, "custom_vjp": checks}


if __name__ == "__main__":
    main()
