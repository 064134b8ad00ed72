"""bf16 optimizer state and masters against fp32 ones: memory, step time and loss curves.

The experiments' GPT (zj.models.gpt) and a small package Llama (zj.models.llama), each
trained at stage 3 in bf16 compute on 8 simulated CPU devices, the same data and initial
weights, with (1) fp32 masters and moments, (2) bf16 moments, (3) bf16 moments and bf16
masters rounded to nearest (DeepSpeed's ``bf16_master_weights_and_grads``), (4) the same
rounded stochastically. Prints a markdown table per model: state bytes per device (from the
arrays), the compiled step's bytes (``memory_analysis``), the median step time, and the
loss curve's distance from run (1):

    python experiments/state_dtypes.py [--steps 300 --lr 1e-3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt, llama  # noqa: E402

RUNS = {
    "fp32 masters + moments": {},
    "bf16 moments": {"optimizer": "bfloat16"},
    "+ bf16 masters, nearest": {"optimizer": "bfloat16", "masters": "bfloat16"},
    "+ bf16 masters, stochastic": {"optimizer": "bfloat16", "masters": "bfloat16", "rounding": "stochastic"},
}


def models(args) -> dict:
    return {
        "GPT": (
            gpt.GPTConfig(vocab=256, seq_len=64, d_model=args.d_model, n_layers=args.layers, n_heads=4),
            gpt.init,
            gpt.make_loss,
        ),
        "Llama": (
            llama.LlamaConfig(
                vocab=256,
                d_model=args.d_model,
                n_layers=args.layers,
                n_heads=4,
                n_kv_heads=2,
                d_ff=2 * args.d_model + 32,
                seq_len=64,
            ),
            llama.init,
            llama.make_loss,
        ),
    }


def run(model, state_dtypes: dict, args) -> dict:
    cfg, init, make_loss = model
    graphdef, params = init(cfg, 0)
    tx = optax.adamw(args.lr, weight_decay=0.01)
    mesh = zj.make_mesh()
    zc = zj.ZeroConfig(stage=3, compute_dtype="bfloat16", grad_clip=1.0, state_dtypes=state_dtypes)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(make_loss(graphdef), tx, mesh=mesh, config=zc)
    stream = data.windows(data.stdlib_bytes(), args.batch, cfg.seq_len, seed=0)
    first = next(stream)
    compiled = zj.report.compiled_bytes(step.lower(state, first).compile())
    arrays = zj.report.state_bytes_per_device(state)
    losses, times = [], []
    batch = first
    for _ in range(args.steps):
        t = time.perf_counter()
        state, m = step(state, batch)
        losses.append(float(m["loss"]))  # waits for the step
        times.append(time.perf_counter() - t)
        batch = next(stream)
    return {
        "losses": np.asarray(losses),
        "step_ms": 1e3 * float(np.median(times[5:])),
        "opt_bytes": arrays["opt_state"],
        "param_bytes": arrays["params"],
        "state_bytes": arrays["total"],
        "compiled": compiled["total"],
        "argument": compiled["argument"],
    }


def table(name: str, results: dict, window: int) -> str:
    base = results["fp32 masters + moments"]
    rows = [
        f"**{name}** (stage 3, bf16 compute; per device)",
        "",
        "| run | masters (B) | optimizer state (B) | state total (B) | compiled step (B) | step (ms) "
        f"| mean loss, last {window} | mean abs loss distance from fp32 | same, last {window} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run_name, r in results.items():
        dist = np.abs(r["losses"] - base["losses"])
        rows.append(
            f"| {run_name} | {r['param_bytes']:,} | {r['opt_bytes']:,} | {r['state_bytes']:,} | {r['compiled']:,} "
            f"| {r['step_ms']:.1f} | {r['losses'][-window:].mean():.4f} | {dist.mean():.4f} "
            f"| {dist[-window:].mean():.4f} |"
        )
    return "\n".join(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--window", type=int, default=50)
    args = ap.parse_args(argv)
    out = {}
    for name, model in models(args).items():
        out[name] = {run_name: run(model, sd, args) for run_name, sd in RUNS.items()}
        print(table(name, out[name], min(args.window, args.steps)), "\n", flush=True)
    return out


if __name__ == "__main__":
    main()
