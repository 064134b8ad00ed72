"""zj.data.Prefetch: global batches placed on the mesh ahead of the step, on a thread, with a
data position that counts only the batches handed out."""

import functools
import gc
import importlib.util
import pathlib
import sys
import threading
import time
import traceback

import grain
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from tests import models
from zerojax.resume import IndexSampler, Run, RunConfig
from zerojax.sharding.mesh import auto_axes
from zerojax.step import place_batch

ROOT = pathlib.Path(__file__).resolve().parents[1]
N_RECORDS, GB = 64, 16
TX = optax.adam(1e-2)
CFG = zj.ZeroConfig(stage=3)


@functools.cache
def records():
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(N_RECORDS, models.IN)).astype(np.float32),
        rng.normal(size=(N_RECORDS, models.OUT)).astype(np.float32),
    )


def load(idx):
    """The host batch of record indices ``idx``; ``idx`` rides along to name the samples."""
    x, y = records()
    return {"x": x[idx], "y": y[idx], "idx": np.asarray(idx, np.int32)}


def loss(p, b):
    return models.mlp_loss(p, b)


def threads():
    return [t for t in threading.enumerate() if t.name == "zerojax-prefetch"]


# -- placement --------------------------------------------------------------------------------

# (mesh, config, the sharding each leaf of {"x": [16, 8, 3], "w": [16]} must get, by hand)
MESHES = {
    "data": (lambda: zj.make_mesh(), zj.ZeroConfig(), {"x": P("data"), "w": P("data")}),
    "hybrid": (
        lambda: zj.make_mesh(replicas=2),
        zj.ZeroConfig(),
        {"x": P(("replica", "data")), "w": P(("replica", "data"))},
    ),
    "tensor": (lambda: zj.make_mesh(tensor=2), zj.ZeroConfig(), {"x": P("data"), "w": P("data")}),
    "context": (lambda: zj.make_mesh(context=2), zj.ZeroConfig(), {"x": P("data", "context"), "w": P("data")}),
}


@pytest.mark.parametrize("name", sorted(MESHES))
@pytest.mark.parametrize("rows", ["global", "process"])
def test_placed_batches_equal_device_put_shard_by_shard(name, rows):
    make, cfg, specs = MESHES[name]
    mesh = make()
    rng = np.random.default_rng(1)
    host = [
        {"x": rng.normal(size=(16, 8, 3)).astype(np.float32), "w": np.arange(16, dtype=np.int32) + k} for k in (0, 1)
    ]
    with zj.data.Prefetch(iter(host), mesh, config=cfg, rows=rows) as batches:
        placed = list(batches)
    assert len(placed) == 2
    for got, want in zip(placed, host):
        for key, spec in specs.items():
            ref = jax.device_put(want[key], NamedSharding(auto_axes(mesh), spec))
            assert got[key].sharding.is_equivalent_to(ref.sharding, want[key].ndim), (key, got[key].sharding)
            shards = {s.device: s for s in got[key].addressable_shards}
            assert len(shards) == 8
            for r in ref.addressable_shards:
                s = shards[r.device]
                assert s.index == r.index, (key, r.device)
                np.testing.assert_array_equal(np.asarray(s.data), np.asarray(r.data))


# -- training ---------------------------------------------------------------------------------


@functools.cache
def trained_plain(steps):
    """Stage 3 on the plain host batches of IndexSampler(seed=0): params after each step."""
    mesh = zj.make_mesh()
    step = models.shared_step(loss, TX, mesh=mesh, config=CFG)
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=CFG)
    sampler, out = IndexSampler(N_RECORDS, GB, seed=0), []
    for _ in range(steps):
        state, _ = step(state, load(next(sampler)))
        out.append(jax.tree.map(np.asarray, zj.gather_params(state)))
    return out


def test_training_through_prefetch_equals_plain_batches_and_moves_nothing():
    mesh = zj.make_mesh()
    step = models.shared_step(loss, TX, mesh=mesh, config=CFG)
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=CFG)
    with zj.data.Prefetch(IndexSampler(N_RECORDS, GB, seed=0), mesh, config=CFG, load=load) as batches:
        for k, batch in zip(range(4), batches):
            if k == 0:  # the step's own placement leaves it as it is, and its program takes it as placed
                moved = place_batch(batch, step.mesh, ("data",))
                assert all(a is b for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(batch)))
                wanted = step.lower(state, batch).compile().input_shardings[0][1]
                for have, want in zip(jax.tree.leaves(batch), jax.tree.leaves(wanted)):
                    assert have.sharding.is_equivalent_to(want, have.ndim), (have.sharding, want)
            state, _ = step(state, batch)
            got = jax.tree.map(np.asarray, zj.gather_params(state))
            jax.tree.map(np.testing.assert_array_equal, got, trained_plain(4)[k])
    assert not threads()


