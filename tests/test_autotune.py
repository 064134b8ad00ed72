"""zj.autotune: plans from compiled programs and a cost model, checked against references
computed here independently (zj.report.step_memory, zj.report.zero_formula_bytes, XLA's cost analysis of
unrolled programs, a matmul's 2·M·N·K)."""

import contextlib
import dataclasses
import importlib
import io
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.tuning import DeviceSpec, SearchSpace, device_spec, parse_memory
from zerojax.tuning.cost import step_cost
from zerojax.tuning.devices import measure_matmuls

search_module = importlib.import_module("zerojax.tuning.search")
hlo_cost = importlib.import_module("zerojax.tuning.hlo_cost")

MIB = 2**20
# Rates for tests that do not measure the machine (the figures only order the plans).
SPEC = DeviceSpec(
    name="test",
    peak_flops=1e10,
    peak_flops_fp32=1e10,
    hbm_bandwidth=1e9,
    link_bandwidth=1e9,
    collective_latency=1e-4,
    async_collectives=False,
)
D_IN, D_HID = 256, 512  # Ψ = 2 · 256 · 512 = 262,144: fp32 Adam's 12Ψ = 3 MiB at stage 0


def tiny_params(dtype="float32"):
    return {"w1": jax.ShapeDtypeStruct((D_IN, D_HID), dtype), "w2": jax.ShapeDtypeStruct((D_HID, D_IN), dtype)}


def tiny_loss(p, x):
    return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)


BATCH = jax.ShapeDtypeStruct((32, D_IN), "float32")
SMALL = SearchSpace(accum=(1, 2), remat=("none",), offload=("none",), prefetch=(0,))


@pytest.fixture(scope="module")
def tuned_and_progress():
    """One search of the tiny model in 2 MiB: stage 0 (3 MiB of state) is pruned unseen.
    With its progress: what the callback saw and the lines ``verbose`` printed."""
    seen, err = [], io.StringIO()
    with contextlib.redirect_stderr(err):
        plans = zj.autotune(
            tiny_loss,
            tiny_params(),
            optax.adam(1e-3),
            BATCH,
            mesh=zj.make_mesh(),
            memory="2MiB",
            device=SPEC,
            space=SMALL,
            verbose=True,
            progress=lambda done, total, msg: seen.append((done, total)),
        )
    return plans, seen, err.getvalue()


@pytest.fixture(scope="module")
def tuned(tuned_and_progress):
    return tuned_and_progress[0]


def test_plans_fit_and_memory_is_step_memory_of_the_same_config(tuned):
    mesh, budget = zj.make_mesh(), 2 * MIB
    assert len(tuned) >= 1 and tuned.best is tuned[0] and list(tuned) == list(tuned.plans)
    assert [p.time for p in tuned] == sorted(p.time for p in tuned)
    for plan in tuned:
        assert plan.memory.device <= budget
        assert plan.memory.source == "compiled"
    best = tuned.best
    direct = zj.report.step_memory(tiny_loss, tiny_params(), optax.adam(1e-3), BATCH, mesh=mesh, config=best.config)
    assert best.memory.step == direct
    assert best.memory.compiled == direct.device_total
    assert best.memory.device == int(np.ceil(direct.device_total * 1.10))  # the default 10% margin
    assert best.memory.state == direct.state


def test_pruned_are_exactly_the_candidates_whose_formula_exceeds_the_budget(tuned):
    psi = 2 * D_IN * D_HID
    usable = 2 * MIB / 1.10
    opt_bytes = (8 * psi + 4) / psi  # Adam's m and v, and its int32 step count
    assert tuned.candidates == 8  # 4 stages x 2 accumulation counts
    for c in tuned.pruned:
        want = zj.report.zero_formula_bytes(psi, 8, c.config.stage, opt_bytes=opt_bytes, memory="device")
        assert c.formula_bytes == pytest.approx(want) and want > usable
    for stage in range(4):
        formula = zj.report.zero_formula_bytes(psi, 8, stage, opt_bytes=opt_bytes, memory="device")
        pruned = {c.config.grad_accum_steps for c in tuned.pruned if c.config.stage == stage}
        assert pruned == ({1, 2} if formula > usable else set()), stage
    assert {c.config.stage for c in tuned.pruned} == {0}
    # Every candidate is pruned, decided from a compiled neighbour, or compiled (alone or shared).
    decided = len(tuned.skipped) + tuned.compiled + tuned.shared
    assert decided + len(tuned.pruned) == tuned.candidates


def test_the_chosen_plan_keeps_the_users_compute_dtype_and_other_fields():
    base = zj.ZeroConfig(compute_dtype="bfloat16", grad_clip=1.0, donate=False)
    result = zj.autotune(
        tiny_loss,
        tiny_params(),
        optax.adam(1e-3),
        BATCH,
        mesh=zj.make_mesh(),
        memory="4MiB",
        config=base,
        device=SPEC,
        space=SearchSpace(stages=(2, 3), accum=(1,), remat=("none",), offload=("none",), prefetch=(0,)),
    )
    for plan in result:
        assert plan.config.compute_dtype == "bfloat16"
        assert plan.config.grad_clip == 1.0 and plan.config.donate is False
        assert isinstance(plan.config, zj.ZeroConfig)


