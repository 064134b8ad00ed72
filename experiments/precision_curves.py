"""Loss curves of the experiments' GPT in fp32, bf16 and fp16 (dynamic loss scaling).

All three runs use ZeRO (stage 3 by default) on 8 simulated CPU devices, the same data
and the same initial weights. Prints a markdown table of the loss every few steps and the
final comparison (mean of the last 10 steps, relative to fp32):

    python experiments/precision_curves.py [--steps 60 --stage 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402

RUNS = {
    "fp32": dict(compute_dtype="float32"),
    "bf16": dict(compute_dtype="bfloat16"),
    "fp16": dict(compute_dtype="float16", loss_scaling={"loss_scale": "dynamic", "loss_scale_window": 20}),
}


def run(cfg: gpt.GPTConfig, precision: dict, stage: int, steps: int, batch: int, seed: int = 0) -> dict:
    graphdef, params = gpt.init(cfg, seed)
    tx = optax.adamw(3e-3, weight_decay=0.01)
    mesh, zc = zj.make_mesh(), zj.ZeroConfig(stage=stage, grad_clip=1.0, **precision)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
    stream = data.windows(data.stdlib_bytes(), batch, cfg.seq_len, seed=seed)
    out = {"loss": [], "loss_scale": [], "skipped": []}
    for _ in range(steps):
        state, m = step(state, next(stream))
        out["loss"].append(float(m["loss"]))
        out["loss_scale"].append(float(m["loss_scale"]))
        out["skipped"].append(bool(m["skipped"]))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    args = ap.parse_args(argv)
    cfg = gpt.GPTConfig(vocab=256, seq_len=64, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    results = {}
    for name, precision in RUNS.items():
        results[name] = run(cfg, precision, args.stage, args.steps, args.batch)
        print(f"{name}: done ({sum(results[name]['skipped'])} skipped steps)", file=sys.stderr)
    print(
        f"GPT {cfg}, ZeRO-{args.stage}, AdamW 3e-3, clip 1.0, batch {args.batch}, "
        f"{len(jax.devices())} x {jax.devices()[0].platform}, jax {jax.__version__}\n"
    )
    print("| step | " + " | ".join(RUNS) + " | fp16 loss scale |")
    print("|---|" + "---|" * (len(RUNS) + 1))
    every = max(1, args.steps // 10)
    for i in list(range(0, args.steps, every)) + [args.steps - 1]:
        row = " | ".join(f"{results[n]['loss'][i]:.3f}" for n in RUNS)
        print(f"| {i} | {row} | {results['fp16']['loss_scale'][i]:.0f} |")
    ref = np.mean(results["fp32"]["loss"][-10:])
    print()
    for name in RUNS:
        last = np.mean(results[name]["loss"][-10:])
        print(
            f"- {name}: mean loss of the last 10 steps {last:.4f} ({100 * (last / ref - 1):+.2f}% vs fp32), "
            f"{sum(results[name]['skipped'])} skipped steps"
        )
    return results


if __name__ == "__main__":
    main()
