"""``nnx.LoRALinear`` parameters in an export: merged into their kernels, alone, or kept.

A LoRA layer's parameters are ``X.kernel``, ``X.lora.lora_a`` ``[..., in, r]`` and
``X.lora.lora_b`` ``[..., r, out]``; its function is ``x @ kernel + (x @ a) @ b``.
``lora="merge"`` writes ``kernel + a @ b`` under the kernel's tensors and leaves the
adapters out (a plain checkpoint of the base architecture); ``"adapters"`` writes the
adapters alone; ``"keep"`` writes every parameter as it is.
"""

from __future__ import annotations

import numpy as np

from zerojax.tensors import boxes
from zerojax.tensors.expressions import Expr

MODES = ("merge", "adapters", "keep")


def triples(names: list[str]) -> dict[str, tuple[str, str]]:
    """``{kernel name: (lora_a name, lora_b name)}`` for ``nnx.LoRALinear`` parameters."""
    present = set(names)
    out = {}
    for n in names:
        if n.endswith(".lora.lora_a"):
            base = n[: -len(".lora.lora_a")]
            if f"{base}.kernel" in present and f"{base}.lora.lora_b" in present:
                out[f"{base}.kernel"] = (n, f"{base}.lora.lora_b")
    return out


def select(names: list[str], mode: str, what: str) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """``(the parameters an export writes, {kernel: (a, b)} to merge)`` for ``mode``."""
    if mode not in MODES:
        raise ValueError(f"lora must be one of {MODES}, got {mode!r}.")
    found = triples(names)
    adapters = {n for ab in found.values() for n in ab}
    if mode == "merge":
        return [n for n in names if n not in adapters], found
    if mode == "adapters":
        if not adapters:
            raise ValueError(
                f"lora='adapters' exports the LoRA adapters, but {what} has none (no nnx.LoRALinear "
                "parameters '*.lora.lora_a' / '*.lora.lora_b')."
            )
        return [n for n in names if n in adapters], {}
    return list(names), {}


class LowRankAdd(Expr):
    """Writes ``child`` as ``kernel + a @ b`` (an ``nnx.LoRALinear``'s merged kernel) in
    float32; ``a``: ``[..., in, r]``, ``b``: ``[..., r, out]``, held whole (adapters are small)."""

    def __init__(self, child: Expr, a: np.ndarray, b: np.ndarray):
        self.child, self.a, self.b = child, a, b
        self.shape, self.dtype = child.shape, child.dtype

    def write(self, box, values, io):
        lead, (i0, i1), (o0, o1) = box[:-2], box[-2], box[-1]
        lead_sl = boxes.slices(lead)
        delta = np.matmul(
            self.a[lead_sl + (slice(i0, i1), slice(None))].astype(np.float32),
            self.b[lead_sl + (slice(None), slice(o0, o1))].astype(np.float32),
        )
        self.child.write(box, np.asarray(values, np.float32) + delta, io)

    def boxes(self, box):
        return self.child.boxes(box)

    def tensors(self):
        return self.child.tensors()

    def describe(self):
        return f"merged({self.child.describe()})"
