"""The time model: seconds per step from a compiled program and a device's rates.

Read from the compiled program, per device and per step (nothing runs):

* FLOPs and bytes accessed: ``cost_analysis()`` (which reports one device's partitioned
  program), with the loop iterations it leaves out added from the HLO
  (:mod:`zerojax.tuning.hlo_cost`);
* collective bytes per set of mesh axes, and how many collectives run:
  :func:`zerojax.report.communication_report`;
* host traffic of offloaded state: every offloaded byte crosses the host link, or is
  touched by the host's update, once each way per step (2 × the offloaded state).

Then, with a :class:`~zerojax.tuning.DeviceSpec`::

    compute = Σ_matmuls FLOPs / rate(shape) + other FLOPs / peak + Σ_instructions bytes / bandwidth(working set)
    comm    = Σ_axes paper-unit bytes · (g − 1)/g / bandwidth(span) + collectives · latency
    host    = 2 · offloaded bytes / host bandwidth
    time    = compute + comm + host, or max(compute, comm) + host where the device runs
              collectives asynchronously and the program gathers ahead (stage 3 prefetch)

``rate(shape)`` is the peak FLOP/s of the compute dtype for datasheet devices; for measured
ones, the rate a chain of matmuls of that very shape reached
(:func:`~zerojax.tuning.devices.measure_matmuls`, which the search runs for the shapes its
programs contain), or else the rate a square matmul of the dot's smallest side reached (small
and thin matmuls run far below a large square one, and they are most of a small model's).
``bandwidth(working set)`` is the device's datasheet memory bandwidth or, measured, the rate
an elementwise pass over a working set of that size reached (on a CPU, cache-sized working
sets run ten times faster than 16 MiB ones; a small model's instructions touch a few hundred
KiB each). ``g`` is the number of
devices a collective spans; a ring moves (g − 1)/g of the buffer per
device, in the paper's units (an all-reduce twice); a ``collective-permute`` (a pipeline's
activation passed to the next stage) sends its whole buffer once. ``span`` is the devices of
the smallest block of consecutive mesh positions holding one group (the product of the mesh's
sizes from the group's outermost axis inwards): a node holds ``devices_per_node`` consecutive
devices, so a group whose span exceeds it crosses nodes and runs at the network's rate. The
data axis of ``make_mesh(pipeline=2)`` over 2 nodes of 4 spans 4 (inside a node), its
pipeline axis 8 (across them), as the data axis of ``make_mesh()`` over the same 8. Summing compute and memory time rather
than taking their maximum prices each kernel as bound by one of the two (matmuls by FLOPs,
elementwise work by bytes), which is closer to the sum of per-kernel rooflines than a
roofline of the totals.

The figures are one device's; the step's time is that device's, all devices running the
same program. Datasheet peaks make absolute times optimistic on accelerators (no kernel runs
at peak); what the tuner needs is the order of the candidates.
"""

from __future__ import annotations

import dataclasses
import math

from zerojax.report.comm import collectives
from zerojax.tuning.devices import DeviceSpec
from zerojax.tuning.hlo_cost import loop_cost


