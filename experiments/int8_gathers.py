"""Stage 3 with int8 weight gathers (ZeRO++'s qwZ) against bf16 and fp32 gathers.

Two parts, on 8 simulated CPU devices:

* traffic: the compiled step's all-gather bytes per device per step, by dtype, for
  gathers in fp32, bf16 and int8 (``communication_report``; XLA's CPU backend runs bf16
  collectives in fp32, so the bf16 row is read from the lowered program, at the dtype
  zerojax asks for, as ``comm.py`` does);
* loss: the GPT trained ``--steps`` steps (bf16 compute, same data and initial weights)
  with bf16 gathers and with int8 gathers; the table gives the loss every few steps and the
  last-10-step means; ``--plot`` draws both curves.

    python experiments/int8_gathers.py [--steps 300 --plot docs/img/int8_gathers_loss.png]
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

GATHERS = harness.GATHERS


def build(cfg: gpt.GPTConfig, kw: dict) -> tuple[zj.ZeroState, zj.TrainStep]:
    """The trained setup: ZeRO-3 with ``kw``'s gathers, AdamW with weight decay, clip 1.0."""
    graphdef, params = gpt.init(cfg, 0)
    tx = optax.adamw(3e-3, weight_decay=0.01)
    mesh, zc = zj.make_mesh(), zj.ZeroConfig(stage=3, grad_clip=1.0, **kw)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    return state, zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)


def gather_traffic(cfg: gpt.GPTConfig, batch: int, runs: dict[str, tuple]) -> dict[str, dict]:
    """All-gather bytes per device per step for each gather dtype, read from the compiled
    step of ``runs[name]`` (the step that then trains: its call reuses this compile) or,
    for a dtype not trained, of :func:`build`'s."""
    tokens = next(data.windows(data.stdlib_bytes(1 << 20), batch, cfg.seq_len))
    out = {}
    for name, kw in GATHERS.items():
        state, step = runs[name] if name in runs else build(cfg, kw)
        rep = zj.report.communication_report(step.lower(state, tokens).compile())
        by_dtype = {k.split(":")[1]: v["bytes"] for k, v in rep.items() if k.startswith("all-gather:")}
        if name == "bf16":  # the CPU backend widens bf16 collectives: count them as asked
            by_dtype = {"bf16": by_dtype.get("f32", 0) // 2}
        out[name] = by_dtype
    return out


def train(run: tuple, steps: int, batch: int, seq_len: int, progress) -> list[float]:
    state, step = run
    stream = data.windows(data.stdlib_bytes(), batch, seq_len, seed=0)
    losses = []
    for _ in range(steps):
        state, m = step(state, next(stream))
        losses.append(float(m["loss"]))
        progress.update(1)
    return losses


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    harness.add_gpt_args(ap, d_model=128, layers=2, batch=16)
    ap.add_argument("--plot", default=None, help="write the two loss curves to this PNG")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args, head_dim=32)
    runs = {name: build(cfg, GATHERS[name]) for name in ("bf16", "int8")}
    traffic = gather_traffic(cfg, args.batch, runs)
    progress = bar(2 * args.steps, "int8_gathers")
    losses = {name: train(runs.pop(name), args.steps, args.batch, cfg.seq_len, progress) for name in ("bf16", "int8")}
    progress.close()
    psi = cfg.num_params()
    print(
        f"GPT d{args.d_model} L{args.layers} ({psi:,} parameters), ZeRO-3, AdamW 3e-3, clip 1.0, batch "
        f"{args.batch} x {cfg.seq_len}, {len(jax.devices())} x {jax.devices()[0].platform}, jax {jax.__version__}; "
        f"int8 blocks of {zj.ZeroConfig().collectives.gather_block_size}\n"
    )
    fp32 = sum(traffic["fp32"].values())
    print("| gathers | all-gather bytes per device per step | by dtype | vs fp32 |")
    print("|---|---|---|---|")
    for name, by in traffic.items():
        total = sum(by.values())
        parts = ", ".join(f"{d} {b / 2**20:.3f} MiB" for d, b in sorted(by.items()))
        print(f"| {name} | {total / 2**20:.3f} MiB | {parts} | {total / fp32:.3f} |")
    print("\n| step | bf16 gathers | int8 gathers |")
    print("|---|---|---|")
    every = max(1, args.steps // 6)
    for i in list(range(0, args.steps, every)) + [args.steps - 1]:
        print(f"| {i} | {losses['bf16'][i]:.4f} | {losses['int8'][i]:.4f} |")
    last = {k: float(np.mean(v[-10:])) for k, v in losses.items()}
    rel = last["int8"] / last["bf16"] - 1
    print(
        f"\nmean loss of the last 10 steps: bf16 gathers {last['bf16']:.4f}, int8 gathers {last['int8']:.4f} "
        f"({100 * rel:+.2f}%)"
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, ls in losses.items():
            ax.plot(ls, label=f"{name} gathers", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/byte)")
        ax.set_title(f"ZeRO-3 GPT, bf16 compute: int8 vs bf16 weight gathers ({100 * rel:+.2f}%)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    out = {"traffic": traffic, "losses": losses, "last": last, "relative": rel}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, default=float)
    return out


if __name__ == "__main__":
    main()
