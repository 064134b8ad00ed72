"""Pipeline parallelism beside ZeRO: the loss's layer scan split over ``make_mesh(pipeline=P)``.

Every training test compares with plain single-device optax on the whole batch
(``models.reference_run``); the communication claims are read from the compiled step's
collectives, the memory ones from the arrays' own shards.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.models import gpt
from zerojax.report.comm import communication_report
from zerojax.tuning.hlo_cost import loop_cost

L, D, V, ROWS, T = 8, 6, 16, 16, 5


def toy_params(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "embed": jax.random.normal(k[0], (V, D)) * 0.5,
        "blocks": {"w": jax.random.normal(k[1], (L, D, D)) * 0.4, "b": jnp.full((L, D), 0.1)},
        "head": jax.random.normal(k[2], (D, V)) * 0.5,
    }


def toy_loss(p, batch):
    """An embedding, a residual layer stack run by ``lax.scan``, a head and cross-entropy, with
    a per-row mask the layers read (a batch-derived value closed over by the scan body)."""
    x = p["embed"][batch["x"]]
    keep = (batch["x"] > 0).astype(x.dtype)[..., None]

    def layer(h, w):
        return h + keep * jnp.tanh(h @ w["w"] + w["b"]), None

    x, _ = jax.lax.scan(layer, x, p["blocks"])
    return optax.softmax_cross_entropy_with_integer_labels(x @ p["head"], batch["y"]).mean()


def toy_batches(n: int = 3, rows: int = ROWS, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [
        {"x": jnp.asarray(rng.integers(0, V, (rows, T))), "y": jnp.asarray(rng.integers(0, V, (rows, T)))}
        for _ in range(n)
    ]


def pipeline_run(loss_fn, params, tx, batches, *, pipeline, data, micro, stage=3, with_rng=False, **config):
    mesh = zj.make_mesh(jax.devices()[: pipeline * data], pipeline=pipeline)
    group = {"microbatches": micro, "stack": config.pop("pipeline_stack", None)}
    group["carry_reduce"] = config.pop("pipeline_carry", None)
    group["schedule"] = config.pop("pipeline_schedule", "gpipe")
    group["repeats"] = config.pop("pipeline_repeats", 1)
    cfg = zj.ZeroConfig(stage=stage, pipeline=group, **config)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg, rng=jax.random.key(7) if with_rng else None)
    step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg, with_rng=with_rng)
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append({k: float(v) for k, v in m.items()})
    assert step.compile_count() == 1
    return state, metrics


def _max_err(a, b) -> float:
    return float(models.abs_errors(jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)).max())


# --- the mesh and the config -----------------------------------------------------------


def test_the_pipeline_axis_is_outermost_and_each_stage_is_contiguous_devices():
    mesh = zj.make_mesh(pipeline=2, replicas=2)
    assert mesh.axis_names == ("pipeline", "replica", "data")
    devices = jax.devices()
    for p in range(2):
        assert sorted(d.id for d in mesh.devices[p].flat) == [d.id for d in devices[4 * p : 4 * p + 4]]
    assert dict(zj.make_mesh(pipeline=2, tensor=2).shape) == {"pipeline": 2, "data": 2, "tensor": 2}
    with pytest.raises(ValueError, match=r"make_mesh\(pipeline=3\): 8 devices do not split .* Use pipeline in"):
        zj.make_mesh(pipeline=3)
    with pytest.raises(ValueError, match=r"pipeline_axis='data'\) must be a non-empty name other than"):
        zj.make_mesh(pipeline=2, pipeline_axis="data")


def test_the_pipeline_group_is_validated_and_needs_a_pipeline_axis():
    assert zj.ZeroConfig(pipeline={"microbatches": 4}).pipeline == zj.config.Pipeline(microbatches=4)
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        zj.config.Pipeline(microbatches=0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        zj.config.Pipeline(schedule="1f1b")
    with pytest.raises(ValueError, match="repeats=2 belongs to the circular schedule"):
        zj.config.Pipeline(repeats=2)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        zj.config.Pipeline(schedule="circular", repeats=0)
    with pytest.raises(TypeError, match="stack must be None or a parameter path prefix"):
        zj.config.Pipeline(stack=3)
    cfg = zj.ZeroConfig(pipeline={"microbatches": 2})
    with pytest.raises(ValueError, match=r"needs a pipeline axis.*grad_accum_steps=2"):
        zj.init_state(toy_params(), optax.sgd(0.1), mesh=zj.make_mesh(), config=cfg)


def test_the_stack_is_split_by_layers_and_zero_sharded_within_a_stage():
    """Per device, from the arrays' shards: a stack leaf holds 1/(P·D) of itself at stage 3
    (its stage's L/P layers, ZeRO-sharded over the D data devices), every other leaf 1/D;
    at stage 0 the stack leaf is its stage's L/P layers whole."""
    params, tx = toy_params(), optax.adam(1e-2)
    for stage, P, Dn in ((3, 2, 4), (3, 4, 2), (0, 4, 2)):
        mesh = zj.make_mesh(pipeline=P)
        state = zj.init_state(params, tx, mesh=mesh, config=zj.ZeroConfig(stage=stage))
        held = state.params if stage == 0 else state.master
        for name, leaf, whole in (
            ("w", held["blocks"]["w"], params["blocks"]["w"]),
            ("embed", held["embed"], params["embed"]),
        ):
            per = (P * (Dn if stage else 1)) if name == "w" else (Dn if stage else 1)
            for shard in leaf.addressable_shards:
                assert shard.data.size == whole.size // per, (stage, P, name, shard.data.shape)
        if stage:  # Adam's moments follow their parameter
            mu = state.opt_state[0].mu["blocks"]["w"]
            assert {s.data.size for s in mu.addressable_shards} == {params["blocks"]["w"].size // (P * Dn)}


def test_the_stack_is_chosen_by_count_then_by_size():
    """Without ``stack=``: the leading dimension most leaves share, then the one whose leaves
    hold the most elements (one stacked weight beside an embedding and a head)."""
    params = {"embed": jnp.zeros((16, 32)), "layers": jnp.zeros((8, 32, 32)), "head": jnp.zeros((32, 4))}
    state = zj.init_state(params, optax.sgd(0.1), mesh=zj.make_mesh(pipeline=2), config=zj.ZeroConfig())
    assert [state.plan.paths[i] for i in state.plan.stack_leaves] == ["['layers']"]


def test_an_ambiguous_or_indivisible_stack_is_refused_with_the_fix():
    tx, mesh = optax.sgd(0.1), zj.make_mesh(pipeline=2)
    tied = {"a": jnp.zeros((4, 3)), "b": jnp.zeros((6, 2))}  # one leaf of 12 elements each
    with pytest.raises(ValueError, match=r"layer stack is ambiguous.*pipeline=\{'stack'"):
        zj.init_state(tied, tx, mesh=mesh, config=zj.ZeroConfig())
    with pytest.raises(ValueError, match=r"3 layers do not split into 2 pipeline stages"):
        zj.init_state({"w": jnp.zeros((3, 4, 4)), "e": jnp.zeros((5,))}, tx, mesh=mesh, config=zj.ZeroConfig())
    with pytest.raises(ValueError, match=r"stack=\"\['nope'\]\" matches no parameter"):
        zj.init_state(toy_params(), tx, mesh=mesh, config=zj.ZeroConfig(pipeline={"stack": "['nope']"}))


# --- exact against single-device optax -------------------------------------------------

# (stage, P, data devices, micro-batches as a multiple of P, optimizer): every stage, both
# pipeline degrees, both data degrees and both M = P and 2P, pairwise.
CASES = models.pairwise(stage=[0, 1, 2, 3], P=[2, 4], data=[2, 4], m=[1, 2], tx=["momentum", "adamw"])
CASES = [c for c in CASES if c[1] * c[2] <= 8]
TXS = {"momentum": optax.sgd(0.2, momentum=0.9), "adamw": optax.adamw(1e-2, weight_decay=0.1)}


@pytest.mark.parametrize(
    "stage,P,data,m,tx",
    models.marked_slow(CASES, slow=CASES[4:]),  # reason: the first four cover each value
)
def test_trains_as_single_device_optax(stage, P, data, m, tx):
    params, batches = toy_params(stage), toy_batches(seed=stage)
    ref, ref_losses = models.reference_run(toy_loss, params, TXS[tx], batches)
    state, metrics = pipeline_run(toy_loss, params, TXS[tx], batches, pipeline=P, data=data, micro=m * P, stage=stage)
    assert _max_err(zj.gather_params(state), ref) < 1e-5
    np.testing.assert_allclose([x["loss"] for x in metrics], ref_losses, rtol=1e-6)


# The circular schedule: (stage, P, data, R), M = P. Stage 3 on two stages and stage 1 on four
# by default; stages 0 and 2 and four rounds in the slow set.
CIRCULAR = [(3, 2, 4, 2), (1, 4, 2, 2), (0, 2, 4, 4), (2, 2, 2, 2)]


@pytest.mark.parametrize(
    "stage,P,data,R",
    models.marked_slow(CIRCULAR, slow=CIRCULAR[2:]),  # reason: the first two cover P, R and ZeRO
)
def test_the_circular_schedule_trains_as_single_device_optax(stage, P, data, R):
    """Each stage holds R blocks of L / (P·R) layers (blocks p, p + P, ...), and every
    micro-batch goes round the stages R times: the weights and losses of single-device optax."""
    params, batches = toy_params(stage), toy_batches(seed=stage)
    tx = TXS["adamw"]
    ref, ref_losses = models.reference_run(toy_loss, params, tx, batches)
    state, metrics = pipeline_run(
        toy_loss, params, tx, batches, pipeline=P, data=data, micro=P, stage=stage,
        pipeline_schedule="circular", pipeline_repeats=R,
    )  # fmt: skip
    assert _max_err(zj.gather_params(state), ref) < 1e-5
    np.testing.assert_allclose([x["loss"] for x in metrics], ref_losses, rtol=1e-6)


def test_the_circular_schedule_draws_the_dropout_masks_of_gpipe():
    """Keys are folded with the micro-batch and come with their layer: two rounds on two stages
    draw the masks one round does."""
    params, batches, tx = toy_params(), toy_batches(2), optax.sgd(0.5)
    a, am = pipeline_run(toy_dropout_loss, params, tx, batches, pipeline=2, data=4, micro=2, with_rng=True)
    b, bm = pipeline_run(
        toy_dropout_loss, params, tx, batches, pipeline=2, data=4, micro=2, with_rng=True,
        pipeline_schedule="circular", pipeline_repeats=2,
    )  # fmt: skip
    assert _max_err(zj.gather_params(a), zj.gather_params(b)) < 1e-6
    assert [m["loss"] for m in am] == pytest.approx([m["loss"] for m in bm], rel=1e-6)


def test_the_circular_bubble_is_in_the_compiled_flops():
    """A stage computes its layers (R·M + P - 1) / R times per step: 12, 10 and 9 block-sized
    evaluations for GPipe and 2 and 4 rounds (P = M = 2, L = 8). The compiled FLOPs differ
    by those counts: (GPipe - R2) / (R2 - R4) = 2, and each difference is the layers' FLOPs."""
    d = 256  # layers heavy enough that the loop's bookkeeping is small beside them
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "embed": jax.random.normal(k[0], (V, d)),
        "blocks": {"w": jax.random.normal(k[1], (L, d, d)) * 0.05, "b": jnp.zeros((L, d))},
        "head": jax.random.normal(k[2], (d, V)),
    }
    batch, tx = toy_batches(1, rows=64)[0], optax.sgd(0.1)
    flops = {}
    for schedule, r in (("gpipe", 1), ("circular", 2), ("circular", 4)):
        mesh = zj.make_mesh(pipeline=2)
        cfg = zj.ZeroConfig(stage=3, pipeline={"microbatches": 2, "schedule": schedule, "repeats": r})
        state = zj.init_state(params, tx, mesh=mesh, config=cfg)
        step = zj.make_train_step(toy_loss, tx, mesh=mesh, config=cfg)
        flops[r] = loop_cost(step.lower(state, batch).compile()).flops
    per_layer = 3 * 2 * (64 // 4 // 2) * T * d * d  # forward and backward of one layer on a micro-batch
    assert (flops[1] - flops[2]) / (flops[2] - flops[4]) == pytest.approx(2, rel=0.05)
    assert (flops[1] - flops[4]) / per_layer == pytest.approx(3, rel=0.05)


def test_the_circular_schedule_refuses_micro_batches_other_than_the_stages_and_an_indivisible_stack():
    with pytest.raises(ValueError, match=r"circular schedule with 4 micro-batches on 2 stages.*'microbatches': 2"):
        pipeline_run(toy_loss, toy_params(), optax.sgd(0.1), toy_batches(1), pipeline=2, data=4, micro=4,
                     pipeline_schedule="circular", pipeline_repeats=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"8 layers, which do not split into 4 stages x 3 repeats"):
        pipeline_run(toy_loss, toy_params(), optax.sgd(0.1), toy_batches(1), pipeline=4, data=2, micro=4,
                     pipeline_schedule="circular", pipeline_repeats=3)  # fmt: skip


@pytest.fixture(scope="module")
def small_gpt():
    cfg = gpt.GPTConfig(vocab=32, seq_len=8, d_model=16, n_layers=4, n_heads=2)
    graphdef, params = gpt.init(cfg)
    rng = np.random.default_rng(3)
    return graphdef, params, [{"tokens": jnp.asarray(rng.integers(0, 32, (8, 9)))} for _ in range(2)]


def test_the_package_gpt_trains_as_single_device_optax_with_global_clipping(small_gpt):
    """``zj.models.GPT`` (an ``nnx.scan`` stack) as it is: stage 3, two stages, two
    micro-batches, global-norm clipping over all stages: each step's gradient norm is the
    whole model's, and the weights are single-device optax's with the same clipping."""
    graphdef, params, batches = small_gpt
    loss_fn = gpt.make_loss(graphdef)
    tx = optax.sgd(0.5, momentum=0.9)
    norms = []
    ref, _ = models.reference_run(loss_fn, params, optax.chain(optax.clip_by_global_norm(1.0), tx), batches, norms)
    state, metrics = pipeline_run(loss_fn, params, tx, batches, pipeline=2, data=4, micro=2, grad_clip=1.0)
    np.testing.assert_allclose([m["grad_norm"] for m in metrics], norms, rtol=1e-5)
    assert _max_err(zj.gather_params(state), ref) < 1e-5


def toy_dropout_loss(p, batch, rng):
    """``toy_loss`` with dropout in every layer, from per-layer keys scanned with the stack."""
    x = p["embed"][batch["x"]]

    def layer(h, wk):
        w, key = wk
        kept = jax.random.bernoulli(key, 0.7, h.shape)
        return h + jnp.where(kept, jnp.tanh(h @ w["w"] + w["b"]) / 0.7, 0.0), None

    x, _ = jax.lax.scan(layer, x, (p["blocks"], jax.random.split(rng, L)))
    return optax.softmax_cross_entropy_with_integer_labels(x @ p["head"], batch["y"]).mean()


def test_dropout_draws_one_key_per_micro_batch_and_layer_whatever_the_stage_count():
    """The same data degree and micro-batches on 2 and on 4 stages: the same training with
    dropout (each layer's key folded with the micro-batch's index, not the stage's)."""
    params, batches, tx = toy_params(), toy_batches(2), optax.sgd(0.5)
    a, am = pipeline_run(toy_dropout_loss, params, tx, batches, pipeline=2, data=2, micro=4, with_rng=True)
    b, bm = pipeline_run(toy_dropout_loss, params, tx, batches, pipeline=4, data=2, micro=4, with_rng=True)
    assert _max_err(zj.gather_params(a), zj.gather_params(b)) < 1e-6  # the same masks: rounding only
    assert [m["loss"] for m in am] == pytest.approx([m["loss"] for m in bm], rel=1e-6)
    assert abs(am[0]["loss"] - float(toy_loss(params, batches[0]))) > 1e-3  # dropout did run


def test_float16_scaling_and_skipped_steps_agree_with_the_step_without_a_pipeline():
    params, batches = toy_params(), toy_batches()
    tx = optax.sgd(0.2)
    cfg = dict(stage=3, compute_dtype="float16", loss_scaling={"initial_scale_power": 20})
    piped, pm = pipeline_run(toy_loss, params, tx, batches, pipeline=2, data=4, micro=2, **cfg)
    mesh = zj.make_mesh()
    state = zj.init_state(params, tx, mesh=mesh, config=zj.ZeroConfig(**cfg))
    step = zj.make_train_step(toy_loss, tx, mesh=mesh, config=zj.ZeroConfig(**cfg))
    for b in batches:
        state, m = step(state, b)
    assert pm[-1]["skipped_steps"] == float(m["skipped_steps"]) > 0  # 2^20 overflows float16 at first
    assert pm[-1]["loss_scale"] == float(m["loss_scale"])
    assert _max_err(zj.gather_params(piped), zj.gather_params(state)) < 1e-3  # float16 compute's distance


# --- communication: ZeRO's collectives once per step -------------------------------------


@pytest.fixture(scope="module")
def data_bytes():
    """Collective bytes per device by mesh axis of the stage-3 step on 2 stages x 4 data
    devices at M = 4 and 8, and without a pipeline on 4 data devices."""
    params, tx = toy_params(), optax.sgd(0.1)
    batch = toy_batches(1, rows=32)[0]
    out = {}
    for P, M in ((2, 4), (2, 8), (1, 1)):
        mesh = zj.make_mesh(jax.devices()[: 4 * P], pipeline=P)
        cfg = zj.ZeroConfig(stage=3, pipeline={"microbatches": M})
        state = zj.init_state(params, tx, mesh=mesh, config=cfg)
        step = zj.make_train_step(toy_loss, tx, mesh=mesh, config=cfg)
        out[(P, M)] = communication_report(step.lower(state, batch).compile(), mesh=mesh)["by_axis"]
    return out


def test_data_axis_traffic_does_not_grow_with_micro_batches(data_bytes):
    """Stage 3 gathers a stage's parameters once per step and reduce-scatters their
    gradients once: the data axis carries the same bytes at M = 8 as at M = 4, no more than
    without a pipeline (a device gathers only its stage's layers), and only the pipeline
    axis's transfers depend on M."""
    four, eight, plain = data_bytes[(2, 4)], data_bytes[(2, 8)], data_bytes[(1, 1)]
    assert eight["data"] == four["data"]
    assert four["data"]["bytes"] <= plain["data"]["bytes"]
    assert eight["pipeline"]["count"] > four["pipeline"]["count"] > 0
    assert "pipeline" not in plain


# --- refused with the fix, before anything compiles ---------------------------------------


def _step_error(loss_fn, params=None, batch=None, micro=2, P=2):
    params = toy_params() if params is None else params
    mesh = zj.make_mesh(pipeline=P)
    cfg = zj.ZeroConfig(stage=3, pipeline={"microbatches": micro})
    state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=cfg)
    step = zj.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, config=cfg)
    with pytest.raises(ValueError) as e:
        step(state, toy_batches(1)[0] if batch is None else batch)
    return str(e.value)


