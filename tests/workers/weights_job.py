"""A multi-process job for the tests: pretrained weights into a stage-3 state and back out.

Run by ``python -m zerojax.launch``. Each process loads a Hugging Face-layout checkpoint
(bf16 on disk, written by the test) through a map into sharded arrays, reading only its own
shards, then into a stage-3 state, exports the state in Hugging Face's format (each process
writing its own shards), and records per rank in ``$OUT/rank{R}.json``: bytes read and
written, the bytes of its own shards, host memory peaks (RSS high-water mark over the load;
tracemalloc, which sees numpy's host buffers but not XLA's device buffers, over each part).
"""

import argparse
import json
import os
import sys
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zerojax as zj  # noqa: E402

mesh = zj.distributed.initialize(heartbeat_timeout_s=10)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests.weights_model import MAP, abstract_params  # noqa: E402
from zerojax.tensors.safetensors_files import TensorFiles, TensorWriter  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--ckpt", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--buffer-mib", type=float, default=1.0)
args = ap.parse_args()
rank = jax.process_index()


def rss_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS to the current RSS
        f.write("5")


def own_bytes(arrays, itemsize=None) -> int:
    """Bytes of the distinct shards this process's devices hold."""
    total = 0
    for x in jax.tree.leaves(arrays):
        seen = {tuple((s.start, s.stop) for s in sh.index) for sh in x.addressable_shards}
        per = int(np.prod(x.sharding.shard_shape(x.shape))) * (itemsize or x.dtype.itemsize)
        total += len(seen) * per
    return total


src = zj.Weights(args.ckpt, MAP, buffer_mib=args.buffer_mib)
abstract = abstract_params()
report = {"rank": rank, "processes": jax.process_count(), "local_devices": jax.local_device_count()}

# 1. zj.load_weights into arrays sharded like stage 3 (no compilation involved).
shard = lambda x: NamedSharding(mesh, P(*([None] * (x.ndim - 1)), "data"))
like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard(x)), abstract)
TensorFiles.process_bytes_read = 0
reset_hwm()
base = rss()
tracemalloc.start()
loaded = zj.load_weights(src, like)
jax.block_until_ready(loaded)
current, peak = tracemalloc.get_traced_memory()
report["load"] = {
    "rss_peak_delta": rss_hwm() - base,
    "host_peak": peak,
    # numpy buffers still traced after the load back device arrays (CPU device_put
    # may alias them): they are the shards themselves, not a transient.
    "host_transient": peak - current,
    "bytes_read": TensorFiles.process_bytes_read,
    "own_disk_bytes": own_bytes(loaded, 2),
    "own_bytes": own_bytes(loaded),
    "largest_shard": max(int(np.prod(x.sharding.shard_shape(x.shape))) * 4 for x in jax.tree.leaves(loaded)),
}
tracemalloc.stop()
del loaded

# 2. A stage-3 state born from the weights.
cfg = zj.ZeroConfig(stage=3)
TensorFiles.process_bytes_read = 0
reset_hwm()
base = rss()
tracemalloc.start()
state = zj.init_state(abstract, optax.sgd(0.1), mesh=mesh, config=cfg, weights=src)
jax.block_until_ready(state.master)
current, peak = tracemalloc.get_traced_memory()
report["init"] = {
    "rss_peak_delta": rss_hwm() - base,
    "host_peak": peak,
    "host_transient": peak - current,
    "bytes_read": TensorFiles.process_bytes_read,
    "own_disk_bytes": own_bytes(state.master, 2),
    "own_bytes": own_bytes(state.master),
}
tracemalloc.stop()

# 3. Exported by every process, each writing its own shards.
TensorWriter.process_bytes_written = 0
tracemalloc.start()
zj.export_weights(state, args.out + "/export", map=MAP, format="hf", max_shard_size="3MB", dtype="bfloat16")
current, peak = tracemalloc.get_traced_memory()
report["export"] = {
    "host_peak": peak,
    "host_transient": peak - current,
    "bytes_written": TensorWriter.process_bytes_written,
}
tracemalloc.stop()

# 4. The full parameters, for the test to compare with the checkpoint.
if rank == 0:
    full = zj.gather_params(state)
    np.savez(args.out + "/params.npz", **{k: np.asarray(v) for k, v in full.items()})
else:
    zj.gather_params(state)
with open(f"{args.out}/rank{rank}.json", "w") as f:
    json.dump(report, f)
print(f"process {rank} done", flush=True)
