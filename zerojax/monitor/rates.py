"""What a step's record derives from the devices: their peak FLOP/s, the compiled step's
FLOPs and the memory in use."""

from __future__ import annotations

from typing import Any

from zerojax.tuning import devices as device_table


def peak_flops(device: Any, mesh: Any, compute_dtype: str) -> tuple[float | None, str]:
    """``(peak FLOP/s of one device for compute_dtype, "")``, or ``(None, why not)``:
    ``device`` a :class:`~zerojax.tuning.DeviceSpec` or a datasheet name; None: the
    datasheet of the mesh's devices (none for the CPU backend, whose rate varies by host:
    give a spec, e.g. ``zj.autotune.calibrate(mesh)``'s)."""
    if device is not None:
        spec = device_table.device_spec(device)
        return spec.flops_for(compute_dtype), ""
    first = mesh.devices.flat[0] if mesh is not None else None
    kind = getattr(first, "device_kind", "")
    spec = device_table.known(kind) if getattr(first, "platform", "cpu") != "cpu" else None
    if spec is None:
        return None, (
            f"no datasheet peak for {kind or 'these devices'!r}: give Monitor(device=...) a zj.autotune.DeviceSpec "
            "or a datasheet name"
        )
    return spec.flops_for(compute_dtype), ""


def compiled_flops(step: Any, state: Any, batch: Any) -> float:
    """FLOPs per device of one execution of ``step``'s compiled program, every loop
    iteration counted (:func:`zerojax.tuning.hlo_cost.loop_cost`)."""
    from zerojax.tuning.hlo_cost import loop_cost

    if not hasattr(step, "lower"):
        raise TypeError(
            f"flops_per_step='compiled' needs a zerojax TrainStep (with .lower), got {type(step).__name__}."
        )
    return float(loop_cost(step.lower(state, batch).compile()).flops)


def memory(devices: list) -> dict[str, float]:
    """``memory_in_use_bytes`` / ``memory_peak_bytes``: the most any of ``devices`` holds
    now and has held (``Device.memory_stats()``); empty where the backend keeps none."""
    stats = [d.memory_stats() for d in devices]
    stats = [s for s in stats if s]
    if not stats:
        return {}
    out = {}
    for key, name in (("bytes_in_use", "memory_in_use_bytes"), ("peak_bytes_in_use", "memory_peak_bytes")):
        values = [s[key] for s in stats if key in s]
        if values:
            out[name] = float(max(values))
    return out
