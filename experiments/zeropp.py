"""ZeRO++'s quantized communication: weight gathers × gradient exchanges, bytes and loss.

On 8 simulated CPU devices, the GPT of ``zerojax/models/gpt.py``:

* traffic: for each weight-gather dtype (fp32; bf16; int8 = qwZ, bf16 compute) and each
  gradient-exchange dtype (fp32; bf16; int8 = qgZ), the compiled ZeRO-3 step's bytes per
  device per step, split into weight gathers and gradient exchange
  (``communication_report``: all-gathers; reduce-scatters and all-to-alls). XLA's CPU
  backend runs bf16 collectives in fp32, so bf16 ones are counted at the width zerojax
  asks for (half the f32 bytes it reports). int8 buffers carry their fp32 scales (4 bytes
  per block) inside them;
* loss: the same runs trained ``--steps`` steps of AdamW (same data and initial weights),
  plus ZeRO-2 with fp32 and int8 gradients; each int8-gradient run is compared with its
  fp32-gradient twin on the mean loss of the last 10 steps. ``--plot`` draws the curves.

    python experiments/zeropp.py [--steps 200 --plot docs/img/zeropp_loss.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import harness  # noqa: E402
from experiments.progress import bar  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402

WEIGHTS = harness.GATHERS
GRADS = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}  # the gradient reduction's dtype


def runs(weights: list[str]) -> list[tuple[int, str, str]]:
    """(stage, weights, grads) trained: the stage-3 cells of the table, and ZeRO-2 in bf16."""
    return [(3, w, g) for w in weights for g in GRADS] + [(2, "bf16", "fp32"), (2, "bf16", "int8")]


def config(stage: int, weights: str, grads: str) -> zj.ZeroConfig:
    w = dict(WEIGHTS[weights])
    collectives = {**w.pop("collectives", {}), "reduce_dtype": GRADS[grads]}
    return zj.ZeroConfig(stage=stage, grad_clip=1.0, collectives=collectives, **w)


def traffic(report: dict, cfg: zj.ZeroConfig) -> dict[str, int]:
    """Weight-gather and gradient bytes per device per step, bf16 counted as asked."""
    out = {"gathers": 0, "grads": 0}
    for key, r in report.items():
        if key in ("total", "by_axis"):
            continue
        kind, dtype = key.split(":")
        role = "gathers" if kind == "all-gather" else "grads" if kind in ("reduce-scatter", "all-to-all") else None
        if role is None:
            continue  # all-reduces: the loss and metrics (a few bytes)
        asked = cfg.compute_dtype if role == "gathers" else cfg.collectives.reduce_dtype
        if dtype == "s8" and role == "gathers" and cfg.collectives.gather_dtype != "int8":
            role = "grads"  # the int8 all-gather of an int8 all-reduce (leaves kept whole)
        halve = dtype == "f32" and asked == "bfloat16" and not (role == "gathers" and cfg.collectives.gather_dtype)
        out[role] += r["bytes"] // 2 if halve else r["bytes"]
    return out


def measure(gcfg: gpt.GPTConfig, batch: int, steps: int, todo: list, progress) -> dict:
    graphdef, params = gpt.init(gcfg, 0)
    tx, mesh = optax.adamw(3e-3, weight_decay=0.01), zj.make_mesh()
    loss_fn = gpt.make_loss(graphdef)
    out = {}
    for run in todo:
        cfg = config(*run)
        state = zj.init_state(params, tx, mesh=mesh, config=cfg)
        step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
        stream = data.windows(data.stdlib_bytes(), batch, gcfg.seq_len, seed=0)
        first = next(stream)
        bytes_ = traffic(zj.report.communication_report(step.lower(state, first).compile()), cfg)
        losses = []
        b = first
        for _ in range(steps):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
            b = next(stream)
            progress.update(1)
        out[run] = {"bytes": bytes_, "losses": losses, "last": float(np.mean(losses[-10:]))}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    harness.add_gpt_args(ap, d_model=128, layers=2, batch=16)
    ap.add_argument("--weights", default="fp32,bf16,int8", help="weight-gather rows of the table (comma-separated)")
    ap.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    ap.add_argument("--json", default=None, help="also write the results here (a run's key as stage/weights/grads)")
    args = ap.parse_args(argv)
    weights = args.weights.split(",")
    unknown = [w for w in weights if w not in WEIGHTS]
    if unknown or not weights:
        raise ValueError(f"--weights takes a comma-separated subset of {list(WEIGHTS)}, got {args.weights!r}.")
    todo = runs(weights)
    gcfg = harness.gpt_config(args, head_dim=32)
    progress = bar(len(todo) * args.steps, "zeropp")
    res = measure(gcfg, args.batch, args.steps, todo, progress)
    progress.close()
    cfg0 = zj.ZeroConfig()
    print(
        f"GPT d{args.d_model} L{args.layers} ({gcfg.num_params():,} parameters), AdamW 3e-3, clip 1.0, batch "
        f"{args.batch} x {gcfg.seq_len}, {args.steps} steps, {len(jax.devices())} x {jax.devices()[0].platform}, "
        f"jax {jax.__version__}; int8 blocks of {cfg0.collectives.gather_block_size} (weights) and "
        f"{cfg0.collectives.reduce_block_size} (gradients)\n"
    )
    base = res[(3, weights[0], "fp32")]["bytes"]
    print("ZeRO-3, bytes per device per step (MiB), and the loss (mean of the last 10 steps):\n")
    print(
        f"| weights | gradients | gathers | gradient exchange | gradients vs fp32 | total vs {weights[0]}/fp32 | loss | "
        "vs fp32 gradients |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rel = {}
    for stage, w, g in todo:
        r = res[(stage, w, g)]
        twin = res[(stage, w, "fp32")]
        rel[(stage, w, g)] = r["last"] / twin["last"] - 1
        if stage != 3:
            continue
        total = sum(r["bytes"].values()) / sum(base.values())
        print(
            f"| {w} | {g} | {r['bytes']['gathers'] / 2**20:.3f} | {r['bytes']['grads'] / 2**20:.3f} | "
            f"{r['bytes']['grads'] / twin['bytes']['grads']:.3f} | {total:.3f} | {r['last']:.4f} | "
            f"{100 * rel[(stage, w, g)]:+.2f}% |"
        )
    print("\nZeRO-2 (bf16 compute):\n")
    print("| gradients | gradient exchange (MiB) | vs fp32 | loss | vs fp32 gradients |")
    print("|---|---|---|---|---|")
    for g in ("fp32", "int8"):
        r, twin = res[(2, "bf16", g)], res[(2, "bf16", "fp32")]
        print(
            f"| {g} | {r['bytes']['grads'] / 2**20:.3f} | {r['bytes']['grads'] / twin['bytes']['grads']:.3f} | "
            f"{r['last']:.4f} | {100 * rel[(2, 'bf16', g)]:+.2f}% |"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for stage, w, g in [
            (2, "bf16", "fp32"),
            (2, "bf16", "int8"),
            (3, "bf16", "fp32"),
            (3, "bf16", "int8"),
            (3, "int8", "fp32"),
            (3, "int8", "int8"),
        ]:
            if (stage, w, g) not in res:
                continue
            ax.plot(
                res[(stage, w, g)]["losses"],
                lw=1,
                ls="-" if g == "fp32" else "--",
                label=f"ZeRO-{stage}, {w} weights, {g} gradients",
            )
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/byte)")
        ax.set_title("GPT, AdamW: int8 gradient exchange (qgZ) vs fp32")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    if args.json:
        key = lambda k: "/".join(map(str, k))
        with open(args.json, "w") as f:
            json.dump(
                {"runs": {key(k): v for k, v in res.items()}, "relative": {key(k): v for k, v in rel.items()}},
                f,
                default=float,
            )
    return {"runs": res, "relative": rel}


if __name__ == "__main__":
    main()
