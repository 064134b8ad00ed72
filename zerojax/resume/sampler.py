"""A data position that checkpoints: global batches of record indices, epoch by epoch."""

from __future__ import annotations

import numpy as np

_FIELDS = ("num_records", "global_batch", "seed", "shuffle")


class IndexSampler:
    """Global batches of record indices in a seeded order, whose position is saved with
    the run's checkpoints (grain's iterator protocol: ``get_state`` / ``set_state``).

    Batch ``k`` is a pure function of ``(seed, k)``: epoch ``e = k // batches_per_epoch``
    permutes the records with ``numpy.random.default_rng([seed, e])`` (``shuffle=False``:
    in order) and takes its ``(k % batches_per_epoch)``-th block of ``global_batch``; the
    ``num_records % global_batch`` records left over in an epoch's order are not drawn
    that epoch. Every process draws the same global indices and loads the rows its
    devices hold (``indices[zj.distributed.process_rows(global_batch, mesh)]``), so the
    data follows the same trajectory on any number of processes or devices.

    Example:
      >>> from zerojax.resume import IndexSampler
      >>> s = IndexSampler(num_records=10, global_batch=4, seed=0)
      >>> first = next(s); second = next(s)
      >>> s.get_state()["position"]
      2
      >>> t = IndexSampler(num_records=10, global_batch=4, seed=0)
      >>> t.set_state(s.get_state())
      >>> bool((next(t) == next(s)).all())
      True
    """

    def __init__(self, num_records: int, global_batch: int, *, seed: int = 0, shuffle: bool = True) -> None:
        for name, v in (("num_records", num_records), ("global_batch", global_batch)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        if global_batch > num_records:
            raise ValueError(
                f"global_batch={global_batch} is larger than num_records={num_records}: an epoch would hold no batch."
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}.")
        self.num_records, self.global_batch = int(num_records), int(global_batch)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.position = 0
        self._epoch, self._order = -1, None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_records // self.global_batch

    def batch(self, k: int) -> np.ndarray:
        """The record indices of batch ``k`` (int64, ``global_batch`` of them)."""
        epoch, j = divmod(int(k), self.batches_per_epoch)
        if epoch != self._epoch:
            self._order = (
                np.random.default_rng([self.seed, epoch]).permutation(self.num_records)
                if self.shuffle
                else np.arange(self.num_records)
            )
            self._epoch = epoch
        return self._order[j * self.global_batch : (j + 1) * self.global_batch].astype(np.int64)

    def __iter__(self) -> IndexSampler:
        return self

    def __next__(self) -> np.ndarray:
        out = self.batch(self.position)
        self.position += 1
        return out

    def get_state(self) -> dict:
        return {"position": self.position, **{f: getattr(self, f) for f in _FIELDS}}

    def set_state(self, state: dict) -> None:
        """Continues from a saved position; the sampler must be the one that was saved
        (records, batch, seed and order), else the data would silently differ."""
        if not isinstance(state, dict) or "position" not in state:
            raise ValueError(f"not an IndexSampler state: {state!r}.")
        differ = [
            f"{f}: saved {state.get(f)!r}, this sampler {getattr(self, f)!r}"
            for f in _FIELDS
            if state.get(f) != getattr(self, f)
        ]
        if differ:
            raise ValueError(
                "the saved data position belongs to another sampler ("
                + "; ".join(differ)
                + "). Build the IndexSampler the run was started with."
            )
        self.position = int(state["position"])
