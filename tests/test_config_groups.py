"""ZeroConfig's groups: the flat keywords and the grouped form build the same config, the
printed form builds it back, and each group refuses bad values naming the group and field."""

import dataclasses
import random
import warnings

import pytest

import zerojax as zj
from zerojax.config import groups as G
from zerojax.config import zero as Z

# Valid values of each flat keyword, other than its default (stage 3, float16 compute, so
# that every group's values are allowed together).
VALUES = {
    "loss_scale": ["dynamic", 128.0, None],
    "initial_scale_power": [0, 12],
    "loss_scale_window": [1, 500],
    "hysteresis": [1, 4],
    "consecutive_hysteresis": [True],
    "min_loss_scale": [0.5, 4.0],
    "raise_at_min_scale": [False],
    "skip_nonfinite": [True],
    "offload_optimizer": [True],
    "offload_params": [True],
    "offload_update": ["host", "device"],
    "offload_group_size": [1, 4096],
    "reduce_dtype": ["bfloat16", "float16", "int8"],
    "gather_dtype": ["int8"],
    "reduce_quant_block_size": [64, 8000],
    "quant_block_size": [128, 2048],
    "axis": ["dp", "fsdp"],
    "replica_axis": ["groups"],
    "tensor_axis": ["tp", "model"],
    "context_axis": ["cp", "seq"],
    "expert_axis": ["ep", "experts"],
    "axis_rules": [(("mlp", "tensor"), ("embed", None)), (("heads", ("tensor", "data")),)],
    "axis_map": [{"fsdp": "data", "tensor": "tensor"}],
    "context_layout": ["balanced"],
    "context_dims": [1, {"['tokens']": 1, "['mask']": (1, 2)}],
}


def test_every_flat_keyword_has_values_here():
    assert set(VALUES) == set(G.FLAT)


@pytest.mark.parametrize("seed", range(24))
def test_flat_and_grouped_keywords_build_the_same_config(seed):
    rng = random.Random(seed)
    picked = {k: rng.choice(v) for k, v in rng.sample(sorted(VALUES.items()), rng.randint(1, 8))}
    if "axis" in picked and "tensor_axis" in picked and picked["axis"] == picked["tensor_axis"]:
        del picked["tensor_axis"]
    base = dict(stage=3, compute_dtype="float16", grad_accum_steps=rng.choice([1, 2]))
    if picked.get("offload_params"):
        base["prefetch"] = 0
    grouped: dict = {}
    for key, value in picked.items():
        group, field = G.FLAT[key]
        grouped.setdefault(group, {})[field] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = zj.ZeroConfig(**base, **picked)
        replaced = dataclasses.replace(zj.ZeroConfig(**base), **picked)
    as_groups = zj.ZeroConfig(**base, **grouped)
    as_classes = zj.ZeroConfig(**base, **{g: G.GROUPS[g](**f) for g, f in grouped.items()})
    assert flat == replaced == as_groups == as_classes
    assert hash(flat) == hash(as_groups)
    # Read back flat: the flat name is the group's field, normalized as the group stores it.
    for key in picked:
        group, field = G.FLAT[key]
        assert getattr(flat, key) == getattr(getattr(flat, group), field)
    # The printed form is code that builds the same config, without a flat keyword.
    Z._said_flat = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a flat keyword in it would say so
        assert eval(flat.code(), {"zj": zj}) == flat


def test_replace_with_a_flat_keyword_keeps_the_groups_other_fields():
    cfg = zj.ZeroConfig(stage=3, offload={"optimizer": True, "update": "host", "group_size": 7})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = dataclasses.replace(cfg, offload_params=True)
    assert out.offload == G.Offload(optimizer=True, params=True, update="host", group_size=7)


