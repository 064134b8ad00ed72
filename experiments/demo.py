"""zerojax demo: a GPT trained with ZeRO-3, and the per-device memory of every stage.

With no accelerator, JAX runs on 8 simulated CPU devices.

    python experiments/demo.py [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402


def memory_table(params, tx, mesh) -> None:
    psi = sum(x.size for x in jax.tree.leaves(params))
    n = mesh.devices.size
    print(f"\nPersistent state per device, fp32 params + AdamW, Ψ = {psi:,} params, N = {n}")
    print(f"{'stage':>5} | {'measured (arrays)':>18} | {'formula':>18} | formula text")
    texts = {0: "12Ψ", 1: "4Ψ + 8Ψ/N", 2: "4Ψ + 8Ψ/N", 3: "12Ψ/N"}
    for stage in range(4):
        state = zj.init_state(params, tx, mesh=mesh, config=zj.ZeroConfig(stage=stage))
        got = zj.report.state_bytes_per_device(state)["total"]
        want = zj.report.zero_formula_bytes(psi, n, stage)
        print(f"{stage:>5} | {got / 2**20:>14.2f} MiB | {want / 2**20:>14.2f} MiB | {texts[stage]}")
        del state


def traffic_table(report, params) -> None:
    """ZeRO-3's bytes per device per step from the compiled step, in units of Ψ (fp32
    parameter bytes), beside the paper's 3Ψ and what makes them differ."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    psi = sum(x.size for _, x in leaves)
    # A bias's gradient is the sum of its output's gradient and an embedding's is a scatter of
    # it: backward reads neither value, so stage 3 gathers them once, in forward only.
    names = lambda path: {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
    once = sum(x.size for path, x in leaves if names(path) & {"bias", "embedding", "wpe"})
    unit = lambda kind: sum(r["zero_bytes"] for k, r in report.items() if k.startswith(kind)) / (4 * psi)
    gathered, reduced = unit("all-gather"), unit("reduce-scatter")
    print(
        f"\nZeRO-3 traffic per device per step: {report['total']['zero_bytes'] / (4 * psi):.2f}Ψ "
        f"= all-gather {gathered:.3f}Ψ + reduce-scatter {reduced:.3f}Ψ (+ a scalar all-reduce)"
    )
    print(
        f"paper: 3Ψ = all-gather in forward (Ψ) + again in backward (Ψ) + reduce-scatter (Ψ). Here the "
        f"biases and embeddings ({once:,} of {psi:,} parameters, {once / psi:.3f}Ψ) are gathered in forward "
        f"only: their gradients do not read their values. 3Ψ - {once / psi:.3f}Ψ = {3 - once / psi:.3f}Ψ."
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)

    mesh = zj.make_mesh()
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}")
    cfg = gpt.GPTConfig(vocab=256, seq_len=64, d_model=128, n_layers=4, n_heads=4)
    graphdef, params = gpt.init(cfg)
    tx = optax.adamw(3e-3, weight_decay=0.01)
    memory_table(params, tx, mesh)

    zero = zj.ZeroConfig(stage=3)
    state = zj.init_state(params, tx, mesh=mesh, config=zero)
    train_step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zero)
    stream = data.windows(data.stdlib_bytes(), args.batch, cfg.seq_len)
    first = next(stream)
    report = zj.report.communication_report(train_step.lower(state, first).compile())
    traffic_table(report, params)

    print(f"\nTraining a {cfg.num_params():,}-parameter GPT with ZeRO-3 on the stdlib's source bytes")
    history = zj.monitor.History()
    monitor = zj.monitor.Monitor(
        [zj.monitor.Console(every=10), history],
        tokens_per_step=args.batch * cfg.seq_len,
        flops_per_token=cfg.flops_per_token(),
    )
    step = monitor.watch(train_step)  # prints a line every 10 steps, read a step late
    batch = first
    for _ in range(args.steps):
        state, metrics = step(state, batch)
        batch = next(stream)
    monitor.close()
    losses, seconds = history.values("loss"), history.values("step_time_s")
    print(f"\nloss {losses[0]:.3f} -> {np.mean(losses[-5:]):.3f} (mean of last 5 steps)")
    if len(seconds) > 1:
        tokens = history.values("tokens_per_s")
        print(
            f"{1e3 * np.median(seconds[1:]):.1f} ms/step, {np.median(tokens[1:]):,.0f} tokens/s "
            f"(median of steps 2-{len(seconds)}; the first step's compile is its own record)"
        )


if __name__ == "__main__":
    main()
