"""Local multi-process launcher, in the spirit of ``torchrun --standalone``.

    zerojax launch --nprocs 2 --devices-per-proc 4 -- python train.py ...
    python -m zerojax.launch --nprocs 2 --devices-per-proc 4 -- python train.py ...

Starts ``--nprocs`` copies of the command with the environment that
``zj.distributed.initialize()`` reads (coordinator on a free localhost port, process
count and id, simulated CPU devices per process), prefixes each output line with
``[rank i]``, and exits with a non-zero status as soon as any process fails, stopping the
others; ``--timeout`` bounds the whole job; ``--gpu-overlap`` adds XLA's GPU flags that
overlap collectives with compute (:mod:`zerojax.xla_flags`) to every process.

Fault tolerance: ``--max-restarts R`` starts the job again (all processes) when a process
fails, is killed, stops answering (``--heartbeat-timeout``) or stops on a preemption notice
(status 75), up to R times; a :class:`zerojax.resume.Run` in the command resumes from its
newest checkpoint. See :func:`launch` and docs/fault_tolerance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from zerojax.distributed.heartbeat import (
    ENV_HEARTBEAT_S,
    ENV_LAUNCH_DIR,
    ENV_RESTART,
    REFUSED,
    RESUMABLE_EXIT,
    complete_steps,
    heartbeat_path,
    read_progress,
    read_refusal,
)
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


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one start of the job ended: ``status`` (the job's exit status), ``cause`` (a
    sentence), ``failed_on_its_own`` (a process exited with an error status by itself,
    rather than being killed, stopping answering or being preempted)."""

    status: int
    cause: str
    failed_on_its_own: bool = False
    preempted: bool = False


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _describe_exit(rank: int, pid: int, code: int) -> str:
    if code < 0:
        return f"process {rank} (pid {pid}) was killed by {_signal_name(code)}"
    return f"process {rank} (pid {pid}) exited with status {code}"


