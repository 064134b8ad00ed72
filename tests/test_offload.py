"""ZeRO-Offload: optimizer state (and stage 3's parameters) in host memory.

The CPU backend treats moves between memory kinds as no-ops and reports no host memory
apart, so these tests check what it can show: where each array is placed, that training
is exactly what it is without offload, the byte split against the formulas, and that
checkpoints carry offloaded states.
"""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.optim.offload import update_groups

HOST = "pinned_host"
BATCHES = [models.batch(16, s) for s in range(3)]
TX = optax.adamw(1e-2)


def kinds(tree):
    return None if tree is None else {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def train(cfg, tx=TX, batches=BATCHES, params=None):
    mesh = zj.make_mesh()
    state = zj.init_state(params or models.stacked_params(), tx, mesh=mesh, config=cfg)
    step = models.shared_step(models.stacked_loss, tx, mesh=mesh, config=cfg)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, step, losses


@functools.cache
def without_offload(cfg, tx=TX):
    """The run the offloaded ones are compared with, trained once per (config, optimizer):
    (gathered params, losses, optimizer-state leaves)."""
    ref, _, losses = train(cfg, tx=tx)
    return zj.gather_params(ref), losses, [np.asarray(x) for x in jax.tree.leaves(ref.opt_state)]


CASES = [  # (stage, compute dtype, offload_params): where the masters live with offload_optimizer
    (1, "float32", False),  # no separate masters: the replicated params are them
    (1, "bfloat16", False),  # sharded masters beside the bf16 copy: offloaded
    (2, "bfloat16", False),
    (3, "float32", False),  # the masters are what stage 3 gathers: on the device
    (3, "bfloat16", True),  # ... unless offload_params
]


# Stage 1 with bf16 in the slow set: it places its state as stage 2 does (separate masters
# beside the bf16 copy), whose case here shares its compiled step with
# test_checkpoint_round_trip_of_offloaded_state's; stage 1 is in the default set in float32.
@pytest.mark.parametrize("stage,dtype,offload_params", models.marked_slow(CASES, slow=[CASES[1]]))
def test_offloaded_state_lives_in_host_memory(stage, dtype, offload_params):
    cfg = zj.ZeroConfig(stage=stage, compute_dtype=dtype, offload={"optimizer": True, "params": offload_params})
    state, _, _ = train(cfg, batches=BATCHES[:1])  # placement after a step, not only after init
    assert kinds(state.opt_state) == {HOST}
    separate = dtype != "float32" and stage in (1, 2)
    if separate or offload_params:
        assert kinds(state.master) == {HOST}
    elif state.master is not None:
        assert kinds(state.master) == {"device"}
    if state.params is not None:  # what forward reads stays on the device
        assert kinds(state.params) == {"device"}
    for x in jax.tree.leaves(state.opt_state):  # sharded in host memory as on the device
        if x.ndim:
            assert x.addressable_shards[0].data.size * 8 >= x.size


# The default set: stage 1's update on the host and stage 3's (offloaded params) streamed to
# the device, each stage and each place once. The other two are in the slow set: stage 1's
# streamed update is stage 2's (test_streamed_update_of_coupled_and_shape_aware_transforms,
# test_fp16_skipped_steps_change_nothing_in_host_memory), and stage 3's host update trains
# test_eval_step_reads_offloaded_parameters' and test_checkpoint_round_trip_of_offloaded_state's
# runs, compared there with the run without offload.
TRAINS = [(*c, place) for c in CASES for place in ("host", "device")]
TRAINS_DEFAULT = [(*CASES[1], "host"), (*CASES[4], "device")]


@pytest.mark.parametrize(
    "stage,dtype,offload_params,place", models.marked_slow(TRAINS, slow=[c for c in TRAINS if c not in TRAINS_DEFAULT])
)
def test_offload_trains_exactly_as_without(stage, dtype, offload_params, place):
    """Within 1e-6 of the same run without offload, with the update on the host (bit for bit
    on CPU in the cases measured) and streamed to the device one leaf group at a time (each
    group a computation of its own, fused differently: last bits apart, docs/offload.md)."""
    base = zj.ZeroConfig(stage=stage, compute_dtype=dtype)
    ref_params, ref_losses, ref_opt = without_offload(base)
    cfg = dataclasses.replace(
        base, offload={"optimizer": True, "params": offload_params, "update": place, "group_size": 500}
    )
    state, step, losses = train(cfg)
    assert step.update_place(state) == place
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
    assert models.abs_errors(zj.gather_params(state), ref_params).max() <= 1e-6
    for a, b in zip(jax.tree.leaves(state.opt_state), ref_opt):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "tx",
    [
        optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
        # unfactored at these dimensions (all under 128): a whole-leaf read, as LAMB's trust ratio
        pytest.param(optax.adafactor(1e-2), marks=pytest.mark.slow),
        optax.inject_hyperparams(optax.lamb)(learning_rate=1e-2),
    ],
    ids=["clip_adam", "adafactor", "inject_lamb"],
)
def test_streamed_update_of_coupled_and_shape_aware_transforms(tx):
    """A clip inside tx couples every leaf (one group); Adafactor's factored moments and
    LAMB's trust ratio read a whole leaf; injected hyperparameters are shared scalars."""
    base = zj.ZeroConfig(stage=2, compute_dtype="bfloat16")
    ref_params, _, _ = without_offload(base, tx)
    state, _, _ = train(
        dataclasses.replace(base, offload={"optimizer": True, "update": "device", "group_size": 1}), tx=tx
    )
    assert models.abs_errors(zj.gather_params(state), ref_params).max() <= 1e-6


