"""Pretrained weights in and out: maps read any box of a parameter from exactly its bytes,
states are born from a checkpoint in their ZeRO layout, and exports write Hugging Face's
sharded format that ``safetensors`` itself reads back."""

import dataclasses
import functools
import io
import json
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import zerojax as zj
from tests import weights_model
from zerojax import launch
from zerojax.maps import concat, merge_dims, part, split_dim, stack, transpose
from zerojax.tensors import boxes
from zerojax.tensors.safetensors_files import TensorFiles, TensorWriter
from zerojax.tensors.specs import Shapes, as_spec
from zerojax.tensors.weight_map import WeightMap, infer_tensors

ROOT = pathlib.Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(0)


def _random_box(shape, rng):
    return tuple(tuple(sorted(rng.choice(n + 1, 2, replace=False))) for n in shape)


# --- expressions ------------------------------------------------------------------------------

TENSORS = {
    "a": RNG.normal(size=(6, 10)).astype(np.float32),
    "q": RNG.normal(size=(4, 7)).astype(np.float32),
    "k": RNG.normal(size=(2, 7)).astype(np.float32),
    "qkv": RNG.normal(size=(9, 7)).astype(np.float32),
    "h": RNG.normal(size=(2, 3, 5)).astype(np.float32),
    **{f"l.{i}.w": RNG.normal(size=(12, 5)).astype(np.float32) for i in range(3)},
}
T = TENSORS
CASES = {
    "as stored": ("a", T["a"]),
    "transpose": (transpose("a"), T["a"].T),
    "stack of transposes": (stack(transpose("l.{i}.w")), np.stack([T[f"l.{i}.w"].T for i in range(3)])),
    "heads (split_dim)": (split_dim("l.0.w", 0), T["l.0.w"].reshape(3, 4, 5)),
    "heads of a transpose in a stack": (
        stack(split_dim(transpose("l.{i}.w"), 1)),
        np.stack([T[f"l.{i}.w"].T.reshape(5, 3, 4) for i in range(3)]),
    ),
    "merge_dims": (merge_dims("h", 0, 3), T["h"].reshape(6, 5)),
    "concat (fused from separate)": (concat(["q", "k"], 0, sizes=[4, 2]), np.concatenate([T["q"], T["k"]])),
    "part (separate from fused)": (part("qkv", 0, 4), T["qkv"][4:6]),
}


EXACT = {"as stored", "transpose", "stack of transposes", "concat (fused from separate)", "part (separate from fused)"}


@pytest.fixture(scope="module")
def tensor_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "t.safetensors"
    save_file(TENSORS, str(path))
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_a_spec_reads_every_box_as_numpy_does_and_writes_it_back(case, tensor_file, tmp_path):
    spec, ref = CASES[case]
    spec = as_spec(spec)
    with TensorFiles(tensor_file) as f:
        expr = spec.build(ref.shape, {}, Shapes(lambda n: (f.tensors[n].shape, f.tensors[n].dtype)))
        assert expr.shape == ref.shape
        rng = np.random.default_rng(1)
        for _ in range(25):
            box = _random_box(ref.shape, rng)
            before = f.bytes_read
            np.testing.assert_array_equal(expr.read(box, f), ref[boxes.slices(box)])
            if case in EXACT:  # reshapes read a bounding box; the rest exactly the box's bytes
                assert f.bytes_read - before == boxes.box_size(box) * 4
    # Writing the parameter back box by box (a 2 x 2 grid of boxes, as shards) rebuilds
    # each tensor it covers, touching nothing else.
    inferred = infer_tensors(WeightMap({"p": spec}), {"p": ref.shape})
    out = tmp_path / "w.safetensors"
    save_file({n: np.full(s, np.nan, np.float32) for n, s in inferred.items()}, str(out))
    with TensorFiles(out) as g:
        places = dict(g.tensors)
    with TensorWriter(places) as w:
        cuts = [sorted({0, n // 2, n}) for n in ref.shape]
        for corner in np.ndindex(*[len(c) - 1 for c in cuts]):
            box = tuple((c[k], c[k + 1]) for c, k in zip(cuts, corner))
            expr.write(box, ref[boxes.slices(box)], w)
    got = load_file(str(out))
    for n in inferred:
        if n == "qkv":  # the part's rows written, the rows before it untouched
            np.testing.assert_array_equal(got[n][4:6], T[n][4:6])
            assert np.isnan(got[n][:4]).all()
        else:
            np.testing.assert_array_equal(got[n], T[n])


def test_runs_and_flat_boxes_cover_exactly_the_box():
    rng = np.random.default_rng(2)
    for shape in [(5,), (3, 4), (2, 3, 4), (4, 1, 6)]:
        flat = np.arange(int(np.prod(shape))).reshape(shape)
        for _ in range(20):
            box = _random_box(shape, rng)
            starts, length = boxes.runs(shape, box)
            got = np.concatenate([np.arange(s, s + length) for s in starts]) if starts.size else np.zeros(0)
            np.testing.assert_array_equal(got, flat[boxes.slices(box)].reshape(-1))
            a, b = sorted(rng.choice(flat.size + 1, 2, replace=False))
            parts = [flat[boxes.slices(bx)].reshape(-1) for bx in boxes.flat_boxes(shape, a, b)]
            np.testing.assert_array_equal(np.concatenate(parts), np.arange(a, b))
            assert len(parts) <= 2 * len(shape) - 1


# --- a state born from weights ----------------------------------------------------------------

L = 3
SMALL = {
    "emb": RNG.normal(size=(13, 16)).astype(np.float32),
    "head": RNG.normal(size=(13, 16)).astype(np.float32),
    **{f"layers.{i}.w": RNG.normal(size=(24, 16)).astype(np.float32) for i in range(L)},
    **{f"layers.{i}.n": RNG.normal(size=(16,)).astype(np.float32) for i in range(L)},
}
SMALL_MAP = zj.maps.WeightMap(
    {
        "emb": "emb",
        "head.kernel": transpose("head"),
        "blocks.w": stack(split_dim(transpose("layers.{i}.w"), 1)),
        "blocks.n": stack("layers.{i}.n"),
    }
)
SMALL_REF = {
    "emb": SMALL["emb"],
    "head": {"kernel": SMALL["head"].T},
    "blocks": {
        "w": np.stack([SMALL[f"layers.{i}.w"].T.reshape(16, 4, 6) for i in range(L)]),
        "n": np.stack([SMALL[f"layers.{i}.n"] for i in range(L)]),
    },
}
ABSTRACT = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), SMALL_REF)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """SMALL in Hugging Face's sharded format, in bf16 (3 files)."""
    folder = tmp_path_factory.mktemp("small")
    weights_model.write_sharded(str(folder), {k: v.astype(ml_dtypes.bfloat16) for k, v in SMALL.items()}, 1200)
    return folder


def _bf16(tree):
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)), tree)