def test_the_thread_keeps_depth_batches_ahead_and_stops():
    taken = []

    def source():
        for k in range(100):
            taken.append(k)
            yield {"x": np.full((8, 2), k, np.float32)}

    for depth in (1, 3):
        taken.clear()
        batches = zj.data.Prefetch(source(), zj.make_mesh(), depth=depth)
        assert taken == []  # nothing is loaded before the first next()
        assert float(next(batches)["x"][0, 0]) == 0
        deadline = time.monotonic() + 10
        while len(taken) < 1 + depth and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert len(taken) == 1 + depth  # the batch handed out and `depth` ahead, no more
        assert [float(next(batches)["x"][0, 0]) for _ in range(3)] == [1, 2, 3]
        assert len(threads()) == 1
        del batches
        gc.collect()
        assert not threads()  # collected: the thread stops


def test_errors_on_the_thread_surface_with_their_traceback():
    def broken_loader():
        yield {"x": np.zeros((8, 2), np.float32)}
        raise KeyError("record 17 is missing")

    batches = zj.data.Prefetch(broken_loader(), zj.make_mesh())
    next(batches)
    for _ in range(2):  # and again on the next call: the stream does not go on past an error
        with pytest.raises(KeyError, match="record 17") as e:
            next(batches)
        assert "broken_loader" in "".join(traceback.format_tb(e.value.__traceback__))
    batches.close()


def test_refusals(tmp_path):
    mesh = zj.make_mesh()
    step = models.shared_step(loss, TX, mesh=mesh, config=CFG)
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=CFG)
    bad = load(np.arange(12))  # 12 rows do not divide over 8 devices
    with pytest.raises(ValueError) as by_step:
        step(state, bad)
    with zj.data.Prefetch(iter([bad]), mesh, config=CFG) as batches, pytest.raises(ValueError) as by_prefetch:
        next(batches)
    assert str(by_prefetch.value) == str(by_step.value) and "multiple of 8" in str(by_step.value)
    accum = zj.ZeroConfig(stage=3, grad_accum_steps=4)  # 2 rows per device do not make 4 micro-batches
    with zj.data.Prefetch(iter([load(np.arange(16))]), mesh, config=accum) as batches:
        with pytest.raises(ValueError, match="grad_accum_steps=4"):
            next(batches)
    with zj.data.Prefetch(iter([load(np.arange(6))]), mesh, rows="process") as batches:
        with pytest.raises(ValueError, match="process_rows"):
            next(batches)
    plain = zj.data.Prefetch(iter([load(np.arange(16))]), mesh)
    with pytest.raises(TypeError, match="no get_state"):
        plain.get_state()
    with pytest.raises(TypeError, match="data must have get_state"):  # Run refuses it before any step
        Run(RunConfig(tmp_path, save_every=1)).restore_or_init(
            models.mlp_params(), TX, mesh=mesh, config=CFG, data=iter([])
        )
    next(plain)
    plain.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(plain)
    for kwargs, match in [
        ({"depth": 0}, "depth must be a positive int"),
        ({"rows": "local"}, "rows must be 'global'"),
        ({"config": {"stage": 3}}, "config must be the train step's zj.ZeroConfig"),
        ({"load": 3}, "load must be callable"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            zj.data.Prefetch(iter([]), mesh, **kwargs)
    with pytest.raises(TypeError, match="iterator"):
        zj.data.Prefetch([load(np.arange(16))], mesh)
    with pytest.raises(ValueError, match="axes"):
        zj.data.Prefetch(iter([]), mesh, config=zj.ZeroConfig(axes={"data": "batch"}))


# -- resume, with batches in the queue --------------------------------------------------------


def grain_map():
    x, y = records()
    ds = grain.MapDataset.range(N_RECORDS).shuffle(seed=5)
    return iter(ds.map(lambda i: {"x": x[i], "y": y[i], "idx": np.int32(i)}).batch(GB, drop_remainder=True))


class Records:
    """A grain data source: record i of records()."""

    def __repr__(self):  # grain checks a restored DataLoader's source by its repr
        return f"Records({N_RECORDS})"

    def __len__(self):
        return N_RECORDS

    def __getitem__(self, i):
        x, y = records()
        return {"x": x[i], "y": y[i], "idx": np.int32(i)}


def grain_loader():
    sampler = grain.samplers.IndexSampler(
        N_RECORDS, shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True), shuffle=True, seed=2
    )
    ops = [grain.transforms.Batch(GB, drop_remainder=True)]
    return iter(grain.DataLoader(data_source=Records(), sampler=sampler, operations=ops, worker_count=0))


SOURCES = {
    "IndexSampler": lambda: (IndexSampler(N_RECORDS, GB, seed=0), load),
    "ElasticBatches": lambda: (zj.data.ElasticBatches(Records(), GB), None),
    "grain.MapDataset": lambda: (grain_map(), None),
    "grain.DataLoader": lambda: (grain_loader(), None),
}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_resumed_run_with_batches_ahead_is_bit_identical(name, tmp_path):
    """3 steps, stopped with 2 batches loaded ahead, resumed to 4 (the sources hold 4
    batches): the params of an uninterrupted plain run, bit for bit, and each sample once."""
    mesh = zj.make_mesh()
    step = models.shared_step(loss, TX, mesh=mesh, config=CFG)
    source, fn = SOURCES[name]()
    state, want = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=CFG), []
    for _, b in zip(range(4), source):  # IndexSampler goes on epoch after epoch; the others hold 4 batches
        b = fn(b) if fn else b
        want.append(b["idx"])
        state, _ = step(state, b)
    assert len(want) == 4 and len(np.unique(np.concatenate(want))) == 4 * GB
    reference = jax.tree.map(np.asarray, zj.gather_params(state))

    seen = []

    def train(until):
        run = Run(RunConfig(tmp_path, save_every=3, synchronous=True))
        data = zj.data.Prefetch(*[SOURCES[name]()[0]], mesh, config=CFG, load=SOURCES[name]()[1])
        state = run.restore_or_init(models.mlp_params(), TX, mesh=mesh, config=CFG, data=data)
        while run.step < until:
            batch = next(data)
            seen.append(np.asarray(batch["idx"]))
            state, _ = step(state, batch)
            run.completed(state)
        if until == 3:  # the thread has loaded past the position the run saves
            time.sleep(0.2)
            assert data.source.get_state() != data.get_state()
        run.finish(state)
        data.close()
        return state

    train(3)
    state = train(4)
    np.testing.assert_array_equal(np.concatenate(seen), np.concatenate(want))
    assert len(np.unique(np.concatenate(seen))) == 4 * GB  # no sample repeated or skipped
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, zj.gather_params(state)), reference)