def _indexed(p, batch):
    x = p["embed"][batch["x"]]
    for i in range(L):
        x = x + jnp.tanh(x @ p["blocks"]["w"][i] + p["blocks"]["b"][i])
    return jnp.mean(x @ p["head"])


def _two_scans(p, batch):
    x = p["embed"][batch["x"]]
    half = jax.tree.map(lambda a: a[: L // 2], p["blocks"])
    x, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w["w"]), None), x, p["blocks"])
    return jnp.mean(x @ p["head"]) + jnp.sum(half["b"])


def _with_ys(p, batch):
    x = p["embed"][batch["x"]]
    x, ys = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w["w"] + w["b"]), jnp.mean(h)), x, p["blocks"])
    return jnp.mean(x @ p["head"]) + jnp.sum(ys)


def _summed(p, batch):
    x = p["embed"][batch["x"]]
    (x, total), _ = jax.lax.scan(
        lambda c, w: ((c[0] + jnp.tanh(c[0] @ w["w"] + w["b"]), c[1] + jnp.mean(c[0])), None), (x, 0.0), p["blocks"]
    )
    return jnp.mean(x @ p["head"]) + total


@pytest.mark.parametrize(
    "loss_fn,match",
    [
        (_indexed, r"outside the layer scan at .*test_pipeline.py"),
        (_two_scans, r"outside the layer scan"),
        (_with_ys, r"returns 1 per-layer output\(s\)"),
        (_summed, r"carries a value \(carry 1, \(\)\) that does not start from the batch.*'carry_reduce': 'mean'"),
    ],
)
def test_a_loss_the_pipeline_cannot_split_is_refused_naming_the_line(loss_fn, match):
    text = _step_error(loss_fn)
    assert re.search(match, text), text


