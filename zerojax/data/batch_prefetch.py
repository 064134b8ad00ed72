"""Global batches loaded and placed on the mesh ahead of the step, on a background thread,
with a data position that counts only the batches handed out."""

from __future__ import annotations

import copy
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from zerojax.data.placement import ROWS, Rows, batch_plan, place

_END = object()  # the source is exhausted
_STOP_POLL_S = 0.05  # how often a thread waiting for room looks for a stop


class _Worker:
    """One run of the background thread: the queue it fills and the flag that stops it.
    Holds no reference to the :class:`Prefetch`, so that the prefetch can be collected."""

    def __init__(self, depth: int) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.room = threading.Semaphore(depth)  # batches it may load beyond those handed out
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def run(self, source: Iterator, load: Callable | None, put: Callable, stateful: bool) -> None:
        try:
            while not self.stop.is_set():
                if not self.room.acquire(timeout=_STOP_POLL_S):
                    continue
                if self.stop.is_set():
                    return
                try:
                    item = next(source)
                except StopIteration:
                    self.queue.put((_END, None))
                    return
                position = copy.deepcopy(source.get_state()) if stateful else None
                self.queue.put((put(item if load is None else load(item)), position))
        except BaseException as e:  # handed to the consumer, who raises it with this traceback
            self.queue.put((e, None))

    def halt(self) -> None:
        """Stops the thread after the item it is loading, and waits for it."""
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()


