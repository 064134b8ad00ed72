"""Sequence packing: documents of mixed length packed into the rows of global batches, with
segment ids, per-document positions and loss weights normalised over the global batch.

A document of ``n`` tokens is ``n - 1`` (input, target) pairs, ``doc[:-1]`` predicting
``doc[1:]``: each document is shifted on its own before it is placed, so a target is
always the next token *of the same document* and no token is ever trained to predict the
next document's first token (there is no such pair to weigh). A row holds ``seq_len``
pairs, what ``zj.data.windows``'s ``seq_len + 1`` tokens give.

Placement, row by row (best fit over a window of documents): the packer keeps up to
``window`` documents read ahead, in the order read. A row starts with the oldest of them,
then takes, while one fits the room left, the longest that fits (the oldest among equals),
reading ahead again after each take. So a document waits at most ``window`` rows, and the
order is a pure function of the documents and the settings. ``window=1`` places the
documents in their order, a row closing when the next does not fit (next fit).

A document longer than a row (``len(doc) > seq_len + 1``) is refused unless
``long="split"``: it is cut into pieces of ``seq_len`` pairs (the last one shorter), each
placed as a document of its own, its positions continuing the document's (piece ``k``
starts at position ``k * seq_len``); each pair is trained once, but a piece attends only
to its own tokens.

Padding (the rest of a row, and the rows of a last batch the documents do not fill) has
segment id 0, position 0, input and target 0, and weight 0. Documents in a row have
segment ids 1, 2, ... in the order placed.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

LONG = ("refuse", "split")  # Packer's long= values
KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")  # the leaves of a batch
_FIELDS = ("batch_size", "seq_len", "window", "long")  # what a saved position must match


def _positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}.")
    return int(v)


def normalised_weights(mask: np.ndarray) -> np.ndarray:
    """``float32`` weights ``mask * (mask.size / mask.sum())`` (zeros where nothing is
    real): the mean of ``weights * token_loss`` over any equal split of the rows into
    devices and micro-batches, averaged, is the masked mean over every real token.

    >>> normalised_weights(np.array([[1, 1, 0, 0], [1, 0, 0, 0]])).tolist()
    [[2.6666667461395264, 2.6666667461395264, 0.0, 0.0], [2.6666667461395264, 0.0, 0.0, 0.0]]
    """
    m = np.asarray(mask, np.float32)
    count = float(m.sum())
    return (m * np.float32(m.size / count)).astype(np.float32) if count else np.zeros_like(m)


class Packer:
    """Global batches of packed rows from documents (1-D int arrays of token ids).

    Each batch is ``{"inputs", "targets", "positions", "segment_ids"}`` ``int32[batch_size,
    seq_len]`` and ``"weights"`` ``float32[batch_size, seq_len]``: the form
    ``zj.models.llama.make_loss`` takes, whose loss is ``mean(weights * cross_entropy)``,
    and that splits over a context axis in either layout (every leaf has the same length).
    The weights are 1 on each real target, normalised over the global batch
    (:func:`normalised_weights`), so the step's loss and gradient are those of the mean over
    every real target, with any number of devices and ``grad_accum_steps``.

    ``documents``: a sequence (``len`` and indexing: a list, a grain ``MapDataset``), read
    by index, or any iterable, read once in order. Iteration ends after the batch that
    places the last document (its empty rows padding). ``window``: documents read ahead
    for best fit (1: in order). ``long``: ``"refuse"`` (default) or ``"split"`` a document
    longer than a row (see the module docstring). ``vocab``: when given, a token outside
    ``[0, vocab)`` is refused (an embedding lookup would not raise).

    The position is checkpointable (``get_state`` / ``set_state``, a JSON dict, so
    ``zerojax.resume.Run(...).restore_or_init(..., data=packer)`` saves it): the documents
    read and the pieces read ahead but not yet placed, by index. ``set_state`` reads the
    pending pieces back (from an iterable: on a fresh packer over the same documents from
    their start, reading up to where the saved one was), and checks their tokens against a
    checksum saved with them.

    Example:
      >>> import numpy as np
      >>> docs = [np.array([5, 6, 7]), np.array([8, 9, 10, 11]), np.array([1, 2])]
      >>> batch = next(Packer(docs, batch_size=2, seq_len=4, window=1))
      >>> batch["inputs"].tolist(), batch["targets"].tolist()
      ([[5, 6, 0, 0], [8, 9, 10, 1]], [[6, 7, 0, 0], [9, 10, 11, 2]])
      >>> batch["segment_ids"].tolist(), batch["positions"].tolist()
      ([[1, 1, 0, 0], [1, 1, 1, 2]], [[0, 1, 0, 0], [0, 1, 2, 0]])
      >>> batch["weights"][0].tolist()
      [1.3333333730697632, 1.3333333730697632, 0.0, 0.0]
    """

    def __init__(
        self,
        documents: Sequence | Iterable,
        batch_size: int,
        seq_len: int,
        *,
        window: int = 64,
        long: str = "refuse",
        vocab: int | None = None,
    ) -> None:
        self.batch_size = _positive("batch_size", batch_size)
        seq_len = _positive("seq_len", seq_len)
        if seq_len < 2:
            raise ValueError(
                f"seq_len must be >= 2 (a row of seq_len input/target pairs), got {seq_len}; "
                "use the model's training length."
            )
        self.seq_len = seq_len
        self.window = _positive("window", window)
        if long not in LONG:
            raise ValueError(f"long must be one of {LONG}, got {long!r}.")
        self.long = long
        self.vocab = None if vocab is None else _positive("vocab", vocab)
        if isinstance(documents, np.ndarray) and documents.ndim < 2:
            raise TypeError(
                f"documents is one array of shape {documents.shape}: pass an iterable of 1-D token arrays "
                "([tokens] for a single document)."
            )
        self._random = hasattr(documents, "__len__") and hasattr(documents, "__getitem__")
        self._source = documents
        self._iter = None if self._random else iter(documents)
        if not self._random and not isinstance(documents, Iterable):
            raise TypeError(f"documents must be a sequence or an iterable of 1-D token arrays, got {documents!r}.")
        self._read = 0  # documents read from the source
        self._pending: list[tuple[int, int, int, np.ndarray]] = []  # (document, start, stop, tokens)
        self._done = False  # the source is exhausted
        self.batches = 0
        self.targets = 0  # real (weight > 0) targets emitted
        self.slots = 0  # batch_size * seq_len per batch emitted

    # -- reading ----------------------------------------------------------------------------

    def _check(self, i: int, doc: Any) -> np.ndarray:
        arr = np.asarray(doc)
        if arr.ndim != 1:
            raise ValueError(f"document {i} has shape {arr.shape}: a document is a 1-D array of token ids.")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(
                f"document {i} has dtype {arr.dtype}: token ids must be integers (tokenize it, or "
                "cast exact floats with .astype(np.int32))."
            )
        if len(arr) < 2:
            raise ValueError(
                f"document {i} has {len(arr)} token(s): a document needs 2 or more (one next-token target); "
                "leave such documents out before packing."
            )
        if len(arr) > self.seq_len + 1 and self.long == "refuse":
            raise ValueError(
                f"document {i} has {len(arr)} tokens, longer than a row of seq_len={self.seq_len} pairs "
                f"({self.seq_len + 1} tokens): pass long='split' to cut it into pieces of {self.seq_len} pairs "
                "(positions continuing), raise seq_len, or cut it yourself."
            )
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or (self.vocab is not None and high >= self.vocab):
            raise ValueError(
                f"document {i} has token ids in [{low}, {high}], outside [0, {self.vocab or 'vocab'}): "
                "map them into the model's vocabulary."
            )
        return arr.astype(np.int32)

    def _next_document(self) -> tuple[int, np.ndarray] | None:
        if self._done:
            return None
        if self._random:
            if self._read >= len(self._source):
                self._done = True
                return None
            doc = self._source[self._read]
        else:
            try:
                doc = next(self._iter)
            except StopIteration:
                self._done = True
                return None
        i = self._read
        self._read += 1
        return i, self._check(i, doc)

    def _pieces(self, i: int, doc: np.ndarray) -> list[tuple[int, int, int, np.ndarray]]:
        """``(document, start, stop, tokens)``: pairs ``[start, stop)``, tokens ``doc[start:stop + 1]``."""
        n = len(doc) - 1
        return [
            (i, a, min(a + self.seq_len, n), doc[a : min(a + self.seq_len, n) + 1]) for a in range(0, n, self.seq_len)
        ]

    def _fill(self) -> None:
        while len(self._pending) < self.window:
            got = self._next_document()
            if got is None:
                return
            self._pending.extend(self._pieces(*got))

    # -- packing ----------------------------------------------------------------------------

    def _row(self) -> list[tuple[int, int, int, np.ndarray]]:
        self._fill()
        if not self._pending:
            return []
        row = [self._pending.pop(0)]  # the oldest first: nothing waits more than `window` rows
        room = self.seq_len - (row[0][2] - row[0][1])
        while room > 0:
            self._fill()
            best, size = -1, 0
            for j, (_, a, b, _) in enumerate(self._pending[: self.window]):
                if size < b - a <= room:
                    best, size = j, b - a
            if best < 0:
                break
            row.append(self._pending.pop(best))
            room -= size
        return row

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        rows = [self._row() for _ in range(self.batch_size)]
        if not rows[0]:
            raise StopIteration
        shape = (self.batch_size, self.seq_len)
        out = {k: np.zeros(shape, np.int32) for k in KEYS[:-1]}
        for r, row in enumerate(rows):
            t = 0
            for seg, (_, a, b, tokens) in enumerate(row, start=1):
                n = b - a
                out["inputs"][r, t : t + n] = tokens[:-1]
                out["targets"][r, t : t + n] = tokens[1:]
                out["positions"][r, t : t + n] = np.arange(a, b)
                out["segment_ids"][r, t : t + n] = seg
                t += n
        real = out["segment_ids"] > 0
        out["weights"] = normalised_weights(real)
        self.batches += 1
        self.targets += int(real.sum())
        self.slots += real.size
        return out

    @property
    def efficiency(self) -> float:
        """Real targets over the slots of the batches emitted so far (1.0: no padding)."""
        return self.targets / self.slots if self.slots else 0.0

    # -- the position -----------------------------------------------------------------------

    def get_state(self) -> dict:
        """The position as a JSON-able dict."""
        return {
            "documents_read": self._read,
            "pending": [[i, a, b] for i, a, b, _ in self._pending],
            "pending_crc32": _crc(self._pending),
            "done": self._done,
            "batches": self.batches,
            "targets": self.targets,
            "slots": self.slots,
            **{f: getattr(self, f) for f in _FIELDS},
        }

    def set_state(self, state: dict) -> None:
        """Continues from a saved position (see the class docstring)."""
        if not isinstance(state, dict) or "documents_read" not in state or "pending" not in state:
            raise ValueError(f"not a Packer state: {state!r}.")
        differ = [
            f"{f}: saved {state.get(f)!r}, this packer {getattr(self, f)!r}"
            for f in _FIELDS
            if state.get(f) != getattr(self, f)
        ]
        if differ:
            raise ValueError(
                "the saved position belongs to another packer (" + "; ".join(differ) + "). Build the Packer the run "
                "was started with."
            )
        if not self._random and self._read:
            raise ValueError(
                f"set_state on a packer that has read {self._read} documents from an iterable: build a fresh "
                "Packer over the same documents from their start, then set its state."
            )
        read = int(state["documents_read"])
        wanted = [(int(i), int(a), int(b)) for i, a, b in state["pending"]]
        docs: dict[int, np.ndarray] = {}
        if self._random:
            if read > len(self._source):
                raise ValueError(
                    f"the saved position has read {read} documents; these documents are {len(self._source)}."
                )
            docs = {i: self._check(i, self._source[i]) for i in {w[0] for w in wanted}}
        else:
            need = {w[0] for w in wanted}
            for i in range(read):
                try:
                    doc = next(self._iter)
                except StopIteration:
                    raise ValueError(
                        f"the saved position has read {read} documents; these documents ended after {i}."
                    ) from None
                if i in need:
                    docs[i] = self._check(i, doc)
        pending = [(i, a, b, docs[i][a : b + 1]) for i, a, b in wanted]
        if _crc(pending) != state.get("pending_crc32"):
            raise ValueError(
                "the documents read back for the saved position differ from the ones it was saved with "
                "(checksum of the pending pieces): give the same documents in the same order."
            )
        self._read, self._pending, self._done = read, pending, bool(state.get("done", False))
        self.batches, self.targets, self.slots = (int(state.get(k, 0)) for k in ("batches", "targets", "slots"))


def _crc(pending: list) -> int:
    crc = 0
    for i, a, b, tokens in pending:
        crc = zlib.crc32(np.asarray([i, a, b], np.int64).tobytes(), crc)
        crc = zlib.crc32(np.ascontiguousarray(tokens, np.int32).tobytes(), crc)
    return crc
