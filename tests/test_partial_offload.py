"""A partial offload (``Offload(ratio=r)``, DeepSpeed's Twin-Flow): the update's independent
groups of leaves, from the last parameter back, live in host memory until at least ``r`` of
the parameter elements do; the rest stay and update on the device.

The split is checked against the parameters' own sizes (an Adam leaf is its own group, a clip
inside ``tx`` couples all of them), the placement and bytes against ``addressable_shards``,
and training against the same run without offload, on randomized cases.
"""

import dataclasses
import warnings

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from tests.test_offload import BATCHES, train, without_offload
from zerojax.optim.offload import update_groups
from zerojax.report.estimate import tier_bytes

HOST = "pinned_host"


def expected_host_leaves(params, ratio: float) -> list[bool]:
    """Per parameter leaf (flattened order): in host memory with an elementwise optimizer,
    whose groups are single leaves: the last leaves until at least ``ratio`` of the elements."""
    sizes = [x.size for x in jax.tree.leaves(params)]
    host, taken = [False] * len(sizes), 0
    for i in reversed(range(len(sizes))):
        if taken >= ratio * sum(sizes):
            break
        host[i], taken = True, taken + sizes[i]
    return host


def moments_on_host(state) -> list[list[bool]]:
    """For each Adam moment tree (mu, nu), per parameter leaf: whether it is in host memory."""
    adam = state.opt_state[0]
    return [[x.sharding.memory_kind == HOST for x in jax.tree.leaves(t)] for t in (adam.mu, adam.nu)]


@pytest.mark.parametrize("seed", range(6))
def test_the_split_takes_the_last_groups_until_the_ratio(seed):
    """From abstract states (nothing compiles): random models, ratios, stages and group sizes."""
    rng = np.random.default_rng(seed)
    layers, d = int(rng.integers(2, 7)), int(rng.choice([8, 16, 24]))
    params = models.deep_params(layers, d, stacked=False, seed=seed)  # 2 x layers leaves of two sizes
    ratio = float(rng.uniform(0.02, 0.98))
    stage, dtype = [(1, "bfloat16"), (2, "bfloat16"), (2, "float32"), (3, "float32")][seed % 4]
    cfg = zj.ZeroConfig(stage=stage, compute_dtype=dtype, offload={"optimizer": True, "ratio": ratio})
    tx = optax.adamw(1e-2)
    state = zj.abstract_state(params, tx, mesh=zj.make_mesh(), config=cfg)
    want = expected_host_leaves(params, ratio)
    assert moments_on_host(state) == [want, want]
    sizes = [x.size for x in jax.tree.leaves(params)]
    share = sum(s for s, h in zip(sizes, want) if h) / sum(sizes)
    assert state.plan.offload_split.share == pytest.approx(share) and share >= ratio
    counts = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 0]
    assert {x.sharding.memory_kind for x in counts} == {"device"}  # every group reads them
    if stage in (1, 2) and dtype != "float32":  # separate masters go with their state
        assert [x.sharding.memory_kind == HOST for x in jax.tree.leaves(state.master)] == want
    elif state.master is not None:
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.master)} == {"device"}
    # Bytes, from the shardings: the host holds the offloaded leaves' moments (and masters).
    got = zj.report.state_bytes_per_device(state)
    full = zj.report.state_bytes_per_device(
        zj.abstract_state(params, tx, mesh=zj.make_mesh(), config=dataclasses.replace(cfg, offload={"optimizer": True}))
    )
    assert got["total"] == full["total"] and got["device"] + got["host"] == got["total"]
    scalars = sum(x.dtype.itemsize for x in counts)
    assert got["host"] == pytest.approx(share * (full["host"] - scalars), rel=0.05, abs=64)
    # ... and what `zerojax estimate --offload optimizer --ratio` prints for that share.
    tiers = tier_bytes(sum(sizes), 8, stage, offload="optimizer", compute_dtype=dtype, ratio=share)
    for memory in ("device", "host"):
        assert tiers[memory] <= got[memory] <= 1.03 * tiers[memory] + 64, (memory, got, tiers)  # + scalars
    # The streamed update's groups never hold leaves of both sides.
    plan = state.plan
    n, split = len(plan.master_layouts), plan.offload_split
    side = list(split.masters) + list(split.opt)
    for ins, outs in update_groups(plan, tx, int(rng.choice([1, 300, 10**9]))).groups:
        units = {i if i < n + len(split.opt) else i - n - len(split.opt) for i in ins} | set(outs)
        assert len({side[u] for u in units}) <= 1


def test_leaves_that_read_one_another_move_together():
    """A clip inside ``tx`` couples every leaf into one group: all of it is offloaded, and the
    warning names the shares this model allows."""
    params = models.deep_params(3, 16, stacked=False)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    cfg = zj.ZeroConfig(stage=2, offload={"optimizer": True, "ratio": 0.3})
    with pytest.warns(UserWarning, match=r"ratio=0.3 keeps 1 of the optimizer state .* no smaller share exists"):
        state = zj.abstract_state(params, tx, mesh=zj.make_mesh(), config=cfg)
    assert state.plan.offload_split.share == 1.0
    assert moments_on_host(type("S", (), {"opt_state": state.opt_state[1]})) == [[True] * 6] * 2
    # Elementwise Adam: single leaves; a ratio that one of them meets exactly gives no warning.
    sizes = [x.size for x in jax.tree.leaves(params)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact = zj.abstract_state(
            params,
            optax.adam(1e-2),
            mesh=zj.make_mesh(),
            config=dataclasses.replace(cfg, offload={"optimizer": True, "ratio": sizes[-1] / sum(sizes)}),
        )
    assert exact.plan.offload_split.share == sizes[-1] / sum(sizes)


# (stage, compute dtype, update place, optimizer, ratio, group size): drawn once, seeded.
TXS = {
    "adamw": optax.adamw(1e-2),
    "lamb": optax.inject_hyperparams(optax.lamb)(learning_rate=1e-2),  # whole-leaf reads, shared scalars
    "clip_adam": optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),  # one group
}
_rng = np.random.default_rng(63)
TRAINS = [(2, "bfloat16", "host", "adamw", 0.4, 10**9), (3, "float32", "device", "lamb", 0.6, 1)] + [
    (
        int(_rng.integers(1, 4)),
        str(_rng.choice(["float32", "bfloat16"])),
        place,
        # a clip inside tx and LAMB's trust ratio make device arrays: no update in host memory
        # (test_offload's forced-host refusal)
        "adamw" if place == "host" else str(_rng.choice(list(TXS))),
        round(float(_rng.uniform(0.05, 0.95)), 2),
        int(_rng.choice([1, 500, 10**9])),
    )
    for place in ("host", "device", "host", "device")
]


