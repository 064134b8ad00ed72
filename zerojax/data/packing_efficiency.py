"""How full :class:`zerojax.data.Packer` fills its rows on a realistic mix of document
lengths: the standard library's source cut into its functions, methods and classes
(byte tokens), packed at a few row lengths and windows, beside one document per row.

Run ``python -m zerojax.data.packing_efficiency`` for the table docs/packing.md shows.
"""

from __future__ import annotations

import re

import numpy as np

from zerojax.data.packing import Packer
from zerojax.data.text import stdlib_bytes

_DEFINITION = re.compile(rb"\n[ \t]*(?:async def|def|class) ")


def definitions(max_bytes: int = 2 << 20) -> list[np.ndarray]:
    """The first ``max_bytes`` of ``zj.data.stdlib_bytes`` cut before every line that opens
    a ``def``/``class`` (at any indentation): documents of 2 or more byte tokens.

    >>> docs = definitions(1 << 14)
    >>> len(docs) > 10, min(len(d) for d in docs) >= 2
    (True, True)
    """
    data = stdlib_bytes(max_bytes).tobytes()
    cuts = [0] + [m.start() + 1 for m in _DEFINITION.finditer(data)] + [len(data)]
    return [np.frombuffer(data[a:b], np.uint8) for a, b in zip(cuts, cuts[1:]) if b - a >= 2]


def table(docs: list[np.ndarray], seq_lens=(512, 2048), windows=(1, 8, 64, 256), batch_size: int = 8) -> str:
    """A Markdown table: per row length, the documents longer than a row (split), the
    fraction of slots holding a real target with one document (piece) per row, and with
    the packer at each window."""
    lengths = np.array([len(d) - 1 for d in docs])  # pairs per document
    head = ["seq_len", "documents split", "one per row"] + [f"window {w}" for w in windows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for t in seq_lens:
        rows = int(np.sum(-(-lengths // t)))  # pieces of at most t pairs
        cells = [str(t), f"{int(np.sum(lengths > t))} of {len(docs)}", f"{lengths.sum() / (rows * t):.1%}"]
        for w in windows:
            packer = Packer(docs, batch_size, t, window=w, long="split")
            for _ in packer:
                pass
            cells.append(f"{packer.efficiency:.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(max_bytes: int = 2 << 20) -> None:
    docs = definitions(max_bytes)
    n = np.array([len(d) for d in docs])
    p = np.percentile(n, [10, 50, 90, 99]).astype(int).tolist()
    print(
        f"{len(docs)} documents ({n.sum():,} byte tokens) from the first {max_bytes:,} bytes of the standard "
        f"library cut at each def/class; tokens per document: 10/50/90/99th percentile {p}, mean {n.mean():.0f}. "
        "Real targets over slots, 8 rows per batch, long='split':"
    )
    print(table(docs))


if __name__ == "__main__":
    main()