CONFIGS = {
    "stage 0": (dict(stage=0), {}),
    "stage 1 bf16": (dict(stage=1, compute_dtype="bfloat16"), {}),
    "stage 2": (dict(stage=2), {}),
    "stage 3 fp16": (dict(stage=3, compute_dtype="float16"), {}),
    "stage 3 tensor 2": (dict(stage=3), dict(tensor=2)),
    "stage 3 hybrid": (dict(stage=3), dict(replicas=2)),
    "stage 3 offload": (dict(stage=3, offload={"params": True}), {}),
}
TENSOR_SPECS = {"emb": None, "head": {"kernel": P("tensor", None)}, "blocks": {"w": P(None, None, "tensor"), "n": None}}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_born_from_weights_is_the_state_of_the_same_arrays(name, small_ckpt):
    """Every field (masters, optimizer state, replicated copies), value and sharding, equals
    init_state on the parameters read by numpy; each process read the checkpoint's bytes of
    its shards (one process here: the model once at stage 3, and once at stage 0, where all
    eight devices hold the same copy)."""
    cfg, mesh_kw = CONFIGS[name]
    mesh, zc = zj.make_mesh(**mesh_kw), zj.ZeroConfig(**cfg)
    specs = TENSOR_SPECS if "tensor" in mesh_kw else None
    tx = optax.adamw(1e-2)
    before = TensorFiles.process_bytes_read
    state = zj.init_state(
        ABSTRACT, tx, mesh=mesh, config=zc, weights=zj.Weights(small_ckpt, SMALL_MAP), tensor_specs=specs
    )
    read = TensorFiles.process_bytes_read - before
    expected = zj.init_state(_bf16(SMALL_REF), tx, mesh=mesh, config=zc, tensor_specs=specs)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(expected)):
        assert a.sharding == b.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    if "tensor" not in mesh_kw and "hybrid" not in name:
        assert read == sum(v.size for v in SMALL.values()) * 2  # bf16 bytes, each once


LACKING = zj.maps.WeightMap(dict(SMALL_MAP.entries) | {"new_head.kernel": transpose("lm_head.weight")})


def _with(tree, **extra):
    return {**tree, **extra}


def test_a_parameter_the_checkpoint_lacks_is_an_error_on_every_path(small_ckpt):
    """A map naming a tensor the checkpoint lacks (a new head), or a parameter the map does
    not name, is refused the same way whether the parameters are abstract, an init
    function, concrete, or load_weights' like: one ValueError naming them all, before a
    byte is read. Nothing is left at its initial value unless said (optional=)."""
    head = jax.ShapeDtypeStruct((16, 13), jnp.float32)
    abstract = _with(ABSTRACT, new_head={"kernel": head}, adapter=jax.ShapeDtypeStruct((16, 4), jnp.float32))
    concrete = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    mesh, cfg, tx = zj.make_mesh(), zj.ZeroConfig(stage=3), optax.sgd(0.1)
    want = [
        r"missing from the checkpoint \(1\): lm_head\.weight \(read by new_head\.kernel\)",
        r"parameters the map does not name \(1\): adapter",
    ]
    before = TensorFiles.process_bytes_read
    for params in (abstract, lambda: concrete, concrete):
        with pytest.raises(ValueError) as e:
            zj.init_state(params, tx, mesh=mesh, config=cfg, weights=zj.Weights(small_ckpt, LACKING))
        for w in want:
            assert re.search(w, str(e.value)), str(e.value)
        assert "optional=('*.lora.*', ...)" in str(e.value)
    with pytest.raises(ValueError, match=want[0]):
        zj.load_weights(zj.Weights(small_ckpt, LACKING), like=abstract)
    with pytest.raises(ValueError, match=want[0]):
        zj.load_weights(zj.Weights(small_ckpt, LACKING), like=jax.tree.map(np.asarray, concrete))
    assert TensorFiles.process_bytes_read == before  # refused before reading
    # optional= with abstract parameters: there is nothing to take the absent ones from.
    with pytest.raises(ValueError, match=r"optional=\('new_head\.\*',\).*abstract.*nothing to take them from"):
        zj.init_state(
            abstract, tx, mesh=mesh, config=cfg, weights=zj.Weights(small_ckpt, LACKING, optional=("new_head.*",))
        )


