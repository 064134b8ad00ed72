"""DeepSpeed's logging keys as a :class:`zerojax.monitor.Monitor`: ``steps_per_print``,
``wall_clock_breakdown``, ``flops_profiler`` and the ``tensorboard``, ``wandb``,
``csv_monitor`` and ``comet`` sections (``deepspeed/monitor/config.py``).

Paths follow DeepSpeed's monitors: TensorBoard logs under ``output_path/job_name``; the CSV
monitor's folder is the same, where DeepSpeed writes one ``step,value`` file per metric and
zerojax one ``metrics.csv`` with a column per metric.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

# Each section's keys and DeepSpeed's defaults.
_SECTIONS = {
    "tensorboard": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "csv_monitor": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "wandb": {"enabled": False, "group": None, "team": None, "project": "deepspeed"},
}
_COMET = frozenset(
    {
        "enabled",
        "samples_log_interval",
        "project",
        "workspace",
        "api_key",
        "experiment_name",
        "experiment_key",
        "online",
        "mode",
    }
)
_FLOPS_PROFILER = frozenset(
    {"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed", "output_file"}
)
STEPS_PER_PRINT_DEFAULT = 10  # DeepSpeed's
KEYS = ("steps_per_print", "wall_clock_breakdown", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet")


@dataclasses.dataclass(frozen=True)
class MonitorSpec:
    """The writers (``(class name, keywords)`` in ``zj.monitor``) and ``Monitor`` keywords
    a DeepSpeed config asks for."""

    writers: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    options: tuple[tuple[str, Any], ...] = ()

    def code(self) -> str:
        """``zj.monitor.Monitor([...])`` as code."""
        writers = ", ".join(f"zj.monitor.{name}({_args(kw)})" for name, kw in self.writers)
        extra = "".join(f", {k}={v!r}" for k, v in self.options)
        return f"zj.monitor.Monitor([{writers}]{extra})"

    def build(self, **options: Any) -> Any:
        """The monitor (``options`` are more ``Monitor`` keywords: ``tokens_per_step``,
        ``flops_per_token``, ``device``)."""
        from zerojax import monitor

        writers = [getattr(monitor, name)(**dict(kw)) for name, kw in self.writers]
        return monitor.Monitor(writers, **{**dict(self.options), **options})


def _args(kw: tuple[tuple[str, Any], ...]) -> str:
    return ", ".join(repr(v) if k == "path" else f"{k}={v!r}" for k, v in kw)


def _section(ds: Mapping, key: str, defaults: Mapping[str, Any] | frozenset) -> dict | None:
    """The section's values with DeepSpeed's defaults, or None when it is off or absent."""
    if key not in ds:
        return None
    section = ds[key]
    if not isinstance(section, Mapping):
        raise ValueError(f"DeepSpeed key {key!r} must be an object like {{'enabled': true, ...}}, got {section!r}.")
    unknown = sorted(set(section) - set(defaults))
    if unknown:
        raise ValueError(f"DeepSpeed section {key!r} has no key(s) {unknown}; it takes {sorted(defaults)}.")
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"DeepSpeed key '{key}.enabled' must be true or false, got {enabled!r}.")
    if not enabled:
        return None
    return {**(defaults if isinstance(defaults, Mapping) else {}), **section}


def parse(ds: Mapping, unmapped: dict[str, str], notes: list[str]) -> MonitorSpec:
    """The monitor of a DeepSpeed config (a console line every ``steps_per_print`` steps,
    10 by default as in DeepSpeed, and the writers its sections enable); keys without an
    equivalent go to ``unmapped`` with the reason, partial mappings to ``notes``."""
    every = ds.get("steps_per_print", STEPS_PER_PRINT_DEFAULT)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"DeepSpeed key 'steps_per_print' must be a positive integer, got {every!r}.")
    writers: list[tuple[str, tuple]] = [("Console", (("every", every),))]
    options: list[tuple[str, Any]] = []
    tb = _section(ds, "tensorboard", _SECTIONS["tensorboard"])
    if tb is not None:
        writers.append(("TensorBoard", (("logdir", os.path.join(tb["output_path"], tb["job_name"])),)))
    csv_ = _section(ds, "csv_monitor", _SECTIONS["csv_monitor"])
    if csv_ is not None:
        path = os.path.join(csv_["output_path"], csv_["job_name"], "metrics.csv")
        writers.append(("CSV", (("path", path), ("makedirs", True))))
        notes.append(
            f"csv_monitor writes {path!r}: one CSV with a column per metric, where DeepSpeed writes one "
            "'step,value' file per metric in that folder."
        )
    wb = _section(ds, "wandb", _SECTIONS["wandb"])
    if wb is not None:
        kw = [("project", wb["project"])] + [(k, wb[d]) for k, d in (("group", "group"), ("entity", "team")) if wb[d]]
        writers.append(("WandB", tuple(kw)))
    if _section(ds, "comet", _COMET) is not None:
        unmapped["comet"] = (
            "no Comet writer: subclass zj.monitor.Writer (write(kind, step, values)) around comet_ml's Experiment"
        )
    clock = ds.get("wall_clock_breakdown", False)
    if not isinstance(clock, bool):
        raise ValueError(f"DeepSpeed key 'wall_clock_breakdown' must be true or false, got {clock!r}.")
    if clock:
        notes.append(
            "wall_clock_breakdown: the step is one compiled program (forward, backward, reduction and update "
            "fused), so its time is one number: every record's step_time_s."
        )
    fp = _section(ds, "flops_profiler", _FLOPS_PROFILER)
    if fp is not None:
        options.append(("flops_per_step", "compiled"))
        notes.append(
            "flops_profiler: the compiled step's FLOPs give the records' MFU (Monitor(flops_per_step='compiled')); "
            "the per-module breakdown has no equivalent (zj.report.communication_report and cost_analysis() are "
            "per program)."
        )
    return MonitorSpec(tuple(writers), tuple(options))
