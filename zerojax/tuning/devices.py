"""What a device can do per second: datasheet constants for known accelerators, measured
ones for the rest.

A :class:`DeviceSpec` holds the rates the time model (:mod:`zerojax.tuning.cost`) divides
by. Known accelerators (:data:`KNOWN`) take their vendors' datasheet figures (dense, no
sparsity; cited beside each). The CPU backend and any device not listed are measured once
per process on the mesh itself (:func:`calibrate`, about a second: a matmul, a copy and two
collectives on every device at once), so the rates include what the devices share (on
simulated CPU devices, the host's cores and memory bus). None of this runs the user's
train step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Per-device rates for the time model, in FLOP/s, bytes/s and seconds.

    Fields:
      name: what the figures describe (a product, or "cpu (calibrated)").
      peak_flops: matmul FLOP/s in bfloat16/float16.
      peak_flops_fp32: matmul FLOP/s for float32 compute (TF32 on NVIDIA GPUs, JAX's default
        matmul precision there; one bf16 pass on TPUs).
      hbm_bandwidth: device memory bytes/s.
      link_bandwidth: bytes/s one device sends (one direction) to the devices of its node
        (NVLink, TPU ICI).
      network_bandwidth: bytes/s per device to other nodes (InfiniBand); collectives over more
        devices than ``devices_per_node`` run at this rate.
      devices_per_node: devices joined by ``link_bandwidth``.
      host_bandwidth: host<->device bytes/s (PCIe), for offloaded state.
      collective_latency: seconds each collective costs whatever its size.
      async_collectives: whether collectives overlap compute where the program allows it
        (stage 3 with ``prefetch``): true on GPUs and TPUs, false on the CPU backend.
      memory_bytes: device memory (the CLI's default budget); 0 where unknown.
      source: "datasheet", "calibrated" or "user".
      matmul_curve: measured ``(side, FLOP/s)`` of square matmuls of a few sides, increasing
        (calibration fills it): a matmul whose smallest of M, N, K is ``side`` runs at the rate
        interpolated between them (log-log; the end rates beyond the ends). Empty: every
        matmul at the peak.
      matmul_rates: measured ``((M, N, K), FLOP/s)`` of matmuls of given shapes
        (:func:`measure_matmuls` fills it with the shapes of the programs the tuner prices):
        a program whose every dot has a measured shape is priced at those rates, the curve
        otherwise.
      memory_curve: measured ``(bytes, bytes/s)`` of elementwise passes whose operands and
        output come to that many bytes, increasing (calibration fills it): an instruction
        accessing that many bytes runs at the rate interpolated between them. On a CPU a pass
        over a 64 KiB working set runs from cache, ten times faster than one over 128 MiB;
        empty: every byte at ``hbm_bandwidth`` (an accelerator's HBM).

    Example:
      >>> from zerojax.tuning import DeviceSpec, device_spec
      >>> h100 = device_spec("H100")
      >>> h100.peak_flops / 1e12, h100.hbm_bandwidth / 1e12
      (989.4, 3.35)
      >>> import dataclasses
      >>> dataclasses.replace(h100, network_bandwidth=25e9).network_bandwidth
      25000000000.0
      >>> DeviceSpec(name="x", peak_flops=0, peak_flops_fp32=1, hbm_bandwidth=1, link_bandwidth=1)
      Traceback (most recent call last):
      ...
      ValueError: DeviceSpec.peak_flops must be a positive number, got 0.
    """

    name: str
    peak_flops: float
    peak_flops_fp32: float
    hbm_bandwidth: float
    link_bandwidth: float
    network_bandwidth: float | None = None
    devices_per_node: int = 8
    host_bandwidth: float | None = None
    collective_latency: float = 10e-6
    async_collectives: bool = True
    memory_bytes: float = 0.0
    source: str = "user"
    matmul_curve: tuple[tuple[float, float], ...] = ()
    memory_curve: tuple[tuple[float, float], ...] = ()
    matmul_rates: tuple[tuple[tuple[int, int, int], float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("peak_flops", "peak_flops_fp32", "hbm_bandwidth", "link_bandwidth"):
            _positive(self, name)
        if self.network_bandwidth is None:
            object.__setattr__(self, "network_bandwidth", self.link_bandwidth)
        if self.host_bandwidth is None:
            object.__setattr__(self, "host_bandwidth", self.hbm_bandwidth)
        for name in ("network_bandwidth", "host_bandwidth"):
            _positive(self, name)
        if (
            isinstance(self.devices_per_node, bool)
            or not isinstance(self.devices_per_node, int)
            or self.devices_per_node < 1
        ):
            raise ValueError(f"DeviceSpec.devices_per_node must be a positive int, got {self.devices_per_node!r}.")
        value = self.collective_latency
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"DeviceSpec.collective_latency must be seconds >= 0, got {value!r}.")
        if not isinstance(self.async_collectives, bool):
            raise TypeError(f"DeviceSpec.async_collectives must be a bool, got {self.async_collectives!r}.")
        if self.source not in ("datasheet", "calibrated", "user"):
            raise ValueError(f"DeviceSpec.source must be 'datasheet', 'calibrated' or 'user', got {self.source!r}.")
        for name, what in (("matmul_curve", "(side, FLOP/s)"), ("memory_curve", "(bytes, bytes/s)")):
            given = getattr(self, name)
            curve = tuple((float(a), float(b)) for a, b in given)
            if any(not (a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)) for a, b in curve) or [
                a for a, _ in curve
            ] != sorted({a for a, _ in curve}):
                raise ValueError(
                    f"DeviceSpec.{name} must be {what} pairs, positive, the first increasing, got {given!r}."
                )
            object.__setattr__(self, name, curve)
        rates = tuple((tuple(int(d) for d in mnk), float(r)) for mnk, r in self.matmul_rates)
        if any(len(mnk) != 3 or min(mnk) < 1 or not (r > 0 and math.isfinite(r)) for mnk, r in rates):
            raise ValueError(
                f"DeviceSpec.matmul_rates must be ((M, N, K), FLOP/s) pairs, positive, got {self.matmul_rates!r}."
            )
        object.__setattr__(self, "matmul_rates", rates)

    def flops_for(self, compute_dtype: str) -> float:
        """Matmul FLOP/s for a compute dtype (float32 or a 16-bit one)."""
        return self.peak_flops_fp32 if compute_dtype == "float32" else self.peak_flops

    def matmul_rate(self, side: float, compute_dtype: str) -> float:
        """FLOP/s of a matmul with M·N·K = ``side``³: from :attr:`matmul_curve` where measured,
        the peak of the compute dtype otherwise.

        Example:
          >>> from zerojax.tuning import DeviceSpec
          >>> spec = DeviceSpec(name="x", peak_flops=8e9, peak_flops_fp32=8e9, hbm_bandwidth=1e9,
          ...                   link_bandwidth=1e9, matmul_curve=((128, 2e9), (512, 8e9)))
          >>> [round(spec.matmul_rate(s, "float32") / 1e9, 3) for s in (64, 128, 256, 512, 4096)]
          [2.0, 2.0, 4.0, 8.0, 8.0]
        """
        return _interpolate(self.matmul_curve, side) if self.matmul_curve else self.flops_for(compute_dtype)

    def memory_rate(self, nbytes: float) -> float:
        """Bytes/s of an instruction that reads and writes ``nbytes`` in all: from
        :attr:`memory_curve` where measured, :attr:`hbm_bandwidth` otherwise.

        Example:
          >>> from zerojax.tuning import DeviceSpec
          >>> spec = DeviceSpec(name="x", peak_flops=1e9, peak_flops_fp32=1e9, hbm_bandwidth=2e9,
          ...                   link_bandwidth=1e9, memory_curve=((2**16, 32e9), (2**24, 2e9)))
          >>> [round(spec.memory_rate(b) / 1e9, 1) for b in (2**10, 2**16, 2**20, 2**24, 2**30)]
          [32.0, 32.0, 8.0, 2.0, 2.0]
        """
        return _interpolate(self.memory_curve, nbytes) if self.memory_curve else self.hbm_bandwidth

    def axis_bandwidth(self, group_size: int) -> float:
        """Bytes/s per device of a collective over ``group_size`` devices: the node's links
        when the group fits in a node, the network otherwise."""
        return self.link_bandwidth if group_size <= self.devices_per_node else self.network_bandwidth


