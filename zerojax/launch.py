"""Local multi-process launcher, in the spirit of ``torchrun --standalone``.

    zerojax launch --nprocs 2 --devices-per-proc 4 -- python experiments/train.py ...
    python -m zerojax.launch --nprocs 2 --devices-per-proc 4 -- python experiments/train.py ...

Starts ``--nprocs`` copies of the command with the environment that
``zj.distributed.initialize()`` reads (coordinator on a free localhost port, process
count and id, simulated CPU devices per process), prefixes each output line with
``[rank i]``, and exits with a non-zero status as soon as any process fails, stopping the
others; ``--timeout`` bounds the whole job; ``--gpu-overlap`` adds XLA's GPU flags that
overlap collectives with compute (:mod:`zerojax.xla_flags`) to every process.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from zerojax.distributed.init import ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from zerojax.xla_flags import with_gpu_overlap_flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Gloo's note for every communicator it connects (several per collective group): noise, hidden
# unless the launcher is run with --verbose. Threads print its pieces, which may interleave
# anywhere ("[Gloo] Rank 1 is connected to [Gloo] Rank 7 peer ranks. ..."): a line that
# holds "[Gloo]" and nothing but the words and numbers of that message is dropped.
_GLOO_WORDS = frozenset("Rank is connected to peer ranks Expected number of".split())


def _gloo_noise(line: str) -> bool:
    if "[Gloo]" not in line:
        return False
    words = re.sub(r"\[Gloo\]|[\d.:]", " ", line).split()
    return all(w in _GLOO_WORDS for w in words)


def _pump(rank: int, stream, out, lock: threading.Lock, verbose: bool = True) -> None:
    for line in iter(stream.readline, ""):
        if not verbose and _gloo_noise(line):
            continue
        with lock:
            out.write(f"[rank {rank}] {line}")
            out.flush()
    stream.close()


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(cmd: Sequence[str], nprocs: int, devices_per_proc: int | None = None, port: int | None = None,
           timeout_s: float | None = None, grace_s: float = 5.0, out=None, gpu_overlap: bool = False,
           verbose: bool = False) -> int:
    """Runs ``cmd`` in ``nprocs`` processes; returns the job's exit status. ``gpu_overlap``
    adds XLA's GPU overlap flags (:mod:`zerojax.xla_flags`) to every process's ``XLA_FLAGS``.
    Gloo's "Rank i is connected to k peer ranks" lines are dropped unless ``verbose``."""
    if nprocs < 1:
        raise ValueError(f"--nprocs must be >= 1, got {nprocs}")
    if not cmd:
        raise ValueError("no command given: zerojax launch --nprocs 2 -- python train.py")
    out = out or sys.stdout
    port = port or free_port()
    lock = threading.Lock()
    procs, pumps = [], []
    for rank in range(nprocs):
        env = dict(os.environ)
        env.update({ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(nprocs),
                    ENV_PROCESS_ID: str(rank), "PYTHONUNBUFFERED": "1"})
        if devices_per_proc is not None:
            env[ENV_LOCAL_DEVICES] = str(devices_per_proc)
        if gpu_overlap:
            env["XLA_FLAGS"] = with_gpu_overlap_flags(env.get("XLA_FLAGS", ""))
        p = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock, verbose), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)
    start = time.monotonic()
    status = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                with lock:
                    out.write(f"zerojax.launch: process {rank} (pid {procs[rank].pid}) exited with "
                              f"status {code}; stopping the other {nprocs - 1}\n")
                    out.flush()
                status = code if code > 0 else 128 - code
                break
            if all(c == 0 for c in codes):
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                with lock:
                    running = [r for r, c in enumerate(codes) if c is None]
                    out.write(f"zerojax.launch: timeout after {timeout_s:.0f}s; processes {running} "
                              "still running; stopping them\n")
                    out.flush()
                status = 124
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
    finally:
        _stop(procs, grace_s)
        for t in pumps:
            t.join(timeout=2)
    return status


USAGE = ("%(prog)s [-h] --nprocs N [--devices-per-proc D] [--port PORT] [--timeout SECONDS] [--gpu-overlap] "
         "[--verbose] -- command [args...]")


def main(argv: Sequence[str] | None = None, prog: str = "python -m zerojax.launch") -> int:
    """The launcher's command line (``zerojax launch`` / ``python -m zerojax.launch``):
    options, then ``--``, then the command every process runs; returns the job's status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    else:
        cmd = []
    ap = argparse.ArgumentParser(prog=prog, usage=USAGE, description=__doc__.splitlines()[0],
                                 epilog="Everything after -- is the command each process runs, e.g. "
                                        f"{prog} --nprocs 2 --devices-per-proc 4 -- python train.py --steps 10")
    ap.add_argument("--nprocs", type=int, required=True, metavar="N", help="processes to start")
    ap.add_argument("--devices-per-proc", type=int, default=None, metavar="D",
                    help="simulated CPU devices per process (CPU runs)")
    ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    ap.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                    help="stop the job after this many seconds")
    ap.add_argument("--gpu-overlap", action="store_true",
                    help="add XLA's GPU flags that overlap collectives with compute (zerojax.xla_flags)")
    ap.add_argument("--verbose", action="store_true",
                    help="also show gloo's connection messages (one per communicator and process)")
    args, extra = ap.parse_known_args(argv)
    if extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)} (the command to run goes after --, "
                 f"e.g. -- {' '.join(extra)})")
    if not cmd:
        ap.error("give the command after --, e.g. -- python experiments/train.py")
    return launch(cmd, args.nprocs, args.devices_per_proc, args.port, args.timeout, gpu_overlap=args.gpu_overlap,
                  verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
