"""Models that carry their own sharding (MaxText style): logical axis names on every parameter,
activation constraints against the model's own mesh and rules, scanned remat'd layers. Under
``ZeroConfig(axes={"model_axes": ...})`` they train as on one device, at every stage, with and without
tensor parallelism."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax as zj
from experiments.maxtext_style import AXIS_MAP, RULES, SEQ, build, data, make_loss
from tests.models import abs_errors, reference_run


@pytest.mark.parametrize(
    "tensor,stages",
    [
        pytest.param(1, (0, 3), marks=pytest.mark.slow),
        (2, (3,)),
        pytest.param(1, (1, 2), marks=pytest.mark.slow),
        pytest.param(2, (0, 1, 2), marks=pytest.mark.slow),
    ],
)  # slow: about 4 s a stage; tensor 2 at stage 3 stays in the default set (stage 0 with the
# model's axis_map trains in test_attention_on_the_models_mesh_trains_as_on_one_device)
def test_maxtext_style_model_trains_as_on_one_device(tensor, stages):
    graphdef, params = build()
    loss_fn, tx = make_loss(graphdef), optax.sgd(0.3)
    ref, ref_losses = reference_run(loss_fn, jax.tree.map(jnp.asarray, params), tx, data())
    mesh = zj.make_mesh(tensor=tensor)
    for stage in stages:
        cfg = zj.ZeroConfig(stage=stage, axes={"model_axes": AXIS_MAP, "rules": RULES})
        state = zj.init_state(params, tx, mesh=mesh, config=cfg)
        step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
        losses = []
        for b in data():
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert abs_errors(zj.gather_params(state), ref).max() <= 1e-5, stage
        # "mlp" -> ("fsdp_transpose", "tensor") -> ("data", "tensor"): split over "tensor" where the mesh has it
        split = {p.split("]")[-2].strip("['"): l.tdim for p, l in zip(state.plan.paths, state.plan.layouts)}
        assert (split["wi"], split["wout"], split["wq"], split["norm"]) == (
            (2, 1, 2, -1) if tensor > 1 else (-1, -1, -1, -1)
        )


def _constraint_specs(jaxpr) -> list:
    """The specs of every sharding constraint in ``jaxpr`` and the programs inside it."""
    from zerojax._jaxpr.form import programs_in as _sub_jaxprs

    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            out.append(tuple(eqn.params["sharding"].spec))
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                out += _constraint_specs(sub)
    return out


def test_constraints_translated_onto_zerojax_mesh():
    """The model's constraints name ("data", "fsdp", "fsdp_transpose") and "tensor" on its own
    mesh; inside the step only "tensor" ones remain, on zerojax's mesh (the batch axes are
    the shard_map's own)."""
    from zerojax.sharding import foreign
    from zerojax.sharding.plan import make_plan

    graphdef, params = build()
    loss_fn, b = make_loss(graphdef), data(1)[0]
    local = {"tokens": jax.ShapeDtypeStruct((4, SEQ + 1), jnp.int32)}
    model = _constraint_specs(jax.make_jaxpr(loss_fn)(params, local).jaxpr)
    assert any("tensor" in str(s) for s in model) and all("fsdp" in str(s) for s in model)
    mesh = zj.make_mesh(tensor=2)
    plan = make_plan(params, mesh, zj.ZeroConfig(axes={"model_axes": AXIS_MAP, "rules": RULES}))
    closed, _ = foreign.trace(loss_fn, (params, local), plan)
    specs = []

    def capture(p, t):
        program = foreign.Translator(plan).program(closed)
        specs.extend(_constraint_specs(program.jaxpr if hasattr(program, "jaxpr") else program))
        return t

    jax.eval_shape(
        jax.shard_map(
            capture, mesh=plan.mesh, in_specs=(P(), P("data")), out_specs=P("data"), axis_names=plan.manual_axes
        ),
        params,
        b["tokens"],
    )
    # the logits' constraint (batch only) is gone; every other one keeps its "tensor" dimension
    assert specs and all(set(s) <= {None, "tensor"} and "tensor" in s for s in specs), specs
    assert len(specs) == sum("tensor" in s for s in model)


def test_eval_step_with_own_sharding():
    graphdef, params = build()
    loss_fn = make_loss(graphdef)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3, axes={"model_axes": AXIS_MAP})
    state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=cfg)
    ev = zj.make_eval_step(lambda p, b: {"loss": loss_fn(p, b)}, mesh=mesh, config=cfg)
    b = data(1)[0]
    assert float(ev(state, b)["loss"]) == pytest.approx(float(jax.jit(loss_fn)(params, b)), rel=1e-5)