def test_plans_share_a_compile_when_a_config_changes_nothing():
    """No layer loop: remat policies lower to the same program, compiled once."""
    result = zj.autotune(
        tiny_loss,
        tiny_params(),
        optax.adam(1e-3),
        BATCH,
        mesh=zj.make_mesh(),
        memory="4MiB",
        device=SPEC,
        exhaustive=True,
        space=SearchSpace(stages=(3,), accum=(1,), remat=("none", "full"), offload=("none",), prefetch=(0,)),
    )
    assert result.compiled == 1 and result.shared == 1 and len(result) == 2
    assert result[0].program == result[1].program and result[0].memory == result[1].memory


def test_cost_analysis_is_per_device_and_checked_against_a_known_matmul():
    """XLA's count for a matmul split over the 8 devices is one device's share, 2·M·K·N/8."""
    mesh = zj.make_mesh()
    m, k, n = 512, 256, 128
    x = jax.ShapeDtypeStruct((m, k), "float32", sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((k, n), "float32", sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(jnp.matmul).lower(x, w).compile()
    cost = step_cost(compiled, mesh)
    assert cost.flops == 2 * m * k * n / 8
    assert cost.traffic == ()  # nothing to communicate
    assert cost.seconds(SPEC) == pytest.approx(2 * m * k * n / 8 / 1e10 + cost.bytes_accessed / 1e9)
    # One device's matmul is (64, 256) @ (256, 128): its thinnest side is M = 64 rows, and it is
    # priced at a 64-sided matmul's rate (a thin matmul runs as slowly as its thinnest side).
    assert cost.matmuls == ((64.0, 2 * m * k * n / 8),)
    assert cost.matmul_shapes == (((64, 128, 256), 2 * m * k * n / 8),)
    curved = dataclasses.replace(SPEC, matmul_curve=((64, 2.5e9), (512, 1e10)))
    assert cost.seconds(curved) == pytest.approx(2 * m * k * n / 8 / 2.5e9 + cost.bytes_accessed / 1e9)
    # A rate measured for that very shape replaces the curve's.
    exact = dataclasses.replace(curved, matmul_rates=(((64, 128, 256), 5e9),))
    assert cost.seconds(exact) == pytest.approx(2 * m * k * n / 8 / 5e9 + cost.bytes_accessed / 1e9)


def test_loops_are_counted_per_iteration():
    """cost_analysis() counts a scan body once; the corrected count equals the unrolled
    program's own cost_analysis(), and the parse alone reproduces XLA's loop-free count."""

    def scanned(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    def unrolled(ws, x):
        for i in range(ws.shape[0]):
            x = jnp.tanh(x @ ws[i])
        return x

    ws, x = jnp.ones((6, 128, 128)), jnp.ones((64, 128))
    loop = hlo_cost.loop_cost(jax.jit(scanned).lower(ws, x).compile())
    flat = jax.jit(unrolled).lower(ws, x).compile()
    xla = flat.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert loop.xla_flops < xla["flops"] / 5  # one iteration of six
    assert loop.flops == pytest.approx(xla["flops"], rel=1e-3)
    assert hlo_cost.parsed_cost(flat.as_text()) == (xla["flops"], xla["bytes accessed"])


def test_a_scan_saving_its_outputs_is_priced_by_the_rows_it_writes():
    """A scan that stacks a row per iteration (as the forward pass of a layer loop saves its
    residuals) writes that row in place: the stacked buffer is neither read nor written
    whole per iteration. XLA's own count of one in-place update says so, and the loop's
    bytes match the unrolled program's."""
    upd = jax.jit(lambda b, u, i: jax.lax.dynamic_update_slice(b, jnp.tanh(u) * 2, (i, 0)), donate_argnums=0)
    compiled = upd.lower(jnp.ones((64, 1024)), jnp.ones((1, 1024)), 3).compile()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert xla["bytes accessed"] < 3 * 4 * 1024  # the row read and written, not the 256 KiB buffer
    assert hlo_cost.parsed_cost(compiled.as_text())[1] == xla["bytes accessed"]

    def scanned(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.tanh(h @ w) * 2), x, ws)[1]

    def unrolled(ws, x):
        out = []
        for i in range(ws.shape[0]):
            out.append(jnp.tanh(x @ ws[i]) * 2)
            x = jnp.tanh(x @ ws[i])
        return jnp.stack(out)

    ws, x = jnp.ones((32, 64, 64)), jnp.ones((16, 64))
    loop = hlo_cost.loop_cost(jax.jit(scanned).lower(ws, x).compile())
    flat = jax.jit(unrolled).lower(ws, x).compile().cost_analysis()
    flat = flat[0] if isinstance(flat, list) else flat
    stacked = 32 * 16 * 64 * 4  # the scan's output: one whole read or write per iteration would add 32x this
    assert abs(loop.bytes - flat["bytes accessed"]) < 4 * stacked, (loop.bytes, flat["bytes accessed"])


def test_known_devices_and_calibration():
    h100 = device_spec("H100")
    assert (h100.peak_flops, h100.hbm_bandwidth, h100.source) == (989.4e12, 3.35e12, "datasheet")
    assert device_spec("NVIDIA H200").hbm_bandwidth == 4.8e12 and device_spec("a100").peak_flops == 312e12
    assert device_spec("TPU v5 lite").name == "Google TPU v5e" and device_spec("tpu-v5p").peak_flops == 459e12
    assert h100.axis_bandwidth(8) == 450e9 and h100.axis_bandwidth(64) == 50e9  # NVLink in a node, IB across
    assert device_spec(SPEC) is SPEC
    mesh = zj.make_mesh()
    measured = device_spec(None, mesh)  # the CPU backend is measured, once per process
    assert measured.source == "calibrated" and not measured.async_collectives
    assert device_spec("calibrate", mesh) is measured
    assert [s for s, _ in measured.matmul_curve] == [32, 64, 128, 256, 512]
    assert [b for b, _ in measured.memory_curve] == [2.0**k for k in range(15, 26, 2)]  # 32 KiB to 32 MiB
    assert measured.hbm_bandwidth == measured.memory_curve[-1][1]
    # A shape measured after the search agrees with the square curve's figure for that side
    # (two measurements of one thing), and is added to the spec; datasheet specs stay as they are.
    square = measure_matmuls(measured, mesh, [(128, 128, 128)])
    assert [mnk for mnk, _ in square.matmul_rates] == [(128, 128, 128)]
    ratio = square.matmul_rates[0][1] / measured.matmul_rate(128, "float32")
    assert 0.25 < ratio < 4, ratio
    assert measure_matmuls(h100, mesh, [(128, 128, 128)]) is h100
    with pytest.raises(ValueError, match="no datasheet figures for device 'B300'"):
        device_spec("B300")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("memory_curve", ((2**20, 1e9), (2**16, 2e9)), r"memory_curve must be \(bytes, bytes/s\) pairs.*increasing"),
        ("memory_curve", ((2**16, 0.0),), r"memory_curve must be \(bytes, bytes/s\) pairs, positive"),
        ("matmul_curve", ((128, float("inf")),), r"matmul_curve must be \(side, FLOP/s\) pairs, positive"),
        ("matmul_rates", (((64, 64), 1e9),), r"matmul_rates must be \(\(M, N, K\), FLOP/s\) pairs"),
        ("matmul_rates", (((64, 0, 64), 1e9),), r"matmul_rates must be \(\(M, N, K\), FLOP/s\) pairs, positive"),
        ("collective_latency", -1e-6, r"collective_latency must be seconds >= 0"),
    ],
)
def test_a_device_spec_with_a_bad_curve_is_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(SPEC, **{field: value})


