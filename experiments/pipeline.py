"""The pipeline's cost on 8 simulated devices: FLOPs against the bubble formula, collective
bytes by mesh axis, memory and step time, for ``P`` stages x ``M`` micro-batches.

The GPT of the demo at d512 L16 (stage 3, float32, SGD), one global batch on every row,
``P = 1`` (8 data devices, no pipeline), 2, 4 and 8 stages (``8 / P`` data devices each),
``M = P`` and ``2P`` (GPipe), and the circular schedule at ``M = P`` with ``--repeats`` rounds
``R`` (its bubble ``(P - 1) / (R·P + P - 1)``). Per device and step:

* FLOPs from the compiled program with every loop iteration counted
  (:func:`zerojax.tuning.hlo_cost.loop_cost`), as a ratio to ``P = 1``'s, beside the
  formula: the stack's share ``s`` runs ``(M + P - 1) / M`` times its work (the bubble ticks
  compute on padding), the layers before and after it (share ``o = 1 - s``, embeddings and
  head) run on every stage, ``P`` times: ``s·(M + P - 1)/M + o·P``;
* collective bytes by mesh axis (:func:`zerojax.report.communication_report`);
* temp and total bytes from ``compiled.memory_analysis()`` (argument + output - alias +
  temp);
* step time, the median of ``--steps`` runs after one untimed, all configurations side by
  side in one process (a CPU's simulated devices share its cores: a ratio, not a GPU's
  figure).

    python experiments/pipeline.py [--d-model 512 --layers 16 --seq 32 --batch 32 --steps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.report.comm import communication_report  # noqa: E402
from zerojax.report.memory import compiled_bytes  # noqa: E402
from zerojax.tuning.hlo_cost import loop_cost  # noqa: E402

MIB = 2**20


def stack_share(cfg: gpt.GPTConfig) -> float:
    """The layer stack's share of the model's training FLOPs per token (the head's matmul is
    the rest; embeddings are lookups): from ``GPTConfig.flops_per_token``'s terms."""
    d, L, V, T, m = cfg.d_model, cfg.n_layers, cfg.vocab, cfg.seq_len, cfg.mlp_ratio
    stack = 6 * L * (4 * d * d + 2 * m * d * d) + 12 * L * T * d
    return stack / (stack + 6 * d * V)


def measure(cfg: gpt.GPTConfig, P: int, M: int, batch: dict, steps: int, schedule: str = "gpipe", R: int = 1) -> dict:
    graphdef, params = gpt.init(cfg)
    loss_fn, tx = gpt.make_loss(graphdef), optax.sgd(0.1)
    mesh = zj.make_mesh(pipeline=P)
    config = zj.ZeroConfig(stage=3, pipeline={"microbatches": M, "schedule": schedule, "repeats": R})
    state = zj.init_state(params, tx, mesh=mesh, config=config)
    step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=config)
    compiled = step.lower(state, batch).compile()
    comm = communication_report(compiled, mesh=mesh)["by_axis"]
    state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    mem = compiled_bytes(compiled)
    return {
        "flops": loop_cost(compiled).flops,
        "data": comm.get("data", {}).get("bytes", 0),
        "pipeline": comm.get("pipeline", {}).get("bytes", 0),
        "temp": mem["temp"],
        "total": mem["total"],
        "ms": 1e3 * statistics.median(times),
        "loss": float(m["loss"]),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--schedules", default="gpipe,circular", help="gpipe (M = P, 2P) and/or circular (M = P)")
    ap.add_argument("--repeats", type=int, nargs="+", default=[2], help="the circular schedule's rounds R")
    args = ap.parse_args(argv)
    cfg = gpt.GPTConfig(vocab=256, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    rng = np.random.default_rng(0)
    batch = {"tokens": jax.numpy.asarray(rng.integers(0, 256, (args.batch, args.seq + 1)))}
    s = stack_share(cfg)
    rows = []
    schedules = args.schedules.split(",")
    for P in args.stages:
        runs = [("gpipe", 1, 1)] if P == 1 else []
        if P > 1 and "gpipe" in schedules:
            runs += [("gpipe", P, 1), ("gpipe", 2 * P, 1)]
        if P > 1 and "circular" in schedules:
            runs += [("circular", P, R) for R in args.repeats if args.layers % (P * R) == 0]
        for schedule, M, R in runs:
            rows.append((P, M, R, measure(cfg, P, M, batch, args.steps, schedule, R)))
            print(f"measured P={P} M={M} {schedule} R={R}", file=sys.stderr, flush=True)
    base = rows[0][3]
    print(
        f"GPT d{args.d_model} L{args.layers}, seq {args.seq}, global batch {args.batch}, stage 3, 8 simulated CPU "
        f"devices (data = 8 / P); stack share of the FLOPs s = {s:.4f}\n"
    )
    print(
        "| P | M | R (circular) | bubble (P-1)/(RM+P-1) | FLOPs / P=1's | formula s(RM+P-1)/(RM) + (1-s)P | "
        "data-axis MiB | pipeline-axis MiB | temp MiB | total MiB | ms/step | x P=1 | loss |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for P, M, R, r in rows:
        formula = s * (R * M + P - 1) / (R * M) + (1 - s) * P
        print(
            f"| {P} | {M} | {R if R > 1 else ''} | {(P - 1) / (R * M + P - 1):.3f} | {r['flops'] / base['flops']:.3f} | "
            f"{formula:.3f} | "
            f"{r['data'] / MIB:.2f} | {r['pipeline'] / MIB:.2f} | {r['temp'] / MIB:.1f} | {r['total'] / MIB:.1f} | "
            f"{r['ms']:.0f} | {r['ms'] / base['ms']:.2f} | {r['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
