"""ZeRO-Offload on the experiments' GPT: where the state lives, what each device keeps, and
that training is unchanged.

For each configuration (stage, compute dtype, what is offloaded, where the update runs) the
script trains ``--steps`` steps beside the same run without offload, and prints: the
per-device bytes in device and host memory (from the arrays' ``addressable_shards`` and
memory kinds) against the ZeRO formulas, the compiled step's device total
(``zj.report.step_memory``), the largest parameter difference from the run without offload, and
the step time relative to it (interleaved). The last row measures, the same way, stage 3
against stage 2 without offload: how far two programs that compute the same thing in a
different order drift apart (AdamW turns the rounding noise of a gradient that is zero in
exact arithmetic, the attention key bias's, into steps of the learning rate's size).

On simulated CPU devices host and device memory are the same RAM and moves between them
are no-ops, so the time column shows the cost of the extra program structure only; the
GPU figures come from ``experiments/gpu_throughput.py`` (offload rows).

    python experiments/offload.py [--d-model 256 --layers 8 --batch 16 --steps 4]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from experiments import harness  # noqa: E402
from experiments.progress import bar  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402

MIB = 2**20
# (stage, compute dtype, offload_optimizer, offload_params, offload_update). The last row is
# the yardstick for the difference column: stage 3 against stage 2, neither offloaded (two
# programs that compute the same thing in a different order).
RUNS = [
    (1, "float32", True, False, "host"),
    (2, "bfloat16", True, False, "host"),
    (2, "bfloat16", True, False, "device"),
    (3, "bfloat16", True, False, "host"),
    (3, "bfloat16", True, True, "host"),
    (3, "bfloat16", True, True, "device"),
    (3, "bfloat16", False, False, "stage 2"),
]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_gpt_args(ap, d_model=256, layers=8, batch=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--runs", default=",".join(map(str, range(len(RUNS)))), help="which rows (indices) to run")
    ap.add_argument("--group-size", type=int, default=1_000_000, help="offload_group_size of the device update")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    graphdef, params = gpt.init(cfg)
    psi, n = cfg.num_params(), len(jax.devices())
    mesh, tx = zj.make_mesh(), optax.adamw(1e-3)
    loss_fn = gpt.make_loss(graphdef)
    stream = data.windows(data.stdlib_bytes(1 << 20), args.batch, cfg.seq_len)
    batches = [next(stream) for _ in range(args.steps)]
    rows = []
    selected = [RUNS[int(i)] for i in args.runs.split(",")]
    progress = bar(len(selected), "offload")
    for stage, dtype, opt, par, place in selected:
        plain = zj.ZeroConfig(stage=stage, compute_dtype=dtype)
        if place == "stage 2":  # the yardstick row
            plain, zc = dataclasses.replace(plain, stage=2), plain
        else:
            zc = dataclasses.replace(
                plain, offload=zj.config.Offload(optimizer=opt, params=par, update=place, group_size=args.group_size)
            )
        runs = []
        for c in (plain, zc):
            state = zj.init_state(params, tx, mesh=mesh, config=c)
            step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=c)
            mem = zj.report.step_memory(loss_fn, params, tx, batches[0], mesh=mesh, config=c)
            bytes_ = zj.report.state_bytes_per_device(state)
            runs.append({"state": state, "step": step, "mem": mem, "bytes": bytes_, "times": [], "losses": []})
        for b in batches:  # interleaved: both runs see the same machine
            for r in runs:
                t0 = time.perf_counter()
                r["state"], m = r["step"](r["state"], b)
                r["losses"].append(float(m["loss"]))
                r["times"].append(time.perf_counter() - t0)
        base, off = runs
        diff = max(
            float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
            for a, b in zip(
                jax.tree.leaves(zj.gather_params(base["state"])), jax.tree.leaves(zj.gather_params(off["state"]))
            )
        )
        formula = {
            m: zj.report.zero_formula_bytes(
                psi, n, stage, compute_dtype=dtype, offload_optimizer=opt, offload_params=par, memory=m
            )
            for m in ("device", "host")
        }
        t = lambda r: statistics.median(r["times"][1:] or r["times"])  # the first step compiles
        rows.append(
            {
                "stage": stage,
                "dtype": dtype,
                "offload_optimizer": opt,
                "offload_params": par,
                "place": place if place == "stage 2" else off["step"].update_place(off["state"]),
                "max_loss_diff": max(abs(a - b) for a, b in zip(base["losses"], off["losses"])),
                "device": off["bytes"]["device"],
                "host": off["bytes"]["host"],
                "formula_device": formula["device"],
                "formula_host": formula["host"],
                "plain_device": base["bytes"]["device"],
                "step_device_total": off["mem"].device_total,
                "plain_step_total": base["mem"].total,
                "max_abs_diff": diff,
                "time_ratio": t(off) / t(base),
            }
        )
        progress.update(1)
    progress.close()
    print(
        f"GPT d{args.d_model} L{args.layers} ({psi:,} parameters), batch {args.batch} x {cfg.seq_len}, AdamW, "
        f"{n} x {jax.devices()[0].platform}, jax {jax.__version__}; {args.steps} steps beside the same run "
        f"without offload; per device\n"
    )
    print(
        "| stage | compute | offloaded | update on | state on device (formula) | without offload | "
        "state in host memory (formula) | compiled step, device total (without offload) | "
        "max abs diff: loss, params | step time vs without |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        what = "optimizer + params" if r["offload_params"] else "optimizer" if r["offload_optimizer"] else "nothing"
        place = r["place"]
        if place == "stage 2":
            what, place = "nothing (yardstick: compared with stage 2)", "device"
        print(
            f"| {r['stage']} | {r['dtype']} | {what} | {place} | {r['device'] / MIB:.3f} MiB "
            f"({r['formula_device'] / MIB:.3f}) | {r['plain_device'] / MIB:.3f} MiB | {r['host'] / MIB:.3f} MiB "
            f"({r['formula_host'] / MIB:.3f}) | {r['step_device_total'] / MIB:.2f} MiB "
            f"({r['plain_step_total'] / MIB:.2f}) | {r['max_loss_diff']:.1e}, {r['max_abs_diff']:.1e} | "
            f"{r['time_ratio']:.2f} |"
        )
    return rows


if __name__ == "__main__":
    main()
