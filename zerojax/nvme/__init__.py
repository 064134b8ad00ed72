"""The NVMe tier of the optimizer state (ZeRO-Infinity): files, buffered streaming, the update driver."""

from zerojax.nvme.handles import OnDisk, materialize, on_disk, scalars_only
from zerojax.nvme.store import Store

__all__ = ["OnDisk", "Store", "materialize", "on_disk", "scalars_only"]
