"""Which checkpoint a run resumes from: the same step on every process, agreed before any
process waits in a collective.

A restore through orbax ends in a barrier across processes. If one process's file of the
newest step is damaged, that process fails before the barrier while the others wait in it;
whatever collective the failing process calls next (an agreement, the next step's restore)
pairs with the wrong one, and from then on the processes are a collective apart. So each
process first reads its own shards of a step with no collective at all
(:func:`zerojax.checkpoint.io.read_step`), and only then do the processes compare results,
in one agreement per step tried: every process reads the same steps in the same order and
meets the others at the same agreement.

A step counts as damaged, is named and skipped for the one before it, when its run record
or any process's data does not read, or when it has no run record (a stray folder, a step
whose record was lost, another program's checkpoint). Only a folder in which no step has a
run record at all is refused (:class:`NotARunError`), and another model or optimizer is
refused (:class:`~zerojax.checkpoint.CheckpointMismatchError`) wherever it is seen. The
damaged steps newer than the one resumed from are then moved aside (renamed
``<step>.damaged``, nothing deleted), so that the run saves those steps again.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from zerojax.checkpoint.io import CheckpointMismatchError, StepRead, read_step, read_step_json
from zerojax.state import ZeroState

FORMAT = 1  # the run record's layout
OK, DAMAGED, NOT_A_RUN, MISMATCH = 0, 1, 2, 3


class NotARunError(ValueError):
    """A run directory that holds checkpoints, none of them saved by a :class:`Run`."""


def is_run_record(record: Any) -> bool:
    return isinstance(record, dict) and record.get("format") == FORMAT


@dataclasses.dataclass
class Tried:
    """One process's attempt at one step."""

    status: int
    why: str = ""
    record: dict | None = None
    read: StepRead | None = None
    error: Exception | None = None


def _short(e: Exception) -> str:
    """An error in one line (a TensorStore error spans dozens)."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}{'...' if len(first) > 200 or chr(10) in str(e).strip() else ''}"


def try_step(directory: str, step: int, target: ZeroState) -> Tried:
    """Reads this process's part of checkpoint ``step`` (run record, metadata, shards); no collective."""
    try:
        record = read_step_json(directory, step, "extra")
    except Exception as e:
        return Tried(DAMAGED, f"its run record does not read ({_short(e)})")
    if not is_run_record(record):
        return Tried(NOT_A_RUN, "it has no run record: not saved by a zerojax.resume.Run, or its record was lost")
    try:
        read = read_step(directory, target, step)
    except CheckpointMismatchError as e:
        return Tried(MISMATCH, str(e), error=e)
    except Exception as e:  # any failure to read is damage
        return Tried(DAMAGED, _short(e))
    return Tried(OK, record=record, read=read)


def gather(status: int) -> list[int]:
    """Every process's ``status``, in process order, on every process (one collective)."""
    if jax.process_count() == 1:
        return [status]
    from jax.experimental import multihost_utils

    return [int(s) for s in np.asarray(multihost_utils.process_allgather(np.array(status, dtype=np.int32))).ravel()]


def same_steps(steps: list[int]) -> list[int]:
    """Process 0's list of complete checkpoints, on every process: each then tries the same
    steps in the same order (a shared file system may show a rename late on some hosts)."""
    if jax.process_count() == 1:
        return steps
    from jax.experimental import multihost_utils

    n = int(multihost_utils.broadcast_one_to_all(np.array(len(steps), dtype=np.int64)))
    padded = np.full(max(n, 1), -1, dtype=np.int64)
    padded[: min(n, len(steps))] = steps[:n]
    return [int(s) for s in multihost_utils.broadcast_one_to_all(padded)[:n]]


def _processes(ranks: list[int]) -> str:
    return f"process{'es' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def choose(directory: str, steps: list[int], target: ZeroState | None, say) -> tuple[int | None, Tried | None, list]:
    """The newest step every process reads, its :class:`Tried` on this process, and the
    steps skipped (newer ones, damaged), each ``(step, why)``. Raises
    :class:`NotARunError` when no step has a run record, and
    :class:`~zerojax.checkpoint.CheckpointMismatchError` for another model or optimizer."""
    skipped, any_run = [], False
    for s in reversed(steps):
        mine = try_step(directory, s, target)
        statuses = gather(mine.status)
        where = os.path.join(directory, str(s))
        if MISMATCH in statuses:
            if mine.error is not None:
                raise mine.error
            raise CheckpointMismatchError(
                f"checkpoint {where} holds another model or optimizer than this restore asks for "
                f"(found on {_processes([i for i, x in enumerate(statuses) if x == MISMATCH])}; its output names "
                "the leaves). Restore with the model and optimizer that were saved."
            )
        if all(x == OK for x in statuses):
            return s, mine, skipped
        any_run |= any(x != NOT_A_RUN for x in statuses)
        bad = [i for i, x in enumerate(statuses) if x != OK]
        if mine.status != OK:
            why = mine.why + (f"; unreadable on {_processes(bad)}" if len(statuses) > 1 else "")
        else:
            why = f"it reads on this process, not on {_processes(bad)}"
        skipped.append((s, why))
        say(f"checkpoint {where} is damaged ({why}); trying the checkpoint before it.")
    if steps and not any_run:
        raise NotARunError(
            f"{directory} holds checkpoints (steps {steps}) but none was saved by a zerojax.resume.Run "
            "(none has a run record): restore them with zj.restore_checkpoint, or give the Run a directory "
            "of its own."
        )
    return None, None, skipped


def move_aside(directory: str, skipped: list) -> list[str]:
    """Renames each skipped step's folder ``<step>.damaged`` (``.damaged-2``, ... when taken),
    on process 0, then waits until every process is past the rename; returns the new paths."""
    moved = []
    if skipped and jax.process_index() == 0:
        for s, _ in skipped:
            src = os.path.join(directory, str(s))
            dst, k = f"{src}.damaged", 1
            while os.path.exists(dst):
                k += 1
                dst = f"{src}.damaged-{k}"
            os.rename(src, dst)
            moved.append(dst)
    if skipped and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("zerojax.resume: damaged steps moved aside")
    return moved
