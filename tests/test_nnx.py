"""zj.nnx: an NNX module, optimizer and steps as NNX writes them, against single-device
NNX training (nnx.Optimizer + nnx.value_and_grad) on the same module."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests import models


class Net(nnx.Module):
    """Linear + LoRA, BatchNorm and dropout."""

    def __init__(self, rngs, *, dropout=0.0):
        self.inp = nnx.Linear(6, 16, rngs=rngs)
        self.lora = nnx.LoRA(16, 4, 16, base_module=nnx.Linear(16, 16, rngs=rngs), rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.bn(self.inp(x)))
        return self.out(self.drop(jnp.tanh(self.lora(h))))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n=3, rows=16):
    ks = jax.random.split(jax.random.key(7), n)
    return [
        {"x": jax.random.normal(k, (rows, 6)), "y": jax.random.normal(jax.random.fold_in(k, 1), (rows, 1))} for k in ks
    ]


def reference(model, tx, wrt, data):
    """Single-device NNX, as NNX's docs write it."""
    opt = nnx.Optimizer(model, tx, wrt=wrt)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, b)) for b in data]
    return model, losses


def max_diff(a, b):
    # On the host, in float32 as before: jnp on the sharded leaves compiled a subtract, abs,
    # max and cast for each leaf's shape and sharding (8-device programs) in every test.
    return max(
        float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
        for x, y in zip(
            jax.tree.leaves(nnx.state(a, nnx.Not(nnx.RngState))), jax.tree.leaves(nnx.state(b, nnx.Not(nnx.RngState)))
        )
    )


# In the default set each stage once: all params at stages 0 and 3, LoRA at stages 1 and 2.
# The slow set adds all params at stages 1 and 2 (the optimizer's path is the one the LoRA
# cases take at those stages) and LoRA at stages 0 and 3 (the trainable mask LoRAParam makes
# is the one at stages 1 and 2; test_training_loops.py's
# test_frozen_weights_equal_multi_transform_and_never_change freezes at stages 0 and 3).
DEFAULT_NNX = {("all", 0), ("all", 3), ("lora", 1), ("lora", 2)}


@pytest.mark.parametrize(
    "wrt,stage",
    [
        pytest.param(wrt, stage, id=f"{name}-{stage}", marks=[] if (name, stage) in DEFAULT_NNX else [pytest.mark.slow])
        for stage in range(4)
        for wrt, name in ((nnx.Param, "all"), (nnx.LoRAParam, "lora"))
    ],
)
def test_optimizer_matches_single_device_nnx(stage, wrt):
    data, tx = batches(), optax.sgd(0.1, momentum=0.9)
    ref, ref_losses = reference(Net(nnx.Rngs(0)), tx, wrt, data)
    model = Net(nnx.Rngs(0))
    opt = zj.nnx.Optimizer(model, tx, wrt=wrt, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=stage))
    train_step = zj.nnx.make_train_step(loss_fn)
    losses = [float(train_step(opt, b)["loss"]) for b in data]
    got = opt.gathered_model()
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert max_diff(got, ref) <= 1e-5  # parameters and BatchNorm statistics
    # The module given was trained in place, as nnx.Optimizer trains it ...
    assert opt.model is model and max_diff(model, ref) <= 1e-5
    model.eval(), ref.eval()
    np.testing.assert_allclose(np.asarray(model(data[0]["x"])), np.asarray(ref(data[0]["x"])), rtol=1e-5, atol=1e-6)
    if stage == 3 and wrt is nnx.Param:  # ... and holds its parameters sharded, as ZeRO stores them
        kernel = model.lora.base_module.kernel.get_value()
        assert {s.data.size for s in kernel.addressable_shards} == {kernel.size // 8}
    assert opt.step == 3
    if wrt is nnx.LoRAParam:  # the base stays as it was, with no optimizer state
        base = Net(nnx.Rngs(0))
        np.testing.assert_array_equal(got.inp.kernel.get_value(), base.inp.kernel.get_value())
        assert sum(opt.state.plan.trainable) == 2 and zj.report.state_bytes_per_device(opt.state)["frozen"] > 0


def test_batch_stats_per_device_when_not_synced():
    """sync_batch_stats=False: each device normalizes its own rows; the running variance is
    the mean of the devices' own variances (not the global batch's)."""
    data = batches(1)[0]
    model = Net(nnx.Rngs(0))
    h = np.asarray(model.inp(data["x"])).reshape(8, 2, 16)  # BatchNorm's input, per device
    expected = 0.99 * 1.0 + 0.01 * h.var(axis=1).mean(axis=0)
    opt = zj.nnx.Optimizer(
        model, optax.sgd(0.0), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3), sync_batch_stats=False
    )
    zj.nnx.make_train_step(loss_fn)(opt, data)
    np.testing.assert_allclose(opt.gathered_model().bn.var[...], expected, rtol=1e-5)
    glob = 0.99 + 0.01 * np.asarray(model.inp(data["x"])).var(axis=0)
    assert np.abs(expected - glob).max() > 1e-3  # the two differ on this data


