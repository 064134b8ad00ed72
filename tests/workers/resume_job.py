"""A resumable training job for the fault-tolerance tests: the experiments' GPT (tiny), with
dropout (so the RNG key must come back), at a ZeRO stage, under ``zerojax.resume.Run``.

Run by ``zerojax launch`` (any number of processes) or alone. Prints ``step K loss L`` after
every step (what the chaos test watches), and at the end writes the gathered parameters
(process 0) to ``--out/params.npz`` and ``--out/steps.txt`` (one line per step it ran).
``--sleep`` stretches each step, so that faults land at chosen moments.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zerojax as zj  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True, help="the run's checkpoint directory")
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--save-every", type=int, default=3)
ap.add_argument("--batch", type=int, default=8, help="global batch")
ap.add_argument("--stage", type=int, default=3)
ap.add_argument("--accum", type=int, default=1, help="grad_accum_steps of a fresh run")
ap.add_argument("--keep-last", type=int, default=0, help="0: keep every checkpoint")
ap.add_argument("--sleep", type=float, default=0.0, help="seconds added to each step")
ap.add_argument("--local-devices", type=int, default=None)
ap.add_argument(
    "--optimizer",
    choices=["adamw", "sgd"],
    default="adamw",
    help="sgd (momentum) for elastic resumes: AdamW scales the rounding noise of gradients that are "
    "zero in exact arithmetic (the attention key bias's) up to steps of the learning rate's size",
)
ap.add_argument("--dropout", type=float, default=0.1, help="0 for elastic resumes (keys are per device)")
args = ap.parse_args()

mesh = zj.distributed.initialize(heartbeat_timeout_s=10, local_cpu_devices=args.local_devices)
print(f"process {os.environ.get('ZEROJAX_PROCESS_ID', '0')} pid {os.getpid()}", flush=True)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.resume import IndexSampler, Run, RunConfig  # noqa: E402

SEQ = 16
cfg = gpt.GPTConfig(vocab=256, seq_len=SEQ, d_model=32, n_layers=2, n_heads=2, dropout=args.dropout)
graphdef, params = gpt.init(cfg, 0)
corpus = data.stdlib_bytes(1 << 16)
records = np.lib.stride_tricks.sliding_window_view(corpus, SEQ + 1)[:: SEQ + 1][:256].astype(np.int32)
tx = optax.adamw(1e-2) if args.optimizer == "adamw" else optax.sgd(0.3, momentum=0.9)

run = Run(RunConfig(args.dir, save_every=args.save_every, keep_last=args.keep_last or None))
sampler = IndexSampler(len(records), args.batch, seed=0)
zc = run.micro_batches(zj.ZeroConfig(stage=args.stage, grad_accum_steps=args.accum), mesh, args.batch)
state = run.restore_or_init(params, tx, mesh=mesh, config=zc, data=sampler, rng=jax.random.key(7))
step = zj.make_train_step(gpt.make_loss(graphdef, with_rng=True), tx, mesh=mesh, config=zc, with_rng=True, timeout_s=60)
rows = zj.distributed.process_rows(args.batch, mesh)
os.makedirs(args.out, exist_ok=True)
ran = []
while run.step < args.steps:
    idx = next(sampler)
    batch = zj.distributed.global_batch({"tokens": records[idx][rows]}, mesh)
    state, m = step(state, batch)
    loss = float(m["loss"])
    if args.sleep:
        time.sleep(args.sleep)
    print(f"step {run.step} loss {loss:.6f}", flush=True)
    ran.append(run.step)
    run.completed(state)
run.finish(state)
full = zj.gather_params(state)
if jax.process_index() == 0:
    np.savez(
        os.path.join(args.out, "params.npz"), **{str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(full))}
    )
with open(os.path.join(args.out, f"steps.{jax.process_index()}.txt"), "a") as f:
    f.write("".join(f"{s}\n" for s in ran))
print(f"process {jax.process_index()} done at step {run.step}", flush=True)
