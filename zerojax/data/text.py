"""Byte-level text that ships with every Python (the standard library's own source), for
demos, experiments and tests that must run with no download."""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np


def stdlib_bytes(max_bytes: int = 8 << 20) -> np.ndarray:
    """Up to ``max_bytes`` of the standard library's ``.py`` files (sorted by name,
    concatenated), as ``uint8``: the same bytes on every machine with the same Python.

    >>> corpus = stdlib_bytes(1024)
    >>> corpus.dtype, corpus.shape
    (dtype('uint8'), (1024,))
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py files under {root}; cannot build the text corpus")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def windows(data: np.ndarray, batch_size: int, seq_len: int, seed: int = 0) -> Iterator[dict]:
    """Endless batches of random windows of ``seq_len + 1`` bytes of ``data``:
    ``{"tokens": int32[batch_size, seq_len + 1]}`` (inputs ``[:, :-1]``, targets ``[:, 1:]``),
    the same sequence for the same ``seed``.

    >>> batch = next(windows(np.arange(100, dtype=np.uint8), batch_size=2, seq_len=8))
    >>> batch["tokens"].shape
    (2, 9)
    """
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if len(data) <= seq_len + 1:
        raise ValueError(f"corpus of {len(data)} bytes is shorter than a window of {seq_len + 1}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        yield {"tokens": np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32)}
