"""What fault tolerance costs: a save's blocked time, async against synchronous, and the
time from a preemption notice to a resumable exit.

1. Saves. The experiments' GPT at ZeRO-3 on 8 simulated devices; ``--saves`` checkpoints
   of the same state, interleaved: ``zj.save_checkpoint(..., wait=False)`` (the default:
   it returns once the arrays are copied off the devices; the files are written in the
   background while training goes on) against ``wait=True`` (until the files are complete).
   The table gives the median seconds each call blocked, and the train step's time for
   scale.
2. Preemption. ``zerojax launch`` runs ``tests/workers/resume_job.py`` (the GPT, 4
   processes, a ``zerojax.resume.Run``); after ``--preempt-at`` steps one process gets
   ``SIGTERM``. Measured: from the signal to the launcher's exit with status 75, and the
   steps run after the signal (the processes agree on the next step boundary, save it and
   stop).

    python experiments/fault_tolerance.py [--d-model 128 --layers 4 --saves 5]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def save_table(args) -> list[str]:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import optax

    import zerojax as zj
    from zerojax.models import gpt

    cfg = gpt.GPTConfig(vocab=256, seq_len=64, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    mesh, zc = zj.make_mesh(), zj.ZeroConfig(stage=3, compute_dtype="bfloat16")
    graphdef, params = gpt.init(cfg)
    tx = optax.adamw(1e-3)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
    tokens = np.random.default_rng(0).integers(0, 256, (16, 65), dtype=np.int32)
    for _ in range(2):
        state, m = step(state, {"tokens": tokens})
    jax.block_until_ready(m["loss"])
    step_s = []
    for _ in range(3):
        t = time.perf_counter()
        state, m = step(state, {"tokens": tokens})
        jax.block_until_ready(m["loss"])
        step_s.append(time.perf_counter() - t)
    nbytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.master, state.opt_state)))
    blocked = {False: [], True: []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.saves):
            for wait in (False, True):
                target = os.path.join(d, "async" if not wait else "sync")
                t = time.perf_counter()
                zj.save_checkpoint(target, state, step=i, wait=wait, keep_last=2)
                blocked[wait].append(time.perf_counter() - t)
                zj.checkpoint.wait(target)  # the next call starts with nothing in flight
    a, s = statistics.median(blocked[False]), statistics.median(blocked[True])
    return [
        f"GPT {cfg.num_params():,} parameters, ZeRO-3 bf16 on 8 simulated CPU devices; state {nbytes / 2**20:.1f} "
        f"MiB (params, masters, AdamW moments); {args.saves} saves each, interleaved; train step "
        f"{statistics.median(step_s) * 1e3:.0f} ms.",
        "",
        "| save | blocked per save (median) | relative |",
        "|---|---:|---:|",
        f"| synchronous (`wait=True`) | {s * 1e3:.0f} ms | 1.00 |",
        f"| asynchronous (default) | {a * 1e3:.0f} ms | {a / s:.2f} |",
    ]


def preemption_table(args) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            "-m",
            "zerojax.launch",
            "--nprocs",
            "4",
            "--devices-per-proc",
            "1",
            "--",
            sys.executable,
            str(ROOT / "tests" / "workers" / "resume_job.py"),
            "--dir",
            os.path.join(d, "ck"),
            "--out",
            os.path.join(d, "out"),
            "--steps",
            "1000",
            "--save-every",
            "1000",
            "--sleep",
            str(args.step_sleep),
        ]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        pids, sent, last, after = {}, None, None, 0
        for line in p.stdout:
            if m := re.match(r"\[rank (\d+)\] process \d+ pid (\d+)", line):
                pids[int(m[1])] = int(m[2])
            if m := re.match(r"\[rank 0\] step (\d+) loss", line):
                last = int(m[1])
                if sent is None and last + 1 >= args.preempt_at:
                    os.kill(pids[2], signal.SIGTERM)
                    sent, sent_at = time.monotonic(), last
                elif sent is not None:
                    after += 1
            if "preemption notice: saved step" in line and "[rank 0]" in line:
                saved = int(re.search(r"saved step (\d+)", line)[1])
        p.wait()
        exit_s = time.monotonic() - sent
    return [
        f"4 processes (`zerojax launch`), the worker's GPT at ZeRO-3; `SIGTERM` to process 2 after step "
        f"{sent_at + 1}; steps take about {args.step_sleep:g} s (a sleep added to each).",
        "",
        "| from the signal to | |",
        "|---|---:|",
        f"| the launcher's exit (status {p.returncode}) | {exit_s:.2f} s |",
        f"| steps run after the signal | {after} (checkpoint at step {saved}) |",
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--preempt-at", type=int, default=4)
    ap.add_argument("--step-sleep", type=float, default=0.5)
    ap.add_argument("--skip-preemption", action="store_true")
    args = ap.parse_args(argv)
    lines = ["### Saves", ""] + save_table(args)
    if not args.skip_preemption:
        lines += ["", "### Preemption", ""] + preemption_table(args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