def test_memory_budget_parsing():
    assert parse_memory("80GiB") == 80 * 2**30 and parse_memory("16GB") == 16 * 10**9
    assert parse_memory("512 MiB") == 512 * MIB and parse_memory(3 * 2**30) == 3 * 2**30


@pytest.mark.parametrize(
    "memory,match",
    [
        (80, r"memory=80 is 80 B per device, under 1 MiB"),
        ("0.5MiB", r"under 1 MiB"),
        (
            "2TiB",
            r"2.00 TiB per device, more than any accelerator has \(the largest known, NVIDIA H200 SXM, has 141 GB\)",
        ),
        ("eighty", r"memory='eighty' is not a size"),
    ],
)
def test_a_budget_in_the_wrong_unit_is_refused_before_compiling(memory, match, monkeypatch):
    monkeypatch.setattr(search_module, "abstract_state", _never)
    with pytest.raises(ValueError, match=match):
        zj.autotune(tiny_loss, tiny_params(), optax.adam(1e-3), BATCH, mesh=zj.make_mesh(), memory=memory, device=SPEC)


def test_a_batch_no_accumulation_count_divides_names_the_valid_sizes(monkeypatch):
    monkeypatch.setattr(search_module, "abstract_state", _never)
    with pytest.raises(ValueError, match=r"global batch of 30 rows does not split over the 8 devices.*24 or 32"):
        zj.autotune(
            tiny_loss,
            tiny_params(),
            optax.adam(1e-3),
            jax.ShapeDtypeStruct((30, D_IN), "float32"),
            mesh=zj.make_mesh(),
            memory="2MiB",
            device=SPEC,
        )
    with pytest.raises(
        ValueError,
        match=r"gives each of the 8 devices 2 rows, which no accumulation count tried "
        r"\(3\) divides\. Use a global batch of 24 rows",
    ):
        zj.autotune(
            tiny_loss,
            tiny_params(),
            optax.adam(1e-3),
            jax.ShapeDtypeStruct((16, D_IN), "float32"),
            mesh=zj.make_mesh(),
            memory="2MiB",
            device=SPEC,
            space=SearchSpace(accum=(3,)),
        )


def test_nothing_fits_by_the_formula_is_refused_before_compiling(monkeypatch):
    monkeypatch.setattr(search_module, "abstract_state", _never)
    big = {"w": jax.ShapeDtypeStruct((2048, 2048), "float32")}  # Ψ = 4M: stage 3's 12Ψ/8 = 6 MiB
    with pytest.raises(ValueError) as e:
        zj.autotune(
            tiny_loss,
            big,
            optax.adam(1e-3),
            BATCH,
            mesh=zj.make_mesh(),
            memory="4MiB",
            device=SPEC,
            space=SearchSpace(offload=("none",)),
        )
    msg = str(e.value)
    assert "the smallest, stage 3, accum 1, remat none, holds 6.00 MiB of persistent state alone" in msg
    assert "6.60 MiB with the 10% margin), 2.60 MiB over the budget. Nothing was compiled." in msg
    assert "offload (SearchSpace(offload=('params',))" in msg and "more devices" in msg