def test_dropout_through_the_modules_own_streams():
    """Each device, micro-batch and step draws its own mask, the same at every stage; the
    stream's counter advances once per draw and micro-batch, its key stays the module's."""

    class Masks(nnx.Module):  # returns the dropout mask itself, one row per example
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones((1, 32)))
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(jnp.ones((x.shape[0], 32)) * self.w[...])

    def mask_loss(model, batch):
        m = model(batch)
        return jnp.mean(m), m

    runs = {}
    for stage in (0, 3):
        cfg = zj.ZeroConfig(stage=stage, grad_accum_steps=2)
        opt = zj.nnx.Optimizer(Masks(nnx.Rngs(0, dropout=1)), optax.sgd(0.0), mesh=zj.make_mesh(), config=cfg)
        key0 = jax.random.key_data(opt.gathered_model().drop.rngs.key.get_value())
        step = zj.nnx.make_train_step(mask_loss, has_aux=True, aux_reduce="concat")
        runs[stage] = [np.asarray(step(opt, jnp.zeros((32, 1)))["aux"]) for _ in range(2)]
        model = opt.gathered_model()
        assert int(model.drop.rngs.count.get_value()) == 2 * 2  # 2 steps x 2 micro-batches x 1 draw
        np.testing.assert_array_equal(jax.random.key_data(model.drop.rngs.key.get_value()), key0)
    np.testing.assert_array_equal(runs[0][0], runs[3][0])
    np.testing.assert_array_equal(runs[0][1], runs[3][1])
    first, second = runs[0]
    rows = first.reshape(16, 2, 32)  # 8 devices x 2 micro-batches, 2 rows each
    assert set(np.unique(first)) <= {0.0, 2.0}
    distinct = {r.tobytes() for r in rows[:, 0]}
    assert len(distinct) == 16  # every device and micro-batch its own
    assert not np.array_equal(first, second)  # and every step


def test_eval_step_runs_in_eval_mode_and_leaves_the_optimizer():
    data = batches(1)[0]
    opt = zj.nnx.Optimizer(
        Net(nnx.Rngs(0), dropout=0.5), optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3)
    )
    zj.nnx.make_train_step(loss_fn)(opt, data)
    before = opt.gathered_model()
    ev = zj.nnx.make_eval_step(lambda model, b: {"pred": model(b["x"])}, reduce="concat")
    pred = ev(opt, data)["pred"]
    before.eval()
    np.testing.assert_allclose(pred, before(data["x"]), rtol=1e-5, atol=1e-6)  # no dropout, running stats
    assert max_diff(opt.gathered_model(), before) == 0.0