def test_a_parameter_chosen_by_shape_that_the_scan_does_not_run_is_refused_until_the_stack_is_named():
    """A head whose leading dimension happens to be the layer count is chosen with the stack
    by shape; the step finds it used outside the layer scan and names the fix, which trains."""
    params = {**toy_params(), "head": jnp.ones((L, V)) * 0.1}  # d_model == L

    def loss_fn(p, batch):
        x = jnp.ones((batch["x"].shape[0], L)) * p["embed"][batch["x"]].mean((1, 2))[:, None]
        x, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h[:, :D] @ w["w"]).sum(-1, keepdims=True), None), x, p["blocks"])
        return jnp.mean(x @ p["head"])

    text = _step_error(loss_fn, params)
    assert "params['head'] is split over the pipeline axis" in text and "'stack'" in text
    batches = toy_batches(2)
    ref, _ = models.reference_run(loss_fn, params, optax.sgd(0.1), batches)
    state, _ = pipeline_run(
        loss_fn, params, optax.sgd(0.1), batches, pipeline=2, data=4, micro=2, pipeline_stack="['blocks']"
    )
    assert _max_err(zj.gather_params(state), ref) < 1e-5


def test_a_carried_total_combines_over_micro_batches_as_configured():
    """``_summed`` carries the sum over layers of each layer's mean activation: with
    ``carry_reduce="mean"`` the micro-batches' mean of it is the whole batch's (equal
    micro-batches), so training equals single-device optax."""
    batches = toy_batches(2)
    ref, _ = models.reference_run(_summed, toy_params(), optax.sgd(0.1), batches)
    state, _ = pipeline_run(
        _summed, toy_params(), optax.sgd(0.1), batches, pipeline=2, data=4, micro=2, pipeline_carry="mean"
    )
    assert _max_err(zj.gather_params(state), ref) < 1e-5


