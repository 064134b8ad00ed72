"""Data for training runs: text that ships with every Python, cut into token windows.

>>> import zerojax as zj
>>> corpus = zj.data.stdlib_bytes(1 << 16)
>>> batch = next(zj.data.windows(corpus, batch_size=4, seq_len=32))
>>> batch["tokens"].shape, batch["tokens"].dtype
((4, 33), dtype('int32'))
"""

from zerojax.data.text import stdlib_bytes, windows

__all__ = ["stdlib_bytes", "windows"]
