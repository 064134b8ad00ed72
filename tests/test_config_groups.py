"""ZeroConfig's groups: a flat name of before the groups is refused with the grouped form
that builds what it meant, the printed form builds a config back, and each group refuses bad
values naming the group and field."""

import dataclasses
import random
import re
import warnings

import pytest

import zerojax as zj
from zerojax.config import groups as G

# Valid values of each flat name, other than its default (stage 3, float16 compute, so
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


def _grouped_call(message: str) -> str:
    """The keywords of the grouped ``ZeroConfig(...)`` a refusal names as the fix."""
    return re.search(r": ZeroConfig\((.*)\)\. \(In dataclasses\.replace", message).group(1)


@pytest.mark.parametrize("seed", range(24))
def test_flat_keywords_are_refused_naming_the_grouped_call_that_builds_them(seed):
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
    as_groups = zj.ZeroConfig(**base, **grouped)
    as_classes = zj.ZeroConfig(**base, **{g: G.GROUPS[g](**f) for g, f in grouped.items()})
    assert as_groups == as_classes and hash(as_groups) == hash(as_classes)
    # Given flat, to the constructor or to dataclasses.replace: refused, and the grouped call
    # the message names builds the config the flat keywords meant.
    for build in (
        lambda: zj.ZeroConfig(**base, **picked),
        lambda: dataclasses.replace(zj.ZeroConfig(**base), **picked),
    ):
        with pytest.raises(TypeError, match=r"^ZeroConfig has no keywords? ") as err:
            build()
        assert eval(f"zj.ZeroConfig(**base, {_grouped_call(str(err.value))})", {"zj": zj, "base": base}) == as_groups
    # Read flat: refused, naming the group's field.
    for key in picked:
        group, field = G.FLAT[key]
        with pytest.raises(AttributeError, match=rf"'{key}'; it is {group}\.{field}: read config\.{group}\.{field}\."):
            getattr(as_groups, key)
    # The printed form is code that builds the same config.
    assert eval(as_groups.code(), {"zj": zj}) == as_groups


def test_every_flat_name_is_refused_as_keyword_replace_and_attribute():
    cfg = zj.ZeroConfig(stage=3, compute_dtype="float16")
    for key, (group, field) in G.FLAT.items():
        value = VALUES[key][0]
        fix = rf"it is {group}\.{field}: ZeroConfig\({group}=\{{'{field}': "
        with pytest.raises(TypeError, match=rf"^ZeroConfig has no keyword '{key}'; {fix}"):
            zj.ZeroConfig(stage=3, compute_dtype="float16", **{key: value})
        with pytest.raises(TypeError, match=rf"^ZeroConfig has no keyword '{key}'; {fix}"):
            dataclasses.replace(cfg, **{key: value})
        with pytest.raises(AttributeError, match=rf"^ZeroConfig has no attribute '{key}'; it is {group}\.{field}"):
            getattr(cfg, key)
        assert not hasattr(zj.ZeroConfig, key)


def test_the_replace_form_a_refusal_names_keeps_the_groups_other_fields():
    cfg = zj.ZeroConfig(stage=3, offload={"optimizer": True, "update": "host", "group_size": 7})
    with pytest.raises(TypeError) as err:
        dataclasses.replace(cfg, offload_params=True)
    hint = re.search(r"In dataclasses\.replace, (.*) keeps the group's other fields", str(err.value)).group(1)
    assert hint == "offload=dataclasses.replace(config.offload, params=True)"
    out = eval(f"dataclasses.replace(config, {hint})", {"dataclasses": dataclasses, "config": cfg})
    assert out.offload == G.Offload(optimizer=True, params=True, update="host", group_size=7)


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "offlod_optimizer",
            r"no keyword 'offlod_optimizer'; did you mean offload\.optimizer \(offload=\{'optimizer': \.\.\.\}\)\?",
        ),
        ("grad_acum_steps", r"no keyword 'grad_acum_steps'; did you mean 'grad_accum_steps'\?"),
        ("optimizer", r"no keyword 'optimizer'; it is offload\.optimizer: ZeroConfig\(offload=\{'optimizer': 1\}\)"),
        ("zzz", r"no keyword 'zzz'; its fields are \['axes', 'collectives'"),
    ],
)
def test_other_unknown_keywords_say_what_was_meant(name, message):
    with pytest.raises(TypeError, match=message):
        zj.ZeroConfig(**{name: 1})


def test_the_library_builds_its_own_configs_grouped():
    """The DeepSpeed translation builds its config in the grouped form (a flat keyword would
    be refused), with no notice."""
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
    assert not hasattr(zj.ZeroConfig, "from_deepspeed")  # zj.from_deepspeed is the one name


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
        (dict(context={"layout": "zigzag"}), ValueError, r"ContextParallel.layout must be"),
        (dict(stage=2, offload={"params": True}), ValueError, r"ZeroConfig.offload.params .* Use stage=3"),
        (dict(loss_scaling={"loss_scale": 8.0}), ValueError, r"ZeroConfig.loss_scaling.loss_scale=8.0 cannot apply"),
        (dict(stage=0, collectives={"reduce_dtype": "int8"}), ValueError, r"collectives.reduce_dtype='int8'"),
    ],
)
def test_bad_values_are_refused_naming_the_group_and_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        zj.ZeroConfig(**kwargs)


def test_the_groups_sit_under_zj_config_not_at_the_top_level():
    assert zj.config.Offload is G.Offload and zj.ZeroConfig is zj.config.ZeroConfig
    assert not {"Offload", "LossScaling", "Collectives", "Axes", "ContextParallel"} & set(zj.__all__)


def test_a_grouped_config_pickles_copies_hashes_and_replaces():
    """What runs and checkpoints do with a config: pickle it (process pools, launchers), copy
    it, hash it (a static argument of jit), and change one field with dataclasses.replace."""
    import copy
    import inspect
    import pickle

    import jax

    cfg = zj.ZeroConfig(
        stage=3, compute_dtype="float16", offload={"optimizer": True}, axes={"rules": (("mlp", "tensor"),)}
    )
    assert pickle.loads(pickle.dumps(cfg)) == cfg and copy.deepcopy(cfg) == cfg
    assert hash(pickle.loads(pickle.dumps(cfg))) == hash(cfg) == hash(copy.copy(cfg))
    grouped = dataclasses.replace(cfg, collectives=dataclasses.replace(cfg.collectives, reduce_dtype="int8"))
    assert grouped == zj.ZeroConfig(
        stage=3,
        compute_dtype="float16",
        offload={"optimizer": True},
        axes={"rules": (("mlp", "tensor"),)},
        collectives={"reduce_dtype": "int8"},
    )
    assert jax.jit(lambda x, c: x * c.stage, static_argnums=1)(2.0, grouped) == 6.0
    params = inspect.signature(zj.ZeroConfig).parameters  # the fields, as the dataclass writes them
    assert list(params) == [f.name for f in dataclasses.fields(zj.ZeroConfig)]