def test_optional_parameters_come_from_the_init_function_or_the_values_given(small_ckpt):
    """Fine-tuning with new parameters (LoRA adapters, a new head), named optional: the
    map's parameters come from the checkpoint, the optional ones the checkpoint lacks from
    the init function or the values given, frozen or not."""

    def init_fn():
        k = jax.random.key(7)
        return {
            **jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), ABSTRACT),
            "adapter": jax.random.normal(k, (16, 4)),
            "new_head": {"kernel": jnp.full((16, 13), 0.5)},
        }

    src = zj.Weights(small_ckpt, LACKING, optional=("adapter", "new_head.*"))
    base = lambda p: jax.tree.map(lambda _: True, p) | {"adapter": True, "emb": False}
    for params in (init_fn, init_fn()):
        state = zj.init_state(
            params, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3), weights=src, trainable=base
        )
        got = zj.gather_params(state)
        np.testing.assert_array_equal(np.asarray(got["adapter"]), np.asarray(init_fn()["adapter"]))
        np.testing.assert_array_equal(np.asarray(got["new_head"]["kernel"]), np.full((16, 13), 0.5, np.float32))
        for k in ("emb", "head", "blocks"):
            jax.tree.map(
                lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got[k], _bf16(SMALL_REF)[k]
            )
    # load_weights: an absent optional leaf is like's own value; abstract, it is refused.
    like = jax.tree.map(np.asarray, init_fn())
    out = zj.load_weights(src, like)
    assert out["adapter"] is like["adapter"] and out["new_head"]["kernel"] is like["new_head"]["kernel"]
    np.testing.assert_array_equal(out["emb"], np.asarray(_bf16(SMALL_REF)["emb"]))
    with pytest.raises(ValueError, match=r"lacks the optional parameters adapter, new_head\.kernel.*ShapeDtypeStruct"):
        zj.load_weights(
            src,
            _with(
                like,
                adapter=jax.ShapeDtypeStruct((16, 4), jnp.float32),
                new_head={"kernel": jax.ShapeDtypeStruct((16, 13), jnp.float32)},
            ),
        )
    # An optional parameter that the checkpoint holds in part is neither loaded nor initialised.
    partial = zj.maps.WeightMap(
        dict(SMALL_MAP.entries)
        | {"blocks.n": stack("layers.{i}.n"), "blocks.w": stack(split_dim(transpose("layers.{i}.w"), 1))}
    )
    four = _with(init_fn(), blocks={"n": jnp.zeros((4, 16)), "w": jnp.zeros((4, 16, 4, 6))})
    with pytest.raises(
        ValueError,
        match=r"optional parameters partly in the checkpoint.*\(2\): blocks\.n \(has "
        r"layers\.0\.n, layers\.1\.n, layers\.2\.n; lacks layers\.3\.n\)",
    ):
        zj.init_state(
            four,
            optax.sgd(0.1),
            mesh=zj.make_mesh(),
            config=zj.ZeroConfig(stage=3),
            weights=zj.Weights(small_ckpt, partial, optional=("blocks.*", "adapter", "new_head.*")),
        )


def test_load_weights_places_each_leaf_with_its_sharding(small_ckpt):
    sh = jax.sharding.NamedSharding(zj.make_mesh(), P("data", None))
    like = {**ABSTRACT, "head": {"kernel": jax.ShapeDtypeStruct((16, 13), jnp.bfloat16, sharding=sh)}}
    before = TensorFiles.process_bytes_read
    out = zj.load_weights(zj.Weights(small_ckpt, SMALL_MAP), like)
    assert out["head"]["kernel"].sharding == sh and out["head"]["kernel"].dtype == jnp.bfloat16
    assert TensorFiles.process_bytes_read - before == sum(v.size for v in SMALL.values()) * 2
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b)), out, _bf16(SMALL_REF)
    )