def test_fp16_skipped_steps_change_nothing_in_host_memory():
    """fp16 at DeepSpeed's 2^16 overflows the first two steps, then trains: the skipped
    steps keep the offloaded state bit for bit and the rest update it, on either update
    path, as without offload."""
    base = zj.ZeroConfig(stage=2, compute_dtype="float16", loss_scaling={"hysteresis": 1})
    batches = BATCHES * 2
    ref, _, _ = train(base, batches=batches)
    assert 0 < int(ref.skipped) < len(batches)
    for place in ("host", "device"):
        state, _, _ = train(dataclasses.replace(base, offload={"optimizer": True, "update": place}), batches=batches)
        assert int(state.skipped) == int(ref.skipped)
        assert models.abs_errors(zj.gather_params(state), zj.gather_params(ref)).max() == 0.0


def test_update_groups_follow_what_each_leaf_reads():
    cfg = zj.ZeroConfig(stage=2, compute_dtype="bfloat16", offload={"optimizer": True})
    params = models.stacked_params()
    n_leaves = len(jax.tree.leaves(params))
    for tx, size, expected in [
        (optax.adam(1e-2), 1, n_leaves),  # elementwise: a group per leaf
        (optax.adam(1e-2), 10**9, 1),  # everything fits one group
        # the size counts parameter elements (not Adam's moments too)
        (optax.adam(1e-2), sum(x.size for x in jax.tree.leaves(params)), 1),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), 1, 1),
    ]:
        plan = zj.init_state(params, tx, mesh=zj.make_mesh(), config=cfg).plan
        g = update_groups(plan, tx, size)
        assert len(g.groups) == expected
        outs = sorted(k for _, o in g.groups for k in o)
        n_opt = len(plan.opt_storage_layouts)
        assert outs == list(range(n_leaves + n_opt))  # every output made once
        ins = sorted(i for i_, _ in g.groups for i in i_)
        assert sorted(ins + list(g.shared)) == list(range(2 * n_leaves + n_opt))  # every input sent once


def test_streamed_groups_are_ordered_in_the_program():
    """Group g's state reaches the device after group g−2's update: one optimization
    barrier per group from the third on, in the lowered program."""

    def barriers(size):
        cfg = zj.ZeroConfig(
            stage=2, compute_dtype="bfloat16", offload={"optimizer": True, "update": "device", "group_size": size}
        )
        state = zj.init_state(models.stacked_params(), TX, mesh=zj.make_mesh(), config=cfg)
        step = zj.make_train_step(models.stacked_loss, TX, mesh=zj.make_mesh(), config=cfg)
        groups = len(update_groups(state.plan, TX, size).groups)
        return step.lower(state, BATCHES[0]).as_text().count("optimization_barrier"), groups

    one, g1 = barriers(10**9)
    many, g = barriers(1)
    assert g1 == 1 and g > 3
    assert many - one == g - 2


