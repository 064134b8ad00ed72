"""Joining a multi-process job through JAX's own distributed runtime."""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax
from jax.sharding import Mesh

from zerojax._jaxpr import settings
from zerojax.distributed.heartbeat import start_heartbeat
from zerojax.sharding.mesh import make_mesh

ENV_COORDINATOR = "ZEROJAX_COORDINATOR"
ENV_NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROJAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "ZEROJAX_LOCAL_DEVICES"
_CALLED = False  # initialize() ran once in this process (a second call is not a late first one)


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process stands in the job, and which launcher said so."""

    launcher: str  # "explicit", "zerojax", "slurm", "openmpi" or "single"
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0


def detect(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: dict | None = None,
) -> Launch:
    """Finds the job layout: explicit arguments, then ``zerojax.launch``'s environment, then
    SLURM, then Open MPI; otherwise a single process."""
    env = os.environ if env is None else env
    if coordinator_address is not None or num_processes is not None or process_id is not None:
        missing = [
            n
            for n, v in (
                ("coordinator_address", coordinator_address),
                ("num_processes", num_processes),
                ("process_id", process_id),
            )
            if v is None
        ]
        if missing:
            raise ValueError(f"explicit multi-process setup needs all three values; missing {missing}.")
        return Launch("explicit", coordinator_address, int(num_processes), int(process_id))
    if ENV_COORDINATOR in env:
        try:
            return Launch("zerojax", env[ENV_COORDINATOR], int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID]))
        except KeyError as e:
            raise ValueError(
                f"{ENV_COORDINATOR} is set but {e.args[0]} is not; start processes with "
                "python -m zerojax.launch or set all three variables."
            ) from None
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return Launch("slurm", None, int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]))
    if "OMPI_COMM_WORLD_SIZE" in env and int(env["OMPI_COMM_WORLD_SIZE"]) > 1:
        return Launch("openmpi", None, int(env["OMPI_COMM_WORLD_SIZE"]), int(env["OMPI_COMM_WORLD_RANK"]))
    return Launch("single")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_cpu_devices: int | None = None,
    timeout_s: int = 120,
    heartbeat_timeout_s: int = 30,
    axis: str = "data",
    replicas: int = 1,
) -> Mesh:
    """Joins the job (``jax.distributed.initialize``) and returns the mesh over every
    process's devices: one ``axis``, or ``replicas`` groups of it (hybrid sharding, see
    :func:`zerojax.make_mesh`; with one group per process, each group is a host's devices).

    Call it first, before anything else touches JAX. Launchers are detected (see
    :func:`detect`); on CPU, collectives use gloo and ``local_cpu_devices`` (or
    ``ZEROJAX_LOCAL_DEVICES``) simulates that many devices per process. A process that dies
    is noticed by the others within ``heartbeat_timeout_s``, which then fail instead of
    waiting; joining gives up after ``timeout_s``. Under ``zerojax launch
    --heartbeat-timeout`` it also starts the heartbeat the launcher watches
    (:mod:`zerojax.distributed.heartbeat`).

    Example (one process: nothing to join, the mesh spans the local devices):
      >>> import zerojax as zj
      >>> zj.distributed.initialize().axis_names
      ('data',)
    """
    launch = detect(coordinator_address, num_processes, process_id)
    start_heartbeat()
    local = local_cpu_devices if local_cpu_devices is not None else os.environ.get(ENV_LOCAL_DEVICES)
    global _CALLED
    if launch.launcher == "single" and local is None and not _CALLED and settings.backends_initialized():
        warnings.warn(
            "zj.distributed.initialize() was called after JAX was used (an array was made or a device "
            "listed): that works in one process, but under a launcher the same script fails, because "
            "joining the job must come before anything touches JAX. Call it first.",
            stacklevel=2,
        )
    _CALLED = True
    if launch.launcher != "single" or local is not None:
        try:
            if local is not None:
                jax.config.update("jax_num_cpu_devices", int(local))
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except RuntimeError as e:
            raise RuntimeError(
                "zj.distributed.initialize() must run before JAX is used (it sets the CPU "
                f"devices and collectives): {e}"
            ) from None
    if launch.launcher != "single" and not jax.distributed.is_initialized():
        kwargs = dict(initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)
        if launch.launcher in ("explicit", "zerojax"):
            jax.distributed.initialize(launch.coordinator_address, launch.num_processes, launch.process_id, **kwargs)
        else:  # JAX's own cluster detection reads SLURM / Open MPI's variables
            jax.distributed.initialize(**kwargs)
    return make_mesh(axis=axis, replicas=replicas)
