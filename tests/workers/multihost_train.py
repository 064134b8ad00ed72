"""A multi-process training job for the tests: ZeRO stages 1-3 for a few steps.

Run by ``python -m zerojax.launch``; writes the gathered params of each stage to
``$OUT/params_stage{S}_rank{R}.npz``. With ``--die-after K`` process 1 exits with status 3
after K steps; with ``--global-batch-helper`` each process loads only its own rows.

``--run NAME:STAGES:same|rows|prefetch:REPLICAS[:PIPELINE]`` (repeatable) runs several
trainings in one job, each as the flags would (``rows``: the global-batch helper;
``prefetch``: each process's own rows through ``zj.data.Prefetch(rows="process")``), writing to
``$OUT/NAME/`` and checkpointing its last stage to ``$OUT/NAME/ck``: the tests that only
read a job's results share one job. ``PIPELINE=P`` trains on ``zj.make_mesh(pipeline=P)``
(one stage per process at P = 2) with 2 micro-batches, the stacked model with 4 layers.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zerojax as zj  # noqa: E402

mesh = zj.distributed.initialize(heartbeat_timeout_s=10)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from tests import models  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--stages", default="1,2,3")
ap.add_argument("--die-after", type=int, default=None)
ap.add_argument("--global-batch-helper", action="store_true")
ap.add_argument("--checkpoint", default=None, help="save the last stage's state here")
ap.add_argument("--stall-after", type=int, default=None, help="process 1 hangs after K steps")
ap.add_argument("--step-timeout", type=float, default=None)
ap.add_argument("--replicas", type=int, default=1, help="hybrid sharding: replica groups of the mesh")
ap.add_argument("--run", action="append", default=[], metavar="NAME:STAGES:same|rows|prefetch:REPLICAS")
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
one_d = mesh

rank = jax.process_index()
print(
    f"process {rank} of {jax.process_count()}: {jax.local_device_count()} local devices, "
    f"{jax.device_count()} in the mesh",
    flush=True,
)
PARAMS = jax.tree.map(np.asarray, models.stacked_params())
PIPELINE_PARAMS = jax.tree.map(np.asarray, models.stacked_params(layers=4))
tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))


def train(out, stages, batches, replicas, checkpoint, pipeline=1):
    os.makedirs(out, exist_ok=True)
    mesh = one_d
    if pipeline > 1:
        mesh = zj.make_mesh(pipeline=pipeline)
        print(
            f"pipeline mesh {dict(mesh.shape)}: stages hold the devices of processes "
            f"{[sorted({d.process_index for d in stage.flat}) for stage in mesh.devices]}",
            flush=True,
        )
    if replicas > 1:
        mesh = zj.make_mesh(replicas=replicas)
        print(
            f"hybrid mesh {dict(mesh.shape)}: groups hold the devices of processes "
            f"{[sorted({d.process_index for d in row}) for row in mesh.devices]}",
            flush=True,
        )
    for stage in stages:  # the last stage's state is the checkpoint (one save per step number)
        train_stage(out, stage, mesh, batches, checkpoint if stage == stages[-1] else None, pipeline)


def own_rows(mesh, cfg):
    """This process's rows of each step's batch, placed ahead by ``zj.data.Prefetch``."""
    rows = zj.distributed.process_rows(16, mesh)
    source = (jax.tree.map(lambda x: np.asarray(x)[rows], models.batch(16, seed=i)) for i in range(args.steps))
    return zj.data.Prefetch(source, mesh, config=cfg, rows="process")


def train_stage(out, stage, mesh, batches, checkpoint, pipeline=1):
    cfg = zj.ZeroConfig(stage=stage, pipeline={"microbatches": 2 if pipeline > 1 else 1})
    params = PARAMS if pipeline == 1 else PIPELINE_PARAMS
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(models.stacked_loss, tx, mesh=mesh, config=cfg, timeout_s=args.step_timeout)
    ahead = own_rows(mesh, cfg) if batches == "prefetch" else None
    for i in range(args.steps):
        full_batch = jax.tree.map(np.asarray, models.batch(16, seed=i))
        if ahead is not None:
            batch = next(ahead)
            assert all(x.is_fully_addressable is False for x in jax.tree.leaves(batch)), "not a global batch"
        elif batches == "rows":
            rows = zj.distributed.process_rows(16, mesh)
            batch = zj.distributed.global_batch(jax.tree.map(lambda x: x[rows], full_batch), mesh)
        else:
            batch = full_batch
        state, m = step(state, batch)
        print(f"stage {stage} step {i} loss {float(m['loss']):.6f}", flush=True)
        if args.stall_after is not None and rank == 1 and i + 1 >= args.stall_after:
            print("process 1 stalling on purpose", flush=True)
            time.sleep(3600)
        if args.die_after is not None and rank == 1 and i + 1 >= args.die_after:
            print("process 1 failing on purpose", flush=True)
            os._exit(3)
    if checkpoint:  # every process writes its own shards
        zj.save_checkpoint(checkpoint, state, step=args.steps, wait=True)
    full = zj.gather_params(state)
    leaves = {str(k): np.asarray(v) for k, v in enumerate(jax.tree.leaves(full))}
    np.savez(os.path.join(out, f"params_stage{stage}_rank{rank}.npz"), **leaves)


if args.run:
    for spec in args.run:
        name, stages, batches, replicas, *pipe = spec.split(":")
        out = os.path.join(args.out, name)
        print(f"run {name}", flush=True)
        train(
            out,
            [int(s) for s in stages.split(",")],
            batches,
            int(replicas),
            os.path.join(out, "ck"),
            int(pipe[0]) if pipe else 1,
        )
else:
    train(
        args.out,
        [int(s) for s in args.stages.split(",")],
        "rows" if args.global_batch_helper else "same",
        args.replicas,
        args.checkpoint,
    )
print(f"process {rank} done", flush=True)
