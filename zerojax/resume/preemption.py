"""Agreeing on the step boundary where every process saves after a preemption notice.

``SIGTERM`` is what Kubernetes and SLURM send before they take a node. In a multi-process
job JAX's coordination service already catches it (its preemption notifier, installed by
``jax.distributed.initialize``) and agrees, in the background, on the first step every
process has not yet passed; ``multihost_utils.reached_preemption_sync_point(step)`` turns
True there on all processes at once, so that all save the same step. A single process has
no coordination service: a ``SIGTERM`` handler sets a flag, read at the next boundary.
"""

from __future__ import annotations

import signal
import threading

import jax

from zerojax.distributed.heartbeat import RESUMABLE_EXIT

__all__ = ["RESUMABLE_EXIT", "PreemptionWatch"]


def _coordinated() -> bool:
    return jax.process_count() > 1


class PreemptionWatch:
    """``reached(step)``: whether the run should save and stop after ``step``."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._previous = None
        if not _coordinated() and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self._flag.set()

    def reached(self, step: int) -> bool:
        if _coordinated():
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(int(step)))
        return self._flag.is_set()

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
