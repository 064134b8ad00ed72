"""zj.autotune with memory tiers: a host-memory budget, and the NVMe tier when the host is
short. The NVMe plan's bytes are checked against zerojax.report.estimate.tier_bytes (the
formula), its disk time against bytes / rate, and the chosen plan trains as host offload."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax.report.estimate import tier_bytes
from zerojax.tuning import DeviceSpec, DiskRates, SearchSpace, measure_disk
from zerojax.tuning.budget import parse_host_memory

SPEC = DeviceSpec(
    name="test", peak_flops=1e10, peak_flops_fp32=1e10, hbm_bandwidth=1e9, link_bandwidth=1e9, async_collectives=False
)
D_IN, D_HID = 512, 1024  # Ψ = 1,048,576: Adam's 8 bytes per parameter are 1 MiB per device
PSI = 2 * D_IN * D_HID
RATES = DiskRates(read=2e9, write=1e9)
SPACE = SearchSpace(stages=(2,), accum=(1,), remat=("none",), offload=("optimizer", "nvme"), prefetch=(0,))
CFG = zj.ZeroConfig(compute_dtype="bfloat16")


def params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (D_IN, D_HID)) / D_IN**0.5,
        "w2": jax.random.normal(k2, (D_HID, D_IN)) / D_HID**0.5,
    }


def loss(p, x):
    return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)


BATCH = jax.ShapeDtypeStruct((32, D_IN), "float32")


def tune(tmp_path, **kw):
    nvme = zj.config.NVMe(str(tmp_path), buffer_count=2, buffer_size=2**20)
    shapes = jax.eval_shape(params)
    return zj.autotune(
        loss, shapes, optax.adam(1e-3), BATCH, mesh=zj.make_mesh(), memory="64MiB", config=CFG, device=SPEC,
        space=SPACE, nvme=nvme, disk=RATES, **kw,
    )  # fmt: skip


def test_short_host_memory_chooses_the_nvme_tier(tmp_path):
    unbounded = tune(tmp_path)
    assert unbounded.best.offload == "optimizer"  # no disk time: faster
    bounded = tune(tmp_path, host_memory="1MiB")
    (plan,) = bounded.plans  # host offload keeps 1.5 MiB in host memory: over
    assert plan.offload == "nvme" and plan.config.offload.nvme.path == str(tmp_path)
    # Bytes per device against the formula: masters kept apart (bf16 compute) stay in host
    # memory, the optimizer state goes to disk, and the tier's buffers are shared by the 8 devices.
    want = tier_bytes(PSI, 8, 2, offload="optimizer", nvme=True, compute_dtype="bfloat16")
    assert plan.memory.disk == want["disk"] == PSI
    assert plan.memory.host == want["host"] + 2 * 2**20 // 8 + 4  # + Adam's int32 count, kept in memory
    # Time: the disk reads and writes the process's state (all 8 devices') once each per step.
    assert plan.cost.breakdown(SPEC)["disk"] == pytest.approx(8 * PSI / 2e9 + 8 * PSI / 1e9)
    assert plan.time == pytest.approx(plan.cost.seconds(SPEC))
    # The chosen config trains as host offload does.
    mesh, tx = zj.make_mesh(), optax.adam(1e-3)
    batch = jax.random.normal(jax.random.key(1), (32, D_IN))
    results = []
    for config in (plan.config, unbounded.best.config):
        state = zj.init_state(params(), tx, mesh=mesh, config=config)
        step = zj.make_train_step(loss, tx, mesh=mesh, config=config)
        state, _ = step(state, batch)
        state, m = step(state, batch)
        results.append((float(m["loss"]), zj.gather_params(state)))
        step.close()
    assert abs(results[0][0] - results[1][0]) <= 1e-6
    for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_host_memory_nothing_fits_names_the_next_lever(tmp_path):
    space = SearchSpace(stages=(2,), accum=(1,), remat=("none",), offload=("optimizer",), prefetch=(0,))
    with pytest.raises(ValueError, match=r"fits 1.00 MiB of host memory per device: .* Next: the NVMe tier"):
        zj.autotune(
            loss, jax.eval_shape(params), optax.adam(1e-3), BATCH, mesh=zj.make_mesh(), memory="64MiB", config=CFG,
            device=SPEC, space=space, host_memory="1MiB",
        )  # fmt: skip


def test_tier_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"has 'nvme' but autotune was given no nvme="):
        zj.autotune(loss, jax.eval_shape(params), optax.adam(1e-3), BATCH, mesh=zj.make_mesh(), memory="64MiB",
                    space=SPACE)  # fmt: skip
    with pytest.raises(ValueError, match=r"host_memory=80 is 80 B per device, under 1 MiB"):
        zj.autotune(loss, jax.eval_shape(params), optax.adam(1e-3), BATCH, mesh=zj.make_mesh(), memory="64MiB",
                    host_memory=80)  # fmt: skip
    assert parse_host_memory("2TiB") == 2 * 2**40  # a host may hold more than any accelerator
    with pytest.raises(ValueError, match=r"not a directory"):
        measure_disk(str(tmp_path / "missing"))
    rates = measure_disk(str(tmp_path), size=4 * 2**20)
    assert rates.read > 0 and rates.write > 0 and not list(tmp_path.iterdir())  # the probe file is gone


def test_cli_searches_the_nvme_tier_when_host_memory_is_short(tmp_path, monkeypatch, capsys):
    """`zerojax autotune ... --host-memory 1MiB --nvme PATH`: host offload is over the host's
    budget, the NVMe plan fits, and the table gives its disk bytes and disk time."""
    (tmp_path / "tier_setup.py").write_text(
        "import jax, optax, zerojax as zj\n"
        "from tests.test_autotune_tiers import BATCH, CFG, loss, params\n"
        "def setup():\n"
        "    return loss, jax.eval_shape(params), optax.adam(1e-3), BATCH, CFG\n"
    )
    (tmp_path / "disk").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from zerojax import cli

    argv = ["autotune", "tier_setup:setup", "--memory", "64MiB", "--device", "h100", "--stages", "2", "--accum", "1"]
    argv += ["--remat", "none", "--offload", "optimizer", "--prefetch", "0", "--quiet", "--host-memory", "1MiB"]
    tier = ["--nvme", str(tmp_path / "disk"), "--buffer-count", "2", "--buffer-size", str(2**20)]
    assert cli.main(argv + tier) == 0
    out = capsys.readouterr().out
    assert "| host | disk | time / step |" in out and " | nvme | 0 | bfloat16 | " in out
    assert "| 768 KiB | 1.00 MiB |" in out  # host: bf16's masters 0.5 MiB + 2 MiB of buffers / 8; disk: 8Ψ/8
    assert "nvme=zj.config.NVMe(" in out
    assert cli.main(argv) == 1  # no disk tier: host offload alone is over the host's budget
    assert "of host memory per device" in capsys.readouterr().err


def test_a_partial_offload_is_searched_and_taken_where_the_device_has_room():
    """SearchSpace(ratios=...): half the optimizer state in host memory halves the host traffic
    for more device memory; the plan's host bytes are its real split's. With room on the device
    the search takes ratio 0.5; with a budget between the two, only the full offload fits."""
    shapes, tx = jax.eval_shape(params), optax.adam(1e-3)
    space = SearchSpace(
        stages=(2,), accum=(1,), remat=("none",), offload=("optimizer",), prefetch=(0,), ratios=(0.5, 1.0)
    )
    kw = dict(mesh=zj.make_mesh(), config=CFG, device=SPEC, space=space)
    both = zj.autotune(loss, shapes, tx, BATCH, memory="64MiB", exhaustive=True, **kw)
    half, full = sorted(both.plans, key=lambda p: p.config.offload.ratio)
    assert both.best is half and half.time < full.time and half.memory.device > full.memory.device
    state = zj.abstract_state(shapes, tx, mesh=zj.make_mesh(), config=half.config)
    assert state.plan.offload_split.share == 0.5  # w2 of two equal leaves
    assert half.memory.host == zj.report.state_bytes_per_device(state)["host"]
    assert half.cost.host_bytes == pytest.approx(0.5 * full.cost.host_bytes, rel=1e-3)  # + Adam's count
    tight = zj.autotune(loss, shapes, tx, BATCH, memory=(half.memory.device + full.memory.device) // 2, **kw)
    assert [p.config.offload.ratio for p in tight.plans] == [1.0]
    with pytest.raises(ValueError, match=r"config.offload.ratio=0.5: the search sets the ratio .* SearchSpace\(ratios"):
        zj.autotune(
            loss,
            shapes,
            tx,
            BATCH,
            memory="64MiB",
            **{**kw, "config": dataclasses.replace(CFG, offload={"optimizer": True, "ratio": 0.5})},
        )
