"""Pretrained weights in and out of stage 3 on several processes: bytes read and written,
and host memory, per process.

Runs the job that ``tests/test_weights.py::test_four_processes_read_and_write_only_their_own_shards``
asserts on (``tests/workers/weights_job.py``): a Hugging Face-layout checkpoint (11.0M
parameters, bf16 on disk in 9 files, written by ``safetensors`` itself) is loaded by
``zj.load_weights`` into stage-3 shardings, then into a stage-3 state by
``zj.init_state(..., weights=)``, then exported by ``zj.export_weights`` in the same layout,
every process reading and writing its own shards. Prints one row per process::

    python experiments/pretrained_io.py                # 4 processes x 2 CPU devices, 1 MiB buffer
    python experiments/pretrained_io.py --buffer-mib 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buffer-mib", type=float, default=1.0, help="Weights.buffer_mib: the largest piece read at once")
    args = ap.parse_args()
    from tests import weights_model

    with tempfile.TemporaryDirectory() as tmp:
        ts = weights_model.tensors()
        weights_model.write_sharded(os.path.join(tmp, "ck"), ts)
        disk = sum(os.path.getsize(os.path.join(tmp, "ck", f)) for f in os.listdir(os.path.join(tmp, "ck")))
        cmd = [
            sys.executable,
            "-m",
            "zerojax.launch",
            "--nprocs",
            "4",
            "--devices-per-proc",
            "2",
            "--",
            sys.executable,
            os.path.join(ROOT, "tests", "workers", "weights_job.py"),
            "--ckpt",
            os.path.join(tmp, "ck"),
            "--out",
            tmp,
            "--buffer-mib",
            str(args.buffer_mib),
        ]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(4)]
    params = sum(x.size for x in ts.values())
    mib = lambda b: f"{b / 2**20:.2f}"
    print(
        f"model: {params:,} parameters; checkpoint {mib(disk)} MiB on disk (bf16, 9 files), "
        f"fp32 masters {mib(4 * params)} MiB; 4 processes x 2 devices, stage 3; buffer {args.buffer_mib} MiB"
    )
    print(
        "All figures in MiB, per process. own: the bytes of the shards its devices hold (fp32); "
        "RSS: peak RSS rise over the call;\ntransient: tracemalloc peak less what stays (numpy host buffers); "
        "read/written: bytes of the checkpoint files.\n"
    )
    head = (
        "process",
        "own",
        "largest shard",
        "own on disk",
        "read (load)",
        "read (init)",
        "RSS (load)",
        "RSS (init)",
        "transient (load)",
        "transient (init)",
        "written (export)",
        "transient (export)",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in ranks:
        ld, it, ex = r["load"], r["init"], r["export"]
        row = (
            r["rank"],
            mib(ld["own_bytes"]),
            mib(ld["largest_shard"]),
            mib(ld["own_disk_bytes"]),
            mib(ld["bytes_read"]),
            mib(it["bytes_read"]),
            mib(ld["rss_peak_delta"]),
            mib(it["rss_peak_delta"]),
            mib(ld["host_transient"]),
            mib(it["host_transient"]),
            mib(ex["bytes_written"]),
            mib(ex["host_transient"]),
        )
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
