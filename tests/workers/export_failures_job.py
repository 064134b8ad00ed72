"""A two-process job for the tests: exports that fail in one process only.

Run by ``python -m zerojax.launch --nprocs 2 --devices-per-proc 4``. A stage-3 state is
split over both processes' devices; each scenario makes one process's part fail, every
process catches what ``export_weights`` raised, and ``$OUT/rank{R}.json`` records per
scenario the exception's type and message, when it was raised and (in the failing
process) when the failure was injected, and what the export folder holds afterwards:

- ``overflow``: float16 export, a value of 1e5 in process 1's shard only;
- ``disk``: process 1's third box write fails (``OSError``) while process 0, slowed to
  0.2 s a box, is still writing;
- ``tied``: a head read from the embedding differs from it in process 1's shard only;
- ``stall``: process 1 stalls for 6 s in its first box write, ``timeout_s=2``.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zerojax as zj  # noqa: E402

mesh = zj.distributed.initialize(heartbeat_timeout_s=10)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from zerojax.maps import transpose  # noqa: E402
from zerojax.tensors.safetensors_files import TensorWriter  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
args = ap.parse_args()
rank = jax.process_index()
rng = np.random.default_rng(0)
EMB = rng.normal(size=(64, 16)).astype(np.float32)
PARAMS = {"emb": EMB, "head": {"kernel": EMB.T.copy()}, "w": rng.normal(size=(64, 32)).astype(np.float32)}
MAP = zj.maps.WeightMap({"emb": "emb.weight", "head.kernel": transpose("lm_head.weight"), "w": transpose("w.weight")})
TIED = zj.maps.WeightMap({"emb": "emb.weight", "head.kernel": transpose("emb.weight"), "w": transpose("w.weight")})
CFG = zj.ZeroConfig(stage=3)
report = {}


def state_of(params):
    return zj.init_state(jax.tree.map(jnp.asarray, params), optax.sgd(0.1), mesh=mesh, config=CFG)


def holds(state, path, value) -> bool:
    """Whether this process's shards of a parameter hold ``value``."""
    leaf = state.master
    for k in path:
        leaf = leaf[k]
    return any(bool(np.any(np.asarray(s.data) == value)) for s in leaf.addressable_shards)


def listing(folder):
    """The files a loader sees (hidden ones, such as another process's probe, aside)."""
    return sorted(f for f in os.listdir(folder) if not f.startswith(".")) if os.path.isdir(folder) else []


def attempt(name, fn):
    start = time.time()
    try:
        fn()
        report[name] = {"type": None, "start": start, "t": time.time()}
    except Exception as e:  # noqa: BLE001
        report[name] = {"type": type(e).__name__, "message": str(e), "start": start, "t": time.time()}
    print(f"{name}: {report[name].get('type')}", flush=True)


real_write = TensorWriter.write_box

# overflow: a float16 export refused before a byte, the earlier export untouched.
big = {**PARAMS, "w": PARAMS["w"].copy()}
big["w"][-1, -1] = 1e5
state = state_of(big)
report["overflow_held_here"] = holds(state, ["w"], np.float32(1e5))
out = os.path.join(args.out, "overflow")
zj.export_weights(state, out, map=MAP, format="hf", dtype="bfloat16", max_shard_size=3000)
before = {f: os.path.getmtime(os.path.join(out, f)) for f in listing(out)}
attempt("overflow", lambda: zj.export_weights(state, out, map=MAP, format="hf", dtype="float16"))
report["overflow_untouched"] = before == {f: os.path.getmtime(os.path.join(out, f)) for f in listing(out)}

# disk: process 1 fails while writing; process 0, still writing, stops.
state = state_of(PARAMS)
writes = {"n": 0}


def failing_write(self, *a):
    writes["n"] += 1
    if rank == 1 and writes["n"] == 3:
        report["disk_injected"] = time.time()
        raise OSError(28, "No space left on device (injected)")
    if rank == 0:
        time.sleep(0.2)
    return real_write(self, *a)


TensorWriter.write_box = failing_write
out = os.path.join(args.out, "disk")
attempt("disk", lambda: zj.export_weights(state, out, map=MAP, format="hf", max_shard_size=3000))
TensorWriter.write_box = real_write
report["disk_writes"] = writes["n"]
zj.export_weights(state, os.path.join(args.out, "count"), map=MAP, format="hf", max_shard_size=3000)
writes["n"] = 0
TensorWriter.write_box = lambda self, *a: (writes.__setitem__("n", writes["n"] + 1), real_write(self, *a))[1]
zj.export_weights(state, os.path.join(args.out, "count"), map=MAP, format="hf", max_shard_size=3000)
TensorWriter.write_box = real_write
report["all_writes"] = writes["n"]

# tied: the head read from the embedding differs in process 1's shard only.
apart = {**PARAMS, "head": {"kernel": PARAMS["head"]["kernel"].copy()}}
apart["head"]["kernel"][-1, -1] += 0.25
state = state_of(apart)
report["tied_held_here"] = holds(state, ["head", "kernel"], apart["head"]["kernel"][-1, -1])
out = os.path.join(args.out, "tied")
attempt("tied", lambda: zj.export_weights(state, out, map=TIED, format="hf", max_shard_size=3000))

# stall: process 1 stops making progress; process 0 gives up after timeout_s.
state = state_of(PARAMS)


def stalling_write(self, *a):
    if rank == 1 and not report.get("stall_injected"):
        report["stall_injected"] = time.time()
        time.sleep(6)
    return real_write(self, *a)


TensorWriter.write_box = stalling_write
out = os.path.join(args.out, "stall")
attempt("stall", lambda: zj.export_weights(state, out, map=MAP, format="hf", max_shard_size=3000, timeout_s=2))
TensorWriter.write_box = real_write

with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
print(f"process {rank} done", flush=True)
