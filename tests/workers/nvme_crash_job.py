"""NVMe-tier jobs killed mid-step and resumed, each in its own process.

nvme_crash_job.py crash DIR WORK --at chunk|manifest
    train two steps with the optimizer state under DIR, save a checkpoint (WORK/ck) and the
    committed optimizer state (WORK/committed.npz), then start a third step whose writers
    stop (a) halfway through writing a chunk or (b) with every chunk and the new manifest
    written, before the manifest is switched in; touch WORK/ready and sleep there until killed
nvme_crash_job.py resume DIR WORK
    in a new process on the same DIR: run the third step (a) from the version DIR holds
    (the checkpoint's masters and scalars, the optimizer state read from DIR) and (b) from
    the checkpoint alone; save both results to WORK/resumed.npz
"""

import argparse
import dataclasses
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["crash", "resume"])
ap.add_argument("dir")
ap.add_argument("work")
ap.add_argument("--at", choices=["chunk", "manifest"], default="chunk")
args = ap.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from tests import models  # noqa: E402
from zerojax.nvme import store as store_mod  # noqa: E402
from zerojax.nvme import stream as stream_mod  # noqa: E402

TX = optax.adamw(1e-2)
BATCHES = [models.batch(16, s) for s in range(3)]
CFG = zj.ZeroConfig(stage=2, offload={"optimizer": True, "group_size": 1600, "nvme": {"path": args.dir}})
mesh = zj.make_mesh()
step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=CFG)


def opt_arrays(state) -> dict:
    leaves = jax.tree.leaves(zj.nvme.materialize(state).opt_state)
    return {f"opt{j}": np.asarray(x) for j, x in enumerate(leaves)}


def ready_and_sleep() -> None:
    with open(os.path.join(args.work, "ready.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(args.work, "ready.tmp"), os.path.join(args.work, "ready"))
    time.sleep(600)
    os._exit(3)  # never killed: the test fails on the exit code


if args.mode == "crash":
    state = zj.init_state(models.stacked_params(), TX, mesh=mesh, config=CFG)
    for b in BATCHES[:2]:
        state, _ = step(state, b)
    zj.save_checkpoint(os.path.join(args.work, "ck"), state, step=2, wait=True)
    np.savez(os.path.join(args.work, "committed.npz"), **opt_arrays(state))
    if args.at == "chunk":
        real_write, calls = stream_mod.write_chunk, []

        def stop_midway(path, data):
            calls.append(path)
            if len(calls) < 5:
                return real_write(path, data)
            view = memoryview(data).cast("B")
            real_write(path, view[: len(view) // 2])  # half a chunk on disk, fsync'ed
            ready_and_sleep()

        stream_mod.write_chunk = stop_midway
    else:
        real_replace = store_mod.os.replace

        def stop_before_switch(src, dst):
            if os.path.basename(dst) == store_mod.MANIFEST:
                ready_and_sleep()
            real_replace(src, dst)

        store_mod.os.replace = stop_before_switch
    step(state, BATCHES[2])
    sys.exit(4)  # the step returned: the hook never ran
else:
    ck = os.path.join(args.work, "ck")
    restored = zj.restore_checkpoint(ck, models.stacked_params(), TX, mesh=mesh, config=CFG)
    plan, manifest = restored.plan, store_mod.read_manifest(os.path.join(args.dir, "process_0"))
    leaves = jax.tree.leaves(restored.opt_state)
    handles = [
        zj.nvme.OnDisk(
            j,
            tuple(l.storage_shape),
            np.dtype(l.dtype),
            plan.sharding(l),
            os.path.join(args.dir, "process_0"),
            manifest["version"],
        )
        if str(j) in manifest["chunks"]
        else leaves[j]
        for j, l in enumerate(plan.opt_storage_layouts)
    ]
    from_dir = dataclasses.replace(restored, opt_state=plan.unflatten_opt(handles))
    a, _ = step(from_dir, BATCHES[2])
    out = {"a_" + k: v for k, v in opt_arrays(a).items()}
    out.update({f"a_param{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(zj.gather_params(a)))})
    out["a_listing"] = np.array(sorted(os.listdir(os.path.join(args.dir, "process_0"))))
    restored = zj.restore_checkpoint(ck, models.stacked_params(), TX, mesh=mesh, config=CFG)
    b, _ = step(restored, BATCHES[2])
    out.update({"b_" + k: v for k, v in opt_arrays(b).items()})
    out.update({f"b_param{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(zj.gather_params(b)))})
    np.savez(os.path.join(args.work, "resumed.npz"), **out)
    step.close()