def test_nothing_fits_after_compiling_names_the_smallest_plan_and_the_next_lever():
    space = SearchSpace(stages=(3,), accum=(1,), remat=("none",), offload=("none",), prefetch=(0,))
    with pytest.raises(ValueError) as e:
        zj.autotune(
            tiny_loss,
            tiny_params(),
            optax.adam(1e-3),
            jax.ShapeDtypeStruct((2048, D_IN), "float32"),
            mesh=zj.make_mesh(),
            memory="1MiB",
            device=SPEC,
            space=space,
        )
    msg = str(e.value)
    assert "no configuration fits 1.00 MiB per device: the smallest compiled, stage 3, accum 1, remat none" in msg
    assert "over the budget" in msg and "a smaller micro-batch (grad_accum_steps=2 or more" in msg
    assert "offload" in msg and "more devices" in msg


def test_zero_memory_analysis_falls_back_to_the_formula_with_a_warning(monkeypatch):
    """jax issue #18954: some GPU builds report zeros; then the plan is not called a fit for free."""
    zeros = {k: 0 for k in ("argument", "output", "alias", "temp", "host_temp", "host_argument", "total")}
    monkeypatch.setattr(search_module, "compiled_bytes", lambda compiled: dict(zeros))
    space = SearchSpace(stages=(3,), accum=(1,), remat=("none",), offload=("none",), prefetch=(0,))
    with pytest.warns(RuntimeWarning, match="#18954"):
        result = zj.autotune(
            tiny_loss,
            tiny_params(),
            optax.adam(1e-3),
            BATCH,
            mesh=zj.make_mesh(),
            memory="2MiB",
            device=SPEC,
            space=space,
        )
    mem = result.best.memory
    psi = 2 * D_IN * D_HID
    state = int(np.ceil(zj.report.zero_formula_bytes(psi, 8, 3, opt_bytes=(8 * psi + 4) / psi, memory="device")))
    assert mem.source == "formula" and mem.compiled == state + 32 * D_IN * 4 // 8 > 0
    assert "*" in result.table()


def test_the_search_skips_only_what_the_exhaustive_search_confirms():
    """Candidates ruled out do not fit, dominated ones are predicted no faster than the plan
    that dominates them, and the best plan is the exhaustive search's."""
    kw = dict(
        mesh=zj.make_mesh(),
        memory="2MiB",
        device=SPEC,
        space=SearchSpace(stages=(1, 2, 3), accum=(1, 2), remat=("none", "full"), offload=("none",), prefetch=(0,)),
    )
    params, batch = {"w": jax.ShapeDtypeStruct((512, 256), "float32")}, jax.ShapeDtypeStruct((64, 512), "float32")
    loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
    fast = zj.autotune(loss, params, optax.adam(1e-3), batch, **kw)
    full = zj.autotune(loss, params, optax.adam(1e-3), batch, exhaustive=True, **kw)
    time_of = {p.config: p.time for p in full}
    assert fast.best.config == full.best.config
    assert full.compiled + full.shared == fast.candidates - len(fast.pruned) and not full.skipped
    for s in fast.skipped:
        if s.reason == "ruled out":
            assert s.candidate.config not in time_of
        else:  # dominated: more accumulation or offload, never another remat policy
            assert time_of[s.candidate.config] >= time_of[s.by.config]
            assert s.candidate.config.remat == s.by.config.remat
    assert {p.config for p in fast} <= set(time_of)


def test_search_space_and_results_are_validated():
    with pytest.raises(ValueError, match="SearchSpace.stages values must be among"):
        SearchSpace(stages=(4,))
    with pytest.raises(ValueError, match="unknown remat policy 'most'"):
        SearchSpace(remat=("most",))
    with pytest.raises(ValueError, match="SearchSpace.accum must be positive ints"):
        SearchSpace(accum=(0,))
    with pytest.raises(ValueError, match="DeviceSpec.hbm_bandwidth must be a positive number"):
        dataclasses.replace(SPEC, hbm_bandwidth=-1.0)
    with pytest.raises(ValueError, match="margin must be a fraction in"):
        zj.autotune(tiny_loss, tiny_params(), optax.adam(1e-3), BATCH, mesh=zj.make_mesh(), memory="2MiB", margin=1.5)
    with pytest.raises(ValueError, match="this mesh also splits {'tensor': 2}"):
        mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        zj.autotune(tiny_loss, tiny_params(), optax.adam(1e-3), BATCH, mesh=mesh, memory="2MiB", device=SPEC)


def test_progress_is_reported_per_candidate(tuned_and_progress):
    _, seen, err = tuned_and_progress
    assert [d for d, _ in seen] == list(range(1, 9)) and {t for _, t in seen} == {8}
    assert "[1/8] stage 0, accum 1, remat none: pruned, state 3.00 MiB > 1.82 MiB" in err
    assert "compiled in" in err


