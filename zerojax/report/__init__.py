"""Memory and communication reports."""

from zerojax.report.comm import communication_report
from zerojax.report.memory import compiled_bytes, state_bytes_per_device, zero_formula_bytes

__all__ = ["communication_report", "compiled_bytes", "state_bytes_per_device", "zero_formula_bytes"]
