"""A training run that resumes exactly: one call restores or starts, one call per step saves.

    run = zj.resume.Run(zj.resume.RunConfig("ckpt", save_every=100))
    config = run.micro_batches(zj.ZeroConfig(stage=3), mesh, global_batch=256)
    state = run.restore_or_init(params, tx, mesh=mesh, config=config, data=sampler)
    step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=config)
    while run.step < total_steps:
        state, metrics = step(state, batch_of(next(sampler)))
        run.completed(state)          # saves every save_every steps; on SIGTERM saves and exits 75
    run.finish(state)

Everything the run needs to continue lands in one checkpoint step, complete or absent
together (orbax renames a step's folder only once every process has written it): the ZeRO
state (parameters, optimizer state, master weights, RNG key, loss-scale state, step
counters), the run's step, the data position (``data.get_state()``), the mesh it ran on and
any ``extra`` of the caller's.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from zerojax.checkpoint.io import (
    CheckpointMismatchError,
    checkpoint_extra,
    checkpoint_steps,
    restore_checkpoint,
    save_checkpoint,
    wait,
)
from zerojax.config import ZeroConfig
from zerojax.distributed.heartbeat import start_heartbeat, write_progress
from zerojax.resume.preemption import RESUMABLE_EXIT, PreemptionWatch
from zerojax.state import ZeroState, abstract_state, init_state

FORMAT = 1  # the run record's layout


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where and how often a resumable run saves.

    ``directory``: the run's own checkpoint folder (shared by every process). ``save_every``:
    steps between checkpoints; a preemption notice saves at the next step boundary whatever
    the count. ``keep_last``: checkpoints kept (None: all). ``synchronous``: each save
    blocks until it is on disk (default: only for the copy from the devices; the files are
    written in the background while training goes on).
    """

    directory: str | os.PathLike
    save_every: int
    keep_last: int | None = 3
    synchronous: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)) or not os.fspath(self.directory):
            raise TypeError(f"directory must be a path, got {self.directory!r}.")
        for name in ("save_every", "keep_last"):
            v = getattr(self, name)
            if (v is not None or name == "save_every") and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(
                    f"{name} must be a positive int{' or None' if name == 'keep_last' else ''}, got {v!r}."
                )
        if not isinstance(self.synchronous, bool):
            raise TypeError(f"synchronous must be a bool, got {self.synchronous!r}.")


class NotARunError(ValueError):
    """A checkpoint in a run's directory that no :class:`Run` saved."""


class Preempted(SystemExit):
    """Raised by :meth:`Run.completed` once the run has saved on a preemption notice; exits
    the interpreter with status ``RESUMABLE_EXIT`` (75) unless caught."""


def _say(msg: str) -> None:
    sys.stdout.write(f"zerojax.resume: {msg}\n")
    sys.stdout.flush()


def data_parallel(mesh: Any, config: ZeroConfig) -> int:
    """Devices the batch's rows are split over: all, but the context and tensor axes."""
    shape = dict(mesh.shape)
    return int(mesh.devices.size) // shape.get(config.context_axis, 1) // shape.get(config.tensor_axis, 1)


def _encode(data_state: Any) -> Any:
    """A data position as JSON: grain's DataLoader iterators give bytes, its datasets dicts."""
    if isinstance(data_state, bytes):
        return {"bytes_base64": base64.b64encode(data_state).decode("ascii")}
    return data_state


def _decode(saved: Any) -> Any:
    if isinstance(saved, dict) and set(saved) == {"bytes_base64"}:
        return base64.b64decode(saved["bytes_base64"])
    return saved


def _same_steps(steps: list[int]) -> list[int]:
    """Process 0's list of complete checkpoints, on every process: each then tries the same
    steps in the same order (a shared file system may show a rename late on some hosts)."""
    if jax.process_count() == 1:
        return steps
    from jax.experimental import multihost_utils

    n = int(multihost_utils.broadcast_one_to_all(np.array(len(steps), dtype=np.int64)))
    padded = np.full(max(n, 1), -1, dtype=np.int64)
    padded[: min(n, len(steps))] = steps[:n]
    return [int(s) for s in multihost_utils.broadcast_one_to_all(padded)[:n]]


