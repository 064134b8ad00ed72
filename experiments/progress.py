"""The progress bar every experiment script shows (tqdm, on stderr so tables stay clean)."""

from __future__ import annotations

import sys


def bar(total: int, desc: str, disable: bool = False):
    """A tqdm bar of ``total`` units; ``bar.set_postfix_str`` says what is being measured."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True, disable=disable)
