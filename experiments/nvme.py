"""The NVMe tier on this machine: streaming throughput against ``dd``, peak host memory
against the formula, step time beside in-memory and host offload, and the last-bit
differences between programs.

* ``--part io``: the tier's :class:`zerojax.nvme.stream.Streamer` writes a state of
  ``--io-mb`` MB (four float32 leaves sharded over the 8 devices, one fsync'ed file per
  shard) and reads it back (checked bit for bit), the written files' pages dropped from the
  page cache first (``posix_fadvise(DONTNEED)``); beside it ``dd`` writes a file of the same
  size (``bs=1M conv=fdatasync``) and reads it back, its pages dropped the same way. The
  runs take turns, ``--repeats`` times; the table gives the best of each.
* ``--part rss``: for each of ``--sizes`` (GPT ``d_model x layers``), a fresh process
  trains stage 2 with the optimizer state offloaded to host memory, and another with it on
  disk, the same ``group_size`` and buffers. Each resets its peak RSS
  (``/proc/self/clear_refs``) after the first step (which compiles, and moves
  ``init_state``'s in-memory optimizer state to disk) and reads ``VmHWM`` after two more.
  The formula: the NVMe run's peak is the host run's peak less the optimizer state, plus
  the tier's buffers (``buffer_count x buffer_size``) and the device copies of the three
  largest groups' state (the group read ahead, the one updating, the one being written).
* ``--part time``: step time of in-memory, host offload and NVMe on one small GPT, the
  three taking turns, ``--steps`` steps (the first, which compiles, left out).
* ``--part exactness``: the largest difference from the in-memory run after two AdamW
  steps (a tiny GPT, stage 2): the NVMe tier, the streamed device update, the host update,
  and the in-memory step with ``grad_clip=1e9`` (a clip that multiplies by exactly 1).

On simulated CPU devices device memory is host memory: the RSS of a run counts both.

    python experiments/nvme.py [--part io,rss,time,exactness] [--dir DIR] [--io-mb 256]
        [--sizes 128x4,256x4] [--steps 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import harness  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.nvme.driver import _finish  # noqa: E402
from zerojax.nvme.store import read_chunk  # noqa: E402
from zerojax.nvme.stream import Streamer, assemble  # noqa: E402

MB, MIB = 10**6, 2**20
BUFFERS = {"buffer_count": 4, "buffer_size": 4 * MIB}


# -- io ----------------------------------------------------------------------------------------


def _drop_cache(directory: str) -> None:
    """Drops the (clean, fsync'ed) pages of every file under ``directory`` from the page cache."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dd(directory: str, mb: int) -> tuple[float, float]:
    path = os.path.join(directory, "dd.bin")
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fdatasync"], check=True, capture_output=True
    )
    write = time.perf_counter() - t
    _drop_cache(directory)
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    read = time.perf_counter() - t
    os.remove(path)
    return write, read


def _streamer(directory: str, leaves: list, count: int, size: int) -> tuple[float, float]:
    streamer = Streamer(count, size)
    d = os.path.join(directory, "v0")
    os.makedirs(d)
    try:
        t = time.perf_counter()
        _finish([f for j, x in enumerate(leaves) for f in streamer.write(d, j, x)])
        write = time.perf_counter() - t
        _drop_cache(d)
        t = time.perf_counter()
        futures = [streamer.read(d, j, x.shape, x.dtype, x.sharding) for j, x in enumerate(leaves)]
        back = [assemble(x.shape, x.sharding, fs) for x, fs in zip(leaves, futures)]
        jax.block_until_ready(back)
        read = time.perf_counter() - t
        # The same files read alone (no JAX): into new memory, by the same number of threads.
        _drop_cache(d)
        paths = [os.path.join(d, f) for f in sorted(os.listdir(d))]
        t = time.perf_counter()
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda p: read_chunk(p, np.empty(os.path.getsize(p), np.uint8)), paths))
        alone = time.perf_counter() - t
    finally:
        streamer.close()
    for x, y in zip(leaves, back):
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            raise AssertionError("the state read back is not the state written")
    shutil.rmtree(d)
    return write, read, alone