def test_auto_update_place():
    """The CPU backend compiles the update in host memory, so "auto" picks the host;
    without offloaded state the update is on the device."""
    for cfg, place in [
        (zj.ZeroConfig(stage=2, offload={"optimizer": True}), "host"),
        (zj.ZeroConfig(stage=3, offload={"optimizer": True, "update": "device"}), "device"),
        (zj.ZeroConfig(stage=3), "device"),
        (zj.ZeroConfig(stage=3, offload={"params": True}), "device"),
    ]:  # the moments are on the device
        state = zj.init_state(models.stacked_params(), TX, mesh=zj.make_mesh(), config=cfg)
        step = zj.make_train_step(models.stacked_loss, TX, mesh=zj.make_mesh(), config=cfg)
        assert step.update_place(state) == place


@pytest.mark.parametrize("stage,dtype,offload_params", CASES)
def test_state_bytes_split_device_and_host_as_the_formulas(stage, dtype, offload_params):
    params = models.deep_params(4, 64, stacked=True)  # 16.6K params: padding < 3%
    psi = sum(x.size for x in jax.tree.leaves(params))
    cfg = zj.ZeroConfig(stage=stage, compute_dtype=dtype, offload={"optimizer": True, "params": offload_params})
    state = zj.init_state(params, TX, mesh=zj.make_mesh(), config=cfg)
    got = zj.report.state_bytes_per_device(state)
    assert got["device"] + got["host"] == got["total"]
    plain = zj.report.state_bytes_per_device(
        zj.init_state(params, TX, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=stage, compute_dtype=dtype))
    )
    assert got["total"] == plain["total"]  # offload moves bytes, it adds none
    for memory in ("device", "host"):
        want = zj.report.zero_formula_bytes(
            psi, 8, stage, compute_dtype=dtype, offload_optimizer=True, offload_params=offload_params, memory=memory
        )
        assert want <= got[memory] <= 1.03 * want + 64, (memory, got, want)  # + scalars (step counts)
    # ... and what the compiled step is told: the offloaded state, taken out of the device total.
    mem = zj.report.step_memory(
        models.deep_loss, params, TX, jax.ShapeDtypeStruct((16, 64), "float32"), mesh=zj.make_mesh(), config=cfg
    )
    assert mem.state == got["total"] and mem.state_host == got["host"]
    assert mem.device_total == mem.total - got["host"]  # the CPU backend reports host arguments together
    assert "offloaded state" in str(mem)