@pytest.mark.parametrize("stage,dtype,place,tx,ratio,group_size", models.marked_slow(TRAINS, slow=TRAINS[2:]))
def test_partial_offload_trains_as_without(stage, dtype, place, tx, ratio, group_size):
    """Within 1e-6 of the run without offload over three steps (the device part and the
    streamed groups are computations of their own, fused differently: docs/offload.md), each
    leaf where the split puts it after the steps."""
    base = zj.ZeroConfig(stage=stage, compute_dtype=dtype)
    ref_params, ref_losses, ref_opt = without_offload(base, TXS[tx])
    offload = {"optimizer": True, "update": place, "ratio": ratio, "group_size": group_size}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a coupled tx offloads all of it, said in a warning
        state, step, losses = train(dataclasses.replace(base, offload=offload), tx=TXS[tx])
    assert step.update_place(state) == place
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
    assert models.abs_errors(zj.gather_params(state), ref_params).max() <= 1e-6
    split = state.plan.offload_split
    for j, (a, b) in enumerate(zip(jax.tree.leaves(state.opt_state), ref_opt)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-6)
        assert (a.sharding.memory_kind == HOST) == split.opt[j]
    assert split.share >= ratio


def test_fp16_skipped_steps_keep_both_parts():
    """fp16 at 2^16 overflows the first steps: the skipped steps keep the host part and the
    device part bit for bit, and the rest train as without offload."""
    base = zj.ZeroConfig(stage=2, compute_dtype="float16", loss_scaling={"hysteresis": 1})
    batches = BATCHES * 2
    ref, _, _ = train(base, batches=batches)
    state, _, _ = train(
        dataclasses.replace(base, offload={"optimizer": True, "update": "host", "ratio": 0.75}), batches=batches
    )
    assert 0 < int(state.skipped) == int(ref.skipped) < len(batches)
    assert models.abs_errors(zj.gather_params(state), zj.gather_params(ref)).max() == 0.0


def test_a_partial_state_checkpoints_as_any_other(tmp_path):
    """Saved from a partial offload, restored into the same split and into no offload: the same
    arrays, each in the memory its config gives."""
    params = models.deep_params(3, 16, stacked=False)
    cfg = zj.ZeroConfig(stage=2, compute_dtype="bfloat16", offload={"optimizer": True, "ratio": 0.6})
    tx = optax.adam(1e-2)
    state = zj.init_state(params, tx, mesh=zj.make_mesh(), config=cfg)
    zj.save_checkpoint(tmp_path, state, step=0, wait=True)
    for config in (cfg, zj.ZeroConfig(stage=2, compute_dtype="bfloat16")):
        back = zj.restore_checkpoint(tmp_path, params, tx, mesh=zj.make_mesh(), config=config)
        for a, b in zip(
            jax.tree.leaves((state.opt_state, state.master)), jax.tree.leaves((back.opt_state, back.master))
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        kinds = [x.sharding.memory_kind for x in jax.tree.leaves(back.opt_state)]
        want = (
            [x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)]
            if config is cfg
            else ["device"] * len(kinds)
        )
        assert kinds == want


@pytest.mark.parametrize(
    "offload,match",
    [
        ({"optimizer": True, "ratio": 0}, r"Offload.ratio must be a number in \(0, 1\]"),
        ({"optimizer": True, "ratio": 1.5}, r"Offload.ratio must be a number in \(0, 1\]"),
        ({"optimizer": True, "ratio": True}, r"Offload.ratio must be a number"),
        ({"params": True, "ratio": 0.5}, r"Offload.ratio=0.5 .* Offload.optimizer is False"),
    ],
)
def test_ratio_errors(offload, match):
    with pytest.raises(ValueError, match=match):
        zj.ZeroConfig(stage=3, offload=offload)


def test_a_partial_offload_composes_with_the_pipeline():
    """Stage 3 on two pipeline stages of four data devices, two micro-batches, half the state in
    host memory updated there: the same weights as without offload."""
    from tests.test_pipeline import pipeline_run, toy_batches, toy_loss, toy_params

    params, batches, tx = toy_params(), toy_batches(2), optax.adamw(1e-2)
    ref, _ = pipeline_run(toy_loss, params, tx, batches, pipeline=2, data=4, micro=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the share taken is above 0.5
        got, _ = pipeline_run(
            toy_loss, params, tx, batches, pipeline=2, data=4, micro=2, offload={"optimizer": True, "ratio": 0.5}
        )
    assert models.abs_errors(zj.gather_params(got), zj.gather_params(ref)).max() <= 1e-6
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got.opt_state)} == {"device", HOST}