def test_cli_tunes_a_users_function(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny_setup.py").write_text(
        textwrap.dedent(f"""
        import jax, jax.numpy as jnp, optax
        import zerojax as zj

        def setup():
            params = {{"w1": jax.ShapeDtypeStruct(({D_IN}, {D_HID}), "float32"),
                      "w2": jax.ShapeDtypeStruct(({D_HID}, {D_IN}), "float32")}}
            loss = lambda p, x: jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)
            return loss, params, optax.adam(1e-3), jax.ShapeDtypeStruct((32, {D_IN}), "float32"), \\
                zj.ZeroConfig(compute_dtype="bfloat16")

        def setup_big():
            _, _, tx, batch, config = setup()
            loss = lambda p, x: jnp.mean(x @ p["w"][:{D_IN}])
            return loss, {{"w": jax.ShapeDtypeStruct((2048, 2048), "float32")}}, tx, batch, config
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    from zerojax import cli

    assert (
        cli.main(
            [
                "autotune",
                "tiny_setup:setup",
                "--devices",
                "8",
                "--memory",
                "4MiB",
                "--device",
                "h100",
                "--accum",
                "1",
                "--remat",
                "none",
                "--offload",
                "none",
                "--prefetch",
                "0",
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "4 candidates for 4.00 MiB per device" in out
    assert "| 1 | " in out and " | 1 (4) | none | none | 0 | bfloat16 |" in out
    assert "best: zj.ZeroConfig(" in out and "compute_dtype='bfloat16'" in out and "NVIDIA H100" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["autotune", "tiny_setup:setup", "--memory", "80", "--quiet"])
    assert e.value.code == 2 and "under 1 MiB" in capsys.readouterr().err
    assert cli.main(["autotune", "tiny_setup:setup_big", "--memory", "4MiB", "--offload", "none", "--quiet"]) == 1
    assert "zerojax autotune: no configuration fits 4.00 MiB per device" in capsys.readouterr().err


@pytest.mark.slow  # reason: the CLI in a fresh process; test_autotune_tunes_a_llama_preset_from_the_command_line
def test_cli_tunes_the_experiments_gpt_in_its_own_process():
    import subprocess

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerojax.cli",
            "autotune",
            "--model",
            "gpt",
            "--d-model",
            "64",
            "--layers",
            "2",
            "--batch",
            "16",
            "--devices",
            "8",
            "--memory",
            "16MiB",
            "--stages",
            "2,3",
            "--accum",
            "1",
            "--remat",
            "none,full",
            "--offload",
            "none",
            "--prefetch",
            "0",
            "--context",
            "2",
            "--device",
            "h100",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GPT d_model 64, 2 layers" in out.stdout and "8 cpu devices" in out.stdout
    assert "best: zj.ZeroConfig(" in out.stdout
    assert "| # | stage | context |" in out.stdout and "mesh: zj.make_mesh(context=2)" in out.stdout


def _never(*args, **kwargs):
    raise AssertionError("nothing may be compiled (or traced) before the input is checked")


# Context parallelism: the experiments' Llama (ring attention, so every degree runs the
# memory-saving kernel) on sequences of 256, one search over C = 1, 2, 4.
LLAMA = dict(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=256, attention="ring")
SEQ = jax.ShapeDtypeStruct((8, 256), "int32")
CONTEXT = SearchSpace(stages=(3,), accum=(1,), remat=("full",), offload=("none",), prefetch=(0,), context=(1, 2, 4))


def _llama():
    from zerojax.models import llama

    graphdef, params = llama.init_abstract(llama.LlamaConfig(**LLAMA))
    return llama.make_loss(graphdef), params


@pytest.fixture(scope="module")
def tuned_context():
    loss, params = _llama()
    return zj.autotune(
        loss,
        params,
        optax.adamw(1e-3),
        {"inputs": SEQ, "targets": SEQ},
        mesh=zj.make_mesh(),
        memory="1GiB",
        device=SPEC,
        space=CONTEXT,
    )


@pytest.mark.slow  # three Llama step compiles on context meshes (14 s, with the next test's 7 s)
def test_context_degrees_are_searched_each_on_its_own_mesh(tuned_context):
    """One plan per degree, each compiled on zj.make_mesh(context=C) over the same devices:
    the same state per device (data x context = 8 shards the weights), the rows per device
    growing with C (a data group of 8 / C devices takes 8 / (8 / C) sequences), the
    activations per device falling with C; the C = 4 plan's memory is zj.report.step_memory's of
    the same config on its mesh."""
    by_c = {p.context: p for p in tuned_context}
    assert sorted(by_c) == [1, 2, 4]
    for c, p in by_c.items():
        assert dict(p.mesh.shape) == ({"data": 8} if c == 1 else {"data": 8 // c, "context": c})
        assert p.micro_batch == c
        assert ("context" in p.describe()) == (c > 1)
    assert by_c[1].memory.state == by_c[2].memory.state == by_c[4].memory.state
    temp = [by_c[c].memory.step.temp for c in (1, 2, 4)]
    assert temp[0] > temp[1] > temp[2], temp  # (weights gathered per layer are the same at every C)
    loss, params = _llama()
    direct = zj.report.step_memory(
        loss, params, optax.adamw(1e-3), {"inputs": SEQ, "targets": SEQ}, mesh=by_c[4].mesh, config=by_c[4].config
    )
    assert by_c[4].memory.step == direct
    assert by_c[4].memory.step.batch == 2 * (8 // 2) * (256 // 4) * 4  # two int32 leaves: 4 rows x 64 tokens each
    assert "| context |" in tuned_context.table()
    # Off the search, the context axis's collectives are the ring's: permutes over "context".
    assert any(t.axes == "context" for t in by_c[4].cost.traffic)


@pytest.mark.slow  # shares the compiles above
def test_a_budget_only_a_context_split_fits_chooses_it(tuned_context):
    """Between the C = 1 and C = 2 plans' memory, C = 1 does not fit: the search picks C = 2."""
    by_c = {p.context: p for p in tuned_context}
    budget = (by_c[1].memory.device + by_c[2].memory.device) // 2
    loss, params = _llama()
    result = zj.autotune(
        loss,
        params,
        optax.adamw(1e-3),
        {"inputs": SEQ, "targets": SEQ},
        mesh=zj.make_mesh(),
        memory=budget,
        device=SPEC,
        space=dataclasses.replace(CONTEXT, context=(1, 2)),
    )
    assert [p.context for p in result] == [2] and result.best.memory == by_c[2].memory


def test_context_degrees_that_do_not_fit_are_refused_before_compiling(monkeypatch):
    monkeypatch.setattr(search_module, "abstract_state", _never)
    loss, params = _llama()
    batch = {"inputs": SEQ, "targets": SEQ}
    run = lambda space, b=batch: zj.autotune(
        loss, params, optax.adamw(1e-3), b, mesh=zj.make_mesh(), memory="1GiB", device=SPEC, space=space
    )
    with pytest.raises(ValueError, match=r"\[3\] do not divide the 8 devices .* context degrees among \[1, 2, 4, 8\]"):
        run(dataclasses.replace(CONTEXT, context=(2, 3)))
    odd = jax.ShapeDtypeStruct((8, 250), "int32")
    with pytest.raises(
        ValueError,
        match=r"context 4: batch leaf \['inputs'\]'s sequence length \(dimension 1\) 250 "
        r"does not split into 4 context devices: use a multiple of 4 \(e.g. 248 or 252\)",
    ):
        run(CONTEXT, {"inputs": odd, "targets": odd})
    with pytest.raises(ValueError, match=r"context 1 \(the batch over 8 data groups\): the global batch of 2 rows"):
        two = jax.ShapeDtypeStruct((2, 256), "int32")
        run(CONTEXT, {"inputs": two, "targets": two})
    with pytest.raises(ValueError, match="no batch leaf has a sequence dimension"):
        zj.autotune(
            tiny_loss,
            tiny_params(),
            optax.adam(1e-3),
            jax.ShapeDtypeStruct((32,), "float32"),
            mesh=zj.make_mesh(),
            memory="2MiB",
            device=SPEC,
            space=SearchSpace(context=(2,)),
        )
    with pytest.raises(ValueError, match=r"SearchSpace.context must be positive ints"):
        SearchSpace(context=(0,))


# --- Expert degrees: a mixture of experts searched over zj.make_mesh(expert=E) ---------------

EXPERT = SearchSpace(stages=(3,), accum=(1,), remat=("none",), offload=("none",), prefetch=(0,), expert=(1, 4))


def _moe():
    from zerojax.models import llama

    cfg = llama.LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, n_experts=8, top_k=2, moe_d_ff=64)
    graphdef, abstract = llama.init_abstract(cfg)
    return llama.make_loss(graphdef), abstract, cfg


@pytest.mark.slow  # two step compiles of a Llama with routed experts (14 s); the context search covers the rest
def test_expert_degrees_are_searched_each_on_its_own_mesh():
    """One plan per degree, each on zj.make_mesh(expert=E) over the same devices; each plan's
    memory is zj.report.step_memory's on its mesh; the formula's lower bound (Ψ_d + Ψ_e/E kept
    whole, Ψ/N sharded) prunes nothing that fits; E = 3 is refused before compiling."""
    loss, params, cfg = _moe()
    tokens = {"tokens": jax.ShapeDtypeStruct((16, 17), "int32")}
    result = zj.autotune(
        loss, params, optax.adamw(1e-3), tokens, mesh=zj.make_mesh(), memory="1GiB", device=SPEC, space=EXPERT
    )
    by_e = {p.expert: p for p in result}
    assert sorted(by_e) == [1, 4] and not result.pruned
    assert dict(by_e[4].mesh.shape) == {"data": 2, "expert": 4} and by_e[4].micro_batch == 2
    assert "expert 4" in by_e[4].describe() and "| expert |" in result.table()
    direct = zj.report.step_memory(loss, params, optax.adamw(1e-3), tokens, mesh=by_e[4].mesh, config=by_e[4].config)
    assert by_e[4].memory.step == direct
    # Stage 3 shards everything over the 8 devices at either E: the same state per device.
    assert by_e[1].memory.state == by_e[4].memory.state
    with pytest.raises(ValueError, match=r"SearchSpace\(expert=\(1, 3\)\): \[3\] do not divide the 8 devices"):
        zj.autotune(
            loss,
            params,
            optax.adamw(1e-3),
            tokens,
            mesh=zj.make_mesh(),
            memory="1GiB",
            device=SPEC,
            space=dataclasses.replace(EXPERT, expert=(1, 3)),
        )


# --- the pipeline degree -------------------------------------------------------------------

PIPE_L, PIPE_D = 8, 64  # a stack of 8 layers of 64 x 64: 128 KiB, beside 1 KiB activations


def pipe_params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "inp": jax.random.normal(k[0], (32, PIPE_D)) * 0.2,
        "blocks": {"w": jax.random.normal(k[1], (PIPE_L, PIPE_D, PIPE_D)) * 0.1},
        "head": jax.random.normal(k[2], (PIPE_D, 4)) * 0.2,
    }


