"""Global batches of a random-access dataset whose position, and order, do not depend on the
number of processes that load them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class ElasticBatches:
    """Global batch ``k`` is records ``[k * global_batch, (k + 1) * global_batch)`` of
    ``dataset`` (anything with ``len`` and ``dataset[i]``: a grain ``MapDataset``, shuffled and
    repeated as you like, or a list), its rows in that order; this process loads the rows
    ``rows`` of it (a slice; default all: ``zj.data.Prefetch(..., rows="global")``), stacked
    leaf by leaf into a host batch.

    The position is the next record index (``{"next_index": ...}``), the same on every
    process, so a checkpoint taken on P processes resumes on any other number with the same
    global batches, row for row: pass each process its
    ``rows=zj.distributed.process_rows(global_batch, mesh)`` and
    ``zj.data.Prefetch(..., rows="process")``. (grain's ``ElasticIterator`` keeps the same
    records per step but deals them to the processes in turn, process p taking records
    ``p, p + P, ...``, so the rows' order, and which device gets which example, changes with
    the process count.) The iterator ends when fewer than ``global_batch`` records remain.

    Example:
      >>> from zerojax.data import ElasticBatches
      >>> b = ElasticBatches([{"x": i} for i in range(10)], global_batch=4, rows=slice(2, 4))
      >>> next(b)["x"], next(b)["x"], b.get_state()
      (array([2, 3]), array([6, 7]), {'next_index': 8})
      >>> next(b)
      Traceback (most recent call last):
      StopIteration
    """

    def __init__(self, dataset: Any, global_batch: int, *, rows: slice | None = None) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(
                f"dataset must have len() and dataset[i] (a grain MapDataset, a list), got {type(dataset).__name__}."
            )
        if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive int, got {global_batch!r}.")
        rows = slice(0, global_batch) if rows is None else rows
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"rows must be a contiguous slice of the global batch's rows, got {rows!r}.")
        start, stop, _ = rows.indices(int(global_batch))
        if stop <= start or (rows.stop is not None and rows.stop > global_batch):
            raise ValueError(
                f"rows={rows} is not a non-empty block of the global batch's {global_batch} rows; pass "
                "zj.distributed.process_rows(global_batch, mesh)."
            )
        self.dataset, self.global_batch, self.rows = dataset, int(global_batch), slice(start, stop)
        self.next_index = 0

    def __iter__(self) -> ElasticBatches:
        return self

    def __next__(self) -> Any:
        if self.next_index + self.global_batch > len(self.dataset):
            raise StopIteration
        first = self.next_index + self.rows.start
        records = [self.dataset[i] for i in range(first, self.next_index + self.rows.stop)]
        self.next_index += self.global_batch
        return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *records)

    def get_state(self) -> dict:
        return {"next_index": self.next_index}

    def set_state(self, state: dict) -> None:
        """Continues at the saved record index (saved on any number of processes)."""
        if not isinstance(state, dict) or not isinstance(state.get("next_index"), (int, np.integer)):
            raise ValueError(f"not an ElasticBatches position: {state!r}.")
        if state["next_index"] < 0:
            raise ValueError(f"next_index must be >= 0, got {state['next_index']}.")
        self.next_index = int(state["next_index"])