@pytest.mark.parametrize("stage,dtype,offload_params", [CASES[0], CASES[2], CASES[4]])
def test_checkpoint_round_trip_of_offloaded_state(tmp_path, stage, dtype, offload_params):
    cfg = zj.ZeroConfig(stage=stage, compute_dtype=dtype, offload={"optimizer": True, "params": offload_params})
    state, step, _ = train(cfg, batches=BATCHES[:2])
    zj.save_checkpoint(tmp_path, state, step=2, wait=True)
    mesh = zj.make_mesh()
    restored = zj.restore_checkpoint(tmp_path, models.stacked_params(), TX, mesh=mesh, config=cfg)
    assert kinds(restored.opt_state) == kinds(state.opt_state) == {HOST}
    assert kinds(restored.master) == kinds(state.master)
    for a, b in zip(
        jax.tree.leaves((state.opt_state, zj.gather_params(state))),
        jax.tree.leaves((restored.opt_state, zj.gather_params(restored))),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Into the same run without offload, and on: the same values, on the device.
    plain = zj.ZeroConfig(stage=stage, compute_dtype=dtype)
    on_device = zj.restore_checkpoint(tmp_path, models.stacked_params(), TX, mesh=mesh, config=plain)
    assert kinds(on_device.opt_state) == {"device"}
    a, _ = step(restored, BATCHES[2])
    # The run without offload's step (stage 3's is compiled for test_offload_trains_exactly_as_without).
    b, _ = models.shared_step(models.stacked_loss, TX, mesh=mesh, config=plain)(on_device, BATCHES[2])
    assert models.abs_errors(zj.gather_params(a), zj.gather_params(b)).max() == 0.0


def test_eval_step_reads_offloaded_parameters():
    """Stage 3 with offload_params: the eval step moves each shard to the device where it
    is gathered, and gives what it gives without offload."""
    base = zj.ZeroConfig(stage=3, compute_dtype="bfloat16")
    ref, _, _ = train(base, batches=BATCHES[:1])
    cfg = dataclasses.replace(base, offload={"optimizer": True, "params": True})
    state, _, _ = train(cfg, batches=BATCHES[:1])
    mesh = zj.make_mesh()
    got = zj.make_eval_step(models.stacked_loss, mesh=mesh, config=cfg)(state, BATCHES[1])
    want = zj.make_eval_step(models.stacked_loss, mesh=mesh, config=base)(ref, BATCHES[1])
    assert float(got) == float(want)
    text = zj.make_eval_step(models.stacked_loss, mesh=mesh, config=cfg).lower(state, BATCHES[1]).as_text()
    assert text.count("stablehlo.all_gather") >= len(jax.tree.leaves(models.stacked_params())) - 1  # per use


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(stage=0, offload={"optimizer": True}), r"offload.optimizer needs a sharded optimizer state"),
        (dict(stage=2, offload={"params": True}), r"offload.params keeps stage 3"),
        (dict(stage=2, offload={"optimizer": True, "update": "cpu"}), "Offload.update must be"),
        (dict(stage=3, offload={"params": True}, prefetch=1), "prefetch=1 with offload.params=True"),
        (dict(stage=2, offload={"optimizer": True, "group_size": 0}), "Offload.group_size must be a positive int"),
        (dict(stage=2, offload={"optimizer": 1}), "Offload.optimizer must be a bool"),
    ],
)
def test_offload_config_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        zj.ZeroConfig(**kwargs)


def test_a_forced_host_update_that_cannot_run_there_is_refused_by_name():
    """A clip inside tx makes its norm in device memory: update="host" says so and names the
    fix (JAX's own message speaks of an `add` and memory spaces)."""
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    with pytest.raises(ValueError, match=r"offload.update='host', but .* Use offload update='device' or 'auto'"):
        train(zj.ZeroConfig(stage=2, offload={"optimizer": True, "update": "host"}), tx=tx, batches=BATCHES[:1])


def test_auto_update_place_falls_back_only_when_the_backend_refuses(monkeypatch):
    """offload_update="auto" probes the host update: a refusal to run it in host memory (a
    JaxRuntimeError from the backend's compiler, or JAX's memory-space error while tracing)
    means "device"; any other error in the code being traced (a bug on the host path) is
    raised, not turned into "device". A jax without the compute_on context manager (0.11+)
    has no host update: "auto" says "device" without probing, "host" is refused."""
    import jax.numpy as jnp

    from zerojax.optim import offload

    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=2, offload={"optimizer": True})
    params = {"w": jnp.ones((8, 4))}
    state = zj.init_state(params, TX, mesh=mesh, config=cfg)
    place = lambda: offload.choose_place(state.plan, TX, jax.tree.leaves(state.opt_state))

    def buggy(*a, **k):
        raise TypeError("unsupported operand type(s) for +: 'MaskedNode' and 'float'")

    assert place() == "host"  # the CPU backend compiles it (jax 0.10's compute_on and 0.11+'s alike)

    def refused(self, *a, **k):
        raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: host compute is not supported on this backend")

    with monkeypatch.context() as m:
        m.setattr(jax.stages.Lowered, "compile", refused)
        assert place() == "device"
    # JAX refusing, while tracing, an operation that mixes host and device memory (optax's
    # clip_by_global_norm makes its norm in device memory) is such a refusal too.
    clip = optax.chain(optax.clip_by_global_norm(1.0), TX)
    clipped = zj.init_state(params, clip, mesh=mesh, config=cfg)
    assert offload.choose_place(clipped.plan, clip, jax.tree.leaves(clipped.opt_state)) == "device"

    monkeypatch.setattr(offload, "apply_on_host", buggy)
    with pytest.raises(TypeError, match="unsupported operand"):
        place()
