"""Mixture-of-experts beside ZeRO: ``zj.nn.routed_experts`` against a per-token float64
reference, the expert axis exact against single-device optax at every stage, the
all-to-alls in the compiled program, the state per device from the arrays, and bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from tests.models import abs_errors, lower_as_called, reference_run
from zerojax.moe import capacity, load_balancing_loss, routed_experts, z_loss
from zerojax.report.comm import collectives

B, T, D, F, E = 16, 4, 8, 16, 8


# ----------------------------------------------------------------------------------------------
# The kernel against a per-token loop in float64 (written from the definitions, not from it).


def reference(x, logits, up, down, gate, k, *, normalize, cf=None, groups=1, score="softmax", bias=None, scale=1.0):
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    lg = np.asarray(logits, np.float64).reshape(x.shape[0], -1)
    n, ne = lg.shape
    if score == "softmax":
        s = np.exp(lg - lg.max(1, keepdims=True))
        s /= s.sum(1, keepdims=True)
        choose = s
    else:
        s = 1 / (1 + np.exp(-lg))
        choose = s + (0 if bias is None else np.asarray(bias, np.float64))
    top = np.argsort(-choose, axis=1, kind="stable")[:, :k]
    keep = np.ones((n, k), bool)
    if cf is not None:
        ng, cap = n // groups, capacity(n // groups, k, ne, cf)
        for g in range(groups):
            used = np.zeros(ne, int)
            for slot in range(k):
                for t in range(g * ng, (g + 1) * ng):
                    keep[t, slot] = used[top[t, slot]] < cap
                    used[top[t, slot]] += 1
    silu = lambda a: a / (1 + np.exp(-a))
    y = np.zeros_like(x)
    for t in range(n):
        w = s[t, top[t]]
        w = w / w.sum() if normalize else w
        for slot in range(k):
            e = top[t, slot]
            h = x[t] @ np.asarray(up[e], np.float64)
            h = silu(x[t] @ np.asarray(gate[e], np.float64)) * h if gate is not None else silu(h)
            if keep[t, slot]:
                y[t] += scale * w[slot] * (h @ np.asarray(down[e], np.float64))
    return y, 1 - keep.mean()


def _arrays(seed, ne=E, d=D, f=F, lead=(B, T)):
    r = np.random.default_rng(seed)
    a = lambda *s, sc=1.0: jnp.asarray(r.normal(size=s) * sc, jnp.float32)
    return (a(*lead, d), a(*lead, ne, sc=2.0), a(ne, d, f, sc=0.3), a(ne, f, d, sc=0.3), a(ne, d, f, sc=0.3))


@pytest.mark.parametrize("seed", range(6))
def test_routed_experts_equal_the_per_token_definition(seed):
    """Randomized: k, normalisation, gate or none, the grouped or the dense form, dropless
    or a capacity over groups, softmax or sigmoid with a selection bias."""
    r = np.random.default_rng(100 + seed)
    ne = int(r.choice([4, 8]))
    k = int(r.integers(1, 4))
    x, logits, up, down, gate = _arrays(seed, ne=ne)
    gate = gate if seed % 2 == 0 else None
    cf = [None, 0.5, 1.0][seed % 3]
    groups = [1, 2, 4][seed % 3]
    score = "sigmoid" if seed in (3, 4) else "softmax"
    bias = jnp.asarray(r.normal(size=ne), jnp.float32) if score == "sigmoid" else None
    scale = 2.5 if score == "sigmoid" else 1.0
    kw = dict(normalize=bool(seed % 2), cf=cf, groups=groups, score=score, bias=bias, scale=scale)
    want, want_dropped = reference(x, logits, up, down, gate, k, **kw)
    run = jax.jit(
        functools.partial(  # one compile, not one per primitive as eagerly
            routed_experts,
            top_k=k,
            normalize=kw["normalize"],
            capacity_factor=cf,
            capacity_groups=groups,
            method="dense" if seed == 5 else "ragged",
            score=score,
            scale=scale,
        )
    )
    y, stats = run(x, logits, up, down, gate, selection_bias=bias)
    np.testing.assert_allclose(np.asarray(y, np.float64).reshape(want.shape), want, atol=2e-5, rtol=1e-5)
    assert float(stats.dropped) == pytest.approx(want_dropped, abs=1e-7)
    if cf == 0.5:
        assert float(stats.dropped) > 0  # the capacity case drops, so the drop path is tested
    assert int(stats.counts.sum()) == B * T * k


def test_auxiliary_losses_are_their_definitions():
    """E·Σ fᵢ·Pᵢ with fᵢ assignments per token and Pᵢ the mean probability; the z-loss."""
    _, logits, *_ = _arrays(7)
    lg = np.asarray(logits, np.float64).reshape(-1, E)
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.argsort(-p, 1, kind="stable")[:, :2]
    f = np.bincount(top.ravel(), minlength=E) / len(lg)
    want = E * np.sum(f * p.mean(0))
    probs = jax.nn.softmax(logits, -1)
    got = load_balancing_loss(probs, jax.lax.top_k(probs, 2)[1])
    assert float(got) == pytest.approx(want, rel=1e-6)
    lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
    assert float(z_loss(logits)) == pytest.approx(np.mean(lse**2), rel=1e-6)


# ----------------------------------------------------------------------------------------------
# Over an expert axis: the same values and gradients, by all-to-all.


@pytest.fixture(scope="module")
def arrays():
    return _arrays(1)


def _loss(x, logits, up, down, gate, cf=None):
    y, st = routed_experts(x, logits, up, down, gate, top_k=2, normalize=True, capacity_factor=cf)
    return jnp.sum(y**2) + st.load_balancing_loss + st.z_loss


@pytest.mark.parametrize("ep", [pytest.param(2, marks=pytest.mark.slow), 8])  # E = 2: a second compile (8 s)
def test_expert_parallel_dispatch_equals_one_device(arrays, ep):
    mesh = zj.make_mesh(expert=ep)
    placed = [jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in arrays]
    value_and_grad = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3, 4))
    with jax.set_mesh(mesh):  # compiled once: the program run is the program inspected
        compiled = jax.jit(value_and_grad).lower(*placed).compile()
        value, grads = compiled(*placed)
    want_value, want = jax.jit(value_and_grad)(*arrays)  # one device (one compile, not one per primitive)
    assert float(value) == pytest.approx(float(want_value), rel=1e-6)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5 * float(jnp.abs(w).max()))
    found = collectives(compiled.as_text())
    a2a = [c for c in found if c.kind == "all-to-all" and c.axes(mesh) == ("expert",)]
    # Forward: rows out, their expert ids out, outputs back; backward: the rows' and the
    # outputs' transposes. Each row buffer holds the device's tokens x k rows per destination.
    rows = (B * T // ep) * 2 * ep * D * 4
    assert sorted(c.bytes for c in a2a if c.dtype == "f32") == [rows] * 4, [(c.dtype, c.bytes) for c in a2a]
    assert not [c for c in found if c.kind == "all-gather" and "expert" in c.axes(mesh) and c.bytes >= E * D * F * 4]


# ----------------------------------------------------------------------------------------------
# Training on an expert mesh: single-device optax, every stage.


def moe_params(seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s) / np.sqrt(s[-2]), jnp.float32)
    return {
        "router": f(D, E) * 3,
        "up": f(E, D, F),
        "gate": f(E, D, F),
        "down": f(E, F, D),
        "shared": f(D, D),
        "out": f(D, D),
    }


SPECS = {"router": None, "up": P("expert"), "gate": P("expert"), "down": P("expert"), "shared": None, "out": None}


def plain_moe(p, x, k):
    """A MoE written with plain ops: router, top-k, every expert on every token, one-hot gates."""
    probs = jax.nn.softmax(x @ p["router"], -1)
    w, e = jax.lax.top_k(probs, k)
    gates = (jax.nn.one_hot(e, E) * (w / w.sum(-1, keepdims=True))[..., None]).sum(-2)
    h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, p["gate"])) * jnp.einsum("btd,edf->btef", x, p["up"])
    return jnp.einsum("btef,efd,bte->btd", h, p["down"], gates), 0.0


def zj_moe(p, x, k, cf=None, groups=None, **kw):
    y, st = routed_experts(
        x,
        x @ p["router"],
        p["up"],
        p["down"],
        p["gate"],
        top_k=k,
        normalize=True,
        capacity_factor=cf,
        capacity_groups=groups,
        **kw,
    )
    return y, 0.01 * st.load_balancing_loss + 0.001 * st.z_loss


def moe_loss(p, b, moe):
    y, aux = moe(p, b["x"])
    return jnp.mean((((y + b["x"] @ p["shared"]) @ p["out"]) - b["y"]) ** 2) + aux


def data(steps=3, seed=1):
    r = np.random.default_rng(seed)
    return [
        {
            "x": jnp.asarray(r.normal(size=(B, T, D)), jnp.float32),
            "y": jnp.asarray(r.normal(size=(B, T, D)), jnp.float32),
        }
        for _ in range(steps)
    ]


def _train(step, state, batches):
    """``state`` after ``step`` on each batch, the losses, and the last metrics."""
    losses, m = [], None
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses, m


@functools.cache
def _reference(name):
    moe = {
        "plain": functools.partial(plain_moe, k=2),
        "zj": functools.partial(zj_moe, k=2),
        "capacity": functools.partial(zj_moe, k=1, cf=1.0, groups=8),
    }[name]
    return reference_run(lambda p, b: moe_loss(p, b, moe), moe_params(), optax.sgd(0.1), data())


@pytest.mark.parametrize(
    "name,stage,ep,specs",
    [
        ("plain", 0, 4, True),
        ("plain", 3, 4, False),
        # slow: routed experts train exactly on E = 4 at stage 2 in the padding and
        # accumulation tests, and at stage 3 beside tensor, context and replicas
        pytest.param("zj", 1, 4, True, marks=pytest.mark.slow),
        ("capacity", 3, 4, True),
        # E = 2 and 8 (also trained by the dispatch and combination tests): a step compile each
        pytest.param("zj", 3, 2, True, marks=pytest.mark.slow),
        pytest.param("capacity", 2, 8, True, marks=pytest.mark.slow),
    ],
)
def test_moe_trains_as_one_device_on_an_expert_mesh(name, stage, ep, specs):
    """3 SGD steps against plain single-device optax (1e-5). ``capacity``: one group per
    device on the mesh, the same 8 groups on one device."""
    moe = {
        "plain": functools.partial(plain_moe, k=2),
        "zj": functools.partial(zj_moe, k=2),
        "capacity": functools.partial(zj_moe, k=1, cf=1.0),
    }[name]
    mesh = zj.make_mesh(expert=ep)
    cfg = zj.ZeroConfig(stage=stage)
    state = zj.init_state(moe_params(), optax.sgd(0.1), mesh=mesh, config=cfg, tensor_specs=SPECS if specs else None)
    step = zj.make_train_step(lambda p, b: moe_loss(p, b, moe), optax.sgd(0.1), mesh=mesh, config=cfg)
    state, losses, m = _train(step, state, data())
    ref_params, ref_losses = _reference(name)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert abs_errors(zj.gather_params(state), ref_params).max() < 1e-5
    # The parameters per device, from the arrays (fp32 SGD: no master, no optimizer state),
    # as docs/moe.md's formula says: a routed expert's leaf holds n_experts / ep experts (split
    # over the data devices at stage 3), a dense one (and an unmarked expert stack) is whole at
    # stages 0-2 and split over data x expert, all 8 devices, at stage 3.
    held = state.params if state.params is not None else state.master  # stage 3 fp32: the masters
    n_data = 8 // ep
    for leaf, full in (("up", E * D * F), ("shared", D * D)):
        expert = leaf == "up" and specs
        sizes = {s.data.size for s in held[leaf].addressable_shards}
        want = (full // ep // (n_data if stage == 3 else 1)) if expert else full // (8 if stage == 3 else 1)
        assert sizes == {want}, leaf


def test_expert_degree_and_router_arguments_are_checked():
    with pytest.raises(
        ValueError,
        match=r"dimension 0 of size 8, which does not divide into 3 expert shards. Use an expert degree dividing 8 \(one of \[1, 2\]\)",
    ):
        zj.init_state(
            {"up": jnp.zeros((8, 4, 4))},
            optax.sgd(0.1),
            mesh=zj.make_mesh(jax.devices()[:6], expert=3),
            config=zj.ZeroConfig(),
            tensor_specs={"up": P("expert")},
        )
    x, logits, up, down, gate = _arrays(2)
    with pytest.raises(ValueError, match=r"top_k must be an int in 1\.\.8.*got 9"):
        routed_experts(x, logits, up, down, gate, top_k=9)
    with pytest.raises(ValueError, match=r"capacity_factor must be None \(dropless\) or a number > 0, got 0"):
        routed_experts(x, logits, up, down, gate, top_k=2, capacity_factor=0)
    with pytest.raises(ValueError, match=r"router_logits has shape \(16, 4, 7\); its last dimension must be the 8"):
        routed_experts(x, logits[..., :7], up, down, gate, top_k=2)
    with pytest.raises(ValueError, match="selection_bias is DeepSeek-V3's"):
        routed_experts(x, logits, up, down, gate, top_k=2, selection_bias=jnp.zeros(8))
    with pytest.raises(ValueError, match=r"make_mesh\(expert=3.*Use expert in \[1, 2, 4, 8\]"):
        zj.make_mesh(expert=3)


# ----------------------------------------------------------------------------------------------
# The reference MoE (zerojax.models' Llama family with routed experts).

MOE_CFG = dict(
    vocab=64,
    d_model=16,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    d_ff=24,
    n_experts=8,
    top_k=2,
    moe_d_ff=12,
    router_aux_loss_coef=0.01,
    qk_norm=True,
)
SHARED = dict(shared_d_ff=8, shared_gate=True)


@pytest.mark.parametrize(
    "stage,ep,shared",
    [  # a Llama step compile each (10-13 s); in the default set the
        pytest.param(3, 4, False, marks=pytest.mark.slow),  # model loads on an expert mesh (below) and trains at
        pytest.param(1, 8, True, marks=pytest.mark.slow),  # stage 3 (test_hf_families); routed_experts trains on one
    ],
)  # in test_moe_trains_as_one_device_on_an_expert_mesh
def test_the_reference_moe_trains_as_one_device(stage, ep, shared):
    """Qwen3-MoE-like (q/k norms, GQA, 8 experts, top-2, normalised, with its load-balancing
    loss; ``shared``: with Qwen2-MoE's gated shared expert): 3 SGD steps on an expert mesh
    equal single-device optax; the statistics come back in the step's metrics (every
    assignment counted once)."""
    from zerojax.models import llama

    cfg = llama.LlamaConfig(**MOE_CFG, **(SHARED if shared else {}))
    graphdef, params = llama.init(cfg)
    tx = optax.sgd(0.5)
    r = np.random.default_rng(1)
    batches = [{"tokens": jnp.asarray(r.integers(0, 64, (16, 9)), jnp.int32)} for _ in range(3)]
    ref_params, ref_losses = _llama_reference(shared)
    mesh = zj.make_mesh(expert=ep)
    cfg0 = zj.ZeroConfig(stage=stage)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg0)
    step = zj.make_train_step(
        llama.make_loss(graphdef, with_stats=True),
        tx,
        mesh=mesh,
        config=cfg0,
        has_aux=True,
        aux_reduce=llama.STATS_REDUCE,
    )
    state, losses, m = _train(step, state, batches)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert abs_errors(zj.gather_params(state), ref_params).max() < 1e-5
    assert float(m["aux"]["expert_counts"].sum()) == 16 * 8 * 2 * 2  # tokens x k x layers
    assert float(m["aux"]["dropped"]) == 0.0
    held = state.params if state.params is not None else state.master
    up = held["blocks"]["moe"]["up"]
    assert {s.data.size for s in up.addressable_shards} == {2 * 8 * 16 * 12 // ep // ((8 // ep) if stage == 3 else 1)}


@functools.cache
def _llama_reference(shared):
    from zerojax.models import llama

    tx = optax.sgd(0.5)
    graphdef, params = llama.init(llama.LlamaConfig(**MOE_CFG, **(SHARED if shared else {})))
    r = np.random.default_rng(1)
    batches = [{"tokens": jnp.asarray(r.integers(0, 64, (16, 9)), jnp.int32)} for _ in range(3)]
    return reference_run(llama.make_loss(graphdef), params, tx, batches)


def test_a_checkpoint_saved_at_four_expert_devices_restores_at_two_and_one(tmp_path):
    """Saved at E = 4, stage 3, after 2 Adam steps; restored at E = 2 (stage 3) and E = 1
    (stage 1), 2 more steps each equal 2 more steps of the saved run."""
    moe = functools.partial(zj_moe, k=2)
    loss, tx, batches = (lambda p, b: moe_loss(p, b, moe)), optax.adam(1e-2), data(4)
    steps = {}

    def run(state, mesh, cfg, bs):  # one step per (mesh, config): E = 4's compiles once for both runs
        step = steps.get((mesh, cfg))
        if step is None:
            step = steps[mesh, cfg] = zj.make_train_step(loss, tx, mesh=mesh, config=cfg)
        for b in bs:
            state, _ = step(state, b)
        return state

    mesh, cfg = zj.make_mesh(expert=4), zj.ZeroConfig(stage=3)
    state = run(zj.init_state(moe_params(), tx, mesh=mesh, config=cfg, tensor_specs=SPECS), mesh, cfg, batches[:2])
    zj.save_checkpoint(tmp_path, state, 2, wait=True)
    want = zj.gather_params(run(state, mesh, cfg, batches[2:]))
    for ep, stage in ((2, 3), (1, 1)):
        mesh, cfg = zj.make_mesh(expert=ep), zj.ZeroConfig(stage=stage)
        restored = zj.restore_checkpoint(tmp_path, moe_params(), tx, mesh=mesh, config=cfg, tensor_specs=SPECS)
        assert abs_errors(zj.gather_params(run(restored, mesh, cfg, batches[2:])), want).max() < 1e-6, (ep, stage)


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_moe",
        pytest.param("mixtral", marks=pytest.mark.slow),  # (loaded whole by
        pytest.param("qwen2_moe", marks=pytest.mark.slow),
    ],
)  # test_hf_families in default)
def test_transformers_moe_checkpoints_load_split_over_the_expert_axis(name):
    """tests/data/hf/{qwen3_moe,mixtral,qwen2_moe} (made by transformers) at E = 4, stage 3: each
    device holds one of the 4 experts, and the logits are transformers' (fp32 rounding)."""
    from flax import nnx

    from zerojax.models import llama

    folder = f"tests/data/hf/{name}"
    ref = np.load(f"{folder}/reference.npz")
    cfg, wmap = zj.models.from_hf(folder)
    state = zj.init_state(
        llama.init_abstract(cfg)[1],
        optax.sgd(0.1),
        mesh=zj.make_mesh(expert=4),
        config=zj.ZeroConfig(stage=3),
        weights=zj.Weights(folder, wmap),
    )
    up = state.params["blocks"]["moe"]["up"] if state.params is not None else state.master["blocks"]["moe"]["up"]
    assert {s.data.size for s in up.addressable_shards} == {up.size // 8}  # 1 of 4 experts, 1/2 of the rest
    logits = nnx.merge(llama.init_abstract(cfg)[0], zj.gather_params(state))(jnp.asarray(ref["tokens"]))
    assert np.abs(np.asarray(logits) - ref["logits"]).max() < 2e-5  # measured 1.8e-6 (qwen3_moe), 7.5e-7


@pytest.mark.parametrize(
    "mesh_kw",
    [
        dict(expert=2, tensor=2),
        dict(expert=2, context=2),
        pytest.param(dict(expert=2, replicas=2), marks=pytest.mark.slow),
    ],
)
def test_the_expert_axis_beside_tensor_context_and_replicas(mesh_kw):
    """routed_experts at stage 3 on (data, expert, tensor) with a dense weight split over
    "tensor", on (data, expert, context) with the sequence split over "context", and on
    replica groups: 3 SGD steps equal single-device optax."""
    specs = {**SPECS, "shared": P(None, "tensor")} if "tensor" in mesh_kw else SPECS
    moe = functools.partial(zj_moe, k=2)
    mesh, cfg = zj.make_mesh(**mesh_kw), zj.ZeroConfig(stage=3)
    state = zj.init_state(moe_params(), optax.sgd(0.1), mesh=mesh, config=cfg, tensor_specs=specs)
    step = zj.make_train_step(lambda p, b: moe_loss(p, b, moe), optax.sgd(0.1), mesh=mesh, config=cfg)
    state, losses, m = _train(step, state, data())
    ref_params, ref_losses = _reference("zj")
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert abs_errors(zj.gather_params(state), ref_params).max() < 1e-5
    if "tensor" in mesh_kw:
        held = state.params if state.params is not None else state.master
        assert {s.data.size for s in held["shared"].addressable_shards} == {D * D // 8}  # tensor x data x expert


@functools.cache  # one reference for both expert degrees
def _micro_batch_reference():
    """(k, the loss, docs/moe.md's loss of k = 2 micro-batches, single-device SGD on it)."""
    moe = functools.partial(zj_moe, k=2)
    loss = lambda p, b: moe_loss(p, b, moe)
    k = 2
    micro = lambda b, j: jax.tree.map(lambda x: x[j::k], b)  # micro-batch j: global rows g % k == j
    definition = lambda p, b: (loss(p, micro(b, 0)) + loss(p, micro(b, 1))) / 2
    return k, loss, definition, reference_run(definition, moe_params(), optax.sgd(0.1), data())


@pytest.mark.parametrize("expert", [4, 2])
def test_auxiliary_losses_under_accumulation_are_per_micro_batch_over_every_device(expert):
    """With grad_accum_steps=2 on (data 8/E, expert E) the step's loss, auxiliary losses
    included, is the mean over the two micro-batches of the loss over each micro-batch's
    global rows (micro-batch j: the rows g with g % 2 == j, on every mesh), as docs/moe.md
    defines it: 3 SGD steps against that definition on one device, equal on E = 4 and 2.
    (With each data shard's rows cut into halves instead, the first step's loss was
    2.12535 on data 2 and 2.12522 on data 4, and 2.12595 strided on both.)"""
    k, loss, definition, (ref_params, ref_losses) = _micro_batch_reference()
    mesh, cfg = zj.make_mesh(expert=expert), zj.ZeroConfig(stage=2, grad_accum_steps=k)
    state = zj.init_state(moe_params(), optax.sgd(0.1), mesh=mesh, config=cfg, tensor_specs=SPECS)
    step = zj.make_train_step(loss, optax.sgd(0.1), mesh=mesh, config=cfg)
    state, losses, m = _train(step, state, data())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert abs_errors(zj.gather_params(state), ref_params).max() < 1e-5
    # ... and it is not the loss over the accumulated batch (f·P is not linear in the tokens).
    assert (
        abs(float(jax.jit(definition)(moe_params(), data()[0])) - float(jax.jit(loss)(moe_params(), data()[0]))) > 1e-4
    )


def test_padding_is_not_routed_and_is_left_out_of_the_losses():
    """token_mask: padding tokens get zero output and take no capacity; the load-balancing
    loss is Hugging Face's load_balancing_loss_func with attention_mask (f and P over the
    unmasked tokens); real tokens' outputs are the unmasked call's (dropless); and training
    with padding on (data 2, expert 4) equals single-device optax (the masked means are
    global: each data shard's share averages to them)."""
    x, logits, up, down, gate = _arrays(9)
    mask = np.ones((B, T), bool)
    mask[::3, 2:] = False
    run = jax.jit(functools.partial(routed_experts, top_k=2))
    y, st = run(x, logits, up, down, gate, token_mask=jnp.asarray(mask))
    y0, _ = run(x, logits, up, down, gate)
    assert not np.asarray(y)[~mask].any()
    np.testing.assert_array_equal(np.asarray(y)[mask], np.asarray(y0)[mask])
    lg = np.asarray(logits, np.float64).reshape(-1, E)
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    m = mask.reshape(-1).astype(np.float64)
    top = np.argsort(-p, 1, kind="stable")[:, :2]
    f = np.zeros(E)
    np.add.at(f, top.ravel(), np.repeat(m, 2))
    want = E * np.sum((f / m.sum()) * ((m[:, None] * p).sum(0) / m.sum()))
    assert float(st.load_balancing_loss) == pytest.approx(want, rel=1e-6)
    assert int(st.counts.sum()) == int(m.sum()) * 2

    def loss(p, b):
        y, st = routed_experts(
            b["x"], b["x"] @ p["router"], p["up"], p["down"], p["gate"], top_k=2, normalize=True, token_mask=b["m"]
        )
        out = (y + b["x"] @ p["shared"]) @ p["out"]
        return jnp.mean((out - b["y"]) ** 2) + 0.01 * st.load_balancing_loss + 0.001 * st.z_loss

    r = np.random.default_rng(3)
    batches = [dict(b, m=jnp.asarray(r.random((B, T)) > 0.3)) for b in data()]
    ref_params, ref_losses = reference_run(loss, moe_params(), optax.sgd(0.1), batches)
    mesh, cfg = zj.make_mesh(expert=4), zj.ZeroConfig(stage=2)
    state = zj.init_state(moe_params(), optax.sgd(0.1), mesh=mesh, config=cfg, tensor_specs=SPECS)
    step = zj.make_train_step(loss, optax.sgd(0.1), mesh=mesh, config=cfg)
    state, losses, mt = _train(step, state, batches)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert abs_errors(zj.gather_params(state), ref_params).max() < 1e-5


def test_a_renamed_expert_axis_is_read_from_the_step():
    """make_mesh(expert=4, expert_axis="moe") with ZeroConfig(axes={"expert": "moe"}):
    routed_experts without axis= takes the step's expert axis, so the program has the
    all-to-alls of the default name (before: it looked up "expert", found size 1 and ran
    every expert on every device), and the loss is the same; an axis= that contradicts
    the step's is refused."""
    moe = functools.partial(zj_moe, k=2)
    loss = lambda p, b: moe_loss(p, b, moe)
    got = {}
    for name in ("expert", "moe"):
        mesh = zj.make_mesh(expert=4, expert_axis=name)
        cfg = zj.ZeroConfig(stage=2, axes={"expert": name}, donate=False)
        specs = {k: (P(name) if v is not None else None) for k, v in SPECS.items()}
        state = zj.init_state(moe_params(), optax.sgd(0.1), mesh=mesh, config=cfg, tensor_specs=specs)
        step = zj.make_train_step(loss, optax.sgd(0.1), mesh=mesh, config=cfg)
        text = lower_as_called(step, state, data()[0]).compile().as_text()  # the program the call runs
        got[name] = (text.count("all-to-all("), float(step(state, data()[0])[1]["loss"]))
    assert got["moe"][0] == got["expert"][0] > 0, got
    np.testing.assert_allclose(got["moe"][1], got["expert"][1], rtol=1e-6)
    wrong = lambda p, b: moe_loss(p, b, functools.partial(zj_moe, k=2, axis="expert"))
    with pytest.raises(ValueError, match=r"routed_experts\(axis='expert'\), but the step's expert axis is 'moe'"):
        zj.make_train_step(wrong, optax.sgd(0.1), mesh=mesh, config=cfg)(state, data()[0])
