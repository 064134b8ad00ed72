"""Checkpoint jobs run in their own process (own simulated device count).

checkpoint_job.py restore DIR OUT --devices N --stage S [--steps K]
    restore the latest checkpoint on N devices under stage S, train K steps, save the
    full params to OUT (.npz)
checkpoint_job.py save-and-exit DIR --devices N
    save a checkpoint asynchronously and exit normally (no explicit wait)
checkpoint_job.py save-and-die DIR --devices N
    save step 1 completely, start saving a larger step 2, and die (SIGKILL) mid-save
checkpoint_job.py save-then-time-out DIR --devices N
    start saving step 5 asynchronously, then run a train step whose timeout_s it
    cannot meet: the watchdog ends the process, finishing the save first
"""

import argparse
import os
import signal
import sys
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("mode")
ap.add_argument("dir")
ap.add_argument("out", nargs="?")
ap.add_argument("--devices", type=int, default=8)
ap.add_argument("--stage", type=int, default=3)
ap.add_argument("--steps", type=int, default=3)
args = ap.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from tests import models  # noqa: E402

TX = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))
mesh = zj.make_mesh()
assert len(jax.devices()) == args.devices

if args.mode == "restore":
    cfg = zj.ZeroConfig(stage=args.stage)
    state = zj.restore_checkpoint(args.dir, models.stacked_params(), TX, mesh=mesh, config=cfg)
    start = int(state.step)
    step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg)
    for i in range(start, start + args.steps):
        state, _ = step(state, models.batch(16, seed=i))
    np.savez(
        args.out, *[np.asarray(x) for x in jax.tree.leaves(zj.gather_params(state))], step=np.asarray(int(state.step))
    )
elif args.mode == "save-and-exit":
    state = zj.init_state(models.stacked_params(), TX, mesh=mesh, config=zj.ZeroConfig(stage=3))
    zj.save_checkpoint(args.dir, state, step=7)
    print("saved, exiting", flush=True)
elif args.mode == "save-and-die":
    small = {"w": jnp.ones((64, 64))}
    state = zj.init_state(small, TX, mesh=mesh, config=zj.ZeroConfig(stage=3))
    zj.save_checkpoint(args.dir, state, step=1, wait=True)
    big = {"w": jnp.ones((64, 64)), "big": [jnp.full((2048, 2048), float(i)) for i in range(8)]}
    state = zj.init_state(big, TX, mesh=mesh, config=zj.ZeroConfig(stage=3))

    def die_once_step_2_is_being_written():  # whether the save runs in the background or not
        while not any(n.startswith("2.") and "tmp" in n for n in os.listdir(args.dir)):
            time.sleep(0.001)
        print("killing myself mid-save", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_once_step_2_is_being_written, daemon=True).start()
    zj.save_checkpoint(args.dir, state, step=2)
    time.sleep(600)
elif args.mode == "save-then-time-out":
    big = {"w": [jnp.full((1024, 1024), float(i)) for i in range(16)]}
    cfg = zj.ZeroConfig(stage=3, donate=False)
    state = zj.init_state(big, TX, mesh=mesh, config=cfg)

    def slow_loss(p, x):
        for w in p["w"]:
            x = jnp.tanh(x @ w)
        return jnp.mean(x)

    step = zj.make_train_step(slow_loss, TX, mesh=mesh, config=cfg, timeout_s=600)
    x = jnp.ones((512, 1024))
    step(state, x)  # compiled and run once, well within 600 s
    zj.save_checkpoint(args.dir, state, step=5)
    step.timeout_s = 1e-3  # the next step cannot meet it
    step(state, x)
    print("the step finished within its timeout", flush=True)