def pipe_loss(p, x):
    h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w["w"]), None), jnp.tanh(x @ p["inp"]), p["blocks"])
    return jnp.mean((h @ p["head"]) ** 2)


# The same compute rates; one node of 8 fast-linked devices, or two nodes of 4 joined by a slow
# network (the cost model's only difference).
PIPE_RATES = dict(peak_flops=1e9, peak_flops_fp32=1e9, hbm_bandwidth=1e13, link_bandwidth=1e11, collective_latency=1e-6)
ONE_NODE = DeviceSpec(name="one node of 8", devices_per_node=8, async_collectives=False, **PIPE_RATES)
TWO_NODES = DeviceSpec(
    name="2 nodes of 4, slow network", devices_per_node=4, network_bandwidth=1e7, async_collectives=False, **PIPE_RATES
)


@pytest.fixture(scope="module")
def tuned_pipeline():
    """ZeRO-3 with and without a 2-stage pipeline (M = 2 and 4), priced for two slow-linked nodes."""
    x = jax.ShapeDtypeStruct((16, 32), "float32")
    space = SearchSpace(stages=(3,), accum=(1,), remat=("none",), offload=("none",), prefetch=(0,), pipeline=(1, 2))
    return zj.autotune(
        pipe_loss, pipe_params(), optax.sgd(0.1), x, mesh=zj.make_mesh(), memory="64MiB", device=TWO_NODES, space=space
    )