def test_sharded_build_and_checkpoint_across_stages(tmp_path):
    """Built from a function, never whole; saved at stage 3, restored at stage 1."""
    make = lambda: Net(nnx.Rngs(0))
    tx, data = optax.adam(1e-2), batches(2)
    opt = zj.nnx.Optimizer(make, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
    assert opt.state.master["inp"]["kernel"].get_value().addressable_shards[0].data.size < 6 * 16
    step = zj.nnx.make_train_step(loss_fn)
    step(opt, data[0])
    opt.save(tmp_path, wait=True)
    expected = float(step(opt, data[1])["loss"])
    again = zj.nnx.Optimizer(make, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=1))
    again.restore(tmp_path)
    assert again.step == 1
    assert abs(float(zj.nnx.make_train_step(loss_fn)(again, data[1])["loss"]) - expected) < 1e-6


def test_functional_api_takes_nnx_filters():
    model = Net(nnx.Rngs(0))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    st = zj.init_state(
        params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=2), trainable=nnx.LoRAParam
    )
    assert st.plan.trainable == zj.nnx.select(nnx.LoRAParam, params, name="trainable")
    assert sum(st.plan.trainable) == 2
    path_pred = lambda path, v: "out" in path
    st2 = zj.init_state(params, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=2), trainable=path_pred)
    assert sum(st2.plan.trainable) == 2


def test_bad_input():
    model, mesh, cfg, tx = Net(nnx.Rngs(0)), zj.make_mesh(), zj.ZeroConfig(stage=3), optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"wrt=nnx.Intermediate selects none of the 10 parameter arrays"):
        zj.nnx.Optimizer(model, tx, wrt=nnx.Intermediate, mesh=mesh, config=cfg)
    with pytest.raises(TypeError, match=r"wrt=Any\(.*selects the rng stream variable RngCount"):
        zj.nnx.Optimizer(Net(nnx.Rngs(0), dropout=0.1), tx, wrt=nnx.Any(nnx.Param, nnx.RngCount), mesh=mesh, config=cfg)
    everything = nnx.Any(nnx.LoRAParam, nnx.PathContains("bn"), nnx.PathContains("kernel"), nnx.PathContains("bias"))
    with pytest.raises(ValueError, match=r"wrt=Any\(.*selects all 12 parameter arrays.*nothing would be frozen"):
        zj.nnx.Optimizer(model, tx, wrt=everything, mesh=mesh, config=cfg)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    with pytest.raises(TypeError, match=r"trainable=nnx.LoRAParam selects nnx.Variable types.*to_pure_dict"):
        zj.init_state(params.to_pure_dict(), tx, mesh=mesh, config=cfg, trainable=nnx.LoRAParam)
    with pytest.raises(TypeError, match=r"params is an NNX module \(Net\).*nnx.split"):
        zj.init_state(model, tx, mesh=mesh, config=cfg)
    with pytest.raises(TypeError, match=r"abstract Net \(from nnx.eval_shape.*lambda: Model"):
        zj.nnx.Optimizer(nnx.eval_shape(lambda: Net(nnx.Rngs(0))), tx, mesh=mesh, config=cfg)
    with pytest.raises(TypeError, match="wrt must be an NNX filter"):
        zj.nnx.Optimizer(model, tx, wrt={"inp": True}, mesh=mesh, config=cfg)
    with pytest.raises(TypeError, match="takes a zj.nnx.Optimizer"):
        zj.nnx.make_train_step(loss_fn)(model, batches(1)[0])


