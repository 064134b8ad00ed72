"""A partial offload (``Offload(ratio=r)``, DeepSpeed's Twin-Flow) on the experiments' GPT: per
ratio, the share of the optimizer state taken, the bytes each device keeps in device and host
memory, the compiled step's device total, the difference from the run without offload, and
the step time relative to it (interleaved).

The share moves in whole groups of leaves (the GPT's layer stack is one leaf per weight kind),
so the row gives the share taken beside the one asked for. Host bytes are checked against
``share x`` the full offload's host bytes. On simulated CPU devices host and device memory are
the same RAM, so the time column shows only the cost of the split program; the GPU rows come
from ``experiments/gpu_throughput.py --offload ...,ratio0.5``.

    python experiments/partial_offload.py [--d-model 256 --layers 8 --batch 16 --steps 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings

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


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_gpt_args(ap, d_model=256, layers=8, batch=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ratios", default="0.1,0.25,0.5,0.75,1", help="Offload.ratio values, one row each")
    ap.add_argument("--places", default="host,device", help="Offload.update values")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    graphdef, params = gpt.init(cfg)
    psi, n = cfg.num_params(), len(jax.devices())
    mesh, tx = zj.make_mesh(), optax.adamw(1e-3)
    loss_fn = gpt.make_loss(graphdef)
    stream = data.windows(data.stdlib_bytes(1 << 20), args.batch, cfg.seq_len)
    batches = [next(stream) for _ in range(args.steps)]
    plain = zj.ZeroConfig(stage=args.stage, compute_dtype=args.dtype)
    full = zj.report.state_bytes_per_device(
        zj.abstract_state(
            params, tx, mesh=mesh, config=dataclasses.replace(plain, offload=zj.config.Offload(optimizer=True))
        )
    )
    rows = []
    cases = [(float(r), p) for p in args.places.split(",") for r in args.ratios.split(",")]
    progress = bar(len(cases), "partial offload")
    for ratio, place in cases:
        zc = dataclasses.replace(plain, offload=zj.config.Offload(optimizer=True, update=place, ratio=ratio))
        runs = []
        for c in (plain, zc):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the share taken is a column of its own
                state = zj.init_state(params, tx, mesh=mesh, config=c)
            step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=c)
            mem = zj.report.step_memory(loss_fn, params, tx, batches[0], mesh=mesh, config=c)
            runs.append({"state": state, "step": step, "mem": mem, "times": [], "losses": []})
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
        got = zj.report.state_bytes_per_device(off["state"])
        split = off["state"].plan.offload_split
        share = 1.0 if split is None else split.share
        scalars = sum(x.dtype.itemsize for x in jax.tree.leaves(off["state"].opt_state) if x.ndim == 0)
        t = lambda r: statistics.median(r["times"][1:] or r["times"])  # the first step compiles
        rows.append(
            {
                "ratio": ratio,
                "share": share,
                "place": off["step"].update_place(off["state"]),
                "device": got["device"],
                "host": got["host"],
                "formula_host": share * (full["host"] - scalars) + (scalars if split is None else 0),
                "step_device_total": off["mem"].device_total,
                "plain_step_total": base["mem"].total,
                "max_loss_diff": max(abs(a - b) for a, b in zip(base["losses"], off["losses"])),
                "max_abs_diff": diff,
                "time_ratio": t(off) / t(base),
            }
        )
        progress.update(1)
    progress.close()
    print(
        f"GPT d{args.d_model} L{args.layers} ({psi:,} parameters), batch {args.batch} x {cfg.seq_len}, AdamW, "
        f"stage {args.stage} {args.dtype}, {n} x {jax.devices()[0].platform}, jax {jax.__version__}; "
        f"{args.steps} steps beside the same run without offload; per device\n"
    )
    print(
        "| ratio asked | share taken | update on | state on device | state in host memory (share x full "
        "offload's) | compiled step, device total (without offload) | max abs diff: loss, params | "
        "step time vs without |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['ratio']:g} | {r['share']:.3f} | {r['place']} | {r['device'] / MIB:.3f} MiB | "
            f"{r['host'] / MIB:.3f} MiB ({r['formula_host'] / MIB:.3f}) | {r['step_device_total'] / MIB:.2f} MiB "
            f"({r['plain_step_total'] / MIB:.2f}) | {r['max_loss_diff']:.1e}, {r['max_abs_diff']:.1e} | "
            f"{r['time_ratio']:.2f} |"
        )
    return rows


if __name__ == "__main__":
    main()