def test_a_pipeline_pays_across_a_slow_link_and_not_inside_one_node(tuned_pipeline):
    """Over two nodes joined by a slow network, ZeRO-3's data axis without a pipeline spans both
    (its gathers and reduce-scatters of the whole model cross the network every step), while a
    2-stage pipeline keeps each stage's data axis inside a node and sends only activations
    across: the tuner picks P = 2. Priced for one fast node, the bubble's extra FLOPs make
    P = 1 the fastest. The pipeline's collectives are read from the compiled program."""
    result = tuned_pipeline
    assert sorted((p.pipeline, p.config.pipeline.microbatches) for p in result) == [(1, 1), (2, 2), (2, 4)]
    best = result.best
    assert best.pipeline == 2 and dict(best.mesh.shape) == {"pipeline": 2, "data": 4}
    by_axes = {(t.axes, t.ring): t for t in best.cost.traffic}
    permute = by_axes[("pipeline", False)]
    assert permute.extent == 8 and by_axes[("data", True)].extent == 4  # across the nodes / inside one
    plain = next(p for p in result if p.pipeline == 1)
    assert {t.axes: t.extent for t in plain.cost.traffic}["data"] == 8
    assert permute.bytes < 0.05 * plain.cost.comm_bytes  # activations, not weights, cross the network
    # Priced for one fast node, the order turns: the bubble's FLOPs are in the compiled program.
    fast = sorted(result, key=lambda p: p.cost.seconds(ONE_NODE))
    assert fast[0].pipeline == 1
    for p in result:
        if p.pipeline > 1:
            m, s = p.config.pipeline.microbatches, p.pipeline
            assert p.cost.flops > plain.cost.flops * (1 + 0.5 * (s - 1) / m)  # (M + P - 1)/M of the stack, at least
    table = result.table()
    assert "pipeline (M)" in table and "| 2 (2) |" in table and "| 2 (4) |" in table
    m = best.config.pipeline.microbatches
    assert f"pipeline 2 ({m} micro-batches, bubble {1 / (m + 1):.0%})" in best.describe()


def test_the_chosen_pipeline_plan_trains_as_single_device_optax(tuned_pipeline):
    from tests import models

    best = tuned_pipeline.best
    params = pipe_params()
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.normal(size=(16, 32)), jnp.float32) for _ in range(2)]
    ref, _ = models.reference_run(pipe_loss, params, optax.sgd(0.1), batches)
    state = zj.init_state(params, optax.sgd(0.1), mesh=best.mesh, config=best.config)
    step = zj.make_train_step(pipe_loss, optax.sgd(0.1), mesh=best.mesh, config=best.config)
    for b in batches:
        state, _ = step(state, b)
    err = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(*map(jax.tree.leaves, (zj.gather_params(state), ref)))
    )
    assert err < 1e-5