def test_without_axis_map_the_error_says_what_to_set():
    graphdef, params = build()
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=cfg)
    step = zj.make_train_step(make_loss(graphdef), optax.sgd(0.1), mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match=r"ZeroConfig\(axes=\{'model_axes'"):
        step(state, data(1)[0])


def test_unknown_axis_names_the_source_lines_of_the_helper_and_its_callers():
    graphdef, params = build()
    mesh = zj.make_mesh()
    # no fsdp_transpose in model_axes
    cfg = zj.ZeroConfig(stage=2, axes={"model_axes": {"data": "data", "fsdp": "data", "tensor": "tensor"}})
    state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=cfg)
    step = zj.make_train_step(make_loss(graphdef), optax.sgd(0.1), mesh=mesh, config=cfg)
    with pytest.raises(
        ValueError,
        match=r"mesh axis 'fsdp_transpose' .* at .*maxtext_style.py:\d+.*"
        r"axes=\{'model_axes': \{'fsdp_transpose': 'data'\}\}",
    ) as err:
        step(state, data(1)[0])
    # The helper that constrains (as MaxText's maybe_shard_with_name) and the layer that called it.
    import inspect

    from experiments import maxtext_style

    helper = inspect.getsourcelines(maxtext_style.constrain)[1]
    body, first = inspect.getsourcelines(maxtext_style.Decoder.__call__)
    caller = next(first + i for i, line in enumerate(body) if "constrain(" in line)  # its first constraint
    text = str(err.value)
    assert f"maxtext_style.py:{helper + 2} (constrain), called from " in text, text
    assert f"maxtext_style.py:{caller} (Decoder.__call__)" in text, text


def test_bad_axis_map():
    with pytest.raises(ValueError, match=r"Axes.model_axes must map"):
        zj.ZeroConfig(axes={"model_axes": {"fsdp": 3}})
    graphdef, params = build()
    with pytest.raises(ValueError, match=r"maps the model's axis 'fsdp' to 'model', which is not an axis"):
        zj.abstract_state(
            params, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(axes={"model_axes": {"fsdp": "model"}})
        )


# A model whose attention runs on values that carry its own mesh. JAX's vmap (inside
# jax.nn.dot_product_attention, around its masks) broadcasts an unbatched operand under that
# value's mesh, and JAX records the mesh with the equation; re-bound under it inside the step,
# the broadcast took the model's mesh again and met the step's values ("Mesh for all inputs
# should be equal", jax.nn.dot_product_attention with is_causal=True, with or without a mask).
OWN_MESH = jax.make_mesh((2, 2, 2), ("batch", "fsdp", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
OWN_MAP = {"batch": "data", "fsdp": "data", "model": "tensor"}
T, N, K, H = 4, 4, 2, 2  # sequence, query heads, key/value heads (grouped), head size


def _attention_loss(kind: str, constrain: bool):
    """A one-layer attention model, its activations constrained to OWN_MESH (``constrain``),
    its mask per ``kind``: ``causal`` (is_causal=True), ``mask+causal`` (the input's segments
    and is_causal), ``tril`` (jnp.tril and jnp.logical_and with the segments, as a mask),
    ``vmap`` (a hand-written attention under jax.vmap over the heads, with a gate every head
    shares: vmap broadcasts that unbatched value on the model's mesh, no attention code of
    JAX's involved)."""
    from jax.sharding import NamedSharding

    def own(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(OWN_MESH, spec)) if constrain else x

    def loss(p, b):
        B = b["x"].shape[0]
        h = own(b["x"] @ p["wqkv"], P(("batch", "fsdp"), None, "model"))
        q, k, v = jnp.split(h, [N * H, (N + K) * H], axis=-1)
        q, k, v = q.reshape(B, T, N, H), k.reshape(B, T, K, H), v.reshape(B, T, K, H)
        same = (b["seg"][:, :, None] == b["seg"][:, None, :])[:, None]  # [B, 1, T, T], from the input
        if kind == "causal":
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        elif kind == "mask+causal":
            out = jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True)
        elif kind == "tril":
            out = jax.nn.dot_product_attention(q, k, v, mask=jnp.logical_and(jnp.tril(jnp.ones((T, T), bool)), same))
        else:
            k, v = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
            gate = own(jax.nn.sigmoid(h[..., :H]), P(("batch", "fsdp"), None, "model"))  # [B, T, H], every head's

            def head(qh, kh, vh, gate):
                logits = jnp.einsum("bqh,bkh->bqk", qh, kh)
                probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -1e9), axis=-1)
                return jnp.einsum("bqk,bkh->bqh", probs, vh) * gate

            out = jax.vmap(head, in_axes=(2, 2, 2, None), out_axes=2)(q, k, v, gate)
        out = own(out.reshape(B, T, N * H), P(("batch", "fsdp"), None, "model"))
        return jnp.mean((out @ p["wo"] - b["y"]) ** 2)

    return loss


