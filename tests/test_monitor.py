"""Per-step metrics and their writers (zerojax.monitor), and the learning rate every train
step reports (zerojax.optim.learning_rate), against plain single-device optax, the
writers' own file formats read back, and the MFU formula."""

import csv
import functools
import io
import json
import os
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.monitor import rates
from zerojax.optim import learning_rate
from zerojax.tuning import DeviceSpec

SCHED = optax.linear_schedule(0.2, 0.02, 6)


# -- the learning rate, read from optax's own state and schedules


def _schedules(rng):
    """Random schedules of each optax family: (name, schedule)."""
    lr = float(rng.uniform(1e-4, 1e-1))
    n = int(rng.integers(3, 12))
    return [
        ("linear", optax.linear_schedule(lr, lr * rng.uniform(0, 1), n)),
        ("cosine", optax.cosine_decay_schedule(lr, n, alpha=float(rng.uniform(0, 0.5)))),
        ("warmup_cosine", optax.warmup_cosine_decay_schedule(0.0, lr, max(1, n // 3), n)),
        ("exponential", optax.exponential_decay(lr, max(1, n // 2), float(rng.uniform(0.3, 0.9)))),
        ("piecewise", optax.piecewise_constant_schedule(lr, {n // 2: 0.5, n: 0.1})),
        ("constant", lr),
    ]


def _optimizers(sched):
    """Optimizers over one rate, each with the rate its update scales by at optax count c."""
    rate = sched if callable(sched) else (lambda c: sched)
    return [
        (optax.sgd(sched), rate),
        (optax.adamw(sched, weight_decay=0.1), rate),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.lion(sched)), rate),
        (optax.adafactor(sched), rate),  # flip_sign=False, then optax.scale(-1)
        (optax.inject_hyperparams(optax.adam)(learning_rate=sched), rate),
        (optax.MultiSteps(optax.sgd(sched), 2), lambda c: rate(c // 2)),
    ]


@pytest.mark.parametrize("seed", range(2))
def test_the_rate_read_is_the_schedule_at_optax_own_count(seed):
    """Randomized schedules and optimizers (every family and every optimizer in each seed):
    after k real optax updates on one device, the
    reader's rate for the next update equals the schedule at that update's count."""
    rng = np.random.default_rng(seed)
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    schedules = _schedules(rng)
    pairs = [(name, sched, int(rng.integers(6))) for name, sched in schedules]  # each family, one optimizer
    pairs += [(*schedules[int(rng.integers(len(schedules)))], j) for j in range(6)]  # each optimizer, one family
    for name, sched, j in pairs:
        for tx, rate in [_optimizers(sched)[j]]:
            reader = learning_rate.find(tx, jax.eval_shape(tx.init, params))
            assert isinstance(reader, learning_rate.Reader), (name, reader)
            state = tx.init(params)
            for k in range(int(rng.integers(1, 5))):
                g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
                before = jax.tree.leaves(state)
                _, state = tx.update(g, state, params)
                got = float(reader.read(before, jax.tree.leaves(state)))
                np.testing.assert_allclose(got, float(rate(k)), rtol=1e-6, err_msg=f"{name} {tx} update {k}")


@pytest.mark.parametrize(
    "tx, why",
    [
        (optax.multi_transform({"a": optax.adam(1e-3), "b": optax.sgd(1e-2)}, {"w": "a", "b": "b"}), "2 different"),
        (optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(SCHED), optax.scale(-3.0)), "1 schedule(s) and 1"),
        (optax.scale_by_adam(), "no optax schedule or constant"),
        (optax.contrib.muon(SCHED), "2 schedule counts"),
    ],
)
def test_no_single_rate_is_not_guessed(tx, why):
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    found = learning_rate.find(tx, jax.eval_shape(tx.init, params))
    assert isinstance(found, learning_rate.NotFound) and why in found.reason, found
    assert "inject_hyperparams" in found.reason


def _run(tx, config, steps=3, n=8):
    mesh = zj.make_mesh(jax.devices()[:n])
    cfg = zj.ZeroConfig(**config)
    state = zj.init_state(models.mlp_params(), tx, mesh=mesh, config=cfg)
    step = models.shared_step(models.mlp_loss, tx, mesh=mesh, config=cfg)
    out = []
    for k in range(steps):
        state, metrics = step(state, models.batch(seed=k))
        out.append(metrics)
    return out


def test_sgd_step_reports_the_rate_its_update_applied():
    """Stage 3 with the optimizer state on the host: the reported rate equals -Δp / g, the
    parameters' change over the single-device gradient, element by element."""
    tx = optax.sgd(SCHED)
    mesh = zj.make_mesh()
    cfg = zj.ZeroConfig(stage=3, offload={"optimizer": True})
    state = zj.init_state(models.mlp_params(), tx, mesh=mesh, config=cfg)
    step = models.shared_step(models.mlp_loss, tx, mesh=mesh, config=cfg)
    for k in range(3):
        before = jax.device_get(zj.gather_params(state))
        g = jax.tree.leaves(jax.grad(models.mlp_loss)(before, models.batch(seed=k)))
        state, metrics = step(state, models.batch(seed=k))
        dp = jax.tree.leaves(jax.tree.map(np.subtract, jax.device_get(zj.gather_params(state)), before))
        g, dp = np.concatenate([np.ravel(x) for x in g]), np.concatenate([np.ravel(x) for x in dp])
        big = np.abs(g) > 1e-2
        np.testing.assert_allclose(-dp[big] / g[big], float(metrics["learning_rate"]), rtol=2e-3)
        assert float(metrics["learning_rate"]) == pytest.approx(float(SCHED(k)), rel=1e-6)


@pytest.mark.parametrize(
    "make_tx, config, rate",
    [
        (lambda: optax.adamw(3e-3), dict(stage=1), lambda k: 3e-3),
        (lambda: optax.inject_hyperparams(optax.adam)(learning_rate=SCHED), dict(stage=2), SCHED),
        (lambda: optax.MultiSteps(optax.sgd(SCHED), 2), dict(stage=0), lambda k: SCHED(k // 2)),
    ],
    ids=["adamw-constant", "injected", "multisteps"],
)
def test_step_reports_the_rate_of_each_kind(make_tx, config, rate):
    metrics = _run(make_tx(), config, steps=4)
    np.testing.assert_allclose(
        [float(m["learning_rate"]) for m in metrics], [float(rate(k)) for k in range(4)], rtol=1e-6
    )


def test_a_step_without_a_single_rate_reports_none():
    tx = optax.multi_transform(
        {"a": optax.adam(1e-3), "b": optax.sgd(1e-2)}, lambda p: jax.tree.map(lambda x: "a" if x.ndim == 2 else "b", p)
    )
    assert "learning_rate" not in _run(tx, dict(stage=1), steps=1)[0]


# -- the monitor and its writers


def _tensorboard_scalars(logdir):
    """``{tag: [(step, value)]}`` from the TFRecord event files tensorboardX wrote, parsed with
    its own protobuf definitions."""
    from tensorboardX.proto import event_pb2

    out = {}
    for name in sorted(os.listdir(logdir)):
        data = open(os.path.join(logdir, name), "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


GPT_CFG = dict(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
BATCH = 16
PEAK = DeviceSpec(name="test device", peak_flops=2e9, peak_flops_fp32=1e9, hbm_bandwidth=1e11, link_bandwidth=1e10)


@functools.cache
def _gpt_step():
    from zerojax.models import gpt

    cfg = gpt.GPTConfig(**GPT_CFG)
    graphdef, params = gpt.init(cfg)
    mesh = zj.make_mesh()
    config = zj.ZeroConfig(stage=3)
    tx = optax.adamw(optax.cosine_decay_schedule(1e-3, 10))
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=config)
    return cfg, params, tx, mesh, config, step


def _tokens(k):
    return {"tokens": jnp.asarray(np.random.default_rng(k).integers(0, 64, (BATCH, GPT_CFG["seq_len"] + 1)), jnp.int32)}


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    """Five GPT steps through a Monitor with every built-in writer: the records read back,
    the metrics the loop saw, and the wall time around the steps."""
    cfg, params, tx, mesh, config, step = _gpt_step()
    d = tmp_path_factory.mktemp("monitor")
    console = io.StringIO()
    writers = [
        zj.monitor.Console(every=2, stream=console),
        zj.monitor.JSONL(d / "run.jsonl"),
        zj.monitor.CSV(d / "run.csv"),
        zj.monitor.TensorBoard(d / "tb"),
    ]
    tokens = BATCH * cfg.seq_len
    monitor = zj.monitor.Monitor(writers, tokens_per_step=tokens, flops_per_token=cfg.flops_per_token(), device=PEAK)
    watched = monitor.watch(step)
    state = zj.init_state(params, tx, mesh=mesh, config=config)
    seen, pending_after = [], []
    for k in range(5):
        if k == 1:
            begin = time.perf_counter()  # after the compile
        state, metrics = watched(state, _tokens(k))
        seen.append(metrics)
        pending_after.append(len(open(d / "run.jsonl").read().splitlines()))
    monitor.write("eval", 5, {"eval_loss": jnp.float32(2.5)})
    monitor.close()
    wall = time.perf_counter() - begin
    records = [json.loads(line) for line in open(d / "run.jsonl")]
    return dict(
        records=records,
        seen=jax.device_get(seen),
        pending_after=pending_after,
        wall=wall,
        console=console.getvalue(),
        csv=list(csv.DictReader(open(d / "run.csv"))),
        tb=_tensorboard_scalars(d / "tb"),
        tokens=tokens,
        cfg=cfg,
        devices=mesh.devices.size,
    )


def test_every_step_is_recorded_a_step_late_with_the_loop_s_numbers(monitored):
    train = [r for r in monitored["records"] if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    # Step k's record is written when step k + 1 is called (none after the first call).
    assert monitored["pending_after"] == [1, 2, 3, 4, 5]  # the compile record, then one per later call
    for r, m in zip(train, monitored["seen"]):
        assert r["loss"] == float(m["loss"]) and r["grad_norm"] == float(m["grad_norm"])
        assert r["learning_rate"] == float(m["learning_rate"])
    sched = optax.cosine_decay_schedule(1e-3, 10)
    np.testing.assert_allclose([r["learning_rate"] for r in train], [float(sched(k)) for k in range(5)], rtol=1e-6)
    assert {r["kind"] for r in monitored["records"]} == {"compile", "train", "eval"}


def test_throughput_and_mfu_follow_from_the_measured_step_time(monitored):
    """tokens/s, samples/s and MFU are the formulas of each step's time; the steps' times
    add up to at most the loop's wall time around them."""
    train = [r for r in monitored["records"] if r["kind"] == "train"]
    flops = monitored["cfg"].flops_per_token() * monitored["tokens"]
    for r in train:
        t = r["step_time_s"]
        assert t > 0
        assert r["tokens_per_s"] == pytest.approx(monitored["tokens"] / t, rel=1e-12)
        assert r["samples_per_s"] == pytest.approx(BATCH / t, rel=1e-12)
        assert r["mfu"] == pytest.approx(flops / (t * monitored["devices"] * PEAK.peak_flops_fp32), rel=1e-12)
    assert sum(r["step_time_s"] for r in train[1:]) <= monitored["wall"]


def test_csv_and_tensorboard_hold_every_metric_at_its_step(monitored):
    train = [r for r in monitored["records"] if r["kind"] == "train"]
    rows = [r for r in monitored["csv"] if r["kind"] == "train"]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    for r, row in zip(train, rows):
        for key, value in r.items():
            if key not in ("kind", "step"):
                assert float(row[key]) == pytest.approx(value, rel=1e-12), key
    tb = monitored["tb"]
    for key in ("loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_s", "mfu"):
        got = tb[f"train/{key}"]
        assert [s for s, _ in got] == [1, 2, 3, 4, 5]
        np.testing.assert_allclose([v for _, v in got], [r[key] for r in train], rtol=1e-6)  # float32 on file
    assert [s for s, _ in tb["eval/eval_loss"]] == [5]


def test_console_says_what_it_does_and_what_it_cannot_report(monitored):
    lines = monitored["console"].splitlines()
    assert "device memory: not reported, the backend keeps no memory statistics (the CPU's)" in lines
    assert lines.index("step 1: compiling the train step (the first call traces and compiles it)") < next(
        i for i, line in enumerate(lines) if line.startswith("step 1: compiled in ")
    )
    shown = [line.split(" |")[0] for line in lines if " | " in line]
    assert shown == ["step 1", "step 2", "step 4", "eval at step 5"]  # every=2, and the first
    assert " ms/step | " in lines[-2] and " tok/s | " in lines[-2] and "MFU " in lines[-2]


def test_the_compiled_step_s_flops_are_the_model_s_formula_and_recompute():
    """flops_per_step='compiled' reads the compiled program's FLOPs: at least the model's
    formula (6 per weight per token, plus attention), and not far above it (the softmax,
    norms and the optimizer's update are the rest)."""
    cfg, params, tx, mesh, config, step = _gpt_step()
    state = zj.init_state(params, tx, mesh=mesh, config=config)
    compiled = rates.compiled_flops(step, state, _tokens(0)) * mesh.devices.size
    formula = cfg.flops_per_token() * BATCH * cfg.seq_len
    assert formula <= compiled <= 1.5 * formula, (compiled, formula)


def test_only_process_zero_writes(monkeypatch, tmp_path):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monitor = zj.monitor.Monitor([zj.monitor.JSONL(tmp_path / "r.jsonl")])
    assert monitor.writers == []
    monitor.write("eval", 1, {"eval_loss": 1.0})
    monitor.close()
    assert open(tmp_path / "r.jsonl").read() == ""


def test_refusals_name_the_fix(tmp_path):
    with pytest.raises(TypeError, match="zj.monitor writers"):
        zj.monitor.Monitor([print])
    with pytest.raises(ValueError, match="needs tokens_per_step"):
        zj.monitor.Monitor([], flops_per_token=100)
    with pytest.raises(ValueError, match="not both"):
        zj.monitor.Monitor([], tokens_per_step=4, flops_per_token=100, flops_per_step=400)
    with pytest.raises(ValueError, match="'compiled'"):
        zj.monitor.Monitor([], flops_per_step="yes")
    with pytest.raises(ValueError, match="int >= 1"):
        zj.monitor.Console(every=0)
    with pytest.raises(FileNotFoundError, match="create it first"):
        zj.monitor.JSONL(tmp_path / "missing" / "run.jsonl")
    m = zj.monitor.Monitor([])
    m.close()
    with pytest.raises(ValueError, match="closed"):
        m.write("eval", 1, {"x": 1.0})
    with pytest.raises(ValueError, match="scalars"):
        zj.monitor.Monitor([]).write("eval", 1, {"x": np.ones(2)})


PREEMPTED = """
import jax, sys
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp, optax, zerojax as zj
mesh = zj.make_mesh()
tx = optax.sgd(0.1)
state = zj.init_state({"w": jnp.ones(3)}, tx, mesh=mesh, config=zj.ZeroConfig())
loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
monitor = zj.monitor.Monitor([zj.monitor.Console(every=1), zj.monitor.JSONL(sys.argv[1])])
step = monitor.watch(zj.make_train_step(loss, tx, mesh=mesh, config=zj.ZeroConfig()))
for k in range(3):
    state, metrics = step(state, {"x": jnp.ones((4, 3))})
sys.exit(75)  # as zerojax.resume.Run exits on a preemption notice
"""


def test_a_run_that_exits_mid_loop_still_writes_its_last_step(tmp_path):
    path = tmp_path / "run.jsonl"
    out = subprocess.run([sys.executable, "-c", PREEMPTED, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 75, out.stderr
    steps = [json.loads(line)["step"] for line in open(path) if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2, 3]
    assert "step 1: compiling the train step" in out.stdout and "step 3 | loss " in out.stdout


def _wandb_records(path):
    """The records of a ``.wandb`` run file: a 7-byte header, then LevelDB's log format
    (32 KiB blocks of chunks: crc32, length, type; FULL = 1 ... LAST = 4), each record one
    of wandb's own protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), (ident, magic)
    i, block, parts = 7, 32768, b""
    while i + 7 <= len(data):
        left = block - i % block
        _, n, kind = struct.unpack("<IHB", data[i : i + 7])
        if left < 7 or (n, kind) == (0, 0):  # the block's zero padding
            i += left
            continue
        parts, i = parts + data[i + 7 : i + 7 + n], i + 7 + n
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(parts)
            parts = b""


def _has_exit_record(path):
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path))
    except Exception:  # a record still being written
        return False


@pytest.mark.slow  # reason: starts wandb's service process (3-8 s); the WandB writer's only check, run by CI's slow set
def test_wandb_offline_run_holds_every_record(tmp_path, monkeypatch):
    """Weights & Biases in offline mode: the run's own history file, read with wandb's reader."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    w = zj.monitor.WandB(project="zerojax-test", mode="offline", dir=str(tmp_path))
    for k in (1, 2, 3):
        w.write("train", k, {"loss": 1.0 / k})
    w.close()
    (path,) = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".wandb")]
    # wandb's service process writes the file: finish() can return before it has (seen with
    # several runs at once), so wait for the run's exit record, as `wandb sync` would.
    deadline = time.monotonic() + 60
    while not _has_exit_record(path):
        assert time.monotonic() < deadline, "wandb wrote no exit record within 60 s"
        time.sleep(0.2)
    history = [
        (items["_step"], items["train/loss"])
        for rec in _wandb_records(path)
        if rec.WhichOneof("record_type") == "history"
        for items in [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}]
    ]
    assert history == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]


def test_a_step_returning_neither_form_is_refused_by_name():
    """(state, metrics) and zj.nnx's metrics alone are the two forms; a list is neither."""
    monitor = zj.monitor.Monitor([zj.monitor.History()])
    watched = monitor.watch(lambda state, batch: [state, {"loss": 1.0}])
    with pytest.raises(TypeError, match=r"returns \(state, metrics\).*returned list"):
        watched(0, np.ones((2, 2)))