def test_pipeline_degrees_follow_the_devices_and_the_stack_before_compiling():
    """``"auto"``: the divisors of the device count the layer stack splits into (4 layers: 2
    and 4, not 8); an explicit degree the devices or the stack do not split into is refused
    naming the fix; the pipeline's micro-batches default to P and 2P."""
    from zerojax.tuning.inputs import split_meshes

    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pipe_params())
    shapes["blocks"]["w"] = jax.ShapeDtypeStruct((4, PIPE_D, PIPE_D), "float32")
    x, mesh, base = jax.ShapeDtypeStruct((16, 32), "float32"), zj.make_mesh(), zj.ZeroConfig()
    auto = split_meshes(mesh, base, SearchSpace(pipeline="auto"), x, shapes)
    assert sorted(auto) == [(1, 1, 1), (1, 1, 2), (1, 1, 4)]
    assert dict(auto[1, 1, 4].shape) == {"pipeline": 4, "data": 2}
    with pytest.raises(ValueError, match=r"pipeline=\(3,\)\): \[3\] do not split the 8 devices.*among \[1, 2, 4, 8\]"):
        split_meshes(mesh, base, SearchSpace(pipeline=3), x, shapes)
    with pytest.raises(ValueError, match=r"pipeline 8: params.*its 4 layers do not split into 8 pipeline stages"):
        split_meshes(mesh, base, SearchSpace(pipeline=(1, 8)), x, shapes)
    with pytest.raises(ValueError, match="SearchSpace.pipeline must be positive ints"):
        SearchSpace(pipeline=(0,))
    assert SearchSpace().microbatch_counts(4, 8) == (4, 8) and SearchSpace().microbatch_counts(1, 8) == (1,)
    with pytest.raises(ValueError, match=r"give the mesh without it and SearchSpace\(pipeline=\(2,\)\)"):
        zj.autotune(pipe_loss, shapes, optax.sgd(0.1), x, mesh=zj.make_mesh(pipeline=2), memory="64MiB")


def test_cli_searches_pipeline_degrees_and_refuses_one_the_devices_do_not_split(tmp_path, monkeypatch, capsys):
    """``zerojax autotune --pipeline``: parsed into ``SearchSpace(pipeline=...)``; a degree that
    does not divide the 8 devices fails before anything compiles, naming those that do."""
    (tmp_path / "pipe_setup.py").write_text(
        textwrap.dedent("""
        import jax, optax
        import zerojax as zj
        from tests.test_autotune import pipe_loss, pipe_params

        def setup():
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pipe_params())
            return pipe_loss, shapes, optax.sgd(0.1), jax.ShapeDtypeStruct((16, 32), "float32"), zj.ZeroConfig()
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    from zerojax import cli

    args = ["autotune", "pipe_setup:setup", "--devices", "8", "--memory", "64MiB", "--device", "h100", "--quiet"]
    assert cli.main([*args, "--pipeline", "1,3"]) == 1
    assert "SearchSpace(pipeline=(1, 3)): [3] do not split the 8 devices" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*args, "--pipeline", "two"])


def test_auto_leaves_out_the_degrees_whose_step_refuses_the_loss_and_says_so():
    """Four [64, 64] weights run one after another (no layer scan): the planner takes them for a
    64-layer stack, so ``"auto"`` tries P = 2, 4, 8, the step refuses the loss on each (no scan
    over them), and the search goes on without them, naming why; an explicit degree raises."""
    params = [jax.ShapeDtypeStruct((64, 64), "float32") for _ in range(4)]

    def loss_fn(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    x, seen = jax.ShapeDtypeStruct((16, 64), "float32"), []
    space = SearchSpace(stages=(3,), accum=(1,), remat=("none",), offload=("none",), prefetch=(0,), pipeline="auto")
    result = zj.autotune(
        loss_fn, params, optax.sgd(0.1), x, mesh=zj.make_mesh(), memory="64MiB", device=SPEC, space=space,
        progress=lambda done, total, message: seen.append(message),
    )  # fmt: skip
    assert [p.pipeline for p in result] == [1]
    refused = sorted(m for m in seen if "not searched" in m)
    assert [m.split(":")[0] for m in refused] == ["pipeline 2", "pipeline 4", "pipeline 8"]
    assert all("outside the layer scan" in m for m in refused)
    with pytest.raises(ValueError, match=r"SearchSpace\(pipeline=\(2,\)\), pipeline 2: .*outside the layer scan"):
        zj.autotune(
            loss_fn, params, optax.sgd(0.1), x, mesh=zj.make_mesh(), memory="64MiB", device=SPEC,
            space=dataclasses.replace(space, pipeline=(2,)),
        )  # fmt: skip


def test_nothing_fits_on_a_pipeline_names_more_micro_batches_not_accumulation():
    """A pipeline plan keeps grad_accum_steps at 1: when the smallest plan is one, its lever
    is the micro-batch count (read from the message built for it)."""
    from zerojax.tuning.candidates import Candidate
    from zerojax.tuning.cost import StepCost
    from zerojax.tuning.inputs import nothing_fits_compiled
    from zerojax.tuning.result import Plan, PlanMemory

    config = zj.ZeroConfig(stage=3, pipeline={"microbatches": 2})
    cand = Candidate(config=config, offload="none", formula_bytes=0.0, pipeline=2)
    memory = PlanMemory(device=3 * MIB, compiled=2 * MIB, host=0, state=MIB)
    plan = Plan(config=config, memory=memory, time=1.0, cost=StepCost(flops=1.0, bytes_accessed=0.0), micro_batch=8)
    space = SearchSpace(stages=(3,), remat=("full",), pipeline=(2,))
    msg = nothing_fits_compiled({cand: plan}, space, {cand.split: (1,)}, {cand.split: 16}, 2 * MIB, 0.1)
    assert "pipeline 2 (2 micro-batches" in msg and "grad_accum_steps" not in msg
    assert "more micro-batches through the pipeline (SearchSpace(microbatches=(4, ...)): each device's 16 rows" in msg