@dataclasses.dataclass(frozen=True)
class AxisTraffic:
    """Collectives over one set of mesh axes, per device per step."""

    axes: str  # "data", "replica", "replica+data", ...
    group_size: int  # devices each collective spans
    bytes: float  # in the paper's units (an all-reduce counts twice its buffer)
    count: int  # collectives run
    span: int = 0  # consecutive mesh positions holding one group (0: group_size, innermost axes)
    ring: bool = True  # a ring moves (g - 1)/g of the bytes per device; a permute sends them all

    @property
    def extent(self) -> int:
        """The devices a group's span covers: what decides whether it crosses nodes."""
        return self.span or self.group_size


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one step of a compiled program does on one device (see the module docstring).

    Example (a matmul split over the 8 devices: a device does 1/8 of the FLOPs):
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> import zerojax as zj
      >>> from zerojax.tuning import DeviceSpec
      >>> from zerojax.tuning.cost import step_cost
      >>> mesh = zj.make_mesh()
      >>> x = jax.ShapeDtypeStruct((512, 256), "float32", sharding=NamedSharding(mesh, P("data")))
      >>> w = jax.ShapeDtypeStruct((256, 128), "float32", sharding=NamedSharding(mesh, P()))
      >>> cost = step_cost(jax.jit(jnp.matmul).lower(x, w).compile(), mesh)
      >>> cost.flops == 2 * 512 * 256 * 128 / 8
      True
      >>> spec = DeviceSpec(name="1 TFLOP/s", peak_flops=1e12, peak_flops_fp32=1e12, hbm_bandwidth=1e18,
      ...                   link_bandwidth=1e18)
      >>> round(cost.seconds(spec) * 1e6, 2)   # microseconds: the FLOPs at 1e12 per second
      4.19
    """

    flops: float
    bytes_accessed: float
    traffic: tuple[AxisTraffic, ...] = ()
    host_bytes: float = 0.0
    compute_dtype: str = "float32"
    overlap: bool = False  # gathers issued ahead of their use (stage 3 prefetch)
    matmuls: tuple[tuple[float, float], ...] = ()  # (side, FLOPs) of the matmuls, part of ``flops``
    memory_sizes: tuple[tuple[float, float], ...] = ()  # (working set, bytes): how ``bytes_accessed`` splits
    matmul_shapes: tuple[tuple[tuple[int, int, int], float], ...] = ()  # ((M, N, K), FLOPs) of the dots
    disk_seconds: float = 0.0  # the NVMe tier's reads and writes (DiskRates.seconds), per step

    def __post_init__(self) -> None:
        for name in ("flops", "bytes_accessed", "host_bytes", "disk_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"StepCost.{name} must be a finite number >= 0, got {value!r}.")

    @property
    def comm_bytes(self) -> float:
        return sum(t.bytes for t in self.traffic)

    @property
    def collectives(self) -> int:
        return sum(t.count for t in self.traffic)

    def breakdown(self, spec: DeviceSpec) -> dict[str, float]:
        """Seconds per part: ``compute`` (FLOPs), ``memory`` (bytes accessed), ``comm``
        (collective bytes and latency), ``host`` (offload traffic), ``disk`` (the NVMe tier's
        reads and writes, not overlapped: an upper bound) and the ``total``."""
        matmul_flops = sum(f for _, f in self.matmuls)
        rates = dict(spec.matmul_rates)
        exact = [(rates[mnk], f) for mnk, f in self.matmul_shapes if mnk in rates]
        if exact and len(exact) == len(self.matmul_shapes):  # every dot at its own shape's measured rate
            other = max(matmul_flops - sum(f for _, f in self.matmul_shapes), 0.0)  # convolutions
            matmul = sum(f / r for r, f in exact) + other / spec.flops_for(self.compute_dtype)
        else:
            matmul = sum(f / spec.matmul_rate(side, self.compute_dtype) for side, f in self.matmuls)
        compute = matmul + max(self.flops - matmul_flops, 0.0) / spec.flops_for(self.compute_dtype)
        parsed = sum(b for _, b in self.memory_sizes)
        if spec.memory_curve and parsed > 0:  # each working set at its measured rate, scaled to the total
            memory = sum(b / spec.memory_rate(size) for size, b in self.memory_sizes) * self.bytes_accessed / parsed
        else:
            memory = self.bytes_accessed / spec.hbm_bandwidth
        comm = sum(
            t.bytes * ((t.group_size - 1) / t.group_size if t.ring else 1.0) / spec.axis_bandwidth(t.extent)
            + t.count * spec.collective_latency
            for t in self.traffic
            if t.group_size > 1
        )
        host = self.host_bytes / spec.host_bandwidth
        if self.overlap and spec.async_collectives:
            total = max(compute + memory, comm) + host + self.disk_seconds
        else:
            total = compute + memory + comm + host + self.disk_seconds
        return {
            "compute": compute,
            "memory": memory,
            "comm": comm,
            "host": host,
            "disk": self.disk_seconds,
            "total": total,
        }

    def seconds(self, spec: DeviceSpec) -> float:
        """Predicted seconds per step on devices of ``spec``."""
        return self.breakdown(spec)["total"]


def step_cost(
    compiled, mesh, *, compute_dtype: str = "float32", host_state_bytes: float = 0.0, overlap: bool = False
) -> StepCost:
    """The :class:`StepCost` of ``compiled`` (a program compiled over ``mesh``):
    FLOPs and bytes with every loop iteration, collectives per set of mesh axes,
    ``host_state_bytes`` of offloaded state (crossing the host link twice)."""
    lc = loop_cost(compiled)
    text = compiled.as_text() if hasattr(compiled, "as_text") else str(compiled)
    sizes, order = dict(mesh.shape), list(mesh.axis_names)
    tally: dict[tuple[str, bool], list] = {}
    for c in collectives(text):
        names = c.axes(mesh)
        ring = c.kind != "collective-permute"
        r = tally.setdefault(("+".join(names) or "none", ring), [0, 0])
        r[0] += c.zero_units_bytes
        r[1] += c.count
    traffic = []
    for (axes, ring), (nbytes, count) in sorted(tally.items()):
        names = [a for a in axes.split("+") if a in sizes]
        group = math.prod(sizes[a] for a in names) if names else 1
        outer = min((order.index(a) for a in names), default=len(order))
        span = math.prod(sizes[a] for a in order[outer:]) if names else 1
        traffic.append(
            AxisTraffic(axes=axes, group_size=group, bytes=float(nbytes), count=int(count), span=span, ring=ring)
        )
    return StepCost(
        flops=lc.flops,
        bytes_accessed=lc.bytes,
        traffic=tuple(traffic),
        host_bytes=2.0 * float(host_state_bytes),
        compute_dtype=compute_dtype,
        overlap=overlap,
        matmuls=lc.matmuls,
        memory_sizes=lc.memory,
        matmul_shapes=lc.shapes,
    )
