"""Byte-level text that ships with every Python: the standard library's own source."""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np


def stdlib_bytes(max_bytes: int = 8 << 20) -> np.ndarray:
    """Up to ``max_bytes`` of the standard library's ``.py`` files (sorted, concatenated)."""
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


def batches(data: np.ndarray, batch_size: int, seq_len: int, seed: int = 0) -> Iterator[dict]:
    """Random windows of ``seq_len + 1`` bytes: ``{"tokens": int32[batch_size, seq_len + 1]}``."""
    if len(data) <= seq_len + 1:
        raise ValueError(f"corpus of {len(data)} bytes is shorter than a window of {seq_len + 1}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        yield {"tokens": np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32)}