def _agree(ok: bool) -> bool:
    """Whether every process's ``ok`` is True (each process learns the same answer)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array(ok, dtype=np.int32))))


class Run:
    """A resumable training run over :class:`RunConfig`'s directory; see the module docstring.

    ``step`` is the number of steps completed: where the loop goes on.

    Example (a run that is stopped after 3 steps and resumed to 5; the data position and
    the step come back with the state):
      >>> import tempfile, jax.numpy as jnp, optax, zerojax as zj
      >>> from zerojax.resume import IndexSampler, Run, RunConfig
      >>> mesh, cfg, tx, d = zj.make_mesh(), zj.ZeroConfig(stage=3), optax.sgd(0.1), tempfile.mkdtemp()
      >>> xs = jnp.arange(64.0).reshape(32, 2)
      >>> loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
      >>> step = zj.make_train_step(loss, tx, mesh=mesh, config=cfg)
      >>> def train(until):
      ...     run, data = Run(RunConfig(d, save_every=2)), IndexSampler(32, 8, seed=1)
      ...     state = run.restore_or_init({"w": jnp.ones((2, 1))}, tx, mesh=mesh, config=cfg, data=data)
      ...     while run.step < until:
      ...         state, _ = step(state, xs[next(data)])
      ...         run.completed(state)
      ...     run.finish(state)
      ...     return run.step, data.position
      >>> train(3)
      zerojax.resume: no checkpoint in ...; starting at step 0
      (3, 3)
      >>> train(5)
      zerojax.resume: resuming at step 3 from .../3 (saved on 8 devices, 8 data-parallel, grad_accum_steps 1)
      (5, 5)
    """

    def __init__(self, config: RunConfig) -> None:
        if not isinstance(config, RunConfig):
            raise TypeError(f"Run takes a zerojax.resume.RunConfig, got {type(config).__name__}.")
        self.config = config
        self.directory = os.path.abspath(os.fspath(config.directory))
        self.step = 0
        self.extra: dict | None = None  # the caller's extra of the checkpoint resumed from
        self._data = None
        self._saved_at: int | None = None
        self._record_cache: tuple[int, dict] | None | bool = False
        self._context: dict = {}
        self._watch = PreemptionWatch()
        start_heartbeat()

    # -- where the run stands -------------------------------------------------------------

    def _latest_record(self) -> tuple[int, dict] | None:
        """The newest checkpoint whose run record reads, with that record."""
        if self._record_cache is False:
            self._record_cache = None
            for s in reversed(checkpoint_steps(self.directory)):
                try:
                    record = checkpoint_extra(self.directory, s)
                except Exception:  # an unreadable step: restore_or_init says so and falls back
                    continue
                self._record_cache = (s, self._check_record(s, record))
                break
        return self._record_cache

    def _check_record(self, step: int, record: Any) -> dict:
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise NotARunError(
                f"checkpoint step {step} in {self.directory} was not saved by a zerojax.resume.Run "
                "(it has no run record): restore it with zj.restore_checkpoint, or give the Run a "
                "directory of its own."
            )
        return record

    def micro_batches(self, config: ZeroConfig, mesh: Any, global_batch: int) -> ZeroConfig:
        """``config``, with ``grad_accum_steps`` adjusted when the run resumes on another
        number of data-parallel devices, so that the global batch stays ``global_batch``
        and no device gets more rows per micro-batch than it had when the checkpoint was
        saved (8 -> 4 devices: twice the micro-batches; back to 8: as before). Says what
        it changed. A fresh run, or one on the same devices, gets ``config`` unchanged.

        ``global_batch`` must be the saved run's: another would change the trajectory."""
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a zj.ZeroConfig, got {type(config).__name__}.")
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive int, got {global_batch!r}.")
        dp = data_parallel(mesh, config)
        self._context = {"global_batch": global_batch}
        latest = self._latest_record()
        if latest is None:
            return config
        s, record = latest
        if record["global_batch"] is None:
            _say(
                f"the checkpoint (step {s}) does not record its global batch (saved before micro_batches was "
                "called): grad_accum_steps stays as given."
            )
            return config
        if record["global_batch"] != global_batch:
            raise ValueError(
                f"the run in {self.directory} was saved (step {s}) with a global batch of "
                f"{record['global_batch']} rows; this start asks for {global_batch}. Resume with "
                f"global_batch={record['global_batch']} (another batch changes the trajectory), or "
                "start the new run in another directory."
            )
        if dp == record["data_parallel"]:
            return config
        rows = record["rows_per_micro_batch"]
        for a in range(1, global_batch + 1):
            if global_batch % (dp * a) == 0 and global_batch // (dp * a) <= rows:
                break
        else:
            raise ValueError(
                f"a global batch of {global_batch} rows cannot be split over {dp} data-parallel devices "
                f"in micro-batches of at most {rows} rows per device (the saved run's): use a device "
                f"count that divides {global_batch}."
            )
        _say(
            f"the checkpoint (step {s}) ran on {record['data_parallel']} data-parallel devices with "
            f"grad_accum_steps {record['grad_accum_steps']} ({rows} rows per device per micro-batch); on {dp} "
            f"devices grad_accum_steps becomes {a} ({global_batch // (dp * a)} rows per device per micro-batch), "
            f"the global batch stays {global_batch}."
        )
        return dataclasses.replace(config, grad_accum_steps=a)

    # -- starting ---------------------------------------------------------------------------

    def restore_or_init(
        self, params: Any, tx: Any, *, mesh: Any, config: ZeroConfig, data: Any = None, **init_kwargs: Any
    ) -> ZeroState:
        """The state to train from: the newest complete checkpoint of the run's directory
        that reads on every process, or ``zj.init_state(params, tx, mesh=mesh,
        config=config, **init_kwargs)`` when there is none. A checkpoint that does not read
        (a damaged file) is named and skipped for the one before it; one that holds
        another model or optimizer raises :class:`~zerojax.checkpoint.CheckpointMismatchError`
        naming the leaves, before any step. ``data`` (an object with ``get_state`` /
        ``set_state``, such as :class:`IndexSampler` or a grain iterator) is set to the
        saved position. Sets :attr:`step`."""
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a zj.ZeroConfig, got {type(config).__name__}.")
        if data is not None and not (
            callable(getattr(data, "get_state", None)) and callable(getattr(data, "set_state", None))
        ):
            raise TypeError(
                f"data must have get_state() and set_state() (zerojax.resume.IndexSampler, a grain "
                f"iterator), got {type(data).__name__}."
            )
        self._data = data
        self._mesh, self._zero = mesh, config
        abstract_kwargs = {k: v for k, v in init_kwargs.items() if k != "weights"}
        steps = _same_steps(checkpoint_steps(self.directory))
        target = abstract_state(params, tx, mesh=mesh, config=config, **abstract_kwargs) if steps else None
        for s in reversed(steps):
            state, record, error = None, None, None
            try:
                record = self._check_record(s, checkpoint_extra(self.directory, s))
                state = restore_checkpoint(self.directory, target, step=s)
                jax.block_until_ready(state.params)
            except (CheckpointMismatchError, NotARunError):
                raise
            except Exception as e:  # any failure to read is a damaged checkpoint
                error = e
            if _agree(error is None):
                return self._resumed(s, state, record)
            where = os.path.join(self.directory, str(s))
            why = f"{type(error).__name__}: {str(error)[:300]}" if error else "it does not read on another process"
            _say(f"checkpoint {where} is unreadable ({why}); falling back to the previous complete checkpoint.")
        if steps:
            _say(f"no checkpoint in {self.directory} reads; starting at step 0.")
        else:
            _say(f"no checkpoint in {self.directory}; starting at step 0")
        self.step = 0
        write_progress(self.directory, 0)
        return init_state(params, tx, mesh=mesh, config=config, **init_kwargs)

    def _resumed(self, s: int, state: ZeroState, record: dict) -> ZeroState:
        saved_data = record.get("data")
        if (saved_data is None) != (self._data is None):
            raise ValueError(
                f"checkpoint step {s} was saved {'with' if saved_data is not None else 'without'} a data "
                f"position and this restore passes {'none' if self._data is None else 'one'}: pass the "
                "data= the run was started with."
            )
        if self._data is not None:
            self._data.set_state(_decode(saved_data))
        gb = self._context.get("global_batch")
        if gb is not None and record["global_batch"] is not None and gb != record["global_batch"]:
            raise ValueError(f"global batch {gb} differs from the saved run's {record['global_batch']}.")
        dp = data_parallel(self._mesh, self._zero)
        note = ""
        if dp != record["data_parallel"] and self._zero.grad_accum_steps == record["grad_accum_steps"]:
            note = (
                f"; now on {dp} data-parallel devices with the same grad_accum_steps: each device's micro-batch "
                f"changes size (Run.micro_batches keeps it)"
            )
        _say(
            f"resuming at step {record['step']} from {os.path.join(self.directory, str(s))} (saved on "
            f"{record['devices']} devices, {record['data_parallel']} data-parallel, grad_accum_steps "
            f"{record['grad_accum_steps']}){note}"
        )
        self.step = int(record["step"])
        self.extra = record.get("user")
        self._saved_at = self.step
        write_progress(self.directory, self.step)
        return state

    # -- every step -------------------------------------------------------------------------

    def _record(self, extra: dict | None) -> dict:
        dp = data_parallel(self._mesh, self._zero)
        gb = self._context.get("global_batch")
        a = self._zero.grad_accum_steps
        return {
            "format": FORMAT,
            "step": self.step,
            "data": None if self._data is None else _encode(self._data.get_state()),
            "devices": int(self._mesh.devices.size),
            "processes": jax.process_count(),
            "data_parallel": dp,
            "grad_accum_steps": a,
            "global_batch": gb,
            "rows_per_micro_batch": None if gb is None else gb // (dp * a),
            "user": extra,
        }

    def save(self, state: ZeroState, *, extra: dict | None = None, wait: bool | None = None) -> float:
        """Saves the run at :attr:`step` now; returns the seconds the call blocked."""
        if not hasattr(self, "_mesh"):
            raise RuntimeError("call Run.restore_or_init before saving.")
        start = time.perf_counter()
        save_checkpoint(
            self.directory,
            state,
            step=self.step,
            keep_last=self.config.keep_last,
            wait=self.config.synchronous if wait is None else wait,
            extra=self._record(extra),
        )
        self._saved_at = self.step
        write_progress(self.directory, self.step)
        return time.perf_counter() - start

    def completed(self, state: ZeroState, *, extra: dict | None = None) -> None:
        """Marks one more step done, with the state it returned: saves every
        ``save_every`` steps, and on a preemption notice (``SIGTERM`` to any process) saves
        at this boundary on every process, waits until the checkpoint is on disk and raises
        :class:`Preempted` (exit status 75). Call it on every process after every step."""
        if not isinstance(state, ZeroState):
            raise TypeError(f"completed takes the ZeroState the step returned, got {type(state).__name__}.")
        self.step += 1
        preempted = self._watch.reached(self.step)
        if preempted or self.step % self.config.save_every == 0:
            self.save(state, extra=extra, wait=preempted or None)
        if preempted:
            wait(self.directory)
            self._watch.close()
            _say(
                f"preemption notice: saved step {self.step} to {self.directory}; stopping with status "
                f"{RESUMABLE_EXIT} (resumable)"
            )
            raise Preempted(RESUMABLE_EXIT)

    def finish(self, state: ZeroState, *, extra: dict | None = None) -> None:
        """Saves the final step (unless just saved) and waits until every save is on disk."""
        if self._saved_at != self.step:
            self.save(state, extra=extra)
        wait(self.directory)
        self._watch.close()