@pytest.mark.slow  # reason: a Llama MoE step compiles for ~10 s; test_a_carried_total_... covers carry_reduce
def test_a_mixture_of_experts_stack_trains_as_single_device_optax():
    """``zj.models.Llama`` with routed experts (replicated within a stage) and a weighted
    load-balancing loss: its layers carry per-expert statistics summed over the layers, means
    over the tokens, which ``carry_reduce="mean"`` combines into the whole batch's."""
    from zerojax.models import llama

    cfg = llama.LlamaConfig(
        vocab=32, d_model=16, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=24, seq_len=8, n_experts=4, top_k=2,
        moe_d_ff=8, router_aux_loss_coef=0.5,
    )  # fmt: skip
    graphdef, params = llama.init(cfg)
    loss_fn, tx = llama.make_loss(graphdef), optax.sgd(0.5, momentum=0.9)
    rng = np.random.default_rng(0)
    batches = [{"tokens": jnp.asarray(rng.integers(0, 32, (16, 9)))} for _ in range(2)]
    ref, ref_losses = models.reference_run(loss_fn, params, tx, batches)
    state, metrics = pipeline_run(loss_fn, params, tx, batches, pipeline=2, data=4, micro=2, pipeline_carry="mean")
    assert _max_err(zj.gather_params(state), ref) < 1e-5
    np.testing.assert_allclose([m["loss"] for m in metrics], ref_losses, rtol=1e-6)


