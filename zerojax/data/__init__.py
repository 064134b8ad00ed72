"""Data for training runs: text that ships with every Python, cut into token windows;
documents packed into rows (:class:`Packer`); and global batches placed on the mesh ahead
of the step (:class:`Prefetch`).

>>> import zerojax as zj
>>> corpus = zj.data.stdlib_bytes(1 << 16)
>>> batch = next(zj.data.windows(corpus, batch_size=4, seq_len=32))
>>> batch["tokens"].shape, batch["tokens"].dtype
((4, 33), dtype('int32'))
"""

from zerojax.data.batch_prefetch import Prefetch
from zerojax.data.elastic import ElasticBatches
from zerojax.data.packing import Packer, normalised_weights
from zerojax.data.text import stdlib_bytes, windows

__all__ = ["ElasticBatches", "Packer", "Prefetch", "normalised_weights", "stdlib_bytes", "windows"]
