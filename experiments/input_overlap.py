"""Loading overlapped with the step: N steps of a ZeRO-3 train step fed by a loader that takes
about as long as a step, with and without zj.data.Prefetch, side by side in one run.

    python experiments/input_overlap.py                  # 20 steps, load time = measured step time
    python experiments/input_overlap.py --steps 40 --seconds 0.2

The loader sleeps (a reader waiting on storage or the network), so that on a CPU host the
step's compute and the load do not compete for the same cores. Each step reads its loss
(a logging loop's habit), so without prefetch the next load starts only once the step is
done: about N x (load + step); with prefetch the thread loads and places the next batches
during the step: the target is at most 1.1 x N x max(load, step).
"""

from __future__ import annotations

import argparse
import os
import time

if "jax" not in os.sys.modules:  # 8 simulated devices on a CPU host, set before JAX starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax as zj
from zerojax.resume import IndexSampler

RECORDS, BATCH = 4096, 64


def loss(p, b):
    h = b["x"]
    for w in p["layers"]:
        h = jnp.tanh(h @ w)
    return jnp.mean((h - b["y"]) ** 2)


def build(width: int, layers: int):
    mesh, cfg, tx = zj.make_mesh(), zj.ZeroConfig(stage=3), optax.adam(1e-3)
    rng = np.random.default_rng(0)
    params = {"layers": [jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32)] * layers}
    xs = rng.normal(size=(RECORDS, width)).astype(np.float32)
    ys = rng.normal(size=(RECORDS, width)).astype(np.float32)
    step = zj.make_train_step(loss, tx, mesh=mesh, config=cfg)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    return mesh, cfg, step, state, xs, ys


def train(step, state, batches, steps: int):
    """Seconds for ``steps`` steps, reading each step's loss."""
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, next(batches))
        float(metrics["loss"])
    return time.perf_counter() - start, state


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=None, help="load time per batch (default: the step's)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--depth", type=int, default=2)
    args = ap.parse_args(argv)
    mesh, cfg, step, state, xs, ys = build(args.width, args.layers)
    sampler = IndexSampler(RECORDS, BATCH, seed=0)

    def load(idx):
        time.sleep(seconds)
        return {"x": xs[idx], "y": ys[idx]}

    plain = lambda: {"x": xs[next(sampler)], "y": ys[next(sampler)]}
    # Compile, then warm, for both inputs: a batch already on the mesh (committed to the
    # step's shardings) is a program of its own, compiled at its first step.
    with zj.data.Prefetch(iter([plain() for _ in range(3)]), mesh, config=cfg) as placed:
        for b in [plain(), plain(), plain(), *placed]:
            state, metrics = step(state, b)
            float(metrics["loss"])
    times = []
    for _ in range(5):
        b = plain()
        t = time.perf_counter()
        state, metrics = step(state, b)
        float(metrics["loss"])
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times))
    seconds = step_s if args.seconds is None else args.seconds

    none_s, state = train(step, state, map(load, sampler), args.steps)
    with zj.data.Prefetch(sampler, mesh, config=cfg, depth=args.depth, load=load) as batches:
        next(batches)  # the thread starts with the first batch, as at a run's first step
        prefetch_s, state = train(step, state, batches, args.steps)

    n = args.steps
    serial, overlap = n * (seconds + step_s), n * max(seconds, step_s)
    print("| input | steps | load (ms) | step (ms) | total (s) | ms/step | N x (load + step) (s) | 1.1 x N x max (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, total in (("none", none_s), ("prefetch", prefetch_s)):
        print(
            f"| {name} | {n} | {seconds * 1e3:.0f} | {step_s * 1e3:.0f} | {total:.2f} | {total / n * 1e3:.0f} | "
            f"{serial:.2f} | {1.1 * overlap:.2f} |"
        )
    print(
        f"\n{jax.device_count()} {jax.devices()[0].platform} devices, ZeRO-3, width {args.width} x {args.layers} "
        f"layers, batch {BATCH}, depth {args.depth}."
    )
    return {"none": none_s, "prefetch": prefetch_s, "step": step_s, "load": seconds}


if __name__ == "__main__":
    main()