def io_part(directory: str, mb: int, repeats: int) -> list[dict]:
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    rows_per_leaf = max(8, mb * MB // 4 // 4 // 1024 // 8 * 8)
    rng = np.random.default_rng(0)
    leaves = [jax.device_put(rng.standard_normal((rows_per_leaf, 1024), np.float32), sharding) for _ in range(4)]
    nbytes = sum(x.nbytes for x in leaves)
    shard = max(s.data.nbytes for x in leaves for s in x.addressable_shards)
    times: dict[str, list[float]] = {k: [] for k in ("tier write", "tier read", "dd write", "dd read", "alone read")}
    for _ in range(repeats):  # the two take turns
        w, r, a = _streamer(directory, leaves, BUFFERS["buffer_count"], shard)
        times["tier write"].append(w)
        times["tier read"].append(r)
        times["alone read"].append(a)
        w, r = _dd(directory, round(nbytes / MIB))
        times["dd write"].append(w)
        times["dd read"].append(r)
    dd_bytes = round(nbytes / MIB) * MIB
    gbps = {k: (nbytes if k.startswith("tier") else dd_bytes) / min(v) / 1e9 for k, v in times.items()}
    return [
        {
            "what": what,
            "bytes": nbytes,
            "shard": shard,
            "tier": gbps[f"tier {what}"],
            "dd": gbps[f"dd {what}"],
            "ratio": gbps[f"tier {what}"] / gbps[f"dd {what}"],
            "alone": gbps.get(f"alone {what}"),
        }
        for what in ("write", "read")
    ]


# -- rss ---------------------------------------------------------------------------------------


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _gpt(d_model: int, layers: int) -> gpt.GPTConfig:
    return gpt.GPTConfig(vocab=256, seq_len=64, d_model=d_model, n_layers=layers, n_heads=max(1, d_model // 64))


def _nbytes(layout) -> int:
    return int(np.prod(layout.storage_shape, dtype=np.int64)) * np.dtype(layout.dtype).itemsize


def rss_child(tier: str, d_model: int, layers: int, group_size: int, directory: str) -> dict:
    """One fresh process's peak RSS over steps 2 and 3 (stage 2, optimizer state on ``tier``)."""
    cfg = _gpt(d_model, layers)
    graphdef, params = gpt.init(cfg)
    offload = {"optimizer": True, "update": "device", "group_size": group_size}
    if tier == "nvme":
        offload["nvme"] = {"path": directory, **BUFFERS}
    zc = zj.ZeroConfig(stage=2, offload=offload)
    mesh, tx = zj.make_mesh(), optax.adamw(1e-3)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    del params
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
    stream = data.windows(data.stdlib_bytes(1 << 20), 8, cfg.seq_len)
    state, m = step(state, next(stream))
    jax.block_until_ready(m)
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    for _ in range(2):
        state, m = step(state, next(stream))
        jax.block_until_ready(m)
    out = {"tier": tier, "d_model": d_model, "layers": layers, "params": cfg.num_params()}
    out.update(before=before, peak=_status("VmHWM"))
    opt = zj.nvme.materialize(state).opt_state if tier == "nvme" else state.opt_state
    out["opt_bytes"] = sum(x.nbytes for x in jax.tree.leaves(opt))
    if tier == "nvme":
        t = step.nvme_tier(state)
        layouts = state.plan.opt_storage_layouts
        n = len(state.plan.master_layouts)
        per_group = sorted(
            sum(_nbytes(layouts[k - n]) for k in outs if k >= n and (k - n) not in t.shared)
            for _, outs in t.groups.groups
        )
        out["groups"] = len(per_group)
        out["in_flight"] = sum(per_group[-3:])
        out["buffers"] = BUFFERS["buffer_count"] * BUFFERS["buffer_size"]
        step.close()
    return out


def rss_part(sizes: list[tuple[int, int]], group_size: int, directory: str) -> list[dict]:
    rows = []
    for d_model, layers in sizes:
        got = {}
        for tier in ("host", "nvme"):
            d = tempfile.mkdtemp(dir=directory)
            argv = [sys.executable, os.path.abspath(__file__), "--part", "rss-child", "--tier", tier]
            argv += ["--sizes", f"{d_model}x{layers}", "--group-size", str(group_size), "--dir", d]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            shutil.rmtree(d, ignore_errors=True)
            if r.returncode:
                raise RuntimeError(r.stderr[-3000:])
            got[tier] = json.loads(r.stdout.strip().splitlines()[-1])
        host, nv = got["host"], got["nvme"]
        formula = host["peak"] - host["opt_bytes"] + nv["buffers"] + nv["in_flight"]
        rows.append({**nv, "host_peak": host["peak"], "formula": formula, "ratio": nv["peak"] / formula})
    return rows


# -- time and exactness ------------------------------------------------------------------------


def _configs(directory: str, base: zj.ZeroConfig) -> dict[str, zj.ZeroConfig]:
    os.makedirs(directory, exist_ok=True)
    return {
        "in memory": base,
        "host offload": dataclasses.replace(base, offload={"optimizer": True, "update": "host"}),
        "NVMe": dataclasses.replace(base, offload={"optimizer": True, "nvme": {"path": directory, **BUFFERS}}),
    }


def time_part(directory: str, d_model: int, layers: int, steps: int) -> list[dict]:
    cfg = _gpt(d_model, layers)
    graphdef, params = gpt.init(cfg)
    mesh, tx, loss = zj.make_mesh(), optax.adamw(1e-3), gpt.make_loss(graphdef)
    stream = data.windows(data.stdlib_bytes(1 << 20), 8, cfg.seq_len)
    batches = [next(stream) for _ in range(steps)]
    runs = {}
    for name, zc in _configs(directory, zj.ZeroConfig(stage=2)).items():
        runs[name] = {
            "state": zj.init_state(params, tx, mesh=mesh, config=zc),
            "step": zj.make_train_step(loss, tx, mesh=mesh, config=zc),
            "times": [],
        }
    for b in batches:  # interleaved: the three see the same machine
        for r in runs.values():
            t = time.perf_counter()
            r["state"], m = r["step"](r["state"], b)
            jax.block_until_ready(m)
            r["times"].append(time.perf_counter() - t)
    base = statistics.median(runs["in memory"]["times"][1:])
    rows = []
    for name, r in runs.items():
        ms = statistics.median(r["times"][1:])
        rows.append({"run": name, "params": cfg.num_params(), "ms": 1e3 * ms, "ratio": ms / base})
        if hasattr(r["step"], "close"):
            r["step"].close()
    return rows


def exactness_part(directory: str) -> list[dict]:
    cfg = _gpt(32, 1)
    graphdef, params = gpt.init(cfg)
    mesh, tx, loss = zj.make_mesh(), optax.adamw(1e-2), gpt.make_loss(graphdef)
    stream = data.windows(data.stdlib_bytes(1 << 20), 8, cfg.seq_len)
    batches = [next(stream) for _ in range(2)]
    base = zj.ZeroConfig(stage=2)
    configs = _configs(directory, base)
    configs["streamed device update"] = dataclasses.replace(
        base, offload={"optimizer": True, "update": "device", "group_size": 2000}
    )
    configs["in memory, grad_clip=1e9"] = dataclasses.replace(base, grad_clip=1e9)
    results = {}
    for name, zc in configs.items():
        state = zj.init_state(params, tx, mesh=mesh, config=zc)
        step = zj.make_train_step(loss, tx, mesh=mesh, config=zc)
        for b in batches:
            state, _ = step(state, b)
        state = zj.nvme.materialize(state)
        results[name] = (jax.tree.leaves(zj.gather_params(state)), jax.tree.leaves(state.opt_state))
        step.close()
    diff = lambda xs, ys: max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y)))) for x, y in zip(xs, ys))
    ref = results.pop("in memory")
    return [{"run": k, "params": diff(v[0], ref[0]), "opt": diff(v[1], ref[1])} for k, v in results.items()]


