"""What watching a run costs: ms/step of the same ZeRO-3 GPT steps with no reads at all,
with the hand-written ``float(metrics["loss"])`` after every step (a host sync that
leaves the devices idle while the next step is dispatched), and through ``zj.monitor``
(which reads step k once step k + 1 is queued). The three loops run in turns, several
rounds, side by side; medians of the per-round ms/step.

    python experiments/monitor_overhead.py [--steps 30] [--rounds 3] [--devices 8]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loops_side_by_side(
    step, state, batches, steps: int, rounds: int, tokens_per_step: int
) -> tuple[list[dict], object]:
    """ms/step of ``steps`` steps three ways (no reads, ``float(loss)`` every step,
    ``zj.monitor``), in turns for ``rounds`` rounds; medians, and the state after."""
    import jax
    import numpy as np

    import zerojax as zj

    def plain(state):
        for k in range(steps):
            state, m = step(state, batches[k % len(batches)])
        jax.block_until_ready(m["loss"])
        return state

    def synced(state):
        for k in range(steps):
            state, m = step(state, batches[k % len(batches)])
            float(m["loss"])  # the hand-written print's read: waits for this step
        return state

    def monitored(state):
        monitor = zj.monitor.Monitor(
            [zj.monitor.Console(every=10, stream=io.StringIO())], tokens_per_step=tokens_per_step
        )
        watched = monitor.watch(step)
        for k in range(steps):
            state, _ = watched(state, batches[k % len(batches)])
        monitor.close()
        return state

    loops = {"no reads": plain, "float(loss) every step": synced, "zj.monitor": monitored}
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, loop in loops.items():
            jax.block_until_ready(state)
            t = time.perf_counter()
            state = loop(state)
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - t) / steps)
    base = float(np.median(times["no reads"]))
    rows = [
        {"loop": n, "ms_per_step": 1e3 * float(np.median(v)), "ratio": float(np.median(v)) / base}
        for n, v in times.items()
    ]
    return rows, state


def table(rows: list[dict]) -> str:
    lines = ["| loop | ms/step | x no reads |", "|---|---:|---:|"]
    lines += [f"| {r['loop']} | {r['ms_per_step']:.1f} | {r['ratio']:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU backend only)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import optax

    import zerojax as zj
    from zerojax.models import gpt

    cfg = gpt.GPTConfig(vocab=256, seq_len=64, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    graphdef, params = gpt.init(cfg)
    tx = optax.adamw(1e-3)
    mesh, config = zj.make_mesh(), zj.ZeroConfig(stage=3)
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=config)
    batches = [next(zj.data.windows(zj.data.stdlib_bytes(1 << 20), 16, cfg.seq_len, seed=k)) for k in range(4)]
    state = zj.init_state(params, tx, mesh=mesh, config=config)
    state, _ = step(state, batches[0])  # compile
    rows, _ = loops_side_by_side(step, state, batches, args.steps, args.rounds, 16 * cfg.seq_len)
    print(
        f"\nZeRO-3 GPT d{args.d_model} L{args.layers}, batch 16 x {cfg.seq_len}, {mesh.devices.size} x "
        f"{jax.devices()[0].platform}, {args.steps} steps x {args.rounds} rounds (medians), jax {jax.__version__}\n"
    )
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
