"""Stage 3 with and without prefetch on the experiments' GPT: step time against stage 0 and
against prefetch=0 (interleaved, in one run), and what the compiled program shows: whether
the layer loops' gathers wait for their matmuls, temporaries, gather traffic.

On simulated CPU devices the collectives are memory copies on the same cores as the
compute, so nothing overlaps and the ratios show prefetch's cost (its backward recomputes
each layer, as remat="full" does), not its benefit; the benefit needs a GPU
(``experiments/gpu_throughput.py --prefetch 0,1``).

    python experiments/prefetch.py [--d-model 256 --layers 8 --batch 16 --repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import harness  # noqa: E402
from experiments.progress import bar  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.report import hlo  # noqa: E402

MIB = 2**20
RUNS = [
    ("0", 0, 0, "none"),
    ("3", 3, 0, "none"),
    ("3", 3, 0, "full"),
    ("3, prefetch 1", 3, 1, "none"),
    ("3, prefetch 2", 3, 2, "none"),
]


def loop_independence(text: str) -> tuple[int, int]:
    """(independent, all) pairs of (all-gather, matmul) in the layer loops that have both."""
    prog = hlo.parse(text)
    pairs = [prog.independent(b, g, m) for b in prog.loop_bodies() for g in prog.gathers(b) for m in prog.matmuls(b)]
    return sum(pairs), len(pairs)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_gpt_args(ap, d_model=256, layers=8, batch=16)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per configuration, interleaved")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    graphdef, params = gpt.init(cfg)
    psi = cfg.num_params()
    mesh, tx = zj.make_mesh(), optax.adamw(1e-3)
    stream = data.windows(data.stdlib_bytes(1 << 20), args.batch, cfg.seq_len)
    batch = next(stream)
    rows, steps = [], []
    progress = bar(len(RUNS) * (args.repeats + 1), "prefetch")
    for name, stage, pf, remat in RUNS:
        zc = zj.ZeroConfig(stage=stage, prefetch=pf, remat=remat)
        state = zj.init_state(params, tx, mesh=mesh, config=zc)
        step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
        compiled = step.lower(state, batch).compile()
        indep, pairs = loop_independence(compiled.as_text())
        rep = zj.report.communication_report(compiled)
        state, m = step(state, batch)  # compile and warm up
        float(m["loss"])
        rows.append(
            {
                "run": name,
                "stage": stage,
                "prefetch": pf,
                "remat": remat,
                "temp": zj.report.compiled_bytes(compiled)["temp"],
                "independent": indep,
                "pairs": pairs,
                "gathers": rep.get("all-gather:f32", {}).get("count", 0),
                "gather_traffic": rep.get("all-gather:f32", {}).get("zero_bytes", 0) / (4 * psi),
                "times": [],
            }
        )
        steps.append([step, state])
        progress.update(1)
    for _ in range(args.repeats):  # interleaved: every configuration sees the same machine
        for row, pair in zip(rows, steps):
            t0 = time.perf_counter()
            pair[1], m = pair[0](pair[1], batch)
            float(m["loss"])
            row["times"].append(time.perf_counter() - t0)
            progress.update(1)
    progress.close()
    base = statistics.median(rows[0]["times"])
    no_prefetch = statistics.median(rows[1]["times"])
    for r in rows:
        r["step_s"] = statistics.median(r["times"])
        r["vs_stage0"] = r["step_s"] / base
        r["vs_prefetch0"] = r["step_s"] / no_prefetch
    print(
        f"GPT d{args.d_model} L{args.layers} ({psi:,} parameters), batch {args.batch} x 64, AdamW, "
        f"{len(jax.devices())} x {jax.devices()[0].platform}, jax {jax.__version__}; median of {args.repeats} "
        "interleaved steps\n"
    )
    print(
        "| stage | remat | step time | vs stage 0 | vs stage 3, prefetch 0 | gathers independent of the "
        "loop's matmuls | compiled temp | all-gathers | gather traffic |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['remat']} | {1e3 * r['step_s']:.1f} ms | {r['vs_stage0']:.2f} | "
            f"{r['vs_prefetch0']:.2f} | {r['independent']} of {r['pairs']} | {r['temp'] / MIB:.2f} MiB | "
            f"{r['gathers']} | {r['gather_traffic']:.2f}Ψ |"
        )
    return rows


if __name__ == "__main__":
    main()