def test_rows_that_do_not_split_into_micro_batches_are_refused():
    # 16 rows over 4 data devices: 4 per device, not 3 micro-batches
    text = _step_error(toy_loss, micro=3)
    assert "4 rows of the batch do not split into ZeroConfig.pipeline.microbatches=3" in text


def test_deepspeeds_pipeline_maps_with_the_stage_count_and_names_the_rest():
    from zerojax.deepspeed import translate

    ds = {
        "zero_optimization": {"stage": 3},
        "gradient_accumulation_steps": 8,
        "pipeline": {"stages": 4, "partition": "type:transformer", "pipe_partitioned": True},
    }
    t = translate(ds)
    assert t.config.pipeline.microbatches == 8 and t.config.grad_accum_steps == 1
    assert t.mesh_code() == "zj.make_mesh(pipeline=4)" and dict(t.make_mesh().shape) == {"pipeline": 4, "data": 2}
    assert set(t.unmapped) == {"pipeline.partition", "pipeline.pipe_partitioned"}
    assert any("refuses ZeRO stage 3" in n for n in t.notes)
    assert translate({"pipeline": {}}, pipeline_stages=2).pipeline == 2
    with pytest.raises(ValueError, match="pipeline.stages=4 in the DeepSpeed config and pipeline_stages=2 disagree"):
        translate(ds, pipeline_stages=2)
    assert "pipeline_stages=P" in translate({"pipeline": {"stages": "auto"}}).unmapped["pipeline"]


