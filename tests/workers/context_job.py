"""A multi-process job for the tests: context parallelism across processes.

Run by ``python -m zerojax.launch`` (4 processes x 2 devices): on ``zj.make_mesh(context=4)``
(data 2 x context 4) each process holds half of a data group's context positions, so it
loads only its rows *and* its sequence chunk of each batch (``zj.distributed.process_slices``
and ``global_batch``), and trains the tests' Llama at stage 3 with ring attention. Writes
``$OUT/losses_rank{R}.json`` and, from process 0, the gathered params (``$OUT/params.npz``).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zerojax as zj  # noqa: E402

zj.distributed.initialize(heartbeat_timeout_s=10)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from tests import test_context  # noqa: E402
from zerojax.models import llama  # noqa: E402

out = sys.argv[1]
rank = jax.process_index()
cfg = llama.LlamaConfig(**{**test_context.BASE.__dict__, "attention": "ring"})
graphdef, params = llama.init(cfg)
mesh, zc, tx = zj.make_mesh(context=4), zj.ZeroConfig(stage=3), optax.sgd(0.3)
state = zj.init_state(params, tx, mesh=mesh, config=zc)
step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh, config=zc)
rows, cols = zj.distributed.process_slices(8, 16, mesh)
losses = []
for full in test_context._data():
    local = {k: np.asarray(v)[rows, cols] for k, v in full.items()}
    state, m = step(state, zj.distributed.global_batch(local, mesh))
    losses.append(float(m["loss"]))
with open(os.path.join(out, f"losses_rank{rank}.json"), "w") as f:
    json.dump({"losses": losses, "rows": [rows.start, rows.stop], "cols": [cols.start, cols.stop]}, f)
full = zj.gather_params(state)
if rank == 0:
    np.savez(os.path.join(out, "params.npz"), *[np.asarray(x) for x in jax.tree.leaves(full)])
print(f"process {rank} done", flush=True)