@pytest.mark.slow  # reason: 12 s, two doc scripts in their own processes; the NNX API is tested in the default set
def test_nnx_doc_scripts_run_and_differ_by_four_lines(capsys):
    """docs/nnx.md: the single-device NNX script and the zerojax one both train; the
    zerojax one writes at most 4 lines and deletes only the hand-written step (the module
    is trained in place, as nnx.Optimizer trains it)."""
    import difflib
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "nnx.md").read_text()
    single, zero = re.findall(r"```python\n(.*?)```", text, re.S)[:2]
    ops = difflib.SequenceMatcher(None, single.splitlines(), zero.splitlines()).get_opcodes()
    written = sum(j2 - j1 for tag, _, _, j1, j2 in ops if tag in ("replace", "insert"))
    deleted = sum(max(0, (i2 - i1) - (j2 - j1)) for tag, i1, i2, j1, j2 in ops if tag in ("replace", "delete"))
    assert written <= 4 and deleted <= 5, (written, deleted)
    results = []
    for source in (single, zero):
        exec(compile(source, "docs/nnx.md", "exec"), {"__name__": "__doc__"})
        line = capsys.readouterr().out.strip().splitlines()[-1]
        results.append([float(x) for x in re.findall(r"loss (\d+\.\d+)", line)])
    (loss1, eval1), (loss8, eval8) = results
    assert max(loss1, loss8) < 1.0 and max(eval1, eval8) < 1.0  # from ln(32) = 3.47 at the start
    assert abs(eval8 - eval1) < 0.1  # dropout masks differ, nothing else


def test_nnx_with_bf16_prefetch_and_the_compiled_program():
    """The engine's options apply unchanged: bf16 compute on fp32 masters and prefetch at
    stage 3 (accumulation is in the dropout test: BatchNorm over a micro-batch is not
    BatchNorm over the batch); the step lowers for the reports."""
    data, tx = batches(2), optax.sgd(0.1, momentum=0.9)
    ref, ref_losses = reference(Net(nnx.Rngs(0)), tx, nnx.Param, data)
    cfg = zj.ZeroConfig(stage=3, compute_dtype="bfloat16", prefetch=1)
    opt = zj.nnx.Optimizer(Net(nnx.Rngs(0)), tx, mesh=zj.make_mesh(), config=cfg)
    step = zj.nnx.make_train_step(loss_fn)
    compiled = models.lower_as_called(step, opt, data[0]).compile()  # the program the call runs
    gathers = zj.report.communication_report(compiled)
    assert gathers["total"]["bytes"] > 0
    losses = [float(step(opt, b)["loss"]) for b in data]
    np.testing.assert_allclose(losses, ref_losses, rtol=5e-3)  # bf16 rounding of fp32 training
    assert max_diff(opt.gathered_model(), ref) < 5e-3
    assert opt.gathered_model().inp.kernel[...].dtype == jnp.float32  # the fp32 masters come back