class _Job:
    """One start of the command in ``nprocs`` processes."""

    def __init__(
        self,
        cmd,
        nprocs,
        devices_per_proc,
        port,
        out,
        lock,
        gpu_overlap,
        verbose,
        launch_dir,
        heartbeat_timeout_s,
        restart,
    ):
        self.out, self.lock, self.nprocs = out, lock, nprocs
        self.launch_dir, self.heartbeat_timeout_s = launch_dir, heartbeat_timeout_s
        for name in os.listdir(launch_dir):  # the previous start's heartbeats and refusals
            if name.startswith(("heartbeat.", REFUSED)):
                os.remove(os.path.join(launch_dir, name))
        self.procs, self.pumps = [], []
        self.started = time.monotonic()
        for rank in range(nprocs):
            env = dict(os.environ)
            env.update(
                {
                    ENV_COORDINATOR: f"127.0.0.1:{port}",
                    ENV_NUM_PROCESSES: str(nprocs),
                    ENV_PROCESS_ID: str(rank),
                    "PYTHONUNBUFFERED": "1",
                    ENV_LAUNCH_DIR: launch_dir,
                    ENV_RESTART: str(restart),
                }
            )
            if heartbeat_timeout_s is not None:
                env[ENV_HEARTBEAT_S] = f"{max(0.1, heartbeat_timeout_s / 4):g}"
            if devices_per_proc is not None:
                env[ENV_LOCAL_DEVICES] = str(devices_per_proc)
            if gpu_overlap:
                env["XLA_FLAGS"] = with_gpu_overlap_flags(env.get("XLA_FLAGS", ""))
            p = subprocess.Popen(
                list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
            t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock, verbose), daemon=True)
            t.start()
            self.procs.append(p)
            self.pumps.append(t)

    def say(self, msg: str) -> None:
        with self.lock:
            self.out.write(f"zerojax.launch: {msg}\n")
            self.out.flush()

    def silent(self) -> list[tuple[int, float]]:
        """Running processes whose heartbeat is older than the timeout: ``(rank, seconds
        since the last beat)``. A process is judged from its first beat on (imports and
        start-up before ``zj.distributed.initialize()`` may take long; a process that
        never joins is left to the job's own join timeout)."""
        if self.heartbeat_timeout_s is None:
            return []
        now_wall, stale = time.time(), []
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                continue
            try:
                age = now_wall - os.stat(heartbeat_path(self.launch_dir, rank)).st_mtime
            except FileNotFoundError:
                continue
            if age > self.heartbeat_timeout_s:
                stale.append((rank, age))
        return stale

    def not_answering(self, exclude: int) -> list[tuple[int, str]]:
        """Running processes (but ``exclude``) that are stopped (``SIGSTOP``: their state in
        /proc) or have missed two heartbeats: ``(rank, how)``. When one process fails, such a
        process is the likelier cause: a stopped coordinator makes the others abort."""
        out = []
        lag = None if self.heartbeat_timeout_s is None else max(1.0, self.heartbeat_timeout_s / 2)
        for rank, p in enumerate(self.procs):
            if rank == exclude or p.poll() is not None:
                continue
            if _stopped(p.pid):
                out.append((rank, "it is stopped (SIGSTOP or a debugger)"))
                continue
            if lag is not None:
                try:
                    age = time.time() - os.stat(heartbeat_path(self.launch_dir, rank)).st_mtime
                except FileNotFoundError:
                    continue
                if age > lag:
                    out.append((rank, f"no heartbeat for {age:.1f}s"))
        return out

    def watch(
        self, deadline: float | None, preempt_grace_s: float, stop_requested: threading.Event, finish_grace_s: float
    ) -> Outcome:
        preempted_at = finished_at = None
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0, RESUMABLE_EXIT)]
            if failed:
                rank, code = failed[0]
                exit_ = _describe_exit(rank, self.procs[rank].pid, code)
                silent = self.not_answering(exclude=rank)
                if silent:
                    r, how = silent[0]
                    return Outcome(1, f"process {r} (pid {self.procs[r].pid}) stopped answering ({how}); then {exit_}")
                return Outcome(code if code > 0 else 128 - code, exit_, failed_on_its_own=code > 0)
            if finished_at is None and 0 in codes and None in codes:
                finished_at = time.monotonic()  # the others should follow within finish_grace_s
            if finished_at is not None and None in codes and time.monotonic() - finished_at > finish_grace_s:
                running = [r for r, c in enumerate(codes) if c is None]
                done = [r for r, c in enumerate(codes) if c == 0]
                pids = ", ".join(f"{r} (pid {self.procs[r].pid})" for r in running)
                return Outcome(
                    1,
                    f"process{'es' if len(running) > 1 else ''} {pids} still running {finish_grace_s:g}s after "
                    f"process{'es' if len(done) > 1 else ''} {', '.join(map(str, done))} finished with status 0: "
                    "stuck after the last step (--finish-grace)",
                )
            if all(c is not None for c in codes):
                if any(c == RESUMABLE_EXIT for c in codes):
                    return Outcome(
                        RESUMABLE_EXIT,
                        f"the job saved and stopped on a preemption notice (status {RESUMABLE_EXIT})",
                        preempted=True,
                    )
                return Outcome(0, "every process finished")
            if preempted_at is None and any(c == RESUMABLE_EXIT for c in codes):
                preempted_at = time.monotonic()  # the others are saving the same step: let them finish
            if preempted_at is not None and time.monotonic() - preempted_at > preempt_grace_s:
                running = [r for r, c in enumerate(codes) if c is None]
                return Outcome(
                    RESUMABLE_EXIT,
                    f"a process stopped on a preemption notice but processes {running} "
                    f"did not within --preempt-grace {preempt_grace_s:g}s",
                    preempted=True,
                )
            silent = self.silent()
            if silent:
                rank, age = silent[0]
                return Outcome(
                    1,
                    f"process {rank} (pid {self.procs[rank].pid}) stopped answering: no heartbeat "
                    f"for {age:.1f}s (--heartbeat-timeout {self.heartbeat_timeout_s:g})",
                )
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                return Outcome(124, f"timeout; processes {running} still running")
            if stop_requested.is_set() and preempted_at is None:
                self.say(
                    "SIGTERM: passing it to every process (each saves at the next step boundary if it runs "
                    "a zerojax.resume.Run)"
                )
                for p in self.procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                preempted_at = time.monotonic()
            time.sleep(0.05)

    def stop(self, grace_s: float) -> None:
        _stop(self.procs, grace_s)
        for t in self.pumps:
            t.join(timeout=2)


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is in the stopped state (Linux /proc; False where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _resume_point(launch_dir: str) -> tuple[str | None, int | None]:
    """The run's checkpoint folder (as its process 0 reported it) and its newest complete step."""
    progress = read_progress(launch_dir)
    if not progress:
        return None, None
    steps = complete_steps(progress["checkpoint_dir"])
    return progress["checkpoint_dir"], (steps[-1] if steps else None)


def launch(
    cmd: Sequence[str],
    nprocs: int,
    devices_per_proc: int | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    out=None,
    gpu_overlap: bool = False,
    verbose: bool = False,
    max_restarts: int = 0,
    restart_delay_s: float = 5.0,
    heartbeat_timeout_s: float | None = None,
    preempt_grace_s: float = 120.0,
    finish_grace_s: float = 120.0,
) -> int:
    """Runs ``cmd`` in ``nprocs`` processes; returns the job's exit status. ``gpu_overlap``
    adds XLA's GPU overlap flags (:mod:`zerojax.xla_flags`) to every process's ``XLA_FLAGS``.
    Gloo's "Rank i is connected to k peer ranks" lines are dropped unless ``verbose``.

    When a process exits with an error, is killed, or (with ``heartbeat_timeout_s``) stops
    answering, every process is stopped; with ``max_restarts`` the job then starts again
    (after ``restart_delay_s``, on a fresh coordinator port), up to that many times, each
    restart logged with its cause and the checkpoint step it resumes from. A process
    exiting with an error status on its own before any checkpoint exists is not restarted
    (the same command would fail the same way). A process that exits with
    ``RESUMABLE_EXIT`` (75: it saved on a preemption notice) gives the others
    ``preempt_grace_s`` to do the same; the launcher restarts that too. A process still
    running ``finish_grace_s`` after another finished with status 0 is stuck after its last
    step: it fails the job (and is restarted like a failure). When one process fails while
    another is stopped or has missed heartbeats, the stopped one is named as the cause. A
    run that refuses to go on for a reason a restart cannot change (another job owns its
    folder, the folder is read-only, it holds no run's checkpoints) is not restarted.
    ``SIGTERM`` to the launcher is passed to every process, and the launcher exits with
    their status.

    Exit status: 0 when the command finished on every process; 75 when the job stopped on
    a preemption notice with no restart left (resumable: a cluster's requeue can act on it);
    otherwise the failing process's status (128 + N when killed by signal N), or 124 on
    ``timeout_s``, which bounds the whole job, restarts included.
    """
    if nprocs < 1:
        raise ValueError(f"--nprocs must be >= 1, got {nprocs}")
    if not cmd:
        raise ValueError("no command given: zerojax launch --nprocs 2 -- python train.py")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"--max-restarts must be an int >= 0, got {max_restarts!r}")
    for name, v in (
        ("--restart-delay", restart_delay_s),
        ("--preempt-grace", preempt_grace_s),
        ("--finish-grace", finish_grace_s),
    ):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if heartbeat_timeout_s is not None and heartbeat_timeout_s <= 0:
        raise ValueError(f"--heartbeat-timeout must be > 0 seconds, got {heartbeat_timeout_s}")
    out = out or sys.stdout
    lock = threading.Lock()
    stop_requested = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    launch_dir = tempfile.mkdtemp(prefix="zerojax-launch-")
    restarts, job = 0, None
    try:
        while True:
            job = _Job(
                cmd,
                nprocs,
                devices_per_proc,
                port or free_port(),
                out,
                lock,
                gpu_overlap,
                verbose,
                launch_dir,
                heartbeat_timeout_s,
                restarts,
            )
            try:
                outcome = job.watch(deadline, preempt_grace_s, stop_requested, finish_grace_s)
            except KeyboardInterrupt:
                outcome = Outcome(130, "interrupted")
            if outcome.status == 0:
                if restarts:
                    job.say(f"the job finished after {restarts} restart{'s' if restarts > 1 else ''}")
                return 0
            stopping = "" if outcome.preempted else f"; stopping the other {nprocs - 1}" if nprocs > 1 else ""
            job.say(f"{outcome.cause}{stopping}")
            # A failed job's collectives are broken, so its processes cannot save: stop them at once. A
            # timeout or an interrupt gives them grace_s (their SIGTERM saves a zerojax.resume.Run).
            job.stop(grace_s if outcome.status in (124, 130) or outcome.preempted else 0.0)
            directory, step = _resume_point(launch_dir)
            if stop_requested.is_set() or outcome.status in (124, 130):
                return outcome.status
            refusal = read_refusal(launch_dir)
            if refusal is not None:
                rank, reason = refusal
                job.say(
                    f"process {rank} refused to go on: {reason}\nzerojax.launch: not restarting: a restart would be "
                    "refused the same way."
                )
                return outcome.status
            if restarts >= max_restarts:
                if max_restarts:
                    job.say(
                        f"no restart left (--max-restarts {max_restarts}): the job did not finish"
                        + (
                            f"; its newest complete checkpoint is step {step} in {directory}"
                            if step is not None
                            else ""
                        )
                    )
                return outcome.status
            if outcome.failed_on_its_own and step is None:
                job.say(
                    "it failed before any checkpoint was written: not restarting, since the same command "
                    "would fail the same way. Fix the command (its output is above) and launch again."
                )
                return outcome.status
            restarts += 1
            where = (
                f"resumes from the newest checkpoint that reads (the newest complete one is step {step} in {directory})"
                if step is not None
                else "starts from the beginning (no complete checkpoint yet)"
            )
            job.say(f"restart {restarts}/{max_restarts} in {restart_delay_s:g}s: the job {where}")
            time.sleep(restart_delay_s)
            job = None
    finally:
        if job is not None:
            job.stop(grace_s)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(launch_dir, ignore_errors=True)