# -- another process count ----------------------------------------------------------------------


def test_elastic_batches_keep_the_global_rows_on_another_process_count():
    """A position saved on 2 processes (each loading its half) resumes on 1 or 4 with the
    same global batches row for row; grain's ElasticIterator keeps the records but not the
    rows' order, the reason zerojax has its own."""
    ds = grain.MapDataset.range(N_RECORDS).shuffle(seed=7).map(lambda i: {"i": np.int64(i)})

    def global_batches(p, state=None, n=2):
        shards = [zj.data.ElasticBatches(ds, GB, rows=slice(k * GB // p, (k + 1) * GB // p)) for k in range(p)]
        for s in shards:
            if state is not None:
                s.set_state(state)
        out = [np.concatenate([next(s)["i"] for s in shards]) for _ in range(n)]
        return out, shards[-1].get_state()

    one, _ = global_batches(1, n=4)
    two, state = global_batches(2)
    assert [list(b) for b in two] == [list(b) for b in one[:2]]
    for p in (1, 4):
        rest, _ = global_batches(p, state)
        assert [list(b) for b in rest] == [list(b) for b in one[2:]]
    theirs = []
    for k in range(2):
        it = iter(grain.experimental.ElasticIterator(ds, GB, grain.sharding.ShardOptions(k, 2)))
        theirs.append(next(it)["i"])
    theirs = np.concatenate(theirs)
    assert sorted(theirs) == sorted(one[0]) and list(theirs) != list(one[0])


# -- the overlap experiment -------------------------------------------------------------------


def test_the_overlap_experiment_runs_and_prefetch_is_not_slower(capsys):
    spec = importlib.util.spec_from_file_location("input_overlap", ROOT / "experiments" / "input_overlap.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["input_overlap"] = module
    spec.loader.exec_module(module)
    rows = module.main(["--steps", "6", "--seconds", "0.05"])
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("| input |") and "| prefetch |" in table and "| none |" in table
    assert rows["prefetch"] <= rows["none"]
