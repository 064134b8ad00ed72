"""Agreement among a job's processes for checkpoint reads and writes, with bounded waits.

A multi-process export (or load) has checks whose outcome differs by process (the float16
range of each process's own shards, whether its view of the output folder is writable)
and steps that can fail in one process only (a full disk). :class:`Processes` makes every
such outcome common: at each phase every process reports to JAX's coordination service
(the key-value store ``jax.distributed.initialize`` starts) whether it succeeded, and waits
for every other process's report, so that a failure anywhere raises on every process,
naming the process and its problem. Device collectives (``multihost_utils.
sync_global_devices``) are not used: they wait without a timeout, and a process that has
raised never joins them.

The waits are bounded. While a process works through a long phase (writing its shards) it
calls :meth:`Processes.alive`, which at most every :data:`POLL_S` seconds records that it is
making progress and looks for a failure another process reported in the phase: a process
that fails reports at once, and every other process stops within about ``POLL_S`` plus the
piece it is writing. A process that reports nothing and makes no progress (killed, hung) for
``timeout_s`` seconds is given up on: the others raise ``TimeoutError`` naming it.

In a single process nothing is exchanged: :meth:`Processes.agree` raises the process's own
error as it is.
"""

from __future__ import annotations

import collections
import itertools
import json
import time

import jax

POLL_S = 0.25  # the longest a waiting process sleeps between looks, and alive()'s period
DEFAULT_TIMEOUT_S = 300.0  # no report and no progress from a process for this long: give up on it

_CALLS: dict[str, itertools.count] = collections.defaultdict(itertools.count)  # calls so far, per kind
# Exception types raised again, by name, on every process (other types become RuntimeError).
_TYPES = {
    t.__name__: t
    for t in (
        ValueError,
        TypeError,
        OSError,
        PermissionError,
        FileNotFoundError,
        FileExistsError,
        NotADirectoryError,
        IsADirectoryError,
        TimeoutError,
    )
}


class Stopped(Exception):
    """Raised by :meth:`Processes.alive` in a process that learns another one failed."""


class Processes:
    """The processes of the job, agreeing phase by phase on one call (an export, a load).

    Every process must create one for the same call, in the same order (the calls of each
    kind ``what`` are numbered), and call :meth:`agree` for the same phases in the same
    order. ``collective=False``: a call this process makes alone (its own devices): it
    is process 0 of a group of one, and nothing is exchanged.
    """

    def __init__(self, what: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, collective: bool = True):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        self.what, self.timeout_s = what, float(timeout_s)
        self.count, self.rank = (jax.process_count(), jax.process_index()) if collective else (1, 0)
        self.client = None
        if self.count > 1:
            self.prefix = f"zerojax/{what}/{next(_CALLS[what])}"
            from zerojax._jaxpr import settings

            try:  # the client jax.distributed.initialize starts (the same API in jax 0.10 and 0.12)
                self.client = settings.distributed_client()
            except ImportError as e:
                raise RuntimeError(f"{what}: {e}") from None
            if self.client is None:
                raise RuntimeError(
                    f"{what}: {self.count} processes but no coordination service; start the job with "
                    "zj.distributed.initialize() (jax.distributed.initialize)."
                )
        self.phase: str | None = None
        self._next = 0.0
        self._beats = 0

    @property
    def multi(self) -> bool:
        return self.client is not None

    def start(self, phase: str) -> None:
        """Enters ``phase``: :meth:`alive` watches it for other processes' failures."""
        self.phase = phase

    def alive(self) -> None:
        """Tells the others this process is making progress, and raises :class:`Stopped`
        if another process reported a failure in the current phase; does anything at most
        every ``POLL_S`` seconds, so that it can be called for every piece of work."""
        if self.client is None or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + POLL_S
        self._beats += 1
        self.client.key_value_set(f"{self.prefix}/alive/{self.rank}", str(self._beats), allow_overwrite=True)
        if self.phase is not None:
            failed = sorted(r for r, v in self._reports(self.phase).items() if v and not json.loads(v)["stopped"])
            if failed:
                raise Stopped(f"process {failed[0]} failed")

    def agree(self, phase: str, error: BaseException | None, when: str = "") -> None:
        """Reports this process's outcome of ``phase`` (``error``, or None) and waits for
        every process's; raises on every process if any failed, naming each failed process
        and its error (``when`` says how far the call got, e.g. "before writing anything").
        A single process raises ``error`` itself."""
        if self.client is None:
            if error is not None:
                raise error
            return
        report = (
            ""
            if error is None
            else json.dumps(
                {"type": type(error).__name__, "message": str(error), "stopped": isinstance(error, Stopped)}
            )
        )
        self.client.key_value_set(f"{self.prefix}/{phase}/{self.rank}", report)
        reports = self._wait(phase)
        failed = {r: json.loads(v) for r, v in reports.items() if v}
        real = {r: f for r, f in failed.items() if not f["stopped"]}
        if not real:
            if failed:  # (cannot happen: a process stops only for another's failure)
                raise RuntimeError(f"{self.what}: processes {sorted(failed)} stopped in {phase!r}.")
            return
        raise self._combined(real, when) from error

    def _combined(self, failed: dict[int, dict], when: str) -> BaseException:
        by_message: dict[str, list[int]] = {}
        for r, f in sorted(failed.items()):
            by_message.setdefault(f["message"], []).append(r)
        where = lambda ranks: (
            f"every process ({self.count})"
            if len(ranks) == self.count
            else f"process{'es' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {self.count}"
        )
        parts = [f"on {where(ranks)}: {msg}" for msg, ranks in by_message.items()]
        text = f"{self.what} failed{' ' + when if when else ''}; " + "; ".join(parts)
        first = failed[min(failed)]["type"]
        return _TYPES.get(first, RuntimeError)(text)

    def _reports(self, phase: str) -> dict[int, str]:
        return {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get(f"{self.prefix}/{phase}/")}

    def _wait(self, phase: str) -> dict[int, str]:
        """Every process's report of ``phase``; ``TimeoutError`` when a process that has not
        reported shows no progress for ``timeout_s``."""
        sleep, seen, since = 0.002, {}, {}
        while True:
            reports = self._reports(phase)
            if len(reports) == self.count:
                return reports
            now = time.monotonic()
            beats = {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get(f"{self.prefix}/alive/")}
            pending = [r for r in range(self.count) if r not in reports]
            for r in pending:
                if r not in since or beats.get(r) != seen.get(r):
                    seen[r], since[r] = beats.get(r), now
            stalled = [r for r in pending if now - since[r] > self.timeout_s]
            if stalled:
                raise TimeoutError(
                    f"{self.what}: process{'es' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))} of "
                    f"{self.count} neither finished {phase!r} nor made progress for {self.timeout_s:g} s (timeout_s); "
                    "it may have died or hung. Nothing was completed."
                )
            time.sleep(sleep)
            sleep = min(2 * sleep, POLL_S)