def _attention_data(steps: int = 2, rows: int = 16):
    rng = np.random.default_rng(7)
    return [
        {
            "x": jnp.asarray(rng.normal(size=(rows, T, 6)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(rows, T, 3)), jnp.float32),
            "seg": jnp.asarray(np.sort(rng.integers(0, 2, size=(rows, T)), axis=1), jnp.int32),
        }
        for _ in range(steps)
    ]


def _attention_params():
    rng = np.random.default_rng(0)
    return {
        "wqkv": jnp.asarray(rng.normal(size=(6, (N + 2 * K) * H)) / 2, jnp.float32),
        "wo": jnp.asarray(rng.normal(size=(N * H, 3)) / 2, jnp.float32),
    }


SLOW = pytest.mark.slow


# tensor 2: the "model" constraints kept. Every kind at stage 3 and the mask with is_causal at
# stage 0 too in the default set; tensor 1 at stage 0, and the mask with is_causal at tensor 1
# (the same loss stays at tensor 2), in the slow set.
@pytest.mark.parametrize(
    "kind,tensor,stage",
    [("causal", 1, 3), ("tril", 1, 3), ("vmap", 1, 3), ("mask+causal", 2, 0), ("mask+causal", 2, 3)]
    + [pytest.param(kind, 1, 0, marks=SLOW) for kind in ("causal", "tril", "vmap", "mask+causal")]
    + [pytest.param("mask+causal", 1, 3, marks=SLOW)],
)
def test_attention_on_the_models_mesh_trains_as_on_one_device(kind, tensor, stage):
    params, tx, batches = _attention_params(), optax.sgd(0.1), _attention_data()
    ref, ref_losses = reference_run(_attention_loss(kind, constrain=False), params, tx, batches)
    loss_fn, mesh = _attention_loss(kind, constrain=True), zj.make_mesh(tensor=tensor)
    cfg = zj.ZeroConfig(stage=stage, axes={"model_axes": OWN_MAP})
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert abs_errors(zj.gather_params(state), ref).max() <= 1e-5


def test_the_translated_program_binds_nothing_under_the_models_mesh():
    """JAX records the mesh each equation was traced under and binds it again under that one.
    Outside the step, vmap traced the gate's broadcast under the model's mesh; translated,
    every equation is bound under the step's (inside its shard_map: manual over "data")."""
    from zerojax._jaxpr import form, settings, walk
    from zerojax.sharding import foreign
    from zerojax.sharding.plan import make_plan

    params, b = _attention_params(), _attention_data(1, rows=8)[0]
    plan = make_plan(params, zj.make_mesh(), zj.ZeroConfig(axes={"model_axes": OWN_MAP}))
    local = jax.tree.map(lambda x: x[:1], b)  # one device's rows
    closed, _ = foreign.trace(_attention_loss("vmap", constrain=True), (params, local), plan)
    outside = {form.traced_mesh(e).axis_names for e in walk.equations(form.open_jaxpr(closed)[0])}
    assert ("batch", "fsdp", "model") in outside, outside
    inside = []

    def capture(p, batch):
        program = foreign.Translator(plan).program(closed)
        inside.extend(form.traced_mesh(e) for e in walk.equations(form.open_jaxpr(program)[0]))
        return batch["x"]

    jax.eval_shape(
        jax.shard_map(
            capture, mesh=plan.mesh, in_specs=(P(), P("data")), out_specs=P("data"), axis_names=plan.manual_axes
        ),
        params,
        b,
    )
    assert inside and {m.axis_names for m in inside} == {("data",)}, inside
    assert all(settings.manual_axes(m) == {"data"} for m in inside), inside
