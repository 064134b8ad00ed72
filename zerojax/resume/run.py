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

from zerojax.checkpoint.io import CheckpointMismatchError, list_steps, read_step_json, save_checkpoint, wait
from zerojax.config import ZeroConfig
from zerojax.distributed.heartbeat import start_heartbeat, write_progress, write_refusal
from zerojax.resume import owner
from zerojax.resume.choose import FORMAT, NotARunError, choose, is_run_record, move_aside, same_steps
from zerojax.resume.holder import abstract_of, is_holder, state_of
from zerojax.resume.owner import RunFolderError, RunOwnedError
from zerojax.resume.preemption import RESUMABLE_EXIT, PreemptionWatch
from zerojax.state import ZeroState, abstract_state, init_state

# Errors a restart cannot change: the launcher is told not to restart on them.
_FINAL = (NotARunError, CheckpointMismatchError, RunOwnedError, RunFolderError)


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


class Preempted(SystemExit):
    """Raised by :meth:`Run.completed` once the run has saved on a preemption notice; exits
    the interpreter with status ``RESUMABLE_EXIT`` (75) unless caught."""


def _say(msg: str) -> None:
    sys.stdout.write(f"zerojax.resume: {msg}\n")
    sys.stdout.flush()


def data_parallel(mesh: Any, config: ZeroConfig) -> int:
    """Devices the batch's rows are split over: all, but the context, tensor and pipeline
    axes (every stage of a pipeline runs the same rows)."""
    shape = dict(mesh.shape)
    n = int(mesh.devices.size) // shape.get(config.axes.context, 1) // shape.get(config.axes.tensor, 1)
    return n // shape.get(config.axes.pipeline, 1)


def micro_batches_per_step(config: ZeroConfig) -> int:
    """The parts each device's rows are taken in: accumulation x the pipeline's micro-batches."""
    return config.grad_accum_steps * config.pipeline.microbatches


def _encode(data_state: Any) -> Any:
    """A data position as JSON: grain's DataLoader iterators give bytes, its datasets dicts."""
    if isinstance(data_state, bytes):
        return {"bytes_base64": base64.b64encode(data_state).decode("ascii")}
    return data_state


