"""Train the experiments' GPT with ZeRO on byte-level text from the Python standard library.

Every option of a run is a flag; the loop is ``zj.fit`` and its metrics ``zj.monitor``'s,
written to a JSON-lines log (one object per line: a ``config`` record, then ``train``
records every step and ``eval`` records on held-out text), with a progress bar. With no accelerator, ``--devices`` simulated CPU
devices stand in for GPUs.

    python experiments/train.py --stage 3 --precision bf16 --steps 300 --log run.jsonl --plot run.png
    python experiments/train.py --stage 2 --precision fp16 --remat full --devices 4 --batch 16

Requires the ``experiments`` extra (``pip install -e '.[experiments]'``: tqdm, matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRECISIONS = {
    "fp32": dict(compute_dtype="float32"),
    "bf16": dict(compute_dtype="bfloat16"),
    "fp16": dict(compute_dtype="float16", loss_scaling={"loss_scale": "dynamic"}),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    run = ap.add_argument_group("ZeRO")
    run.add_argument("--stage", type=int, choices=range(4), default=3)
    run.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="bf16",
        help="compute dtype; masters stay fp32, fp16 uses dynamic loss scaling",
    )
    run.add_argument("--remat", default="none", help="remat policy per block (zerojax.remat names)")
    run.add_argument(
        "--devices", type=int, default=8, help="simulated CPU devices when JAX runs on the CPU; on GPUs all are used"
    )
    run.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-batches")
    run.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="hybrid sharding: replica groups (state sharded over devices/replicas, see docs/hybrid.md)",
    )
    model = ap.add_argument_group("model")
    model.add_argument("--d-model", type=int, default=128)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--seq-len", type=int, default=64)
    model.add_argument(
        "--dropout", type=float, default=0.0, help="residual dropout per block (a key per step, device and micro-batch)"
    )
    opt = ap.add_argument_group("optimization")
    opt.add_argument("--steps", type=int, default=200)
    opt.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    opt.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    opt.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine decay")
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clip (0: none)")
    opt.add_argument("--seed", type=int, default=0)
    out = ap.add_argument_group("output")
    out.add_argument("--log", default=None, help="JSON-lines metrics file (default: none)")
    out.add_argument("--eval-every", type=int, default=50, help="held-out loss every N steps (0: end only)")
    out.add_argument("--eval-batches", type=int, default=4)
    out.add_argument("--plot", default=None, help="PNG of the loss curve (matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    for name in (
        "devices",
        "steps",
        "batch",
        "accum",
        "d_model",
        "layers",
        "heads",
        "seq_len",
        "eval_batches",
        "replicas",
    ):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.eval_every < 0:
        ap.error("--warmup and --eval-every must be >= 0")
    if not 0.0 <= args.dropout < 1.0:
        ap.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.devices % args.replicas:
        ap.error(f"--replicas {args.replicas} must divide --devices {args.devices}")
    if args.batch % (args.devices * args.accum):
        ap.error(f"--batch {args.batch} must be a multiple of --devices x --accum = {args.devices * args.accum}")
    return args


def setup_devices(n: int) -> None:
    """Simulated CPU devices; must run before JAX starts its backends."""
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def schedule(args: argparse.Namespace):
    import optax

    warmup = min(args.warmup, args.steps - 1)
    return optax.warmup_cosine_decay_schedule(
        0.0, args.lr, max(warmup, 1), max(args.steps, warmup + 1), end_value=args.lr / 10
    )


def train(args: argparse.Namespace) -> list[dict]:
    """Runs the training; returns the records it logged."""
    setup_devices(args.devices)
    import jax
    import optax

    import zerojax as zj
    from zerojax import data
    from zerojax.models import gpt

    platform = jax.devices()[0].platform
    devices = jax.devices()[: args.devices] if platform == "cpu" else jax.devices()
    if len(devices) < args.devices and platform == "cpu":
        raise SystemExit(f"asked for {args.devices} devices, JAX has {len(devices)}")
    if args.batch % (len(devices) * args.accum):
        raise SystemExit(f"--batch {args.batch} must be a multiple of {len(devices)} devices x --accum {args.accum}")
    cfg = gpt.GPTConfig(
        vocab=256,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        remat=args.remat,
        dropout=args.dropout,
    )
    graphdef, params = gpt.init(cfg, args.seed)
    lr = schedule(args)
    tx = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=args.weight_decay)
    zc = zj.ZeroConfig(
        stage=args.stage, grad_accum_steps=args.accum, grad_clip=args.grad_clip or None, **PRECISIONS[args.precision]
    )
    mesh = zj.make_mesh(devices, replicas=args.replicas)
    dropout = args.dropout > 0
    state = zj.init_state(params, tx, mesh=mesh, config=zc, rng=jax.random.key(args.seed) if dropout else None)
    step = zj.make_train_step(gpt.make_loss(graphdef, with_rng=dropout), tx, mesh=mesh, config=zc, with_rng=dropout)
    # Held-out loss under the run's own layout (no dropout): at stage 3 one layer is gathered at a time.
    eval_loss = zj.make_eval_step(gpt.make_loss(graphdef), mesh=mesh, config=zc)

    corpus = data.stdlib_bytes()
    split = int(len(corpus) * 0.95)
    train_stream = data.windows(corpus[:split], args.batch, cfg.seq_len, seed=args.seed)
    eval_rng = data.windows(corpus[split:], args.batch, cfg.seq_len, seed=12345)
    eval_set = [next(eval_rng) for _ in range(args.eval_batches)]

    config_record = {
        "kind": "config",
        **vars(args),
        "params": cfg.num_params(),
        "platform": platform,
        "n_devices": len(devices),
        "jax": jax.__version__,
        "zero": repr(zc),
    }
    history = zj.monitor.History()
    writers = [history]
    if args.log:
        with open(args.log, "w") as f:
            f.write(json.dumps(config_record) + "\n")
        writers.append(zj.monitor.JSONL(args.log, append=True))
    writers.append(
        zj.monitor.Console(every=args.eval_every or 50)
        if args.no_progress
        else zj.monitor.ProgressBar(args.steps, disable=False)
    )
    monitor = zj.monitor.Monitor(
        writers, tokens_per_step=args.batch * cfg.seq_len, flops_per_token=cfg.flops_per_token()
    )
    zj.fit(
        step,
        state,
        train_stream,
        steps=args.steps,
        monitor=monitor,
        eval_step=eval_loss,
        eval_data=eval_set,
        eval_every=args.eval_every,
    )
    records = [config_record, *history.records]
    if args.plot:
        plot(records, args.plot)
    return records


def plot(records: list[dict], path: str) -> None:
    """Training loss (with a moving average) and held-out loss against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cfg = next(r for r in records if r["kind"] == "config")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    steps = np.array([r["step"] for r in train])
    loss = np.array([r["loss"] for r in train])
    k = max(1, len(loss) // 25)
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=1, label="train loss (per step)")
    ax.plot(steps[k - 1 :], smooth, color="tab:blue", lw=2, label=f"train loss ({k}-step mean)")
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", color="tab:red", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(
        f"GPT {cfg['params']:,} params, ZeRO-{cfg['stage']} {cfg['precision']}, "
        f"{cfg['n_devices']} {cfg['platform']} devices, remat {cfg['remat']}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    import numpy as np

    args = parse_args(argv)
    records = train(args)
    train_recs = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    first = sum(r["loss"] for r in train_recs[:5]) / min(5, len(train_recs))
    last = sum(r["loss"] for r in train_recs[-5:]) / min(5, len(train_recs))
    skipped = int(train_recs[-1].get("skipped_steps", 0))
    print(
        f"train loss {first:.3f} -> {last:.3f} (means of first/last 5 steps); held-out loss "
        f"{evals[-1]['eval_loss']:.3f} ({evals[-1]['eval_loss'] / math.log(2):.2f} bits/byte); "
        f"{skipped} skipped steps; {np.median([r['tokens_per_s'] for r in train_recs[1:]]):,.0f} tokens/s"
    )


if __name__ == "__main__":
    main()
