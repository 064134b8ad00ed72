"""Memory and communication reports."""

from zerojax.report.memory import state_bytes_per_device, zero_formula_bytes

__all__ = ["state_bytes_per_device", "zero_formula_bytes"]