def _decode(saved: Any) -> Any:
    if isinstance(saved, dict) and set(saved) == {"bytes_base64"}:
        return base64.b64decode(saved["bytes_base64"])
    return saved


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
        """The newest checkpoint whose run record reads, with that record (read from its
        file by each process alone: no collective)."""
        if self._record_cache is False:
            self._record_cache = None
            for s in reversed(list_steps(self.directory)):
                try:
                    record = read_step_json(self.directory, s, "extra")
                except Exception:  # an unreadable record: restore_or_init names the step and skips it
                    continue
                if is_run_record(record):
                    self._record_cache = (s, record)
                    break
        return self._record_cache

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
        rows, m = record["rows_per_micro_batch"], config.pipeline.microbatches
        for a in range(1, global_batch + 1):
            if global_batch % (dp * a * m) == 0 and global_batch // (dp * a * m) <= rows:
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
            f"devices grad_accum_steps becomes {a} ({global_batch // (dp * a * m)} rows per device per micro-batch), "
            f"the global batch stays {global_batch}."
            + (
                f" A loss not linear in its rows (a MoE load-balancing loss, synced BatchNorm statistics) now sees "
                f"{a} micro-batches instead of {record['grad_accum_steps']}, so its steps are not the saved run's "
                "within rounding."
                if a != record["grad_accum_steps"]
                else ""
            )
        )
        return dataclasses.replace(config, grad_accum_steps=a)

    # -- starting ---------------------------------------------------------------------------

    def restore_or_init(
        self,
        params: Any,
        tx: Any = None,
        *,
        mesh: Any = None,
        config: ZeroConfig | None = None,
        data: Any = None,
        **init_kwargs: Any,
    ) -> Any:
        """The state to train from: the newest complete checkpoint of the run's directory
        that reads on every process, or ``zj.init_state(params, tx, mesh=mesh,
        config=config, **init_kwargs)`` when there is none.

        ``params`` may instead be a :class:`zerojax.nnx.Optimizer` (anything holding its
        :class:`~zerojax.ZeroState` in ``.state`` with its ``tx``, ``mesh`` and ``config``),
        given alone: it is restored in place and returned (a fresh run keeps it as built).

        Before anything is read, the folder is checked: it must be writable from this
        process, and no other live job may be writing it (:mod:`zerojax.resume.owner`);
        this job then owns it. Each process then reads its own part of the newest step
        with no collective, and the processes agree on the result: a step that does not
        read on some process, or has no run record, is named and skipped for the one
        before it (:mod:`zerojax.resume.choose`), and moved aside once the run has chosen,
        so that its step is saved again. A folder in which no step has a run record raises
        :class:`NotARunError`; a checkpoint of another model or optimizer raises
        :class:`~zerojax.checkpoint.CheckpointMismatchError` naming the leaves, before any
        step. ``data`` (an object with ``get_state`` / ``set_state``, such as
        :class:`IndexSampler` or a grain iterator) is set to the saved position. Sets
        :attr:`step`."""
        holder = params if is_holder(params) else None
        if holder is not None:
            given = [n for n, v in (("tx", tx), ("mesh", mesh), ("config", config)) if v is not None]
            if given or init_kwargs:
                raise ValueError(
                    f"restore_or_init({type(holder).__name__}) takes the optimizer alone (its tx, mesh and config "
                    f"are its own); got also {given + sorted(init_kwargs)}. Call run.restore_or_init(optimizer, "
                    "data=...)."
                )
            tx, mesh, config = holder.tx, holder.mesh, holder.config
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
        try:
            state = self._start(params, tx, holder, init_kwargs)
        except _FINAL as e:
            write_refusal(f"{type(e).__name__}: {e}")
            owner.stop_refreshing(self.directory)
            if jax.process_index() == 0 and not isinstance(e, (RunOwnedError, RunFolderError)):
                owner.release(self.directory)
            raise
        if holder is None:
            return state
        holder.state = state
        return holder

    def _claim(self) -> None:
        """The folder takes writes here; this job owns it (process 0 decides, all agree)."""
        owner.check_writable(self.directory)
        error = None
        if jax.process_index() == 0:
            try:
                owner.claim(self.directory)
            except RunOwnedError as e:
                error = e
        if jax.process_count() > 1:
            from zerojax.resume.choose import gather

            refused = gather(int(error is not None))[0]
            if refused and error is None:
                record, age = owner.read_owner(self.directory)
                error = RunOwnedError(
                    f"the run folder {self.directory} is being written by another job"
                    + (f", {owner.describe(record, age)}" if record else "")
                    + " (process 0 says more): give this run a folder of its own."
                )
        if error is not None:
            raise error
        if jax.process_index() == 0:
            owner.keep_fresh(self.directory)

    def _start(self, params: Any, tx: Any, holder: Any, init_kwargs: dict) -> ZeroState:
        mesh, config = self._mesh, self._zero
        self._claim()
        steps = same_steps(list_steps(self.directory))
        target = None
        if steps:
            if holder is not None:
                target = abstract_of(holder.state)
            else:
                abstract_kwargs = {k: v for k, v in init_kwargs.items() if k != "weights"}
                target = abstract_state(params, tx, mesh=mesh, config=config, **abstract_kwargs)
        s, tried, skipped = choose(self.directory, steps, target, _say)
        for path in move_aside(self.directory, skipped):
            _say(f"moved the damaged checkpoint aside to {path}: its step is saved again when the run reaches it.")
        if skipped:
            list_steps(self.directory)  # every process's view without the steps moved aside
        if s is not None:
            return self._resumed(s, tried.read.state(), tried.record)
        if steps:
            _say(f"no checkpoint in {self.directory} reads; starting at step 0.")
        else:
            _say(f"no checkpoint in {self.directory}; starting at step 0")
        self.step = 0
        write_progress(self.directory, 0)
        if holder is not None:
            return holder.state
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
        if dp != record["data_parallel"] and state.rng is not None:
            note += (
                f". The state carries a key: randomness drawn from the step's key (dropout) is drawn per device "
                f"and micro-batch, so on {dp} data-parallel devices its masks differ from the saved run's and "
                "the trajectory leaves the uninterrupted one (docs/fault_tolerance.md)"
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
            "rows_per_micro_batch": None if gb is None else gb // (dp * micro_batches_per_step(self._zero)),
            "user": extra,
        }

    def save(self, state: Any, *, extra: dict | None = None, wait: bool | None = None) -> float:
        """Saves the run at :attr:`step` now; returns the seconds the call blocked. Refuses
        (:class:`~zerojax.resume.owner.RunOwnedError`) when another job has taken the folder."""
        if not hasattr(self, "_mesh"):
            raise RuntimeError("call Run.restore_or_init before saving.")
        state = state_of(state, "save")
        start = time.perf_counter()
        try:
            owner.check_owner(self.directory)
        except RunOwnedError as e:
            write_refusal(f"{type(e).__name__}: {e}")
            raise
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

    def completed(self, state: Any, *, extra: dict | None = None) -> None:
        """Marks one more step done, with the state it returned (or the
        :class:`zerojax.nnx.Optimizer` it updated): saves every ``save_every`` steps, and on
        a preemption notice (``SIGTERM`` to any process) saves at this boundary on every
        process, waits until the checkpoint is on disk and raises :class:`Preempted` (exit
        status 75). Call it on every process after every step."""
        state = state_of(state, "completed")
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

    def finish(self, state: Any, *, extra: dict | None = None) -> None:
        """Saves the final step (unless just saved), waits until every save is on disk and
        releases the folder (another job may take it at once)."""
        state = state_of(state, "finish")
        if self._saved_at != self.step:
            self.save(state, extra=extra)
        wait(self.directory)
        self._watch.close()
        owner.stop_refreshing(self.directory)
        if jax.process_index() == 0:
            owner.release(self.directory)