def test_the_first_flat_keyword_prints_the_grouped_form_once(monkeypatch):
    monkeypatch.setattr(Z, "_said_flat", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zj.ZeroConfig(stage=2, offload_optimizer=True)
        zj.ZeroConfig(stage=2, reduce_dtype="int8")
        zj.ZeroConfig(stage=2, offload={"optimizer": True})
    said = [str(w.message) for w in caught]
    assert said == [
        "ZeroConfig(offload_optimizer=True): flat keywords keep working; the grouped form of this config is "
        "zj.ZeroConfig(stage=2, offload=zj.config.Offload(optimizer=True)) (said once)."
    ]
    assert caught[0].filename == __file__  # pointed at the caller's line


def test_the_library_builds_its_own_configs_grouped(monkeypatch):
    """No notice for a config the user did not write: the DeepSpeed translation and the
    autotuner's candidates use the grouped form."""
    monkeypatch.setattr(Z, "_said_flat", False)
    from zerojax.deepspeed import translate

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        t = translate(
            {
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 1000},
                "fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 3},
                "communication_data_type": "bf16",
            }
        )
    assert t.config.loss_scaling == G.LossScaling(initial_scale_power=12, hysteresis=3)
    assert t.config.offload == G.Offload(optimizer=True, group_size=1000)
    assert t.config.collectives.reduce_dtype == "bfloat16"
    assert Z._said_flat is False


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(offload={"optimiser": True}), TypeError, r"ZeroConfig.offload has no field\(s\) \['optimiser'\]"),
        (dict(offload=True), TypeError, r"ZeroConfig.offload must be a zj.config.Offload or a dict"),
        (dict(offload={"update": "disk"}), ValueError, r"Offload.update must be 'auto', 'host' or 'device'"),
        (dict(offload={"group_size": 0}), ValueError, r"Offload.group_size must be a positive int"),
        (dict(loss_scaling={"hysteresis": 0}), ValueError, r"LossScaling.hysteresis must be >= 1"),
        (dict(loss_scaling={"loss_scale": 0}), ValueError, r"LossScaling.loss_scale must be 'dynamic'.*0 means"),
        (dict(loss_scaling={"skip_nonfinite": 1}), TypeError, r"LossScaling.skip_nonfinite must be a bool"),
        (dict(collectives={"reduce_dtype": "int4"}), ValueError, r"Collectives.reduce_dtype must be one of"),
        (dict(collectives={"gather_block_size": -1}), ValueError, r"Collectives.gather_block_size must be a positive"),
        (dict(axes={"tensor": "data"}), ValueError, r"Axes.tensor must be a mesh axis name other than data='data'"),
        (dict(axes={"expert": ""}), TypeError, r"Axes.expert must be a non-empty mesh axis name"),
        (dict(context={"layout": "zigzag"}), ValueError, r"Context.layout \(context_layout\) must be"),
        (dict(stage=2, offload={"params": True}), ValueError, r"ZeroConfig.offload.params .* Use stage=3"),
        (dict(loss_scaling={"loss_scale": 8.0}), ValueError, r"ZeroConfig.loss_scaling.loss_scale=8.0 cannot apply"),
        (dict(stage=0, collectives={"reduce_dtype": "int8"}), ValueError, r"collectives.reduce_dtype='int8'"),
        (
            dict(offlod_optimizer=True),
            TypeError,
            r"unknown keyword 'offlod_optimizer'; did you mean 'offload_optimizer'",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_group_and_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        zj.ZeroConfig(**kwargs)


def test_the_groups_sit_under_zj_config_not_at_the_top_level():
    assert zj.config.Offload is G.Offload and zj.ZeroConfig is zj.config.ZeroConfig
    assert not {"Offload", "LossScaling", "Collectives", "Axes", "Context"} & set(zj.__all__)


def test_a_grouped_config_pickles_and_replaces_like_a_flat_one():
    """What runs and checkpoints do with a config: pickle it (process pools, launchers), copy
    it, and change one field with dataclasses.replace, flat or grouped, from user code."""
    import copy
    import pickle

    cfg = zj.ZeroConfig(
        stage=3, compute_dtype="float16", offload={"optimizer": True}, axes={"rules": (("mlp", "tensor"),)}
    )
    assert pickle.loads(pickle.dumps(cfg)) == cfg and copy.deepcopy(cfg) == cfg
    grouped = dataclasses.replace(cfg, collectives=dataclasses.replace(cfg.collectives, reduce_dtype="int8"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = dataclasses.replace(cfg, reduce_dtype="int8")
    assert grouped == flat and flat.offload.optimizer and flat.axes.rules == (("mlp", "tensor"),)