def test_every_problem_in_one_message_before_any_array(small_ckpt, tmp_path):
    wrong = zj.maps.WeightMap(
        {
            "emb": "emb",
            "head.kernel": "head",
            "blocks.w": stack(transpose("layers.{i}.w")),
            "blocks.n": stack("layers.{i}.norm"),
        },
        ignore=("layers.*.w",),
    )
    with pytest.raises(ValueError) as e:
        zj.init_state(
            {**ABSTRACT, "extra": jax.ShapeDtypeStruct((2,), jnp.float32)},
            optax.sgd(0.1),
            mesh=zj.make_mesh(),
            config=zj.ZeroConfig(stage=3),
            weights=zj.Weights(small_ckpt, wrong),
        )
    msg = str(e.value)
    assert "parameters the map does not name (1): extra" in msg
    assert "missing from the checkpoint (3): layers.0.norm, layers.1.norm, layers.2.norm" in msg
    assert "read by no parameter (3): layers.0.n, layers.1.n, layers.2.n" in msg
    assert "head.kernel [16, 13] in the model, [13, 16] from head [13, 16]" in msg
    assert "blocks.w [3, 16, 4, 6] in the model, [3, 16, 24] from stack(transpose(layers.0.w [24, 16])" in msg
    # An index naming a file that is not there; a tensor the index puts in a file without it.
    index = json.loads((small_ckpt / "model.safetensors.index.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in set(index["weight_map"].values()):
        (bad / f).write_bytes((small_ckpt / f).read_bytes())
    index["weight_map"]["emb"] = "model-00009-of-00009.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="names 1 file.* not in .*model-00009-of-00009"):
        zj.Weights(bad, SMALL_MAP).open()
    files = sorted(set(index["weight_map"].values()) - {"model-00009-of-00009.safetensors"})
    index["weight_map"]["emb"] = next(f for f in files if "emb" not in load_file(str(small_ckpt / f)))
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lists 1 tensor"):
        zj.Weights(bad, SMALL_MAP).open()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        zj.Weights(tmp_path / "nowhere", SMALL_MAP)
    # Without an init function, every parameter must come from the checkpoint.
    with pytest.raises(ValueError, match="parameters the map does not name"):
        zj.init_state(
            {**ABSTRACT, "new": jax.ShapeDtypeStruct((2,), jnp.float32)},
            optax.sgd(0.1),
            mesh=zj.make_mesh(),
            config=zj.ZeroConfig(stage=3),
            weights=zj.Weights(small_ckpt, SMALL_MAP),
        )
    with pytest.raises(TypeError, match="abstract"):
        zj.init_state(ABSTRACT, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))


def test_a_cast_that_would_overflow_is_refused(tmp_path):
    save_file(
        {"w": np.array([1.0, 7e4, 2.0, 3.0], np.float32), "b": np.ones(3, np.float32)}, str(tmp_path / "w.safetensors")
    )
    like = {"w": jax.ShapeDtypeStruct((4,), jnp.float16), "b": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="beyond float16's range"):
        zj.load_weights(tmp_path / "w.safetensors", like)
    with pytest.raises(TypeError, match="truncated"):
        zj.load_weights(tmp_path / "w.safetensors", {"w": np.zeros(4, np.int32), "b": np.zeros(3)})
    # A frozen fp16 copy of an fp32 checkpoint (fp16 run, frozen_dtype="compute"): refused
    # before any array is placed, at every stage that stores it.
    cfg = zj.ZeroConfig(stage=3, compute_dtype="float16")
    with pytest.raises(ValueError, match="beyond float16's range"):
        zj.init_state(
            {"w": jax.ShapeDtypeStruct((4,), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.float32)},
            optax.sgd(0.1),
            mesh=zj.make_mesh(),
            config=cfg,
            weights=tmp_path / "w.safetensors",
            trainable={"w": False, "b": True},
        )


def test_lossy_integer_casts_are_refused(tmp_path):
    """Integer tensors keep their values or are refused, before any array: narrowing,
    signed to unsigned, to bool, and into a float that would round them."""
    path = tmp_path / "ints.safetensors"
    save_file(
        {
            "i64": np.array([1, -2, 3], np.int64),
            "i32": np.array([1, -2, 3], np.int32),
            "i8": np.array([1, -2, 3], np.int8),
            "u8": np.array([1, 2, 255], np.uint8),
        },
        str(path),
    )
    ok = {
        "i64": np.zeros(3, np.int64),
        "i32": np.zeros(3, np.int32),
        "i8": np.zeros(3, np.int32),
        "u8": np.zeros(3, np.int16),
    }
    got = zj.load_weights(path, ok)  # widening: exact
    assert got["i8"].tolist() == [1, -2, 3] and got["u8"].tolist() == [1, 2, 255] and got["u8"].dtype == np.int16
    refused = {
        "i64": (
            np.int32,
            r"parameter 'i64' is int32 but its checkpoint tensor is int64: values beyond int32's range "
            r"would wrap around; make the parameter int64",
        ),
        "i32": (np.uint32, r"parameter 'i32' is uint32 but its checkpoint tensor is int32: negative values would wrap"),
        "i8": (
            np.bool_,
            r"parameter 'i8' is bool but its checkpoint tensor is int8: every nonzero value would become "
            r"True",
        ),
        "u8": (np.int8, r"parameter 'u8' is int8 but its checkpoint tensor is uint8: values beyond int8's range"),
    }
    for name, (dtype, message) in refused.items():
        for leaf in (np.zeros(3, dtype), jax.ShapeDtypeStruct((3,), dtype)):
            with pytest.raises(TypeError, match=message):
                zj.load_weights(path, {**ok, name: leaf})
    with pytest.raises(
        TypeError,
        match=r"'i32' is float32 but its checkpoint tensor is int32: integers above 2\*\*24 "
        r"would be rounded",
    ):
        zj.load_weights(path, {**ok, "i32": np.zeros(3, np.float32)})
    assert zj.load_weights(path, {**ok, "i8": np.zeros(3, np.float16)})["i8"].tolist() == [1, -2, 3]


# --- export -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_state(tmp_path_factory):
    """SMALL (fp32, one file) loaded into a state, per stage, built once."""
    folder = tmp_path_factory.mktemp("small32")
    save_file(SMALL, str(folder / "model.safetensors"))

    @functools.cache
    def build(stage):
        return zj.init_state(
            ABSTRACT,
            optax.sgd(0.1),
            mesh=zj.make_mesh(),
            config=zj.ZeroConfig(stage=stage),
            weights=zj.Weights(folder, SMALL_MAP),
        )

    return build


def _read_hf(folder):
    """An export read back by safetensors, with Hugging Face's format checks."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in folder.iterdir()) == sorted(files + ["model.safetensors.index.json"])
    got = {}
    for f in files:
        part_ = load_file(str(folder / f))
        assert set(part_) == {n for n, g in index["weight_map"].items() if g == f}
        assert not set(part_) & set(got)  # each tensor in one file
        got.update(part_)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in got.values())
    return got, files


@pytest.mark.parametrize("stage", [0, 3])
def test_export_writes_hugging_face_layout_that_safetensors_reads(stage, small_state, tmp_path):
    state = small_state(stage)
    shapes = zj.export_weights(state, tmp_path / "hf", map=SMALL_MAP, format="hf", max_shard_size=1000)
    got, files = _read_hf(tmp_path / "hf")
    assert len(files) == 7 and files[0] == "model-00001-of-00007.safetensors"  # greedy, in name order
    assert shapes == {k: v.shape for k, v in SMALL.items()}
    for k, v in SMALL.items():
        np.testing.assert_array_equal(got[k], v)
    # bf16, one file (everything under max_shard_size): model.safetensors, no index.
    zj.export_weights(state, tmp_path / "one", map=SMALL_MAP, format="hf", dtype="bfloat16")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    for k, v in SMALL.items():
        assert one[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(one[k], v.astype(ml_dtypes.bfloat16))


def test_a_failed_export_leaves_nothing_that_looks_complete(small_state, tmp_path, monkeypatch):
    state = small_state(3)
    out = tmp_path / "hf"
    zj.export_weights(state, out, map=SMALL_MAP, format="hf", max_shard_size=1000)
    calls = {"n": 0}
    real = TensorWriter.write_box

    def dying(self, *a):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full")
        return real(self, *a)

    monkeypatch.setattr(TensorWriter, "write_box", dying)
    with pytest.raises(OSError, match="disk full"):
        zj.export_weights(state, out, map=SMALL_MAP, format="hf", max_shard_size=1000)
    # The old index went first; no partial file is left; the old shards are there but no
    # index vouches for them.
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" not in names and not [n for n in names if "partial" in n]


def test_export_merges_lora_adapters_by_default(tmp_path):
    params = {
        "q": {
            "kernel": RNG.normal(size=(16, 8)).astype(np.float32),
            "lora": {
                "lora_a": RNG.normal(size=(16, 2)).astype(np.float32),
                "lora_b": RNG.normal(size=(2, 8)).astype(np.float32),
            },
        }
    }
    wmap = zj.maps.WeightMap(
        {
            "q.kernel": transpose("q_proj.weight"),
            "q.lora.lora_a": transpose("q_proj.lora_A.weight"),
            "q.lora.lora_b": transpose("q_proj.lora_B.weight"),
        }
    )
    state = zj.init_state(
        jax.tree.map(jnp.asarray, params),
        optax.sgd(0.1),
        mesh=zj.make_mesh(),
        config=zj.ZeroConfig(stage=3),
        trainable=lambda p: {"q": {"kernel": False, "lora": {"lora_a": True, "lora_b": True}}},
    )
    zj.export_weights(state, tmp_path / "m.safetensors", map=wmap)
    merged = load_file(str(tmp_path / "m.safetensors"))
    assert list(merged) == ["q_proj.weight"]
    q = params["q"]
    np.testing.assert_allclose(
        merged["q_proj.weight"], (q["kernel"] + q["lora"]["lora_a"] @ q["lora"]["lora_b"]).T, rtol=1e-6, atol=1e-6
    )
    zj.export_weights(state, tmp_path / "a.safetensors", map=wmap, lora="adapters")
    adapters = load_file(str(tmp_path / "a.safetensors"))
    assert sorted(adapters) == ["q_proj.lora_A.weight", "q_proj.lora_B.weight"]
    np.testing.assert_array_equal(adapters["q_proj.lora_A.weight"], q["lora"]["lora_a"].T)


@pytest.mark.slow  # four processes start JAX (about 15 s)
def test_four_processes_read_and_write_only_their_own_shards(tmp_path):
    """Each of 4 processes (2 devices each) loads a 44 MiB model (fp32 masters; 22 MiB of
    bf16 on disk in 9 files) into stage 3, reading exactly the bytes of its shards, with host
    memory within its own shards plus one shard and a read buffer, then exports it, each
    writing its own shards; the export is the checkpoint, bit for bit."""
    ts = weights_model.tensors()
    weights_model.write_sharded(str(tmp_path / "ck"), ts)
    worker = [
        str(ROOT / "tests" / "workers" / "weights_job.py"),
        "--ckpt",
        str(tmp_path / "ck"),
        "--out",
        str(tmp_path),
    ]
    # The launcher in this process (its processes are real ones): a launcher process of its
    # own would import JAX for nothing.
    out = io.StringIO()
    code = launch.launch([sys.executable, *worker, "--buffer-mib", "1"], 4, 2, timeout_s=400, out=out)
    assert code == 0, out.getvalue()[-8000:]
    model = sum(x.size for x in ts.values()) * 4
    for rank in range(4):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        load, init = r["load"], r["init"]
        assert load["own_bytes"] == model // 4  # stage 3 over 8 devices, 2 per process
        assert load["bytes_read"] == load["own_disk_bytes"] == init["bytes_read"]  # its own bytes, once
        assert r["export"]["bytes_written"] == load["own_disk_bytes"]  # bf16 export
        bound = load["own_bytes"] + load["largest_shard"] + 2 * 2**20 + 4 * 2**20
        assert load["rss_peak_delta"] <= bound, (rank, load)
        assert load["rss_peak_delta"] < model / 2
        assert load["host_transient"] <= load["largest_shard"] + 2 * 2**20, (rank, load)
        assert r["export"]["host_transient"] <= 2 * load["largest_shard"] + 2 * 2**20, (rank, r["export"])
    got, files = _read_hf(tmp_path / "export")
    assert len(files) == 9
    for k, v in ts.items():
        np.testing.assert_array_equal(got[k].view(np.uint16), v.view(np.uint16))
    params = np.load(tmp_path / "params.npz")
    for k, v in weights_model.reference(ts).items():
        np.testing.assert_array_equal(params[k], v)


def test_export_command_writes_a_checkpoint_directory_in_hugging_face_layout(small_state, tmp_path, capsys):
    from zerojax import cli

    zj.save_checkpoint(tmp_path / "ck", small_state(3), 0)
    fixture = ROOT / "tests" / "data" / "hf_llama_tiny"
    rc = cli.main(
        [
            "export",
            str(tmp_path / "ck"),
            str(tmp_path / "hf"),
            "--format",
            "hf",
            "--map",
            "tests.test_weights:SMALL_MAP",
            "--max-shard-size",
            "1000",
            "--dtype",
            "bfloat16",
            "--hf-config",
            str(fixture),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert f"wrote {len(SMALL)} tensors" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    for name in ("config.json", "generation_config.json"):
        (tmp_path / "hf" / name).unlink()
    got, files = _read_hf(tmp_path / "hf")
    assert len(files) == 4  # bf16: half the bytes of the fp32 export's 7 files
    for k, v in SMALL.items():
        np.testing.assert_array_equal(got[k], v.astype(ml_dtypes.bfloat16))
    assert cli.main(["export", str(tmp_path / "ck"), str(tmp_path / "x"), "--format", "hf", "--map", "nope"]) == 1
    assert "ready map" in capsys.readouterr().err


# --- export: every map that loads exports, and nothing silently wrong ------------------------

TIED = zj.maps.WeightMap(dict(SMALL_MAP.entries) | {"head.kernel": transpose("emb")})  # an untied head, tied file
TIED_CKPT = {k: v for k, v in SMALL.items() if k != "head"}


def _complete(folder):
    """What a loader finds in ``folder``: the tensors of a complete export, or None. Fails on
    an index that names a file which is not there."""
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.exists():
        files = set(json.loads(index.read_text())["weight_map"].values())
        missing = [f for f in files if not (folder / f).exists()]
        assert not missing, f"the index names files that are not there: {missing}"
        return {k: v for f in files for k, v in load_file(str(folder / f)).items()}
    return load_file(str(single)) if single.exists() else None


def _snapshot(folder):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_a_tensor_read_by_two_parameters_is_written_once_and_checked(tmp_path):
    """An untied head read from a tied checkpoint's embedding exports the embedding once,
    under its own name; if the two parameters differ, the export is refused naming both
    and the largest difference, and nothing is left that looks complete."""
    save_file(TIED_CKPT, str(tmp_path / "tied.safetensors"))
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(
        ABSTRACT, optax.sgd(0.1), mesh=mesh, config=cfg, weights=zj.Weights(tmp_path / "tied.safetensors", TIED)
    )
    shapes = zj.export_weights(state, tmp_path / "hf", map=TIED, format="hf", max_shard_size=1000)
    got = _complete(tmp_path / "hf")
    assert set(got) == set(shapes) == set(TIED_CKPT)
    for k, v in TIED_CKPT.items():
        np.testing.assert_array_equal(got[k], v)
    # Trained apart (here: given apart), the head would be dropped: refused.
    params = jax.tree.map(jnp.asarray, SMALL_REF) | {"head": {"kernel": jnp.asarray(SMALL["emb"].T)}}
    params["head"]["kernel"] = params["head"]["kernel"].at[15, 12].add(0.5)
    apart = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=cfg)
    with pytest.raises(
        ValueError,
        match=r"parameters 'head\.kernel' and 'emb' both read tensor 'emb', and they differ "
        r"by up to 0\.5: the export writes the tensor once, from 'emb', and would "
        r"drop what 'head\.kernel' learnt\. Tie them in the model .* a map that gives "
        r"'head\.kernel' a tensor of its own instead of transpose\(emb \[13, 16\]\)",
    ):
        zj.export_weights(apart, tmp_path / "hf", map=TIED, format="hf", max_shard_size=1000)
    assert _complete(tmp_path / "hf") is None and not list((tmp_path / "hf").glob(".*"))
    # The same from checkpoint directories (process 0 reads each parameter whole).
    for name, st in (("same", state), ("apart", apart)):
        zj.save_checkpoint(tmp_path / name, st, step=0, wait=True)
    zj.export_weights(tmp_path / "same", tmp_path / "from_dir", map=TIED, format="hf")
    np.testing.assert_array_equal(_complete(tmp_path / "from_dir")["emb"], TIED_CKPT["emb"])
    with pytest.raises(
        ValueError,
        match=r"'head\.kernel' and 'emb' both read tensor 'emb', and they differ by up to "
        r"0\.5",
    ):
        zj.export_weights(tmp_path / "apart", tmp_path / "from_dir", map=TIED, format="hf")
    # The fix the message names: the head as a tensor of its own.
    zj.export_weights(apart, tmp_path / "hf", map=SMALL_MAP, format="hf")
    np.testing.assert_array_equal(_complete(tmp_path / "hf")["head"], np.asarray(params["head"]["kernel"]).T)


QKV = RNG.normal(size=(9, 7)).astype(np.float32)  # torch [out, in]: q rows 0:4, k 4:6, v 6:9
FUSED = {
    "attn.qkv.weight": QKV,
    "up.a": RNG.normal(size=(7, 3)).astype(np.float32),
    "up.b": RNG.normal(size=(7, 5)).astype(np.float32),
}
FUSED_MAP = zj.maps.WeightMap(
    {
        "q": transpose(part("attn.qkv.weight", 0, 0)),
        "k": transpose(part("attn.qkv.weight", 0, 4)),
        "v": transpose(part("attn.qkv.weight", 0, 6)),
        "up": concat(["up.a", "up.b"], axis=1, sizes=[3, 5]),
    }
)
FUSED_ABSTRACT = {
    "q": jax.ShapeDtypeStruct((7, 4), jnp.float32),
    "k": jax.ShapeDtypeStruct((7, 2), jnp.float32),
    "v": jax.ShapeDtypeStruct((7, 3), jnp.float32),
    "up": jax.ShapeDtypeStruct((7, 8), jnp.float32),
}


@pytest.mark.parametrize("stage", [1, 3])
def test_fused_parts_and_concatenations_export_what_they_load(stage, tmp_path):
    """q, k, v read from one fused tensor and a fused parameter read from two tensors export
    back to the same tensors, bit for bit, each part writing its own extent; parts that
    leave a gap or overlap are refused, naming the elements."""
    save_file(FUSED, str(tmp_path / "fused.safetensors"))
    state = zj.init_state(
        FUSED_ABSTRACT,
        optax.sgd(0.1),
        mesh=zj.make_mesh(),
        config=zj.ZeroConfig(stage=stage),
        weights=zj.Weights(tmp_path / "fused.safetensors", FUSED_MAP),
    )
    for fmt, out in (("hf", tmp_path / "hf"), ("file", tmp_path / "w.safetensors")):
        shapes = zj.export_weights(state, out, map=FUSED_MAP, format=fmt, max_shard_size=200)
        got = _complete(out) if fmt == "hf" else load_file(str(out))
        assert shapes == {k: v.shape for k, v in FUSED.items()} and set(got) == set(FUSED)
        for k, v in FUSED.items():
            np.testing.assert_array_equal(got[k], v)
    params = {k: jnp.ones(v.shape) for k, v in FUSED_ABSTRACT.items() if k in ("q", "v")}
    two = zj.init_state(params, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=stage))
    gap = zj.maps.WeightMap({k: e for k, e in FUSED_MAP.entries if k in ("q", "v")})
    with pytest.raises(
        ValueError,
        match=r"elements \[4:6, 0:7\] of tensor 'attn\.qkv\.weight' \[9, 7\] are written "
        r"by no parameter: its parts \(part / concat\) leave a gap",
    ):
        zj.export_weights(two, tmp_path / "gap", map=gap, format="hf")
    three = zj.init_state(
        {**params, "k": jnp.ones((7, 2))}, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=stage)
    )
    overlap = zj.maps.WeightMap({**dict(gap.entries), "k": transpose(part("attn.qkv.weight", 0, 3))})
    with pytest.raises(
        ValueError,
        match=r"parameters 'q' and 'k' both write elements \[3:4, 0:7\] of tensor "
        r"'attn\.qkv\.weight' \[9, 7\]",
    ):
        zj.export_weights(three, tmp_path / "overlap", map=overlap, format="hf")
    assert not (tmp_path / "gap").exists() and not (tmp_path / "overlap").exists()


def test_re_export_leaves_exactly_the_new_export(small_state, tmp_path):
    """One file over shards over one file: each export removes the earlier one's weight
    files (and a killed export's leftovers); a config copied in by hand stays."""
    state, out = small_state(3), tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / ".model-00001-of-00002.safetensors.partial").write_bytes(b"left by a killed export")
    shards = lambda n: (
        [f"model-0000{k}-of-0000{n}.safetensors" for k in range(1, n + 1)] + ["model.safetensors.index.json"]
    )
    for size, files in (
        ("5GB", ["model.safetensors"]),
        (1000, shards(7)),
        (2000, shards(4)),
        ("5GB", ["model.safetensors"]),
    ):
        zj.export_weights(state, out, map=SMALL_MAP, format="hf", max_shard_size=size)
        assert sorted(p.name for p in out.iterdir()) == sorted(files + ["config.json"])
        got = _complete(out)
        for k, v in SMALL.items():
            np.testing.assert_array_equal(got[k], v)
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        (out / "model.safetensors.index.json").write_text("{}")
        zj.Weights(out, SMALL_MAP).open()


class _Killed(BaseException):
    """A kill: nothing after it runs (the export's clean-up included)."""


def test_a_killed_export_leaves_nothing_that_looks_complete(small_state, tmp_path, monkeypatch):
    """Killed at each step that changes the folder (each file removed, written or renamed,
    a box written), an export leaves the folder as it was (killed before it began to change
    it), or nothing a loader would take as complete: never the old export beside new files,
    never an index naming files that are not there."""
    from zerojax.checkpoint import sinks

    state, out = small_state(3), tmp_path / "hf"
    config = {"dtype": "bfloat16", "model_type": "small"}
    calls = {"n": 0, "kill": None}

    def hook(real):
        def step(*a, **k):
            calls["n"] += 1
            if calls["n"] == calls["kill"]:
                raise _Killed()
            return real(*a, **k)

        return step

    monkeypatch.setattr(sinks.os, "remove", hook(os.remove))
    monkeypatch.setattr(sinks.os, "replace", hook(os.replace))
    monkeypatch.setattr(sinks, "write_json", hook(sinks.write_json))
    monkeypatch.setattr(TensorWriter, "write_box", hook(TensorWriter.write_box))
    monkeypatch.setattr(sinks.ExportFiles, "cleanup", lambda self: None)
    kills = changed = 0
    for kill in range(1, 200):
        for old in sorted(out.glob("*")) if out.exists() else []:
            old.unlink()
        calls["kill"] = None  # the earlier export, in bf16 and another file count
        zj.export_weights(state, out, map=SMALL_MAP, format="hf", dtype="bfloat16", max_shard_size=1500)
        old = _snapshot(out)
        calls.update(n=0, kill=kill)
        try:
            zj.export_weights(state, out, map=SMALL_MAP, format="hf", max_shard_size=1000, hf_config=config)
        except _Killed:
            kills += 1
            now = {k: v for k, v in _snapshot(out).items() if not k.startswith(".zerojax-export-probe")}
            if now != old:
                changed += 1
                assert _complete(out) is None, (kill, sorted(now))
            continue
        break
    # Killed before the probe's removal or the old index's: the folder as it was. Then the old
    # files' removals, the headers, boxes, the config, the renames, the index.
    assert kills == changed + 2 and changed > 20
    got = _complete(out)
    for k, v in SMALL.items():
        np.testing.assert_array_equal(got[k], v)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_export_writes_config_json_updated_for_its_dtype(small_state, tmp_path):
    """config.json (and generation_config.json) beside a Hugging Face export: the source's
    config from the map or given, its dtype key(s) updated, none added; none without one."""
    from zerojax.checkpoint.configs import exported

    state = small_state(3)
    fixture = ROOT / "tests" / "data" / "hf_llama_tiny"
    zj.export_weights(state, tmp_path / "a", map=SMALL_MAP, format="hf", dtype="bfloat16", hf_config=fixture)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    source = json.loads((fixture / "config.json").read_text())
    assert source["dtype"] == "float32" and config == {**source, "dtype": "bfloat16"}
    assert json.loads((tmp_path / "a" / "generation_config.json").read_text()) == json.loads(
        (fixture / "generation_config.json").read_text()
    )
    # transformers 4.x's key, nested configs too; the map's config, overridden by hf_config=.
    old = {"torch_dtype": "float32", "text_config": {"torch_dtype": "float32"}, "model_type": "x"}
    wmap = dataclasses.replace(SMALL_MAP, hf_config=old, generation_config={"max_length": 9})
    assert wmap == SMALL_MAP and hash(wmap) == hash(SMALL_MAP)  # configs play no part in mapping
    zj.export_weights(state, tmp_path / "b", map=wmap, format="hf", dtype="float16")
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == {
        "torch_dtype": "float16",
        "text_config": {"torch_dtype": "float16"},
        "model_type": "x",
    }
    assert json.loads((tmp_path / "b" / "generation_config.json").read_text()) == {"max_length": 9}
    zj.export_weights(state, tmp_path / "b", map=wmap, format="hf", hf_config={"model_type": "y"})
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == {"model_type": "y"}  # no key added
    # No config: none written.
    zj.export_weights(state, tmp_path / "c", map=SMALL_MAP, format="hf")
    assert not (tmp_path / "c" / "config.json").exists()
    with pytest.raises(ValueError, match="hf_config / generation_config are written beside a Hugging Face model"):
        zj.export_weights(state, tmp_path / "w.safetensors", map=SMALL_MAP, hf_config=fixture)
    with pytest.raises(TypeError, match="WeightMap.hf_config must be JSON"):
        zj.maps.WeightMap({}, hf_config={"x": object()})
    # A head of its own beside a config that ties it: untied, or transformers would drop it.
    assert exported({"tie_word_embeddings": True}, None, dtype="float32", tensors=["lm_head.weight"]) == {
        "config.json": {"tie_word_embeddings": False}
    }
    assert exported({"tie_word_embeddings": True}, None, dtype="float32", tensors=["embed.weight"]) == {
        "config.json": {"tie_word_embeddings": True}
    }


def test_export_refuses_before_the_first_byte(small_state, tmp_path):
    """A float16 overflow and a folder that cannot be written are refused before any byte
    is written: an earlier export in the folder is untouched."""
    out = tmp_path / "hf"
    state = small_state(3)
    zj.export_weights(state, out, map=SMALL_MAP, format="hf", max_shard_size=1000)
    before = _snapshot(out)
    params = jax.tree.map(jnp.asarray, SMALL_REF)
    params["blocks"]["w"] = params["blocks"]["w"].at[2, 15, 3, 5].set(1e5)
    big = zj.init_state(params, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
    with pytest.raises(
        ValueError,
        match=r"parameter 'blocks\.w' has values up to 1e\+05, beyond float16's range "
        r"\(65504\); export in bfloat16",
    ):
        zj.export_weights(big, out, map=SMALL_MAP, format="hf", dtype="float16")
    assert _snapshot(out) == before
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        target = locked if not os.access(locked, os.W_OK) else pathlib.Path("/sys")  # root writes anywhere else
        with pytest.raises(OSError, match=r"cannot write in the export folder"):
            zj.export_weights(state, target / "w.safetensors", map=SMALL_MAP)
    finally:
        locked.chmod(0o755)
    with pytest.raises(IsADirectoryError, match="format='file' writes one file"):
        zj.export_weights(state, out, map=SMALL_MAP)
    assert _snapshot(out) == before