def _interpolate(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """The rate at ``x`` on a measured curve: log-log between its points, the end rates beyond."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (s0, r0), (s1, r1) in zip(curve, curve[1:]):
        if x <= s1:
            w = math.log(x / s0) / math.log(s1 / s0)
            return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
    return curve[-1][1]


def _positive(spec: DeviceSpec, name: str) -> None:
    value = getattr(spec, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"DeviceSpec.{name} must be a positive number, got {value!r}.")


# Vendors' datasheet figures, dense (no structured sparsity), per device.
KNOWN: dict[str, DeviceSpec] = {
    # NVIDIA H100 SXM5 datasheet: BF16 1,979 TFLOPS with sparsity (989.4 dense), TF32 989 with
    # sparsity (494.7 dense); HBM3 80 GB at 3.35 TB/s; NVLink 900 GB/s (both directions: 450 each);
    # PCIe Gen5 128 GB/s (64 each way). Across nodes: one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100).
    "H100": DeviceSpec(
        name="NVIDIA H100 SXM",
        peak_flops=989.4e12,
        peak_flops_fp32=494.7e12,
        hbm_bandwidth=3.35e12,
        link_bandwidth=450 * GB,
        network_bandwidth=50 * GB,
        devices_per_node=8,
        host_bandwidth=64 * GB,
        memory_bytes=80 * GB,
        source="datasheet",
    ),
    # NVIDIA H200 SXM datasheet: same tensor cores as H100 (BF16 989.4 dense, TF32 494.7 dense);
    # HBM3e 141 GB at 4.8 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s.
    "H200": DeviceSpec(
        name="NVIDIA H200 SXM",
        peak_flops=989.4e12,
        peak_flops_fp32=494.7e12,
        hbm_bandwidth=4.8e12,
        link_bandwidth=450 * GB,
        network_bandwidth=50 * GB,
        devices_per_node=8,
        host_bandwidth=64 * GB,
        memory_bytes=141 * GB,
        source="datasheet",
    ),
    # NVIDIA A100 SXM4 80GB datasheet: BF16 312 TFLOPS dense, TF32 156 dense; HBM2e 2,039 GB/s;
    # NVLink 600 GB/s (300 each way); PCIe Gen4 64 GB/s (32 each way); 200 Gb/s HDR per GPU (DGX A100).
    "A100": DeviceSpec(
        name="NVIDIA A100 SXM4 80GB",
        peak_flops=312e12,
        peak_flops_fp32=156e12,
        hbm_bandwidth=2.039e12,
        link_bandwidth=300 * GB,
        network_bandwidth=25 * GB,
        devices_per_node=8,
        host_bandwidth=32 * GB,
        memory_bytes=80 * GB,
        source="datasheet",
    ),
    # Google Cloud TPU v5e: 197 TFLOPS bf16; 16 GB HBM2 at 819 GB/s; ICI 1,600 Gbps per chip
    # (200 GB/s); a pod of 256 chips on ICI.
    "TPU v5e": DeviceSpec(
        name="Google TPU v5e",
        peak_flops=197e12,
        peak_flops_fp32=197e12,
        hbm_bandwidth=819 * GB,
        link_bandwidth=200 * GB,
        devices_per_node=256,
        host_bandwidth=32 * GB,
        memory_bytes=16 * GB,
        source="datasheet",
    ),
    # Google Cloud TPU v5p: 459 TFLOPS bf16; 95 GB HBM2e at 2,765 GB/s; ICI 4,800 Gbps per chip
    # (600 GB/s); a pod of 8,960 chips on ICI.
    "TPU v5p": DeviceSpec(
        name="Google TPU v5p",
        peak_flops=459e12,
        peak_flops_fp32=459e12,
        hbm_bandwidth=2765 * GB,
        link_bandwidth=600 * GB,
        devices_per_node=8960,
        host_bandwidth=32 * GB,
        memory_bytes=95 * GB,
        source="datasheet",
    ),
    # Google Cloud TPU v4: 275 TFLOPS bf16; 32 GiB HBM2 at 1,200 GB/s; ICI 2,400 Gbps (300 GB/s).
    "TPU v4": DeviceSpec(
        name="Google TPU v4",
        peak_flops=275e12,
        peak_flops_fp32=275e12,
        hbm_bandwidth=1200 * GB,
        link_bandwidth=300 * GB,
        devices_per_node=4096,
        host_bandwidth=32 * GB,
        memory_bytes=32 * 2**30,
        source="datasheet",
    ),
}

# How JAX's device_kind names them (and the CLI's short names), in the order to try.
_ALIASES = (
    ("H200", "H200"),
    ("H100", "H100"),
    ("A100", "A100"),
    ("TPU v5 lite", "TPU v5e"),
    ("v5e", "TPU v5e"),
    ("TPU v5p", "TPU v5p"),
    ("v5p", "TPU v5p"),
    ("TPU v5", "TPU v5p"),
    ("TPU v4", "TPU v4"),
    ("v4", "TPU v4"),
)


def known(kind: str) -> DeviceSpec | None:
    """The datasheet spec for a device kind (``jax.Device.device_kind``, or a short name such
    as ``"h100"``, ``"tpu-v5e"``), or None when it is not one of :data:`KNOWN`."""
    text = kind.lower().replace("-", " ").replace("_", " ")
    for alias, key in _ALIASES:
        if alias.lower() in text:
            return KNOWN[key]
    return None


def device_spec(device: Any = None, mesh: Any = None) -> DeviceSpec:
    """The :class:`DeviceSpec` for ``device``: a ``DeviceSpec`` (returned as is), a name
    (``"H100"``, ``"a100"``, ``"tpu-v5e"``; ``"cpu"`` or ``"calibrate"`` measure ``mesh``),
    a ``jax.Device``, or None (the mesh's first device). Known accelerators take their
    datasheet figures; the CPU backend and unknown devices are measured on ``mesh``
    (:func:`calibrate`).

    Example:
      >>> from zerojax.tuning import device_spec
      >>> device_spec("tpu-v5e").name
      'Google TPU v5e'
      >>> device_spec("B300")
      Traceback (most recent call last):
      ...
      ValueError: no datasheet figures for device 'B300'; known: H100, H200, A100, TPU v5e, TPU v5p, TPU v4. ...
    """
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, str):
        if device.lower() in ("cpu", "calibrate"):
            return calibrate(_need_mesh(mesh))
        spec = known(device)
        if spec is None:
            raise ValueError(
                f"no datasheet figures for device {device!r}; known: {', '.join(KNOWN)}. Pass a "
                f"zj.autotune.DeviceSpec(...) with its rates, or device='calibrate' to measure the mesh."
            )
        return spec
    if device is None:
        device = _need_mesh(mesh).devices.flat[0]
    spec = known(getattr(device, "device_kind", ""))
    if spec is not None and getattr(device, "platform", "") != "cpu":
        return spec
    return calibrate(_need_mesh(mesh))


def _need_mesh(mesh: Any):
    if mesh is None:
        raise ValueError("measuring the devices needs the mesh they run on (mesh=...).")
    return mesh


_CALIBRATED: dict[tuple, DeviceSpec] = {}


def calibrate(mesh, *, seconds: float = 1.0) -> DeviceSpec:
    """Measures the devices of ``mesh`` once per process (cached per set of devices):
    chains of float32 matmuls of sides 32 to 512 (FLOP/s by side, :attr:`DeviceSpec.matmul_curve`),
    elementwise passes over buffers of 16 KiB to 16 MiB (bandwidth by working set,
    :attr:`DeviceSpec.memory_curve`), an all-gather of 1 MiB per device (link bandwidth) and
    16 rounds of a small matmul, each ending in an all-reduce, against the same rounds
    without (the latency each collective adds), each run on every device at once inside ``shard_map``, in turns
    after a warm-up, for about ``seconds`` in all; the cost of running a program at all is
    taken out of each. The rates are per device (on simulated CPU devices, each device's
    share of the host). Not a run of any train step.

    Example:
      >>> import zerojax as zj
      >>> from zerojax.tuning import calibrate
      >>> spec = calibrate(zj.make_mesh())
      >>> spec.source, spec.async_collectives, spec.peak_flops > 1e6
      ('calibrated', False, True)
      >>> calibrate(zj.make_mesh()) is spec   # measured once per process
      True
    """
    key = (tuple(d.id for d in mesh.devices.flat), tuple(mesh.axis_names), tuple(mesh.devices.shape))
    if key not in _CALIBRATED:
        _CALIBRATED[key] = _measure(mesh, seconds)
    return _CALIBRATED[key]


def _timed(programs: dict, seconds: float) -> dict[str, float]:
    """Median seconds of each ``name: (fn, arg)``: every program compiled and run twice
    first, then run in turns (one round runs each once) for about ``seconds``, so that the
    host's changing load (other processes, frequency scaling) falls on all of them alike."""
    for fn, arg in programs.values():
        jax.block_until_ready(fn(arg))
        jax.block_until_ready(fn(arg))
    times: dict[str, list[float]] = {name: [] for name in programs}
    start = time.perf_counter()
    while min(len(t) for t in times.values()) < 3 or (
        time.perf_counter() - start < seconds and min(len(t) for t in times.values()) < 50
    ):
        for name, (fn, arg) in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg))
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def _measure(mesh, seconds: float) -> DeviceSpec:
    flat = jax.sharding.Mesh(np.asarray(mesh.devices).reshape(-1), ("_all",))
    n = flat.devices.size
    split = NamedSharding(flat, P("_all"))
    local = lambda f: jax.jit(jax.shard_map(f, mesh=flat, in_specs=P("_all"), out_specs=P("_all")))
    put = lambda shape: jax.device_put(jnp.ones((n * shape[0],) + shape[1:], jnp.float32), split)
    sides, g, r = (32, 64, 128, 256, 512), 1 << 18, 16  # matmuls; gathered shard (1 MiB); collectives chained
    copies = tuple(1 << k for k in range(12, 23, 2))  # elements: 16 KiB to 16 MiB buffers

    # Each matmul program chains (512 / m)³ matmuls (the same FLOPs for every size), and each
    # copy program (16 Mi / e) passes over its buffer (the same bytes), so that a small one's
    # time stands well above the cost of running a program: a single 128-sided matmul takes
    # less than that cost's own noise on an idle host.
    reps = {m: max(1, (sides[-1] // m) ** 3) for m in sides}
    passes = {e: max(1, copies[-1] // e) for e in copies}
    chain = lambda m: lambda x: jax.lax.fori_loop(0, reps[m], lambda _, h: (h @ x) * (1.0 / m), x)
    sweep = lambda e: lambda v: jax.lax.fori_loop(0, passes[e], lambda _, h: h * 0.5 + 1.0, v)
    work = lambda x: jnp.tanh(x @ x) * 0.01  # between collectives: devices arrive at each as in a step

    def worked(with_collectives: bool):  # r rounds of work, each ending in an all-reduce or not
        def f(x):
            for _ in range(r):
                x = jax.lax.psum(work(x), "_all") * 0.125 if with_collectives else work(x)
            return x

        return f

    t = _timed(
        {
            **{f"matmul{m}": (local(chain(m)), put((m, m))) for m in sides},  # 2·m³·reps FLOPs per device
            **{f"copy{e}": (local(sweep(e)), put((e,))) for e in copies},  # 8·e bytes a pass, per device
            "gather": (local(lambda v: jax.lax.all_gather(v, "_all", tiled=True)[None]), put((g,))),
            "launch": (local(lambda v: jax.lax.psum(v, "_all")), put((1,))),  # a program with one tiny collective
            "work": (local(worked(False)), put((128, 128))),
            "worked": (local(worked(True)), put((128, 128))),
        },
        seconds,
    )
    run = lambda name: max(t[name] - t["launch"], 1e-9)  # less the cost of running any program
    curve = tuple((float(m), 2.0 * m**3 * reps[m] / run(f"matmul{m}")) for m in sides)
    memory = tuple((8.0 * e, 8.0 * e * passes[e] / run(f"copy{e}")) for e in copies)
    flops = max(rate for _, rate in curve)
    hbm = memory[-1][1]  # a 16 MiB buffer: past any cache
    link = 4.0 * g * (n - 1) / run("gather") if n > 1 else hbm
    latency = max(t["worked"] - t["work"], 0.0) / r if n > 1 else 0.0
    kind = getattr(mesh.devices.flat[0], "device_kind", "device")
    return DeviceSpec(
        name=f"{kind} (calibrated)",
        peak_flops=flops,
        peak_flops_fp32=flops,
        hbm_bandwidth=hbm,
        link_bandwidth=link,
        network_bandwidth=link,
        devices_per_node=max(n, 1),
        host_bandwidth=hbm,
        collective_latency=latency,
        async_collectives=False,
        source="calibrated",
        matmul_curve=curve,
        memory_curve=memory,
    )


_SHAPE_RATES: dict[tuple, dict[tuple[int, int, int], float]] = {}


def measure_matmuls(spec: DeviceSpec, mesh, shapes, *, flops: float = 2e8, seconds: float = 1.0) -> DeviceSpec:
    """``spec`` with :attr:`~DeviceSpec.matmul_rates` for ``shapes`` (``(M, N, K)``
    triples) added, measured on ``mesh``'s devices (cached per mesh and shape) when ``spec``
    was calibrated there; datasheet and user specs are returned as they are.

    Each shape runs as a chain of matmuls of that shape (about ``flops`` FLOPs per device,
    all devices at once, the programs in turns for about ``seconds``), as the curve's
    square matmuls do: on a CPU a thin matmul (M = 128 tokens, K = 128, N = 512) runs at
    two thirds of a square one of its FLOPs, and accumulation, which thins every matmul of
    a step, is priced by what its own shapes run at.

    Example:
      >>> import zerojax as zj
      >>> from zerojax.tuning import calibrate
      >>> from zerojax.tuning.devices import measure_matmuls
      >>> mesh = zj.make_mesh()
      >>> spec = measure_matmuls(calibrate(mesh), mesh, [(64, 256, 128)])
      >>> [mnk for mnk, _ in spec.matmul_rates]
      [(64, 256, 128)]
    """
    if spec.source != "calibrated":
        return spec
    key = (tuple(d.id for d in mesh.devices.flat), tuple(mesh.devices.shape))
    known = _SHAPE_RATES.setdefault(key, {})
    todo = sorted({tuple(int(d) for d in s) for s in shapes} - set(known))
    if todo:
        flat = jax.sharding.Mesh(np.asarray(mesh.devices).reshape(-1), ("_all",))
        n = flat.devices.size
        split = NamedSharding(flat, P("_all"))
        local = lambda f: jax.jit(jax.shard_map(f, mesh=flat, in_specs=(P("_all"), P("_all")), out_specs=P("_all")))
        put = lambda shape: jax.device_put(jnp.full((n * shape[0],) + shape[1:], 1.0 / shape[-2], jnp.float32), split)
        programs, reps = {}, {}
        for m, nn, k in todo:
            reps[(m, nn, k)] = r = max(1, int(flops // (2 * m * nn * k)))

            def chain(x, w, r=r):  # x: (m, k), w: two (k, n); the weight alternates (nothing to hoist)
                def body(i, acc):
                    y = x[0] @ jax.lax.dynamic_index_in_dim(w[0], i % 2, keepdims=False)
                    return acc + jnp.tanh(y).mean()  # the product read once, as a step's next op reads it

                return jax.lax.fori_loop(0, r, body, x[0, :1, 0] * 0.0)[None]  # a varying zero carry

            programs[(m, nn, k)] = (lambda f: lambda a: f(*a))(local(chain)), (put((1, m, k)), put((1, 2, k, nn)))
        launch = jax.jit(
            jax.shard_map(lambda v: jax.lax.psum(v, "_all"), mesh=flat, in_specs=P("_all"), out_specs=P("_all"))
        )
        t = _timed(
            {
                **{str(s): p for s, p in programs.items()},
                "launch": (launch, jax.device_put(jnp.ones((n,), jnp.float32), split)),
            },
            seconds,
        )
        for s in todo:
            m, nn, k = s
            known[s] = 2.0 * m * nn * k * reps[s] / max(t[str(s)] - t["launch"], 1e-9)
    rates = dict(spec.matmul_rates)
    rates.update({s: known[s] for s in {tuple(int(d) for d in s) for s in shapes}})
    return dataclasses.replace(spec, matmul_rates=tuple(sorted(rates.items())))