# -- main --------------------------------------------------------------------------------------


def main(argv=None) -> dict[str, list[dict]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="io,rss,time,exactness")
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--io-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sizes", default="128x4,256x4", help="d_model x layers of the GPTs whose peak RSS is measured")
    ap.add_argument("--group-size", type=int, default=2**18)
    ap.add_argument("--time-size", default="128x2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tier", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes.split(",")]
    if args.part == "rss-child":
        print(json.dumps(rss_child(args.tier, *sizes[0], args.group_size, args.dir)))
        return {}
    parts = args.part.split(",")
    root = tempfile.mkdtemp(dir=args.dir, prefix="zerojax-nvme-")
    out: dict[str, list[dict]] = {}
    try:
        head = f"{len(jax.devices())} x {jax.devices()[0].platform}, jax {jax.__version__}, {os.cpu_count()} cores"
        if "io" in parts:
            out["io"] = rows = io_part(root, args.io_mb, args.repeats)
            for r in rows:
                r["alone_text"] = (
                    "" if r["alone"] is None else f"{r['alone']:.2f} (tier: {r['tier'] / r['alone']:.2f} of it)"
                )
            print(
                f"\nStreaming {rows[0]['bytes'] / MB:.0f} MB ({rows[0]['shard'] / MB:.0f} MB files) under {root}; {head}\n"
            )
            print(
                harness.table(
                    rows,
                    {
                        "": "{what}",
                        "tier (GB/s)": "{tier:.2f}",
                        "dd, bs=1M (GB/s)": "{dd:.2f}",
                        "tier / dd": "{ratio:.2f}",
                        "the files read alone, into new memory (GB/s)": "{alone_text}",
                    },
                )
            )
        if "rss" in parts:
            out["rss"] = rows = rss_part(sizes, args.group_size, root)
            print(f"\nPeak RSS over steps 2-3, stage 2, AdamW, group_size {args.group_size:,}; {head}\n")
            print(
                harness.table(
                    rows,
                    {
                        "GPT": "d{d_model} L{layers} ({params:,})",
                        "optimizer state": lambda r: f"{r['opt_bytes'] / MIB:.1f} MiB",
                        "host offload peak": lambda r: f"{r['host_peak'] / MIB:.1f} MiB",
                        "NVMe peak": lambda r: f"{r['peak'] / MIB:.1f} MiB",
                        "buffers + 3 largest of groups": lambda r: (
                            f"{r['buffers'] / MIB:.0f} + {r['in_flight'] / MIB:.1f} MiB of {r['groups']}"
                        ),
                        "formula": lambda r: f"{r['formula'] / MIB:.1f} MiB",
                        "NVMe / formula": "{ratio:.3f}",
                    },
                )
            )
        if "time" in parts:
            d_model, layers = map(int, args.time_size.split("x"))
            out["time"] = rows = time_part(os.path.join(root, "time"), d_model, layers, args.steps)
            print(
                f"\nStep time, GPT d{d_model} L{layers}, batch 8 x 64, stage 2, median of steps 2-{args.steps}; {head}\n"
            )
            print(harness.table(rows, {"": "{run}", "step (ms)": "{ms:.1f}", "vs in memory": "{ratio:.2f}"}))
        if "exactness" in parts:
            out["exactness"] = rows = exactness_part(os.path.join(root, "exact"))
            print(f"\nLargest difference from the in-memory run, GPT d32 L1, 2 AdamW steps, stage 2; {head}\n")
            print(harness.table(rows, {"": "{run}", "params": "{params:.1e}", "optimizer state": "{opt:.1e}"}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