def test_checkpoints_and_exports_move_between_pipeline_and_plain_meshes(tmp_path):
    """A pipeline state's checkpoint is an ordinary one: it restores on a mesh without a
    pipeline and back, exactly, and its exported weights are the plain state's."""
    from safetensors.numpy import load_file

    params, tx = toy_params(1), optax.adam(1e-2)
    piped = zj.init_state(
        params, tx, mesh=zj.make_mesh(pipeline=2), config=zj.ZeroConfig(stage=3, pipeline={"microbatches": 2})
    )
    zj.save_checkpoint(tmp_path / "piped", piped, 1, wait=True)
    plain = zj.restore_checkpoint(tmp_path / "piped", params, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=1))
    assert _max_err(zj.gather_params(plain), params) == 0.0
    zj.save_checkpoint(tmp_path / "plain", plain, 1, wait=True)
    back = zj.restore_checkpoint(
        tmp_path / "plain", params, tx, mesh=zj.make_mesh(pipeline=4), config=zj.ZeroConfig(stage=2)
    )
    assert back.plan.is_stack(back.plan.layouts[back.plan.paths.index("['blocks']['w']")])
    assert _max_err(zj.gather_params(back), params) == 0.0
    zj.export_weights(piped, tmp_path / "piped.safetensors")
    zj.export_weights(plain, tmp_path / "plain.safetensors")
    a, b = load_file(tmp_path / "piped.safetensors"), load_file(tmp_path / "plain.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # reason: a second GPT compile (~10 s on jax 0.12); the GPT test covers nnx.scan by default
def test_the_nnx_api_trains_through_the_stages(small_gpt):
    """``zj.nnx.Optimizer`` on a pipeline mesh: the package GPT as an NNX module, one step,
    the loss single-device optax's."""
    from flax import nnx

    graphdef, params, batches = small_gpt
    want = float(gpt.make_loss(graphdef)(params, batches[0]))
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))  # the optimizer trains it in place

    def loss(model, b):
        logits = model(b["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"][:, 1:]).mean()

    mesh, cfg = zj.make_mesh(pipeline=2), zj.ZeroConfig(stage=3, pipeline={"microbatches": 2})
    opt = zj.nnx.Optimizer(model, optax.sgd(0.5), mesh=mesh, config=cfg)
    metrics = zj.nnx.make_train_step(loss)(opt, batches[0])
    assert float(metrics["loss"]) == pytest.approx(want, rel=1e-6)
    assert float(gpt.make_loss(graphdef)(nnx.state(model, nnx.Param), batches[0])) < want  # it trained


