"""What a launched process tells ``zerojax launch``: that it is alive, and where its run stands.

``zerojax launch`` gives every process a folder (``ZEROJAX_LAUNCH_DIR``) shared with the
launcher. A process that joins the job (:func:`zerojax.distributed.initialize`) touches
``heartbeat.<rank>`` there every ``ZEROJAX_HEARTBEAT_S`` seconds from a daemon thread: a
process that stops answering (``SIGSTOP``, a frozen host, a hung interpreter) stops
touching it, and the launcher's ``--heartbeat-timeout`` catches it. A resumable run
(:class:`zerojax.resume.Run`) writes ``progress.json`` (its checkpoint directory and step),
from which the launcher says which step a restart resumes from and whether any checkpoint
exists yet, and ``refused.<rank>`` when a run refuses to start or to go on for a reason
a restart cannot change (another job owns its folder, the folder is read-only, it holds no
run's checkpoints): the launcher then does not restart. Outside the launcher these are
no-ops.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV_LAUNCH_DIR = "ZEROJAX_LAUNCH_DIR"
ENV_HEARTBEAT_S = "ZEROJAX_HEARTBEAT_S"
ENV_RESTART = "ZEROJAX_RESTART"  # how many times the launcher has restarted the job (0: first start)
PROGRESS = "progress.json"
REFUSED = "refused."
# The exit status of a run that saved and stopped on a preemption notice: EX_TEMPFAIL of
# sysexits.h ("a temporary failure; the user is invited to retry"). ``zerojax launch``
# restarts on it; a SLURM or Kubernetes requeue rule can match it.
RESUMABLE_EXIT = 75

_STARTED: list[threading.Thread] = []


def heartbeat_path(launch_dir: str, rank: int) -> str:
    return os.path.join(launch_dir, f"heartbeat.{rank}")


def _rank() -> int:
    from zerojax.distributed.init import ENV_PROCESS_ID

    return int(os.environ.get(ENV_PROCESS_ID, "0"))


def start_heartbeat() -> bool:
    """Starts touching this process's heartbeat file, when the launcher asked for one;
    returns whether a heartbeat runs. Idempotent."""
    launch_dir, interval = os.environ.get(ENV_LAUNCH_DIR), os.environ.get(ENV_HEARTBEAT_S)
    if not launch_dir or not interval:
        return False
    if _STARTED:
        return True
    path, every = heartbeat_path(launch_dir, _rank()), float(interval)

    def beat() -> None:
        while True:
            try:
                with open(path, "a"):
                    os.utime(path)
            except OSError:  # the launcher removed its folder: the job is over
                return
            time.sleep(every)

    t = threading.Thread(target=beat, name="zerojax-heartbeat", daemon=True)
    t.start()
    _STARTED.append(t)
    return True


def write_progress(checkpoint_dir: str, step: int) -> None:
    """Records (process 0 only, atomically) where the run stands, for the launcher."""
    launch_dir = os.environ.get(ENV_LAUNCH_DIR)
    if not launch_dir or _rank() != 0:
        return
    tmp = os.path.join(launch_dir, PROGRESS + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump({"checkpoint_dir": os.path.abspath(checkpoint_dir), "step": int(step)}, f)
        os.replace(tmp, os.path.join(launch_dir, PROGRESS))
    except OSError:
        pass


def write_refusal(reason: str) -> None:
    """Tells the launcher (any process) that this run refused to go on for a reason a
    restart cannot change."""
    launch_dir = os.environ.get(ENV_LAUNCH_DIR)
    if not launch_dir:
        return
    try:
        with open(os.path.join(launch_dir, f"{REFUSED}{_rank()}"), "w") as f:
            f.write(reason)
    except OSError:
        pass


def read_refusal(launch_dir: str) -> tuple[int, str] | None:
    """The lowest rank's refusal and its reason, if any process wrote one."""
    try:
        names = sorted(n for n in os.listdir(launch_dir) if n.startswith(REFUSED) and n[len(REFUSED) :].isdigit())
    except OSError:
        return None
    for name in sorted(names, key=lambda n: int(n[len(REFUSED) :])):
        try:
            with open(os.path.join(launch_dir, name)) as f:
                return int(name[len(REFUSED) :]), f.read()
        except OSError:
            continue
    return None


def read_progress(launch_dir: str) -> dict | None:
    try:
        with open(os.path.join(launch_dir, PROGRESS)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def complete_steps(checkpoint_dir: str) -> list[int]:
    """The complete checkpoints of a zerojax/orbax checkpoint directory, read from the
    names alone (a step's folder is renamed to its number only once every process has
    written it; a save in progress or killed has a temporary name), oldest first."""
    try:
        names = os.listdir(checkpoint_dir)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(checkpoint_dir, n)))
