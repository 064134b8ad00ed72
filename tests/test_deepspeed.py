"""DeepSpeed configs, written in the shape of DeepSpeed's documented examples, translated."""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax import cli
from zerojax.deepspeed import optax_code, translate

# ZeRO-3 with CPU offload, as in DeepSpeed's ZeRO-Infinity / ZeRO-Offload tutorials.
ZERO3_OFFLOAD = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}},
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "initial_scale_power": 12,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 1e6,
        "stage3_prefetch_bucket_size": 0.94e6,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}

# ZeRO-2 in bf16, as in DeepSpeed's config-json documentation.
ZERO2_BF16 = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": False,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
        "offload_optimizer": {"device": "cpu"},
    },
    "communication_data_type": "bf16",
    "gradient_clipping": 0.0,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
    },
}

# ZeRO-1 with a static fp16 loss scale (DeepSpeed's "loss_scale": 128), no clipping key.
ZERO1_STATIC = {
    "train_micro_batch_size_per_gpu": 8,
    "fp16": {"enabled": True, "loss_scale": 128},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
}

# ZeRO++: hpZ groups of 8, int8 weight gathers and int8 gradients (all mapped).
ZEROPP = {
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 3,
        "zero_hpz_partition_size": 8,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
    },
}
# MiCS: shard groups of 4 devices.
MICS = {
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "mics_shard_size": 4, "mics_hierarchical_params_gather": False},
}


def test_zero3_offload_config():
    with pytest.warns(UserWarning) as caught:
        cfg = zj.from_deepspeed(ZERO3_OFFLOAD)
    assert cfg == zj.ZeroConfig(
        stage=3,
        compute_dtype="float16",
        loss_scaling={
            "loss_scale": "auto",
            "initial_scale_power": 12,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1.0,
        },
        offload={"optimizer": True, "params": True, "group_size": 10**9},
        grad_clip=1.0,
        grad_accum_steps=4,
    )
    assert cfg.resolved_loss_scale == "dynamic"
    assert len(caught) == 1  # one warning names them all
    text = str(caught[0].message)
    for key in (
        "zero_optimization.overlap_comm",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.offload_optimizer.pin_memory",
        "train_batch_size",
        "scheduler",
    ):
        assert key in text
    assert "steps_per_print" not in text  # mapped: a console line every 2000 steps
    assert translate(ZERO3_OFFLOAD).monitor.code() == "zj.monitor.Monitor([zj.monitor.Console(every=2000)])"
    assert "the data loader's job" in text and "XLA schedules" in text


def test_zero2_bf16_config_and_its_optimizer():
    t = translate(ZERO2_BF16)
    assert t.config == zj.ZeroConfig(
        stage=2,
        compute_dtype="bfloat16",
        collectives={"reduce_dtype": "bfloat16"},
        offload={"optimizer": True},
        grad_clip=None,
        remat="full",
    )
    assert "activation_checkpointing.partition_activations" in t.unmapped
    assert any("remat='full'" in n for n in t.notes)
    # DeepSpeed's Adam is AdamW unless adam_w_mode is false.
    assert t.optimizer == "optax.adamw(learning_rate=0.0001, b1=0.9, b2=0.999, eps=1e-08, weight_decay=0.01)"
    classic = translate(
        {
            **ZERO2_BF16,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.01, "adam_w_mode": False}},
        }
    )
    assert classic.optimizer.startswith("optax.chain(optax.add_decayed_weights(0.01), optax.adam(")


def test_static_loss_scale_and_the_clipping_default():
    with pytest.warns(UserWarning, match=r"gradient_clipping is absent.*PR #8068.*grad_clip=1.0"):
        cfg = zj.from_deepspeed(ZERO1_STATIC)
    assert cfg.stage == 1 and cfg.compute_dtype == "float16"
    assert cfg.resolved_loss_scale == 128.0 and not cfg.dynamic_scaling
    assert cfg.grad_clip == 1.0


def test_zeropp_maps_int8_gathers_int8_gradients_and_hpz_groups():
    with pytest.warns(UserWarning) as caught:
        cfg = zj.from_deepspeed(ZEROPP)
    text = str(caught[0].message)
    assert "zero_quantized" not in text.split("Notes:")[0]  # mapped: int8 weights and gradients
    assert "zero_hpz_partition_size=8 is mapped to hybrid sharding" in text
    assert "zj.make_mesh(group_size=8)" in text
    assert cfg == zj.ZeroConfig(
        stage=3, compute_dtype="bfloat16", grad_clip=1.0, collectives={"gather_dtype": "int8", "reduce_dtype": "int8"}
    )
    assert translate(ZEROPP).shard_size == 8


