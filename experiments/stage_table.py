"""Per-device state bytes, compiled temp memory and traffic of every ZeRO stage, for one GPT.

Prints a markdown table (the one in docs/stages.md):

    python experiments/stage_table.py [--layers 8 --d-model 256 --batch 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import harness  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402

FORMULA = {0: "12Ψ", 1: "4Ψ + 8Ψ/N", 2: "4Ψ + 8Ψ/N", 3: "12Ψ/N"}
MIB = 2**20


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_gpt_args(ap, d_model=256, layers=8, batch=8, seq_len=64)
    ap.add_argument("--vocab", type=int, default=256)
    args = ap.parse_args(argv)

    cfg = harness.gpt_config(args, vocab=args.vocab)
    graphdef, params = gpt.init(cfg)
    loss_fn = gpt.make_loss(graphdef)
    psi = cfg.num_params()
    mesh = zj.make_mesh()
    n = mesh.devices.size
    tx = optax.adamw(1e-3)
    batch = next(data.windows(data.stdlib_bytes(1 << 20), args.batch, cfg.seq_len))
    print(
        f"GPT {cfg}: Ψ = {psi:,} parameters ({4 * psi / MIB:.2f} MiB fp32), N = {n} devices "
        f"({jax.devices()[0].platform}), AdamW, batch {args.batch} x {cfg.seq_len} tokens, "
        f"jax {jax.__version__}\n"
    )
    print(
        "| stage | state per device (arrays) | formula | compiled temp | compiled total | "
        "traffic per device per step | collectives (executions per step) |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for stage in range(4):
        zc = zj.ZeroConfig(stage=stage)
        state = zj.init_state(params, tx, mesh=mesh, config=zc)
        step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=zc)
        compiled = step.lower(state, batch).compile()
        got = zj.report.state_bytes_per_device(state)["total"]
        want = zj.report.zero_formula_bytes(psi, n, stage)
        mem = zj.report.compiled_bytes(compiled)
        rep = zj.report.communication_report(compiled)
        traffic = rep["total"]["zero_bytes"] / (4 * psi)
        kinds = ", ".join(
            f"{k.split(':')[0]} ×{v['count']}" for k, v in rep.items() if k != "total" and v["bytes"] > 1e-3 * 4 * psi
        )  # not the scalars
        print(
            f"| {stage} | {got / MIB:.2f} MiB | {FORMULA[stage]} = {want / MIB:.2f} MiB | "
            f"{mem['temp'] / MIB:.2f} MiB | {mem['total'] / MIB:.2f} MiB | {traffic:.2f}Ψ | {kinds} |"
        )
        rows.append(
            {
                "stage": stage,
                "state": got,
                "formula": want,
                "temp": mem["temp"],
                "total": mem["total"],
                "traffic": traffic,
                "report": rep,
                "psi": psi,
            }
        )
        del state, step, compiled
    return rows


if __name__ == "__main__":
    main()