USAGE = (
    "%(prog)s [-h] --nprocs N [--devices-per-proc D] [--port PORT] [--timeout SECONDS] [--gpu-overlap] "
    "[--verbose] [--max-restarts R] [--restart-delay SECONDS] [--heartbeat-timeout SECONDS] "
    "[--preempt-grace SECONDS] [--finish-grace SECONDS] -- command [args...]"
)


def main(argv: Sequence[str] | None = None, prog: str = "python -m zerojax.launch") -> int:
    """The launcher's command line (``zerojax launch`` / ``python -m zerojax.launch``):
    options, then ``--``, then the command every process runs; returns the job's status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1 :]
    else:
        cmd = []
    ap = argparse.ArgumentParser(
        prog=prog,
        usage=USAGE,
        description=__doc__.splitlines()[0],
        epilog="Everything after -- is the command each process runs, e.g. "
        f"{prog} --nprocs 2 --devices-per-proc 4 -- python train.py --steps 10",
    )
    ap.add_argument("--nprocs", type=int, required=True, metavar="N", help="processes to start")
    ap.add_argument(
        "--devices-per-proc", type=int, default=None, metavar="D", help="simulated CPU devices per process (CPU runs)"
    )
    ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    ap.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="stop the job after this many seconds"
    )
    ap.add_argument(
        "--gpu-overlap",
        action="store_true",
        help="add XLA's GPU flags that overlap collectives with compute (zerojax.xla_flags)",
    )
    ap.add_argument(
        "--verbose", action="store_true", help="also show gloo's connection messages (one per communicator and process)"
    )
    ft = ap.add_argument_group("fault tolerance (https://github.com/zerojax/zerojax/blob/main/docs/fault_tolerance.md)")
    ft.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart the job up to R times when a process fails, is killed, stops answering or is "
        "preempted (a zerojax.resume.Run resumes from its newest checkpoint)",
    )
    ft.add_argument("--restart-delay", type=float, default=5.0, metavar="SECONDS", help="wait before a restart")
    ft.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a process that has not beaten for this long (SIGSTOP, a frozen host) counts as failed; "
        "processes beat from zj.distributed.initialize() (default: off)",
    )
    ft.add_argument(
        "--preempt-grace",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="after one process stops on a preemption notice (status 75), how long the others get to save and stop too",
    )
    ft.add_argument(
        "--finish-grace",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="after one process finishes (status 0), how long the others get to finish too before the "
        "job counts as failed (a process stuck after its last step)",
    )
    args, extra = ap.parse_known_args(argv)
    if extra:
        ap.error(
            f"unrecognized arguments: {' '.join(extra)} (the command to run goes after --, e.g. -- {' '.join(extra)})"
        )
    if not cmd:
        ap.error("give the command after --, e.g. -- python train.py")
    try:
        return launch(
            cmd,
            args.nprocs,
            args.devices_per_proc,
            args.port,
            args.timeout,
            gpu_overlap=args.gpu_overlap,
            verbose=args.verbose,
            max_restarts=args.max_restarts,
            restart_delay_s=args.restart_delay,
            heartbeat_timeout_s=args.heartbeat_timeout,
            preempt_grace_s=args.preempt_grace,
            finish_grace_s=args.finish_grace,
        )
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
