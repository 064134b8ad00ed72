"""Memory and communication reports."""

from zerojax.report.comm import communication_report
from zerojax.report.memory import StepMemory, compiled_bytes, state_bytes_per_device, step_memory, zero_formula_bytes

__all__ = [
    "StepMemory",
    "communication_report",
    "compiled_bytes",
    "state_bytes_per_device",
    "step_memory",
    "zero_formula_bytes",
]