def test_mics_shard_size_is_the_mesh_of_replica_groups():
    t = translate(MICS)
    assert t.shard_size == 4 and t.mesh_code() == "zj.make_mesh(group_size=4)"
    assert "XLA schedules" in t.unmapped["zero_optimization.mics_hierarchical_params_gather"]
    assert "zero_optimization.mics_shard_size" not in t.unmapped
    # The printed mesh is the layout MiCS describes: groups of 4 devices, 2 replicas on 8.
    mesh = eval(t.mesh_code(), {"zj": zj, "jax": __import__("jax")})
    assert dict(mesh.shape) == {"replica": 2, "data": 4}
    assert translate({"zero_optimization": {"stage": 3, "mics_shard_size": -1}}).shard_size is None
    with pytest.raises(ValueError, match="mics_shard_size.*-1 \\(off\\) or a positive"):
        translate({"zero_optimization": {"stage": 3, "mics_shard_size": 0}})
    with pytest.raises(ValueError, match="ask for different shard groups"):
        translate({"zero_optimization": {"stage": 3, "mics_shard_size": 4, "zero_hpz_partition_size": 8}})


def test_old_forms_and_a_clean_config():
    assert translate({"zero_optimization": True, "gradient_clipping": 0}).config.stage == 1
    assert translate(
        {"zero_optimization": {"stage": 2, "cpu_offload": True}, "gradient_clipping": 0}
    ).config.offload.optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unmapped: no warning
        cfg = zj.from_deepspeed({"zero_optimization": {"stage": 0}, "gradient_clipping": 0.5})
    assert cfg == zj.ZeroConfig(stage=0, grad_clip=0.5)
    nvme = translate(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 6, "pin_memory": False},
                "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
            },
            "aio": {"overlap_events": True},
        }
    )
    assert nvme.config.offload.optimizer and nvme.config.offload.params
    assert nvme.config.offload.nvme == zj.config.NVMe("/nvme", buffer_count=6, pin_memory=False)
    assert any("offload_param.device 'nvme' is mapped to host memory" in n for n in nvme.notes)
    assert "zero_optimization.offload_optimizer.nvme_path" not in nvme.unmapped and "aio" not in nvme.unmapped
    ds_nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}
    partial = translate(
        {"zero_optimization": {**ds_nvme, "offload_optimizer": {**ds_nvme["offload_optimizer"], "ratio": 0.3}}}
    )
    assert partial.config.offload.ratio == 0.3 and partial.config.offload.nvme == zj.config.NVMe("/nvme")
    with pytest.raises(ValueError, match="'aio.block_size' .*'aio.use_gds' .*have no meaning"):
        translate({"zero_optimization": ds_nvme, "aio": {"block_size": 1 << 20, "use_gds": False}})
    with pytest.raises(ValueError, match="nvme_path' is not set"):
        translate({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})


def test_partial_offload_ratio():
    """offload_optimizer.ratio (Twin-Flow) maps to Offload.ratio at stage 3; DeepSpeed refuses it
    below stage 3, and with the state not offloaded it means nothing."""
    cpu = {"device": "cpu", "ratio": 0.3}
    got = translate({"zero_optimization": {"stage": 3, "offload_optimizer": cpu}})
    assert got.config.offload == zj.config.Offload(optimizer=True, ratio=0.3)
    assert not any("ratio" in k for k in got.unmapped)
    with pytest.raises(ValueError, match=r"ratio' is 0.3 at ZeRO stage 2: DeepSpeed refuses a partial offload"):
        translate({"zero_optimization": {"stage": 2, "offload_optimizer": cpu}})
    with pytest.raises(ValueError, match=r"ratio' must be in \(0, 1\], got 0"):
        translate({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0}}})
    none = translate({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "ratio": 0.3}}})
    assert (
        none.unmapped["zero_optimization.offload_optimizer.ratio"]
        == "the optimizer state is not offloaded (device 'none')"
    )


