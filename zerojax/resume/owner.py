"""One writer per run folder: the owner record, and the check that the folder takes writes.

Two jobs started on one folder would interleave their checkpoints (job A's steps 3, 12, 15
beside job B's 6 and 9), and a resume of either could restore the other's state. A run
therefore claims its folder in ``zerojax-run-owner.json``: which job, on which host, under
which process id, since when, with which command. A start refuses a folder that another
job holds while that job is alive; every save checks the record still names this job.

A job is identified without any collective, the same on every process of the job and
across its restarts: ``ZEROJAX_JOB_ID`` when set, else SLURM's job id (a requeue keeps it),
else the ``zerojax launch`` instance (its restarts keep it), else the coordinator address of
a multi-process job, else the host and process id of a single process. Another job counts
as alive while its process 0 runs on this host, or, seen from another host, while its record
was refreshed (every :data:`REFRESH_S` seconds, by process 0) within :data:`STALE_S`
seconds. :meth:`Run.finish <zerojax.resume.Run.finish>` releases the folder.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

OWNER = "zerojax-run-owner.json"
REFRESH_S = 30.0  # process 0 touches its record this often while the run lives
STALE_S = 120.0  # a record from another host not touched for this long is a job that is gone
ENV_JOB_ID = "ZEROJAX_JOB_ID"


class RunOwnedError(RuntimeError):
    """Another job writes this run's folder: two writers would interleave their checkpoints."""


class RunFolderError(OSError):
    """The run's checkpoint folder cannot be written from this process."""


def job_id() -> str:
    """This job's identity: the same on each of its processes and across its restarts."""
    from zerojax.distributed.heartbeat import ENV_LAUNCH_DIR
    from zerojax.distributed.init import ENV_COORDINATOR, ENV_NUM_PROCESSES

    host = socket.gethostname()
    if os.environ.get(ENV_JOB_ID):
        return os.environ[ENV_JOB_ID]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm job {os.environ['SLURM_JOB_ID']}"
    if os.environ.get(ENV_LAUNCH_DIR):
        return f"zerojax launch on {host} ({os.environ[ENV_LAUNCH_DIR]})"
    if os.environ.get(ENV_COORDINATOR) and int(os.environ.get(ENV_NUM_PROCESSES, "1")) > 1:
        return f"the job coordinated at {os.environ[ENV_COORDINATOR]}"
    return f"process {os.getpid()} on {host}"


def _record() -> dict:
    return {
        "job": job_id(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv)[:300],
        "released": False,
    }


def read_owner(directory: str) -> tuple[dict | None, float | None]:
    """The owner record and its age in seconds (None, None when there is none; a record
    that does not parse is treated as none: it names no job that could be refused)."""
    path = os.path.join(directory, OWNER)
    try:
        with open(path) as f:
            record = json.load(f)
        age = time.time() - os.stat(path).st_mtime
    except (OSError, ValueError):
        return None, None
    return (record, age) if isinstance(record, dict) and "job" in record else (None, None)


def describe(record: dict, age: float | None = None) -> str:
    seen = "" if age is None else f", its record refreshed {age:.0f}s ago"
    return (
        f"{record.get('job')!s} (process 0: pid {record.get('pid')} on {record.get('host')}, "
        f"since {record.get('since')}, running {record.get('command')!r}{seen})"
    )


def _alive(record: dict, age: float) -> bool:
    if record.get("released"):
        return False
    if record.get("host") == socket.gethostname():
        try:
            os.kill(int(record.get("pid", -1)), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError, OverflowError):
            return True
        return True
    return age < STALE_S


def _write(directory: str, record: dict, exclusive: bool) -> bool:
    """Writes the record; ``exclusive``: only if there is none yet (False when there is)."""
    path = os.path.join(directory, OWNER)
    if exclusive:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        return True
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return True


def claim(directory: str) -> None:
    """Makes this job the folder's owner, or raises :class:`RunOwnedError` naming the live
    job that owns it. Run on process 0 only."""
    mine = _record()
    for _ in range(3):  # a record appearing between the read and the exclusive create: read again
        record, age = read_owner(directory)
        if record is None:
            if _write(directory, mine, exclusive=True):
                return
            continue
        if record["job"] != mine["job"] and _alive(record, age):
            raise RunOwnedError(_refusal(directory, record, age))
        _write(directory, mine, exclusive=False)
        return
    raise RunOwnedError(
        f"the owner record {os.path.join(directory, OWNER)} keeps changing: another job is starting in it."
    )


def check_owner(directory: str) -> None:
    """Raises :class:`RunOwnedError` when the record names another job (checked before
    each save, on every process)."""
    record, age = read_owner(directory)
    if record is not None and record["job"] != job_id():
        raise RunOwnedError(
            f"{directory} is now written by another job, {describe(record, age)}; this job ({job_id()}) "
            "stops before saving, so that the two do not interleave their checkpoints. Give each run a "
            "folder of its own (RunConfig(directory=...))."
        )


def _refusal(directory: str, record: dict, age: float) -> str:
    remote = record.get("host") != socket.gethostname()
    when = (
        f"; if that job is gone, its claim lapses {max(0.0, STALE_S - age):.0f}s from now, or delete {OWNER}"
        if remote
        else f"; if it should not be running, stop it (kill {record.get('pid')})"
    )
    return (
        f"the run folder {directory} is being written by another job, {describe(record, age)}. Two jobs "
        f"writing one folder interleave their checkpoints, and a resume of either could restore the "
        f"other's state: give this run a folder of its own (RunConfig(directory=...)){when}."
    )


def release(directory: str) -> None:
    """Marks this job's claim as released (its run finished): the next job takes the folder at once."""
    record, _ = read_owner(directory)
    if record is not None and record["job"] == job_id():
        _write(directory, {**record, "released": True}, exclusive=False)


_REFRESHING: dict[str, threading.Event] = {}


def keep_fresh(directory: str) -> None:
    """Touches this job's record every :data:`REFRESH_S` seconds (a daemon thread), so that
    another host sees the job alive. Idempotent per folder."""
    if directory in _REFRESHING:
        return
    stop = _REFRESHING[directory] = threading.Event()
    path = os.path.join(directory, OWNER)

    def refresh() -> None:
        while not stop.wait(REFRESH_S):
            record, _ = read_owner(directory)
            if record is None or record["job"] != job_id() or record.get("released"):
                return
            try:
                os.utime(path)
            except OSError:
                return

    threading.Thread(target=refresh, name="zerojax-run-owner", daemon=True).start()


def stop_refreshing(directory: str) -> None:
    stop = _REFRESHING.pop(directory, None)
    if stop is not None:
        stop.set()


def check_writable(directory: str) -> None:
    """Creates ``directory`` if needed and writes and removes a probe file in it, raising
    :class:`RunFolderError` naming the folder, the process and the fix when it cannot: a
    read-only folder is found before step 1, not at the first save."""
    host, pid = socket.gethostname(), os.getpid()
    probe = os.path.join(directory, f".zerojax-write-probe.{host}.{pid}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        raise RunFolderError(
            f"the run's checkpoint folder {directory} is not writable from process {pid} on {host} "
            f"({type(e).__name__}: {e}): no checkpoint could be saved. Make it writable (permissions, a "
            "read-write mount) or give RunConfig a folder this job can write."
        ) from None