def test_the_estimate_splits_the_stack_over_the_stages_and_keeps_the_rest_per_stage():
    """``zerojax estimate --pipeline P``: zerojax's stage-3 column is the state per device of
    docs/pipeline.md, 12 bytes (fp32 Adam) x (Ψ_stack / (P·D) + Ψ_rest / D), D = N / P."""
    from zerojax.report.estimate import MODELS, table

    shape = MODELS["llama3-8b"]
    psi, stack = shape.num_params(), shape.n_layers * shape.block_params()
    text = table(psi, 64, pipeline=4, stack_params=stack)
    stage3 = [line for line in text.splitlines() if line.strip().startswith("3 ")][0]
    want = 12 * (stack / (4 * 16) + (psi - stack) / 16)
    assert stage3.split()[-2] == f"{want / 1e9:,.1f}"
    assert "4 pipeline stages" in text and "ZeRO over 16 devices per stage" in text
    with pytest.raises(ValueError, match="needs the layer stack's parameter count"):
        table(psi, 64, pipeline=4)


def test_a_linen_nn_scan_stack_trains_as_single_device_optax():
    """A Flax linen model whose blocks are ``nn.scan``-ed (parameters stacked under
    ``ScanBlock_0``), as it is, named with ``stack=``."""
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + jnp.tanh(nn.Dense(12)(h)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(12)(x)
            h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)()(h, None)
            return nn.Dense(3)(h)

    net = Net()
    params = net.init(jax.random.key(0), jnp.ones((1, 5)))["params"]

    def loss_fn(p, b):
        return jnp.mean((net.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    rng = np.random.default_rng(0)
    batches = [{"x": jnp.asarray(rng.normal(size=(16, 5)), jnp.float32), "y": jnp.ones((16, 3))} for _ in range(2)]
    ref, _ = models.reference_run(loss_fn, params, optax.sgd(0.1), batches)
    state, _ = pipeline_run(
        loss_fn, params, optax.sgd(0.1), batches, pipeline=2, data=4, micro=2, pipeline_stack="['ScanBlock_0']"
    )
    assert _max_err(zj.gather_params(state), ref) < 1e-5


@pytest.mark.parametrize("stage", models.marked_slow([3, 1], slow=[1]))  # reason: stage 3 covers the layouts
def test_shard_outside_spreads_the_rest_over_every_device_and_trains_exactly(stage):
    """``pipeline={"shard_outside": True}``: the embedding and head are ZeRO-sharded over
    pipeline x data (1/8 each per device, from the shards) like the stack's state, and
    training is single-device optax's."""
    params, batches, tx = toy_params(), toy_batches(2), optax.adam(1e-2)
    ref, _ = models.reference_run(toy_loss, params, tx, batches)
    mesh = zj.make_mesh(pipeline=2)
    cfg = zj.ZeroConfig(stage=stage, pipeline={"microbatches": 2, "shard_outside": True})
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(toy_loss, tx, mesh=mesh, config=cfg)
    for b in batches:
        state, _ = step(state, b)
    moments = state.opt_state[0].mu
    for name in ("embed", "head"):
        assert {s.data.size for s in moments[name].addressable_shards} == {params[name].size // 8}
    assert {s.data.size for s in moments["blocks"]["w"].addressable_shards} == {params["blocks"]["w"].size // 8}
    assert _max_err(zj.gather_params(state), ref) < 1e-5


def test_remat_applies_inside_each_stage_and_the_eval_step_runs_the_stages():
    """remat="full" is applied to the layers inside each stage: the compiled step's
    temporaries shrink (its memory analysis). The eval step runs the layers through the
    stages and gives the loss of the whole batch."""
    from zerojax.report.memory import compiled_bytes

    params, batch, tx = toy_params(), toy_batches(1)[0], optax.sgd(0.2)
    mesh, temp = zj.make_mesh(pipeline=2), {}
    for remat in (None, "full"):
        cfg = zj.ZeroConfig(stage=2, remat=remat, pipeline={"microbatches": 2})
        state = zj.init_state(params, tx, mesh=mesh, config=cfg)
        step = zj.make_train_step(toy_loss, tx, mesh=mesh, config=cfg)
        temp[remat] = compiled_bytes(step.lower(state, batch).compile())["temp"]
    assert temp["full"] < 0.8 * temp[None], temp
    evaluate = zj.make_eval_step(toy_loss, mesh=mesh, config=cfg)
    assert float(evaluate(state, batch)) == pytest.approx(float(toy_loss(params, batch)), rel=1e-5)


@pytest.mark.slow  # reason: two more trainings; the remat test shows the policy applied, the cases show exactness
def test_bfloat16_and_remat_train_within_their_distance():
    """bf16 compute on fp32 masters through the stages stays within bf16's distance of the
    fp32 reference; remat="full" changes nothing in fp32."""
    params, batches, tx = toy_params(), toy_batches(2), optax.sgd(0.2, momentum=0.9)
    ref, _ = models.reference_run(toy_loss, params, tx, batches)
    bf16, _ = pipeline_run(toy_loss, params, tx, batches, pipeline=2, data=4, micro=2, compute_dtype="bfloat16")
    assert 0 < _max_err(zj.gather_params(bf16), ref) < 2e-2
    remat, _ = pipeline_run(toy_loss, params, tx, batches, pipeline=2, data=4, micro=2, stage=2, remat="full")
    assert _max_err(zj.gather_params(remat), ref) < 1e-5


def test_a_resumed_pipeline_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path):
    """``zerojax.resume.Run`` on a pipeline mesh: stopped after 3 steps (its last checkpoint
    at 2), restarted and run to 5, it ends with the uninterrupted run's parameters, masters
    and Adam moments, bit for bit; its run record counts the data devices of a stage."""
    from zerojax.resume import IndexSampler, Run, RunConfig

    data, tx = toy_batches(1, rows=64, seed=4)[0], optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    mesh = zj.make_mesh(pipeline=2)
    config = zj.ZeroConfig(stage=3, pipeline={"microbatches": 2})
    step = zj.make_train_step(toy_loss, tx, mesh=mesh, config=config)

    def start(directory, until):
        run, sampler = Run(RunConfig(directory, save_every=2)), IndexSampler(64, ROWS, seed=5)
        state = run.restore_or_init(
            toy_params(), tx, mesh=mesh, config=run.micro_batches(config, mesh, ROWS), data=sampler
        )
        while run.step < until:
            idx = next(sampler)
            state, _ = step(state, jax.tree.map(lambda x: x[idx], data))
            run.completed(state)
        run.finish(state)
        return state

    def leaves(state):
        return [np.asarray(x) for x in jax.tree.leaves((zj.gather_params(state), state.master, state.opt_state))]

    want = leaves(start(tmp_path / "ref", 5))
    start(tmp_path / "run", 3)
    got = leaves(start(tmp_path / "run", 5))
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    extra = zj.checkpoint.checkpoint_extra(tmp_path / "run", 4)
    assert extra["data"]["position"] == 4 and extra["devices"] == 8
    assert extra["data_parallel"] == 4 and extra["rows_per_micro_batch"] == ROWS // (4 * 2)