def test_unknown_keys_warn_by_name():
    with pytest.warns(UserWarning, match=r"my_custom_key: unknown to this mapping"):
        zj.from_deepspeed({"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "my_custom_key": 3})


@pytest.mark.parametrize(
    "ds,match",
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enables both fp16 and bf16"),
        ({"zero_optimization": {"stage": 4}}, r"'zero_optimization.stage' must be 0, 1, 2 or 3, got 4"),
        ({"fp16": {"enabled": True, "loss_scale_window": -1}}, r"'fp16.loss_scale_window' must be > 0, got -1"),
        ({"fp16": {"enabled": True, "loss_scale": -2}}, r"'fp16.loss_scale' must be >= 0"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, r"'fp16.hysteresis' must be >= 1"),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, r"'fp16.min_loss_scale' must be > 0"),
        ({"gradient_clipping": -1.0}, r"'gradient_clipping' must be >= 0"),
        ({"zero_optimization": {"stage": "auto"}}, r"zero_optimization.stage: the HF Trainer does not fill this key"),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
            r"scheduler.params.total_num_steps: the HF Trainer computes it",
        ),
        ({"gradient_accumulation_steps": 0}, r"'gradient_accumulation_steps' must be >= 1"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param' needs ZeRO stage 3"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "needs ZeRO stage 1, 2 or 3"),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}},
            "must be 'cpu', 'nvme' or 'none'",
        ),
        ({"communication_data_type": "int8"}, "'communication_data_type' must be one of"),
        ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, "quantizes ZeRO-3's weight gathers"),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "train_batch_size 30 is not"),
    ],
)
def test_contradictions_raise(ds, match):
    with pytest.raises(ValueError, match=match):
        zj.from_deepspeed(ds)


def test_files(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO3_OFFLOAD))
    with pytest.warns(UserWarning):
        assert zj.from_deepspeed(path) == zj.from_deepspeed(str(path))
    dup = tmp_path / "dup.json"
    dup.write_text('{"gradient_clipping": 1.0, "gradient_clipping": 0.0}')
    with pytest.raises(ValueError, match=r"repeats the key\(s\) \['gradient_clipping'\]"):
        zj.from_deepspeed(dup)
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 3}")
    with pytest.raises(ValueError, match="is not valid JSON"):
        zj.from_deepspeed(bad)
    with pytest.raises(TypeError, match="a path to a DeepSpeed JSON config or a dict"):
        zj.from_deepspeed(3)


def test_printed_code_builds_the_same_config_and_optimizer():
    for ds in (ZERO3_OFFLOAD, ZERO2_BF16, ZERO1_STATIC, ZEROPP):
        t = translate(ds)
        assert eval(t.code(), {"zj": zj}) == t.config
    tx = eval(translate({k: v for k, v in ZERO3_OFFLOAD.items() if k != "scheduler"}).optimizer, {"optax": optax})
    ref = optax.adamw(3e-5, b1=0.8, b2=0.999, eps=1e-8, weight_decay=3e-7)
    p, g = {"w": jnp.ones((3,))}, {"w": jnp.asarray([0.1, -0.2, 0.3])}
    np.testing.assert_array_equal(tx.update(g, tx.init(p), p)[0]["w"], ref.update(g, ref.init(p), p)[0]["w"])


