"""Hybrid sharding on a (replica, data) mesh: shard within a group, replicate across groups."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from tests.test_training_loops import bn_reference, bn_run, run_dropout
from zerojax import cli
from zerojax.report import estimate
from zerojax.report.comm import collectives
from zerojax.report.replica_groups import group_axes, replica_groups
from zerojax.sharding.partial_axes import PartialBatchCollective

N = 8
CLIP_SGD = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))
ADAM = lambda: optax.adam(1e-3)
MODELS = {"unrolled": (models.mlp_params, models.mlp_loss), "scan": (models.stacked_params, models.stacked_loss)}
STEPS = 3


def batches():
    return [models.batch(16, seed=s) for s in range(STEPS)]


# --- Results ------------------------------------------------------------------------------

SLOW = pytest.mark.slow


@functools.cache
def clip_sgd_reference(model):
    """Single-device optax (clipped SGD) on ``model``: (params, losses), the same for every
    stage and mesh compared with it."""
    make_params, loss_fn = MODELS[model]
    return models.reference_run(loss_fn, make_params(), CLIP_SGD(), batches())


# Every stage with two groups of the scanned model by default; the other settings pairwise
# (tests.models.pairwise) in the slow set.
@pytest.mark.parametrize(
    "model,replicas,stage",
    [("scan", 2, stage) for stage in range(4)]
    + [
        pytest.param(*row, marks=SLOW)
        for row in models.pairwise(model=["scan", "unrolled"], replicas=[2, 4], stage=[0, 1, 2, 3])
        if row[:2] != ("scan", 2)
    ],
)
def test_matches_single_device_optax(model, replicas, stage):
    make_params, loss_fn = MODELS[model]
    ref, ref_losses = clip_sgd_reference(model)
    got, losses = models.zero_run(loss_fn, make_params(), CLIP_SGD(), batches(), stage, replicas=replicas)
    assert models.abs_errors(got, ref).max() <= 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "features",
    [
        dict(stage=3, compute_dtype="bfloat16", grad_accum_steps=2),
        dict(stage=3, prefetch=1),
        dict(stage=2, offload={"optimizer": True}),
        dict(stage=3, compute_dtype="float16", collectives={"reduce_dtype": "float16"}),
    ],
    ids=["bf16-accum", "prefetch", "offload", "fp16-reduce"],
)
# reason: 4 features x 2 meshes; test_matches_single_device_optax trains 2 groups at every stage, test_tensor_parallel's test_features_together_hybrid_prefetch_int8_bf16_accumulation_frozen with features
@pytest.mark.slow
def test_features_give_what_the_1d_mesh_gives(features):
    """The same config on a 1-D mesh and on 2 replica groups: the same training (the
    reductions differ only in their order)."""
    make_params, loss_fn = MODELS["scan"]
    one, l1 = models.zero_run(loss_fn, make_params(), ADAM(), batches(), replicas=1, **features)
    two, l2 = models.zero_run(loss_fn, make_params(), ADAM(), batches(), replicas=2, **features)
    tol = 1e-6 if features.get("compute_dtype", "float32") == "float32" else 2e-3
    assert models.abs_errors(one, two).max() <= tol
    np.testing.assert_allclose(l1, l2, rtol=tol)


@pytest.mark.slow  # reason: 11 s; int8 gathers on the 1-D mesh and hybrid exactness stay in the default set
def test_int8_gathers_stay_in_the_group_and_train():
    make_params, loss_fn = MODELS["scan"]
    ref, _ = clip_sgd_reference("scan")
    got, _ = models.zero_run(
        loss_fn,
        make_params(),
        CLIP_SGD(),
        batches(),
        3,
        replicas=2,
        collectives={"gather_dtype": "int8", "gather_block_size": 16},
    )
    one, _ = models.zero_run(
        loss_fn, make_params(), CLIP_SGD(), batches(), 3, collectives={"gather_dtype": "int8", "gather_block_size": 16}
    )
    # int8 weights in forward, fp32 masters: off the fp32 run by as much as on a 1-D mesh.
    err, err1 = models.abs_errors(got, ref).max(), models.abs_errors(one, ref).max()
    assert 0 < err <= 2 * err1 and err <= 1e-3
    mesh = zj.make_mesh(replicas=2)
    cfg = zj.ZeroConfig(stage=3, collectives={"gather_dtype": "int8", "gather_block_size": 16})
    st = zj.init_state(make_params(), ADAM(), mesh=mesh, config=cfg)
    text = zj.make_train_step(loss_fn, ADAM(), mesh=mesh, config=cfg).lower(st, models.batch(16)).compile().as_text()
    s8 = [c for c in collectives(text) if c.kind == "all-gather" and c.dtype == "s8"]
    assert s8 and all(c.axes(mesh) == ("data",) and c.group_size == 4 for c in s8)


def test_dropout_keys_and_synced_batchnorm_see_every_device():
    """Keys fold in the device's index over both axes (the same masks as on a 1-D mesh), and
    a BatchNorm synced over ("replica", "data") equals single-device on the global batch."""
    s1, m1 = run_dropout(3)
    s2, m2 = run_dropout(3, replicas=2)
    for a, b in zip(m1, m2):
        np.testing.assert_array_equal(a, b)
    assert models.abs_errors(zj.gather_params(s1), zj.gather_params(s2)).max() <= 1e-6
    ref_p, ref_bs = bn_reference(2)
    with warnings.catch_warnings():  # naming both axes is silent (the warning's test below names one)
        warnings.simplefilter("error", PartialBatchCollective)
        state = bn_run(3, ("replica", "data"), replicas=2)
    assert models.abs_errors(zj.gather_params(state), ref_p).max() <= 1e-5
    assert models.abs_errors(state.model_state["batch_stats"], ref_bs).max() <= 1e-5


def test_eval_step_concatenates_over_every_device():
    make_params, loss_fn = MODELS["scan"]
    mesh, cfg = zj.make_mesh(replicas=4), zj.ZeroConfig(stage=3)
    state = zj.init_state(make_params(), ADAM(), mesh=mesh, config=cfg)
    b = models.batch(16)
    per_row = lambda p, b: {"loss": loss_fn(p, b), "x0": b["x"][:, 0]}
    out = zj.make_eval_step(per_row, mesh=mesh, config=cfg, reduce={"loss": "mean", "x0": "concat"})(state, b)
    np.testing.assert_array_equal(out["x0"], b["x"][:, 0])  # rows in order: device i holds rows 2i, 2i+1
    np.testing.assert_allclose(out["loss"], loss_fn(make_params(), b), rtol=1e-6)


# --- Memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("replicas", [2, pytest.param(4, marks=SLOW)])
def test_persistent_bytes_are_the_formulas_with_the_group_size(replicas, stage):
    params = models.deep_params(4, 64, stacked=True)  # every dimension divides 8: no padding
    psi = sum(x.size for x in jax.tree.leaves(params))
    mesh = zj.make_mesh(replicas=replicas)
    state = zj.init_state(params, ADAM(), mesh=mesh, config=zj.ZeroConfig(stage=stage))
    got = zj.report.state_bytes_per_device(state)
    want = zj.report.zero_formula_bytes(psi, N // replicas, stage)
    counters = 3 * 4  # the step, the skip counter, Adam's count
    assert got["total"] == want + counters, (got, want)
    assert got["padding"] == 0
    # Each replica group holds the same shards: device (r, i) equals device (0, i).
    for leaf in jax.tree.leaves(state.opt_state):
        if leaf.ndim == 0:
            continue
        by_device = {s.device: np.asarray(s.data) for s in leaf.addressable_shards}
        for r in range(replicas):
            for i in range(N // replicas):
                np.testing.assert_array_equal(by_device[mesh.devices[r, i]], by_device[mesh.devices[0, i]])


# --- Communication ------------------------------------------------------------------------


def _compiled(stage, replicas, params, tx=None):
    mesh = zj.make_mesh(replicas=replicas)
    cfg = zj.ZeroConfig(stage=stage)
    tx = tx or optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(models.deep_loss, tx, mesh=mesh, config=cfg)
    return mesh, step.lower(state, jnp.ones((16, 64))).compile()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("replicas", [2, pytest.param(4, marks=SLOW)])
def test_only_gradient_shards_cross_groups(replicas, stage):
    params = models.deep_params(4, 64, stacked=True)
    psi = sum(x.size for x in jax.tree.leaves(params))
    mesh, compiled = _compiled(stage, replicas, params)
    found = collectives(compiled.as_text())
    group = N // replicas
    for c in found:
        if c.kind in ("all-gather", "reduce-scatter"):
            assert c.axes(mesh) == ("data",) and c.group_size == group, c
    across = [c for c in found if "replica" in c.axes(mesh)]
    assert {c.kind for c in across} == {"all-reduce"}
    # Over the replica axis alone: every gradient shard, once (Ψ/(N/R) fp32 elements).
    shards = [c for c in across if c.axes(mesh) == ("replica",)]
    assert sum(c.total_bytes for c in shards) == 4 * psi // group
    # Over every device: only the scalar loss.
    assert all(c.bytes <= 8 for c in across if c.axes(mesh) == ("replica", "data"))


def test_communication_report_splits_bytes_per_mesh_axis():
    params = models.deep_params(4, 64, stacked=True)
    psi = sum(x.size for x in jax.tree.leaves(params))
    mesh1, c1 = _compiled(3, 1, params, optax.adam(1e-3))
    mesh2, c2 = _compiled(3, 2, params, optax.adam(1e-3))
    one, two = zj.report.communication_report(c1, mesh=mesh1), zj.report.communication_report(c2, mesh=mesh2)
    assert set(one["by_axis"]) == {"data"}
    # The same gathers and reduce-scatters, now inside a group (the scalar loss spans both axes).
    assert one["total"]["bytes"] == two["by_axis"]["data"]["bytes"] + two["by_axis"]["replica+data"]["bytes"]
    # ZeRO-3: 2 gathers (forward, backward) and 1 reduce-scatter of Ψ fp32 (backward does not
    # re-gather a bias, whose gradient does not read it).
    assert 2.95 * 4 * psi <= two["by_axis"]["data"]["bytes"] <= 3 * 4 * psi
    assert two["by_axis"]["replica"] == {"count": 4, "bytes": 4 * psi // 4, "zero_bytes": 2 * 4 * psi // 4}
    assert two["by_axis"]["replica+data"]["bytes"] == 4  # the loss
    assert two["total"]["bytes"] == sum(r["bytes"] for r in two["by_axis"].values())


def test_replica_group_forms_read_from_hlo():
    assert replica_groups("x), replica_groups={{0,1},{2,3}}, to_apply=%r") == [[0, 1], [2, 3]]
    assert replica_groups("x), replica_groups=[2,4]<=[8], dimensions={0}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("x), replica_groups=[4,2]<=[2,4]T(1,0), to_apply") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    mesh_form = "x), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, to_apply"
    assert replica_groups(mesh_form) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("x), source_target_pairs={{0,1}}") is None
    with pytest.raises(ValueError, match="cannot read the replica groups"):
        replica_groups("x), replica_groups=somethingnew")
    shape = {"replica": 2, "data": 4}
    assert group_axes([[0, 4], [1, 5]], shape) == ("replica",)
    assert group_axes([[0, 1, 2, 3]], shape) == ("data",)
    assert group_axes([list(range(8))], shape) == ("replica", "data")


# --- Checkpoints --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "save,restore",
    [((2, 3), (1, 2)), pytest.param((1, 3), (4, 1), marks=SLOW), pytest.param((4, 2), (2, 3), marks=SLOW)],
    ids=["2d-to-1d", "1d-to-2d", "2d-to-2d"],
)
def test_checkpoints_restore_between_1d_and_2d_meshes(tmp_path, save, restore):
    make_params, loss_fn = MODELS["scan"]
    ref, _ = models.reference_run(loss_fn, make_params(), ADAM(), batches())
    (r1, s1), (r2, s2) = save, restore
    mesh, cfg = zj.make_mesh(replicas=r1), zj.ZeroConfig(stage=s1)
    state = zj.init_state(make_params(), ADAM(), mesh=mesh, config=cfg)
    step = zj.make_train_step(loss_fn, ADAM(), mesh=mesh, config=cfg)
    for b in batches()[:2]:
        state, _ = step(state, b)
    zj.save_checkpoint(tmp_path, state, step=2, wait=True)
    mesh, cfg = zj.make_mesh(replicas=r2), zj.ZeroConfig(stage=s2)
    state = zj.restore_checkpoint(tmp_path, make_params(), ADAM(), mesh=mesh, config=cfg)
    assert dict(state.plan.mesh.shape) == dict(mesh.shape)
    state, _ = zj.make_train_step(loss_fn, ADAM(), mesh=mesh, config=cfg)(state, batches()[2])
    assert models.abs_errors(zj.gather_params(state), ref).max() <= 1e-6


# --- Errors and the estimate --------------------------------------------------------------


def test_clear_errors():
    with pytest.raises(
        ValueError, match=r"8 devices do not split into 3 equal replica groups. Use one of \[1, 2, 4, 8\]"
    ):
        zj.make_mesh(replicas=3)
    with pytest.raises(ValueError, match="replicas=...\\) must be a positive int"):
        zj.make_mesh(replicas=0)
    with pytest.raises(ValueError, match="replica_axis='data'"):
        zj.make_mesh(replicas=2, replica_axis="data")
    with pytest.raises(ValueError, match="Axes.replica must be a mesh axis name other than data='data'"):
        zj.ZeroConfig(axes={"replica": "data"})
    mesh, cfg = zj.make_mesh(replicas=2), zj.ZeroConfig(stage=3)
    state = zj.init_state(models.mlp_params(), ADAM(), mesh=mesh, config=cfg)
    step = zj.make_train_step(models.mlp_loss, ADAM(), mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match="does not divide over the 8 devices of the 'replica x data' axis"):
        step(state, models.batch(12))
    odd = jax.make_mesh((2, 2, 2), ("replica", "data", "model"))
    with pytest.raises(ValueError, match="axes other than 'data' .* and 'replica'"):
        zj.init_state(models.mlp_params(), ADAM(), mesh=odd, config=cfg)


def test_estimate_takes_the_group_size(capsys):
    assert cli.main(["estimate", "--params", "7.5e9", "--devices", "64", "--replicas", "8"]) == 0
    out = capsys.readouterr().out
    assert "N = 64 devices in 8 replica groups of 8" in out
    for s in range(4):
        assert f"{estimate.paper_bytes(7.5e9, 8, s) / 1e9:,.1f} GB" in out.splitlines()[3 + s]
    assert "an all-reduce of a buffer of Ψ/8 gradient elements" in out
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--params", "1e9", "--devices", "64", "--replicas", "7"])


def test_a_batchnorm_synced_over_one_batch_axis_is_warned_about():
    """On a hybrid mesh, BatchNorm(axis_name="data") normalises each replica group on its
    own (its statistics differ from the global batch's): the step warns, naming the fix;
    naming both axes is silent and exact (test above)."""
    ref_p, ref_bs = bn_reference(2)
    with pytest.warns(
        PartialBatchCollective,
        match=r"loss_fn makes a psum over mesh axes \('data',\), but the batch "
        r"is split over \('replica', 'data'\).*axis_name=\('replica', "
        r"'data'\)",
    ):
        state = bn_run(3, "data", replicas=2)
    # What the warning is about: the statistics are not the global batch's.
    assert models.abs_errors(state.model_state["batch_stats"], ref_bs).max() > 1e-3
    with warnings.catch_warnings():  # both axes on this mesh: silent in the test above, the same step
        warnings.simplefilter("error", PartialBatchCollective)
        bn_run(3, "data")  # a 1-D mesh: "data" is the whole batch