class Prefetch:
    """Global batches from ``source``, loaded and placed on ``mesh`` ``depth`` batches ahead
    of the step on a background thread, laid out exactly as the train step of ``config``
    takes them (rows over the batch axes; on a context mesh, sequences over the context
    axis), so that the step moves nothing.

    ``source``: an iterator of host batches (pytrees of numpy arrays, leading axis the
    global batch's rows), or of whatever ``load`` turns into one (``load`` runs on the
    thread: ``Prefetch(IndexSampler(...), mesh, load=lambda idx: {"x": xs[idx]})``).
    ``rows="global"``: every process gives the whole global batch and each device receives
    its rows; ``rows="process"``: each process gives only its own rows (and, on a context
    mesh, sequence chunks: :func:`zerojax.distributed.process_slices`), joined with
    ``jax.make_array_from_process_local_data``. ``depth``: placed batches kept ahead of the
    one handed out (at most ``depth`` loaded and not yet taken).

    A batch the step would refuse (rows that do not divide over the devices and
    micro-batches, a sequence that does not split over the context axis) is refused here,
    by the step's own checks, when it is handed out. An error on the thread (the source's,
    ``load``'s, a refusal) is raised by the ``next()`` that would have returned that batch,
    with its original traceback, and by every ``next()`` after it.

    The data position (``get_state`` / ``set_state``, what :class:`zerojax.resume.Run`
    saves) is the source's position as of the last batch handed out, not of the last one
    loaded: the thread reads ``source.get_state()`` with each batch it loads. ``set_state``
    drops the batches loaded ahead, restores the source and loads again from there. A
    source without ``get_state``/``set_state`` (a plain generator) is prefetched too, but its
    position is refused rather than saved wrong.

    The thread starts at the first ``next()`` and stops at :meth:`close`, at the end of a
    ``with`` block, or when the prefetch is garbage-collected. While the thread runs, only it
    touches the source.

    Example:
      >>> import numpy as np, zerojax as zj
      >>> from zerojax.resume import IndexSampler
      >>> xs = np.arange(64.0, dtype=np.float32).reshape(32, 2)
      >>> mesh = zj.make_mesh()
      >>> with zj.data.Prefetch(IndexSampler(32, 8, seed=0), mesh, load=lambda i: {"x": xs[i]}) as batches:
      ...     b = next(batches)
      ...     position = batches.get_state()["position"]
      >>> b["x"].shape, len(b["x"].sharding.device_set), position
      ((8, 2), 8, 1)
    """

    def __init__(
        self,
        source: Iterator,
        mesh: Any,
        *,
        config: Any = None,
        depth: int = 2,
        rows: Rows = "global",
        load: Callable[[Any], Any] | None = None,
    ) -> None:
        if not callable(getattr(source, "__next__", None)):
            raise TypeError(
                f"source must be an iterator of host batches (it has no __next__), got {type(source).__name__}; "
                "pass iter(...) of it, or a grain dataset's iterator (iter(dataset))."
            )
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive int (batches placed ahead), got {depth!r}.")
        if rows not in ROWS:
            raise ValueError(
                f"rows must be 'global' (every process gives the whole global batch) or 'process' (each process "
                f"gives its own rows), got {rows!r}."
            )
        if load is not None and not callable(load):
            raise TypeError(f"load must be callable as load(item) -> host batch, got {load!r}.")
        self._plan = batch_plan(mesh, config)
        self.source, self.depth, self.rows, self.load = source, depth, rows, load
        self._stateful = callable(getattr(source, "get_state", None)) and callable(getattr(source, "set_state", None))
        self._position = copy.deepcopy(source.get_state()) if self._stateful else None
        self._worker: _Worker | None = None
        self._error: BaseException | None = None
        self._ended = False
        self._finalizer: weakref.finalize | None = None
        self._closed = False

    def _start(self) -> _Worker:
        worker = _Worker(self.depth)
        worker.thread = threading.Thread(
            target=worker.run,
            args=(self.source, self.load, self._put_fn(), self._stateful),
            name="zerojax-prefetch",
            daemon=True,
        )
        self._finalizer = weakref.finalize(self, worker.halt)
        worker.thread.start()
        return worker

    def _put_fn(self) -> Callable:
        plan, rows = self._plan, self.rows
        return lambda batch: place(plan, batch, rows)  # no reference to self from the thread

    def __iter__(self) -> Prefetch:
        return self

    def __next__(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._ended:
            raise StopIteration
        if self._worker is None:
            if self._closed and not self._stateful:
                raise RuntimeError(
                    "this Prefetch was closed, and the batches it had loaded ahead from a source without "
                    "get_state()/set_state() are gone: build a new Prefetch over the rest of the source."
                )
            self._worker = self._start()
        batch, position = self._worker.queue.get()
        if batch is _END:
            self._ended = True
            raise StopIteration
        if isinstance(batch, BaseException):
            self._error = batch
            raise batch
        self._worker.room.release()
        self._position = position
        return batch

    def get_state(self) -> Any:
        """The source's position as of the last batch handed out (a copy)."""
        if not self._stateful:
            raise TypeError(
                f"the source ({type(self.source).__name__}) has no get_state()/set_state(), so this Prefetch has no "
                "position to save. Give it a checkpointable source: zerojax.resume.IndexSampler with load=..., "
                "zj.data.ElasticBatches, or a grain dataset's or DataLoader's iterator."
            )
        return copy.deepcopy(self._position)

    def set_state(self, state: Any) -> None:
        """Drops the batches loaded ahead, sets the source to ``state`` and loads again from
        there at the next ``next()``."""
        if not self._stateful:
            self.get_state()  # refuses, naming the fix
        self._stop()
        self.source.set_state(state)
        self._position = copy.deepcopy(self.source.get_state())
        self._error, self._ended = None, False

    def _stop(self) -> None:
        """Stops the thread and drops the batches ahead; a checkpointable source goes back to
        the position of the last batch handed out, so that nothing it loaded is skipped."""
        if self._worker is None:
            return
        self._worker.halt()
        self._finalizer.detach()
        self._worker = None
        if self._stateful:
            self.source.set_state(copy.deepcopy(self._position))

    def close(self) -> None:
        """Stops the thread (after the batch it is loading) and drops the batches ahead. A
        checkpointable source is set back to the position of the last batch handed out:
        iterating again goes on from there."""
        self._stop()
        self._closed = True

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