def test_optimizer_sections_that_do_not_translate_whole():
    t = translate(
        {
            "gradient_clipping": 1.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": False, "torch_adam": True}},
        }
    )
    assert t.optimizer.startswith("optax.adamw(") and "bias_correction" in t.unmapped["optimizer"]
    t = translate({"gradient_clipping": 1.0, "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 10}}})
    assert t.optimizer is None and "'OneBitAdam' has no optax equivalent" in t.unmapped["optimizer"]
    with pytest.raises(ValueError, match=r"'optimizer.params.lr' is 'auto'"):  # translate fills it (auto=)
        optax_code({"type": "AdamW", "params": {"lr": "auto"}})
    with pytest.raises(ValueError, match=r"'optimizer.params.betas' must be two numbers"):
        translate({"optimizer": {"type": "AdamW", "params": {"betas": "auto2"}}})


def test_bf16_alias_and_derived_accumulation():
    both = translate({"gradient_clipping": 1.0, "bf16": {}, "bfloat16": {"enabled": True}})
    assert both.config.compute_dtype == "float32" and "bfloat16" in both.unmapped  # DeepSpeed reads "bf16"
    assert translate({"gradient_clipping": 1.0, "bfloat16": {"enabled": True}}).config.compute_dtype == "bfloat16"
    t = translate({"gradient_clipping": 1.0, "train_batch_size": 64, "train_micro_batch_size_per_gpu": 2})
    assert t.config.grad_accum_steps == 1 and any("DeepSpeed derives it" in n for n in t.notes)


def test_weight_decay_is_deepspeeds_default_not_optaxs():
    """DeepSpeed's AdamW decays by 0.0 unless told; optax.adamw by 1e-4. With a zero
    gradient the translated optimizer must leave the weights alone."""
    tx = eval(translate({"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}).optimizer, {"optax": optax})
    p = {"w": jnp.ones((4,))}
    zero = {"w": jnp.zeros((4,))}
    assert np.all(np.asarray(tx.update(zero, tx.init(p), p)[0]["w"]) == 0.0)
    default = optax.adamw(1e-2)
    assert np.all(np.asarray(default.update(zero, default.init(p), p)[0]["w"]) != 0.0)  # what we avoid


def test_translated_fp16_scaler_is_what_the_step_uses():
    """initial_scale_power 12 from the DeepSpeed config: the first step scales by 2^12."""
    with pytest.warns(UserWarning):
        cfg = zj.from_deepspeed({**ZERO3_OFFLOAD, "zero_optimization": {"stage": 2}})
    tx = optax.adamw(3e-5)
    mesh = zj.make_mesh()
    state = zj.init_state(models.mlp_params(), tx, mesh=mesh, config=cfg)
    _, m = zj.make_train_step(models.mlp_loss, tx, mesh=mesh, config=cfg)(state, models.batch(32))
    assert float(m["loss_scale"]) == 2.0**12
    assert jax.tree.leaves(state.opt_state)  # built with the translated config


def test_cli(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO2_BF16))
    assert cli.main(["from-deepspeed", str(path)]) == 0
    out = capsys.readouterr()
    assert "config = zj.ZeroConfig(stage=2, compute_dtype='bfloat16'" in out.out
    assert "collectives=zj.config.Collectives(reduce_dtype='bfloat16'))" in out.out
    assert "tx = optax.adamw(" in out.out
    assert "zero_optimization.overlap_comm" in out.err
    assert "mesh =" not in out.out  # no replica groups: the mesh is zj.make_mesh()
    path.write_text(json.dumps(MICS))
    assert cli.main(["from-deepspeed", str(path)]) == 0
    assert "mesh = zj.make_mesh(group_size=4)" in capsys.readouterr().out
    path.write_text(json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    assert cli.main(["from-deepspeed", str(path)]) == 2
    assert "enables both fp16 and bf16" in capsys.readouterr().err


@pytest.mark.parametrize("size", [4, 3])
def test_the_printed_code_does_what_the_translation_does(size, tmp_path, capsys):
    """Every line `zerojax from-deepspeed` prints, run as Python: the config, the optimizer and
    the mesh of the Translation; a group size that does not divide the 8 devices is refused by
    the printed mesh as by Translation.make_mesh, never silently made larger."""
    ds = {**ZERO3_OFFLOAD, "zero_optimization": {**ZERO3_OFFLOAD["zero_optimization"], "mics_shard_size": size}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    t = translate(ds)
    assert cli.main(["from-deepspeed", str(path)]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if " = " in l]
    assert [l.split(" = ")[0] for l in lines] == ["config", "mesh", "tx", "monitor"]
    ns = {"zj": zj, "jax": jax, "optax": optax}
    exec(lines[0], ns)
    assert ns["config"] == t.config
    exec(lines[3], ns)
    assert [(type(w).__name__, w.every) for w in ns["monitor"].writers] == [("Console", 2000)]
    exec(lines[2], ns)
    from tests.test_deepspeed_config import assert_same_run

    assert_same_run(ns["tx"], t.tx, steps=3)  # the printed optimizer is the translation's
    if 8 % size == 0:
        exec(lines[1], ns)
        assert dict(ns["mesh"].shape) == dict(t.make_mesh().shape) == {"replica": 8 // size, "data": size}
    else:
        with pytest.raises(ValueError, match=f"group_size={size}.*do not divide the 8 devices") as printed:
            exec(lines[1], ns)
        with pytest.raises(ValueError, match=f"groups of {size} devices") as translated:
            t.make_mesh()
        assert str(printed.value) in str(translated.value)


def test_the_guide_shows_what_the_translation_prints():
    """docs/migrating.md's example output is the translation of its example config."""
    import pathlib

    guide = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "migrating.md").read_text()
    shown: dict = {}
    for line in guide.splitlines():  # the first of each: the printed output, before the loop
        if line.startswith(("config = zj.ZeroConfig(", "tx = optax.", "monitor = zj.monitor.")):
            shown.setdefault(*line.split(" = ", 1))
    t = translate(
        {
            k: v
            for k, v in ZERO3_OFFLOAD.items()
            if k
            in (
                "train_batch_size",
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "optimizer",
                "fp16",
                "gradient_clipping",
            )
        }
        | {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            }
        }
    )
    assert shown == {
        "config": t.code(),
        "tx": t.optimizer,
        "monitor": f"{t.monitor.code()}  # step = monitor.watch(step)",
    }


def test_shard_groups_must_divide_the_devices_and_are_stage_3_only():
    """mics_shard_size 3 on 8 devices: DeepSpeed refuses it; floor division made groups of
    4. MiCS and hpZ are ZeRO-3 features that DeepSpeed ignores at stages 1-2: not mapped,
    and the reason says so."""
    t = translate({"zero_optimization": {"stage": 3, "mics_shard_size": 3}})
    assert t.shard_size == 3 and "3 must divide the device count" in t.message()
    with pytest.raises(ValueError, match=r"groups of 3 devices .* do not divide the 8 devices \(DeepSpeed refuses"):
        t.make_mesh()
    mesh = translate({"zero_optimization": {"stage": 3, "mics_shard_size": 4}}).make_mesh()
    assert dict(mesh.shape) == {"replica": 2, "data": 4}
    assert dict(translate({"zero_optimization": {"stage": 3}}).make_mesh().shape) == {"data": 8}
    for stage in (1, 2):
        for key in ("mics_shard_size", "zero_hpz_partition_size"):
            t = translate({"zero_optimization": {"stage": stage, key: 4}})
            assert t.shard_size is None and t.mesh_code() == "zj.make_mesh()"
            assert f"at ZeRO stage 3 only and ignores it at stage {stage}" in t.unmapped[f"zero_optimization.{key}"]


@pytest.mark.parametrize("name", ["sgd", "fusedadam", "FusedAdam", "cpuadam", "Adan"])
def test_optimizer_names_deepspeed_refuses_are_refused(name):
    with pytest.raises(ValueError, match=rf"'optimizer.type' is '{name}', which DeepSpeed refuses: .* 'SGD'"):
        translate({"gradient_clipping": 1.0, "optimizer": {"type": name, "params": {"lr": 0.1}}})
    for ok in ("SGD", "adamw", "ADAM", "Lamb", "lion"):
        assert translate({"gradient_clipping": 1.0, "optimizer": {"type": ok, "params": {"lr": 0.1}}}).optimizer


def test_lion_and_lamb_carry_deepspeeds_defaults():
    """Lion without betas is DeepSpeed's (0.9, 0.999); Lamb's trust-ratio bounds, which
    optax.lamb lacks, are named with their values."""
    import optax

    t = translate({"gradient_clipping": 1.0, "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})
    assert t.optimizer == "optax.lion(learning_rate=0.0001, b1=0.9, b2=0.999, weight_decay=0.0)"
    tx = eval(t.optimizer, {"optax": optax})
    state = tx.init({"w": jnp.zeros(3)})
    g = {"w": jnp.asarray([1.0, -2.0, 0.0])}
    _, state = tx.update(g, state, {"w": jnp.zeros(3)})
    np.testing.assert_allclose(np.asarray(state[0].mu["w"]), 0.001 * np.asarray(g["w"]), rtol=1e-6)  # (1 - b2) g
    t = translate({"gradient_clipping": 1.0, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    assert "clips each layer's trust ratio to [min_coeff, max_coeff] = [0.01, 10.0]" in t.unmapped["optimizer"]
    t = translate({"gradient_clipping": 1.0, "optimizer": {"type": "Lamb", "params": {"max_coeff": 0.3}}})
    assert "[0.01, 0.3]" in t.unmapped["optimizer"] and "max_coeff" not in t.unmapped["optimizer"].split("[")[0]


@pytest.mark.parametrize("section,dtype,ds", [("bf16", "bfloat16", "bf16"), ("fp16", "float16", "fp16")])
def test_compute_dtype_reduction_default_is_named(section, dtype, ds):
    """DeepSpeed reduces gradients in the compute dtype when communication_data_type is
    absent; zerojax keeps float32 and says so."""
    t = translate({"gradient_clipping": 1.0, section: {"enabled": True}})
    assert t.config.collectives.reduce_dtype == "float32"
    assert (
        f"communication_data_type is absent: DeepSpeed then reduces gradients in the compute dtype ({dtype})"
        in t.message()
    ) and f"Set communication_data_type to '{ds}'" in t.message()
    t = translate({"gradient_clipping": 1.0, section: {"enabled": True}, "communication_data_type": ds})
    assert t.config.collectives.reduce_dtype == dtype and "communication_data_type" not in t.message()
    assert "communication_data_type" not in translate({"gradient_clipping": 1.0}).message()


def test_migration_guide_says_how_stock_deepspeeds_fp16_step_differs():
    """The guide used to promise "DeepSpeed's scaler, same sequence": stock DeepSpeed's ZeRO
    step updates the scale before unscaling, so curves differ after each doubling."""
    import pathlib

    guide = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "migrating.md").read_text()
    assert "same sequence" not in guide
    assert "updates the scale first and unscales the gradients" in guide
    assert "with the *new* value" in guide and "agree step for step" in guide


def test_sequence_parallel_size_is_the_context_axis():
    t = translate({"zero_optimization": {"stage": 3}, "sequence_parallel_size": 4, "gradient_clipping": 0})
    assert t.context == 4 and "sequence_parallel_size" not in t.unmapped
    assert t.mesh_code() == "zj.make_mesh(context=4)"
    assert dict(eval(t.mesh_code(), {"zj": zj}).shape) == dict(t.make_mesh().shape) == {"data": 2, "context": 4}
    both = translate({"zero_optimization": {"stage": 3, "mics_shard_size": 4}, "sequence_parallel_size": 2})
    assert both.mesh_code() == "zj.make_mesh(group_size=4, context=2)"
    assert dict(eval(both.mesh_code(), {"zj": zj}).shape) == {"replica": 2, "data": 2, "context": 2}
    assert translate({"sequence_parallel_size": 1}).context is None
    with pytest.raises(ValueError, match="sequence_parallel_size"):
        translate({"sequence_parallel_size": 0})


def test_autoep_expert_parallel_is_the_expert_axis():
    """DeepSpeed AutoEP's section (PR #7938 / #8064): autoep_size is the expert axis; an
    expert tensor-parallel degree is refused; disabled or size 1 builds no axis."""
    t = translate(
        {
            "zero_optimization": {"stage": 3},
            "expert_parallel": {"enabled": True, "autoep_size": 4, "expert_tensor_parallel_size": 1},
        }
    )
    assert t.expert == 4 and "expert_parallel" not in t.unmapped
    assert t.mesh_code() == "zj.make_mesh(expert=4)" and dict(t.make_mesh().shape) == {"data": 2, "expert": 4}
    assert translate({"expert_parallel": {"enabled": False, "autoep_size": 4}}).expert is None
    with pytest.raises(ValueError, match="expert_tensor_parallel_size' = 2"):
        translate({"expert_parallel": {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 2}})


# --- what the translation says about zerojax ------------------------------------------------

from zerojax.deepspeed import REASONS  # noqa: E402
from zerojax.deepspeed.keys import OFFLOAD_OPTIMIZER_KEYS, OFFLOAD_PARAM_KEYS, ZERO_KEYS  # noqa: E402


def test_autotp_size_is_the_tensor_axis(capsys, tmp_path):
    t = translate({"gradient_clipping": 1.0, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}})
    assert t.tensor == 2 and "tensor_parallel" not in t.unmapped
    assert t.mesh_code() == "zj.make_mesh(tensor=2)" and dict(t.make_mesh().shape) == {"data": 4, "tensor": 2}
    assert "tensor_parallel.tp_overlap_comm" in t.unmapped and any("annotates" in n for n in t.notes)
    assert translate({"tensor_parallel": {"autotp_size": 0}}).tensor is None  # 0: AutoTP off, as in DeepSpeed
    path = tmp_path / "tp.json"
    path.write_text(json.dumps({"gradient_clipping": 1.0, "tensor_parallel": {"autotp_size": 2}}))
    assert cli.main(["from-deepspeed", str(path)]) == 0
    assert "mesh = zj.make_mesh(tensor=2)  # the weights the model annotates split over 2 devices" in (
        capsys.readouterr().out
    )


def test_reasons_name_what_zerojax_has():
    """The reasons name zerojax's own counterpart (no "data parallel only": tensor, context
    and expert axes exist), and every zerojax name a reason or note gives exists: none
    points at experiments/, which pip does not install."""
    import re

    ds = {
        "gradient_clipping": 1.0,
        "pipeline": {"stages": "auto"},
        "autotuning": {"enabled": True},
        "elasticity": {"enabled": True},
        "activation_checkpointing": {"partition_activations": True},
        "steps_per_print": 10,
        "wall_clock_breakdown": True,
        "tensorboard": {"enabled": True},
        "comms_logger": {"enabled": True},
        "flops_profiler": {"enabled": True},
        "memory_breakdown": True,
        "tensor_parallel": {"autotp_size": 2},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7},
    }
    t = translate(ds)
    said = t.message()
    assert "data parallel" not in said and "experiments/" not in said
    assert "pipeline_stages=P" in t.unmapped["pipeline"]  # the stage count is the model's
    assert "zj.autotune" in t.unmapped["autotuning"] and "zerojax autotune" in t.unmapped["autotuning"]
    assert "zerojax.resume.Run" in t.unmapped["elasticity"]
    assert "context" in t.unmapped["activation_checkpointing.partition_activations"]
    for text in [*REASONS.values(), *t.notes]:
        assert "experiments/" not in text and "data parallel (ZeRO) only" not in text
        for name in re.findall(r"\b(?:zj|zerojax)\.[A-Za-z_][\w.]*[A-Za-z_]", text):
            obj = zj
            for part in name.split(".")[1:]:
                assert hasattr(obj, part), f"{name} (in {text!r}) does not exist"
                obj = getattr(obj, part)


@pytest.mark.parametrize(
    "zero,nearest",
    [
        ({"stage": 3, "stage3_prefetch_bucket_sise": 1e6}, "stage3_prefetch_bucket_size"),
        ({"stage": 2, "overlap_com": True}, "overlap_comm"),
        ({"stage": 2, "contigous_gradients": True}, "contiguous_gradients"),
        ({"stage": 3, "stage4_magic": 1}, "stage"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memori": True}}, "pin_memory"),
        ({"stage": 3, "offload_param": {"device": "cpu", "buffer_sise": 1}}, "buffer_size"),
    ],
)
def test_zero_optimization_typos_are_refused_with_the_nearest_key(zero, nearest):
    with pytest.raises(ValueError, match=rf"is not a key of .*the nearest one is '{nearest}'"):
        translate({"gradient_clipping": 1.0, "zero_optimization": zero})


def test_every_misspelt_zero_key_is_refused_naming_the_key_meant():
    """DeepSpeed's zero_optimization models forbid extra keys: every key with one letter
    dropped or doubled is refused, naming the key meant; every key DeepSpeed accepts is
    either mapped or given a reason."""
    rng = np.random.default_rng(0)
    for section, known in (
        ("zero_optimization", ZERO_KEYS),
        ("zero_optimization.offload_param", OFFLOAD_PARAM_KEYS),
        ("zero_optimization.offload_optimizer", OFFLOAD_OPTIMIZER_KEYS),
    ):
        for key in sorted(known):
            i = int(rng.integers(len(key)))
            typo = key[:i] + key[i + 1 :] if rng.random() < 0.5 else key[:i] + key[i] + key[i:]
            if typo in known:
                continue
            zero = {"stage": 3, typo: 1}
            if section != "zero_optimization":
                zero = {"stage": 3, section.split(".")[1]: {"device": "cpu", typo: 1}}
            with pytest.raises(ValueError, match=rf"'{section}.{typo}' is not a key .* nearest one is '{key}'"):
                translate({"gradient_clipping": 1.0, "zero_optimization": zero})
    from zerojax.deepspeed.mapping import _PREFETCH_KEYS, _ZERO_MAPPED

    for key in ZERO_KEYS - set(_ZERO_MAPPED) - set(_PREFETCH_KEYS):
        assert f"zero_optimization.{key}" in REASONS, key


@pytest.mark.parametrize("op", ["sum", "SUM"])
def test_a_summed_gradient_is_refused_with_the_fix(op):
    with pytest.raises(ValueError, match=r"'gradient_allreduce_op' is 'sum': zerojax averages .*multiply the loss"):
        translate({"gradient_clipping": 1.0, "gradient_allreduce_op": op})
    t = translate({"gradient_clipping": 1.0, "gradient_allreduce_op": "mean"})
    assert t.unmapped == {} and t.config == zj.ZeroConfig(stage=0, grad_clip=1.0)
    with pytest.raises(ValueError, match="must be 'mean' or 'sum'"):
        translate({"gradient_allreduce_op": "max"})


@pytest.mark.parametrize("key", ["stage3_prefetch_bucket_size", "prefetch_bucket_size"])
def test_prefetch_bucket_size_sets_prefetch(key):
    on = translate({"gradient_clipping": 1.0, "zero_optimization": {"stage": 3, key: 5e7}})
    assert on.config.prefetch == 1 and f"zero_optimization.{key}" not in on.unmapped
    assert any("prefetch=1" in n for n in on.notes) and eval(on.code(), {"zj": zj}) == on.config
    off = translate({"gradient_clipping": 1.0, "zero_optimization": {"stage": 3, key: 0}})
    assert off.config.prefetch == 0 and off.unmapped == {}
    stage2 = translate({"gradient_clipping": 1.0, "zero_optimization": {"stage": 2, key: 5e7}})
    assert stage2.config.prefetch == 0 and "stage 2" in stage2.unmapped[f"zero_optimization.{key}"]
    offloaded = translate(
        {"gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, key: 5e7}}
    )
    assert offloaded.config.prefetch == 0 and "offload_param" in offloaded.unmapped[f"zero_optimization.{key}"]
    with pytest.raises(ValueError, match="keep one"):
        translate({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 1}})
    # "auto": the HF Trainer fills stage3_prefetch_bucket_size with 0.9 x hidden_size^2 (positive);
    # DeepSpeed drops an "auto" it was not given, leaving its default, 5e7. Prefetching either way.
    assert translate({"zero_optimization": {"stage": 3, key: "auto"}}).config.prefetch == 1
    filled = translate({"zero_optimization": {"stage": 3, key: "auto"}}, auto={"hidden_size": 64})
    assert filled.config.prefetch == 1
    if key.startswith("stage3_"):
        assert (f"zero_optimization.{key}", int(0.9 * 64 * 64)) in [r[:2] for r in filled.resolved]


def test_logging_keys_build_a_monitor_where_deepspeed_writes(tmp_path):
    """DeepSpeed's monitor sections become zj.monitor writers at DeepSpeed's paths
    (output_path/job_name); what has no writer is named, and the monitor builds and writes."""
    out = str(tmp_path)
    ds = {
        "zero_optimization": {"stage": 1},
        "steps_per_print": 3,
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb_job"},
        "csv_monitor": {"enabled": True, "output_path": out},
        "wandb": {"enabled": False, "project": "p"},
        "comet": {"enabled": True, "project": "x"},
        "wall_clock_breakdown": True,
        "flops_profiler": {"enabled": True, "profile_step": 1},
    }
    t = translate(ds)
    assert t.monitor.code() == (
        f"zj.monitor.Monitor([zj.monitor.Console(every=3), zj.monitor.TensorBoard(logdir={out + '/tb_job'!r}), "
        f"zj.monitor.CSV({out + '/DeepSpeedJobName/metrics.csv'!r}, makedirs=True)], flops_per_step='compiled')"
    )
    assert "comet" in t.unmapped and "zj.monitor.Writer" in t.unmapped["comet"]
    for key in ("steps_per_print", "tensorboard", "csv_monitor", "wandb", "wall_clock_breakdown", "flops_profiler"):
        assert key not in t.unmapped
    assert any("step_time_s" in n for n in t.notes) and any("one CSV with a column per metric" in n for n in t.notes)
    monitor = t.monitor.build(tokens_per_step=8)
    assert [type(w).__name__ for w in monitor.writers] == ["Console", "TensorBoard", "CSV"]
    assert monitor.writers[0].every == 3 and monitor.tokens_per_step == 8 and monitor.flops_per_step == "compiled"
    monitor.write("eval", 1, {"eval_loss": 1.5})
    monitor.close()
    assert open(tmp_path / "DeepSpeedJobName" / "metrics.csv").read().splitlines() == [
        "kind,step,eval_loss",
        "eval,1,1.5",
    ]
    assert os.listdir(tmp_path / "tb_job")  # the event file
    wandb = translate({"wandb": {"enabled": True, "team": "t", "group": "g"}}).monitor
    assert wandb.writers[1] == ("WandB", (("project", "deepspeed"), ("group", "g"), ("entity", "t")))


@pytest.mark.parametrize(
    "ds, match",
    [
        ({"steps_per_print": 0}, "steps_per_print"),
        ({"tensorboard": {"enabled": "yes"}}, "tensorboard.enabled"),
        ({"tensorboard": {"enabled": True, "path": "x"}}, r"no key\(s\) \['path'\]"),
        ({"wandb": True}, "must be an object"),
        ({"wall_clock_breakdown": 1}, "wall_clock_breakdown"),
    ],
)
def test_bad_logging_keys_are_refused(ds, match):
    with pytest.raises(ValueError, match=match):
        translate(ds)