def test_scanned_layer_stack_through_the_optimizer():
    """An nnx.vmap-built, nnx.scan-run stack trains as single-device NNX does, through zj.nnx."""
    data = [models.batch(16, seed=s) for s in range(2)]
    loss = lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2)
    tx = optax.sgd(0.05, momentum=0.9)
    ref = models.NNXModel(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, opt, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        opt.update(model, grads)
        return value

    ref_losses = [float(ref_step(ref, ref_opt, b)) for b in data]
    opt = zj.nnx.Optimizer(models.NNXModel(nnx.Rngs(0)), tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
    step = zj.nnx.make_train_step(loss)
    losses = [float(step(opt, b)["loss"]) for b in data]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert max_diff(opt.gathered_model(), ref) <= 1e-5


# reason: fp16 steps on two layouts; test_sharded_build_and_checkpoint_across_stages and test_dropout_through_the_modules_own_streams
@pytest.mark.slow
def test_hybrid_fp16_lora_dropout_and_a_checkpoint_across_layouts(tmp_path):
    """Features together: a hybrid mesh, fp16 with loss scaling, frozen base weights, dropout
    streams, BatchNorm; saved at stage 3 on 2 x 4 devices, restored at stage 2 on 8."""
    make = lambda: Net(nnx.Rngs(0, dropout=1), dropout=0.2)
    data, tx = batches(3), optax.adam(1e-2)
    # 2^16 overflows this net
    cfg = zj.ZeroConfig(stage=3, compute_dtype="float16", loss_scaling={"initial_scale_power": 8})
    opt = zj.nnx.Optimizer(make, tx, wrt=nnx.LoRAParam, mesh=zj.make_mesh(replicas=2), config=cfg)
    step = zj.nnx.make_train_step(loss_fn)
    first = [step(opt, b) for b in data[:2]]
    assert all(np.isfinite(float(m["loss"])) and not bool(m["skipped"]) for m in first)
    assert float(first[0]["loss_scale"]) == 2.0**8
    opt.save(tmp_path, wait=True)
    expected = float(step(opt, data[2])["loss"])
    model = opt.gathered_model()
    np.testing.assert_array_equal(model.inp.kernel[...], make().inp.kernel[...].astype(jnp.float16))  # frozen
    cfg2 = zj.ZeroConfig(stage=2, compute_dtype="float16", loss_scaling={"initial_scale_power": 8})
    again = zj.nnx.Optimizer(make, tx, wrt=nnx.LoRAParam, mesh=zj.make_mesh(), config=cfg2)
    again.restore(tmp_path)
    assert again.step == 2
    restored = again.gathered_model()
    assert int(restored.drop.rngs.count[...]) == 2  # the streams' counters came back
    # The next step draws the same dropout masks (step key and device order are the layout's
    # own: the hybrid mesh's 8 devices in the same order), so the loss is the same.
    got = float(zj.nnx.make_train_step(loss_fn)(again, data[2])["loss"])
    assert abs(got - expected) < 1e-5


class ListNet(nnx.Module):
    """Unrolled blocks in an nnx.List, the usual way to write layers in NNX."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(6, 128, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(128, 128, rngs=rngs) for _ in range(4)])
        self.out = nnx.Linear(128, 1, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + jnp.tanh(block(h)) * jnp.sin(h)
        return self.out(h)


def test_config_remat_reaches_blocks_held_in_a_list():
    """ZeroConfig(remat="full") makes each listed block's call a remat region: the step's
    program has one more optimization barrier (JAX's remat boundary) per block than with
    remat "none" (before: the same count), with the same losses and parameters. (On the
    CPU backend XLA's temp bytes do not show remat on unrolled blocks, even for plain
    jax.checkpoint; the remat table measures it on layer loops.)"""
    data = batches(2, rows=64)
    got = {}
    for remat in ("none", "full"):
        opt = zj.nnx.Optimizer(
            ListNet(nnx.Rngs(0)), optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=0, remat=remat)
        )
        train_step = zj.nnx.make_train_step(loss_fn)
        barriers = train_step.lower(opt, data[0]).as_text().count("optimization_barrier")
        got[remat] = (barriers, [float(train_step(opt, b)["loss"]) for b in data], opt)
    (barriers_none, losses_none, opt_none), (barriers_full, losses_full, opt_full) = got.values()
    assert barriers_full >= barriers_none + len(opt_full.model.blocks), (barriers_none, barriers_full)
    np.testing.assert_allclose(losses_full, losses_none, rtol=1e-6)
    assert max_diff(opt_full.model, opt_none.model) <= 1e-6


def test_config_remat_with_nothing_to_apply_to_says_so():
    """A loss whose layers are unrolled (a Python loop, no scan, no remat region) gets a
    RematNotApplied warning naming the fixes; a scanned stack does not."""
    from zerojax.sharding.per_use import RematNotApplied

    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=2, remat="full")
    b = models.batch(16)
    for params, loss, warns in (
        (models.mlp_params(), models.mlp_loss, True),
        (models.stacked_params(), models.stacked_loss, False),
    ):
        state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=cfg)
        step = zj.make_train_step(loss, optax.sgd(0.1), mesh=mesh, config=cfg)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step.lower(state, b)
        said = [w for w in seen if issubclass(w.category, RematNotApplied)]
        assert bool(said) == warns, [str(w.message) for w in seen]
        if warns:
            assert "zj.remat.nnx_module" in str(said[0].message)
