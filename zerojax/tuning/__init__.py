"""Which ZeRO configuration fits the devices, and which is fastest: ``zj.autotune``, from
compiled programs and a cost model, with no trial step (see docs/autotune.md)."""

from zerojax.tuning.budget import parse_memory
from zerojax.tuning.candidates import Candidate, SearchSpace
from zerojax.tuning.cost import AxisTraffic, StepCost, step_cost
from zerojax.tuning.devices import KNOWN, DeviceSpec, calibrate, device_spec
from zerojax.tuning.disk import DiskRates, measure_disk
from zerojax.tuning.result import AutotuneResult, Plan, PlanMemory, Skipped
from zerojax.tuning.search import autotune

__all__ = [
    "KNOWN",
    "AutotuneResult",
    "AxisTraffic",
    "Candidate",
    "DeviceSpec",
    "DiskRates",
    "Plan",
    "PlanMemory",
    "SearchSpace",
    "Skipped",
    "StepCost",
    "autotune",
    "calibrate",
    "device_spec",
    "measure_disk",
    "parse_memory",
    "step_cost",
]
