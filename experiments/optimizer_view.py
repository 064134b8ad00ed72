"""What it costs for the optimizer to see every parameter in its own shape.

For square layers of width d, stage 1 and stage 3, AdamW, 8 devices: how each leaf is
stored (``zerojax.sharding.leaf_layout``), the persistent bytes per device against the formula,
the compiled step's temporaries and its all-gather traffic. Widths come in pairs: one that
divides 8 and its awkward neighbour, so the difference is the cost of the awkward shape:
a ``dim`` layout (the leaf split in its own shape, a padded last shard) costs its padding;
a ``flat`` one (every dimension too small to pad within 2%) is all-gathered for the update:
the exact path.

    python experiments/optimizer_view.py [--widths 344,345,1000,1001 --layers 4]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments.progress import bar  # noqa: E402

MIB = 2**20


def layers(d: int, n: int) -> dict:
    rng = np.random.default_rng(0)
    return {f"l{i}": jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32) for i in range(n)}


def loss_fn(p, x):
    for k in sorted(p):
        x = jnp.tanh(x @ p[k])
    return jnp.mean(x**2)


def measure(d: int, n_layers: int, stage: int, batch: int) -> dict:
    params, tx = layers(d, n_layers), optax.adamw(1e-3)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
    compiled = step.lower(state, jnp.ones((batch, d))).compile()
    psi = n_layers * d * d
    rep = zj.report.communication_report(compiled)
    return {
        "width": d,
        "stage": stage,
        "layout": state.plan.layouts[0].describe(),
        "kind": state.plan.layouts[0].kind,
        "psi": psi,
        "state": zj.report.state_bytes_per_device(state)["total"] - 12,  # less the int32 counters
        "formula": zj.report.zero_formula_bytes(psi, mesh.devices.size, stage),
        "temp": zj.report.compiled_bytes(compiled)["temp"],
        "all_gather": rep.get("all-gather:f32", {}).get("zero_bytes", 0) / (4 * psi),
        "reduce_scatter": rep.get("reduce-scatter:f32", {}).get("zero_bytes", 0) / (4 * psi),
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="344,345,1000,1001")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    progress = bar(2 * len(widths), "optimizer_view")
    rows = []
    for stage in (1, 3):
        for d in widths:
            progress.set_postfix_str(f"stage {stage} d {d}")
            rows.append(measure(d, args.layers, stage, args.batch))
            progress.update(1)
    progress.close()
    print(
        f"{args.layers} layers of d x d, AdamW, batch {args.batch}, {len(jax.devices())} x "
        f"{jax.devices()[0].platform}, jax {jax.__version__}\n"
    )
    print(
        "| stage | width | layout of each leaf | state per device / formula | compiled temp | "
        "temp / full params | all-gather traffic | reduce-scatter |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['stage']} | {r['width']} | {r['layout']} | {r['state'] / r['formula']:.4f} | "
            f"{r['temp'] / MIB:.2f} MiB | {r['temp'] / (4 * r['psi']):.2f} | {r['all_gather']:.3f}Ψ | "
            f"{r['reduce_scatter']:.3f}Ψ |"
        )
    return rows


if __name__ == "__main__":
    main()
