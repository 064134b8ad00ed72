"""Runs that survive a lost process, a preemption and a restart on other devices.

:class:`Run` saves everything a run needs to continue (state, step, data position) in one
checkpoint, resumes from the newest one that reads on every process, and on ``SIGTERM``
saves at the next step boundary on every process and exits with :data:`RESUMABLE_EXIT`;
``zerojax launch --max-restarts`` restarts the job. One job writes a run's folder at a time
(:mod:`zerojax.resume.owner`). See docs/fault_tolerance.md.
"""

from zerojax.resume.choose import NotARunError
from zerojax.resume.owner import RunFolderError, RunOwnedError
from zerojax.resume.preemption import RESUMABLE_EXIT
from zerojax.resume.run import Preempted, Run, RunConfig, data_parallel
from zerojax.resume.sampler import IndexSampler

__all__ = [
    "RESUMABLE_EXIT",
    "IndexSampler",
    "NotARunError",
    "Preempted",
    "Run",
    "RunConfig",
    "RunFolderError",
    "RunOwnedError",
    "data_parallel",
]
