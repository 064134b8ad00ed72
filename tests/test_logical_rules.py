"""Logical axis rules resolve as Flax resolves them: linen by precedence (the first rule
whose mesh axes are free), NNX as a table (the last rule of a name) -- checked against
Flax's own functions on MaxText-style rule lists, and through the plan on a tensor mesh."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax import nnx

import zerojax as zj
from zerojax.sharding import logical
from zerojax.sharding.plan import make_plan

# MaxText's base.yml style: names repeated in order of preference, tuples of mesh axes,
# empty targets; the 12 axes of its mesh.
MAXTEXT_RULES = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    ("activation_heads", ("tensor", "tensor_transpose", "sequence", "tensor_sequence")),
    ("activation_length", ("sequence", "context")),
    ("activation_length", ("context",)),
    ("activation_vocab", ("tensor", "tensor_transpose", "sequence", "tensor_sequence")),
    ("activation_vocab", ("tensor", "tensor_transpose")),
    ("activation_vocab", "tensor_sequence"),
    ("activation_vocab", ("sequence", "context")),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("vocab", ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive")),
    ("heads", ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive")),
    ("q_heads", ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive")),
    ("kv_heads", ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive")),
    ("embed", ("fsdp", "fsdp_transpose", "sequence", "tensor_transpose", "context", "expert")),
    ("embed", ("fsdp", "sequence", "tensor_transpose", "context", "expert")),
    ("embed", ("fsdp", "fsdp_transpose", "sequence", "context", "expert")),
    ("embed", ("fsdp", "sequence", "context", "expert")),
    ("embed_no_exp", ("fsdp", "fsdp_transpose", "sequence", "tensor_transpose", "context")),
    ("embed_moe", ("fsdp", "fsdp_transpose", "sequence", "tensor_transpose", "context")),
    ("embed_moe", ("fsdp", "sequence", "context")),
    ("q_lora", ("fsdp", "fsdp_transpose", "sequence", "context", "tensor_transpose", "expert")),
    ("q_lora", ("fsdp", "sequence", "context", "tensor_transpose", "expert")),
    ("q_lora", ("fsdp", "fsdp_transpose", "sequence", "context", "expert")),
    ("kv_lora", ("fsdp", "fsdp_transpose", "sequence", "context", "tensor_transpose", "expert")),
    ("kv_lora", ("fsdp", "sequence", "context", "expert")),
    ("norm", ("tensor", "tensor_transpose", "tensor_sequence")),
    ("layers", "stage"),
    ("kv", ()),
    ("kv_head_dim", ()),
    ("exp", "expert"),
    ("mlp_moe", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("mlp_moe", "tensor"),
)
MAXTEXT_AXES = (
    "data",
    "stage",
    "fsdp",
    "fsdp_transpose",
    "sequence",
    "context",
    "tensor",
    "tensor_transpose",
    "tensor_sequence",
    "expert",
    "autoregressive",
)
ANNOTATIONS = [
    ("embed", "mlp"),
    ("mlp", "embed"),
    ("embed", "vocab"),
    ("vocab", "embed"),
    ("embed", "heads", "kv"),
    ("heads", "kv", "embed"),
    ("layers", "embed", "q_lora"),
    ("embed", "kv_lora"),
    ("q_lora", "kv_lora"),
    ("exp", "embed_moe", "mlp_moe"),
    ("exp", "mlp_moe", "embed_moe"),
    ("norm",),
    ("layers", "norm"),
    ("activation_batch", "activation_length", "activation_vocab"),
    ("activation_heads", "activation_vocab"),
    ("embed", None, "mlp"),
    (None, "kv_head_dim"),
    ("embed_no_exp", "q_heads", "kv_heads"),
    ("mlp", "mlp_moe"),
    ("kv_heads", "heads"),
]
# The example: a repeated name whose first rule splits and second does not.
SIMPLE = (("x", "tensor"), ("x", None), ("y", "tensor"))


def axes(entry) -> tuple:
    """One PartitionSpec entry as a tuple of mesh axes (None, (), [] -> ())."""
    if entry is None or entry is logical.UNRULED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def ours(names, rules, style) -> tuple:
    return tuple(axes(x) for x in logical.resolve(logical.Annotation(names, style), rules))


@pytest.mark.parametrize("rules", [MAXTEXT_RULES, SIMPLE], ids=["maxtext", "simple"])
def test_linen_rules_resolve_as_nn_logical_to_mesh_axes(rules):
    annotations = ANNOTATIONS if rules is MAXTEXT_RULES else [("x", "y"), ("y", "x"), ("x",), ("y", None, "x")]
    for names in annotations:
        want = tuple(axes(x) for x in nn.logical_to_mesh_axes(names, rules))
        assert ours(names, rules, logical.LINEN) == want, names
    assert ours(("x", "y"), SIMPLE, logical.LINEN) == (("tensor",), ())  # the first rule of "x" wins


def _nnx_spec(names, rules, local=None):
    with nnx.use_eager_sharding(False):
        kw = {} if local is None else {"sharding_rules": local}
        v = nnx.Param(jnp.zeros((2,) * len(names)), out_sharding=names, **kw)
    with nnx.logical_axis_rules(rules):
        spec = nnx.get_partition_spec(nnx.State({"v": v}))["v"]
    return tuple(spec.get_value() if hasattr(spec, "get_value") else spec.value)


@pytest.mark.parametrize("rules", [MAXTEXT_RULES, SIMPLE], ids=["maxtext", "simple"])
def test_nnx_rules_resolve_as_nnx_get_partition_spec(rules):
    annotations = ANNOTATIONS if rules is MAXTEXT_RULES else [("x", "y"), ("y", "x"), ("x",), ("y", None, "x")]
    for names in annotations:
        want = tuple(axes(x) for x in _nnx_spec(names, rules))
        assert ours(names, rules, logical.NNX) == want, names
    assert ours(("x", "y"), SIMPLE, logical.NNX) == ((), ("tensor",))  # a table: the last rule of "x"
    # A Variable's own rules join the context's; a contradiction is refused as Flax refuses it.
    local = (("z", "tensor"),)
    got = logical.resolve(logical.Annotation(("z", "x"), logical.NNX, local), SIMPLE)
    assert tuple(axes(x) for x in got) == tuple(axes(x) for x in _nnx_spec(("z", "x"), SIMPLE, local))
    with pytest.raises(ValueError, match="contradicts ZeroConfig.axes.rules"):
        logical.resolve(logical.Annotation(("y",), logical.NNX, (("y", None),)), SIMPLE)


def test_a_name_twice_in_one_linen_annotation_is_refused_as_flax_refuses_it():
    with pytest.raises(ValueError, match="occur more than once"):
        nn.logical_to_mesh_axes(("x", "x"), SIMPLE)
    with pytest.raises(ValueError, match=r"names \['x'\] on more than one dimension"):
        logical.resolve(logical.Annotation(("x", "x")), SIMPLE)


# The plan, on a tensor mesh: the dimension split over "tensor" is the one Flax's own
# resolution puts "tensor" on, for linen boxes and NNX Variables alike.
MAXTEXT_MAP = {
    a: ("data" if a in ("data", "fsdp", "fsdp_transpose") else "tensor" if a == "tensor" else None)
    for a in MAXTEXT_AXES
}


def _shape(names):
    return tuple(4 for _ in names)


def _linen_params(annotations):
    return {f"p{i:02d}": nn.LogicallyPartitioned(jnp.zeros(_shape(n)), n) for i, n in enumerate(annotations)}


def _nnx_params(annotations):
    with nnx.use_eager_sharding(False):
        return nnx.State(
            {f"p{i:02d}": nnx.Param(jnp.zeros(_shape(n)), out_sharding=n) for i, n in enumerate(annotations)}
        )


def _tensor_dims(flax_spec) -> list[int]:
    return [d for d, e in enumerate(flax_spec) if any(MAXTEXT_MAP.get(a, a) == "tensor" for a in axes(e))]


def _tensor_dim(flax_spec) -> int:
    dims = _tensor_dims(flax_spec)
    assert len(dims) <= 1
    return dims[0] if dims else -1


@pytest.mark.parametrize("style", ["linen", "nnx"])
def test_the_plan_splits_the_dimension_flax_splits(style):
    mesh = zj.make_mesh(tensor=2)
    annotations = [n for n in ANNOTATIONS if "activation_batch" not in n]
    rules_cases = [(MAXTEXT_RULES, MAXTEXT_MAP, annotations), (SIMPLE, None, [("x", "y"), ("y", "x"), ("x",)])]
    for rules, amap, anns in rules_cases:
        twice = [n for n in anns if style == "nnx" and len(_tensor_dims(_nnx_spec(n, rules))) > 1]
        anns = [n for n in anns if n not in twice]
        params = _linen_params(anns) if style == "linen" else _nnx_params(anns)
        cfg = zj.ZeroConfig(stage=3, axes={"rules": rules, "model_axes": amap})
        plan = make_plan(params, mesh, cfg)
        for i, names in enumerate(anns):
            spec = nn.logical_to_mesh_axes(names, rules) if style == "linen" else _nnx_spec(names, rules)
            assert plan.layouts[i].tdim == _tensor_dim(spec), (style, names, spec)
        if style == "nnx":  # NNX's table can put one mesh axis on two dimensions: refused, as JAX refuses it
            for names in twice:
                assert len(_tensor_dims(_nnx_spec(names, rules))) == 2
                with pytest.raises(ValueError, match="on dimensions"):
                    make_plan(_nnx_params([names]), mesh, cfg)
    # The case: linen splits "x" over "tensor" (dimension 0), NNX leaves it whole and
    # splits "y" (dimension 1).
    params = _linen_params([("x", "y")]) if style == "linen" else _nnx_params([("x", "y")])
    plan = make_plan(params, mesh, zj.ZeroConfig(stage=3, axes={"rules": SIMPLE}))
    assert plan.layouts[0].tdim == (0 if style == "linen" else 1)


def test_partitioned_boxes_name_mesh_axes_and_no_rule_applies():
    # nn.with_partitioning names mesh axes: a rule for the same name does not rename it.
    params = {"w": nn.Partitioned(jnp.zeros((4, 4)), (None, "tensor"))}
    plan = make_plan(params, zj.make_mesh(tensor=2), zj.ZeroConfig(axes={"rules": (("tensor", None),)}))
    assert plan.layouts[0].tdim == 1
    assert tuple(nn.get_partition_spec(params)["w"]) == (None, "tensor")


def test_a_box_with_its_own_rules_uses_them_as_flax_does():
    box = nn.LogicallyPartitioned(jnp.zeros((4, 4)), ("x", "y"), rules=(("x", None), ("y", "tensor")))
    plan = make_plan({"w": box}, zj.make_mesh(tensor=2), zj.ZeroConfig(axes={"rules": SIMPLE}))
    assert plan.layouts[0].tdim == 1  # its own rules replace the context's, as in unbox()
    assert tuple(nn.logical_to_mesh_axes(("x", "y"), box.rules)) == (None, "tensor")
