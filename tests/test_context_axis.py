"""A context axis not named "context": the step's layout names its axis, and the attention
kernels and global_positions find it there (no axis= of their own), so a mesh's axis name
changes neither the compiled program's collectives nor the values; what they cannot tell
is refused, never guessed."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

import zerojax as zj
from tests import models
from zerojax.context import Layout
from zerojax.report.comm import collectives

B, T, N, H = 4, 16, 2, 8


def _batch():
    rng = np.random.default_rng(0)
    return {name: jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for name in ("q", "k", "v")}


def _loss(p, b, layout):
    out = zj.nn.dot_product_attention(b["q"] * p["w"], b["k"], b["v"], is_causal=True, method="ring", layout=layout)
    return jnp.mean(out**2)


@functools.cache
def _step(name: str, kind: str):
    """``(loss, collectives)`` of one sgd step of ``_loss`` on a mesh whose context axis is ``name``."""
    mesh = zj.make_mesh(context=2, context_axis=name)
    zc = zj.ZeroConfig(stage=0, axes={"context": name}, context={"layout": kind})
    state = zj.init_state({"w": jnp.ones(())}, optax.sgd(0.1), mesh=mesh, config=zc)
    step = zj.make_train_step(_loss, optax.sgd(0.1), mesh=mesh, config=zc, with_layout=True)
    text = models.lower_as_called(step, state, _batch()).compile().as_text()  # the program the call runs
    _, metrics = step(state, _batch())
    return float(metrics["loss"]), sorted((c.kind, c.count, c.bytes) for c in collectives(text))


@pytest.mark.parametrize("kind", ["contiguous", "balanced"])
def test_a_context_axis_of_another_name_runs_the_same_program(kind):
    """make_mesh(context=2, context_axis="seq") with ZeroConfig(axes={"context": "seq"}): the
    step's layout names "seq", the ring kernel runs over it with the collectives it has over
    "context" (collective-permutes, no all-gather of the sequence), and the loss is JAX's
    attention's on the whole batch."""
    loss, ops = _step("seq", kind)
    assert ops == _step("context", kind)[1]
    kinds = {k for k, _, _ in ops}
    assert "collective-permute" in kinds and "all-gather" not in kinds, ops
    b = _batch()
    want = jnp.mean(jax.nn.dot_product_attention(b["q"], b["k"], b["v"], is_causal=True) ** 2)
    np.testing.assert_allclose(loss, float(want), rtol=1e-5)


def _seq_mesh(c: int = 2) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(8 // c, c), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)


def test_the_kernel_and_positions_read_the_axis_from_the_layout():
    """Under jax.set_mesh of a ("data", "seq") mesh, a Layout naming "seq" is all the kernel
    and global_positions need: values JAX's (balanced: on the permuted sequence), and the
    compiled program permutes the chunks round the ring instead of gathering them."""
    b, lay = _batch(), Layout("balanced", 2, "seq")
    order, inv = lay.order(T), lay.inverse(T)
    fn = jax.jit(
        lambda q, k, v: zj.nn.dot_product_attention(q, k, v, is_causal=True, method="ring", layout=lay)[:, inv]
    )
    args = [b[n][:, order] for n in ("q", "k", "v")]
    with jax.set_mesh(_seq_mesh()):
        got = fn(*args)
        ops = {c.kind for c in collectives(fn.lower(*args).compile().as_text())}
        positions = np.asarray(zj.nn.global_positions(T, lay))
    np.testing.assert_allclose(got, jax.nn.dot_product_attention(b["q"], b["k"], b["v"], is_causal=True), atol=1e-5)
    assert "collective-permute" in ops and "all-gather" not in ops, ops
    np.testing.assert_array_equal(positions, order)


def test_an_axis_that_cannot_be_told_is_refused():
    """Never guessed: ``layout="balanced"`` naming no axis on a mesh with no "context" axis, an
    ``axis=`` other than the layout's, and a layout over devices of an axis the mesh lacks are
    each refused with the fix; off a mesh, "balanced" over one device is JAX's attention."""
    b = _batch()
    q, k, v = b["q"], b["k"], b["v"]
    with jax.set_mesh(_seq_mesh()):
        with pytest.raises(ValueError, match=r"layout='balanced' names no axis.*\('data', 'seq'\).*axis="):
            zj.nn.dot_product_attention(q, k, v, is_causal=True, layout="balanced")
        with pytest.raises(ValueError, match=r"layout='balanced' names no axis"):
            zj.nn.global_positions(T, "balanced")
        with pytest.raises(ValueError, match=r"axis='context', but the layout .* splits the sequence over 'seq'"):
            zj.nn.dot_product_attention(q, k, v, layout=Layout("balanced", 2, "seq"), axis="context")
        with pytest.raises(ValueError, match=r"2 devices of the mesh axis 'context', but the mesh has no such axis"):
            zj.nn.dot_product_attention(q, k, v, layout=Layout("contiguous", 2))
        with pytest.raises(ValueError, match=r"4 devices of the mesh axis 'seq', but the mesh has 2 devices on it"):
            zj.nn.global_positions(T, Layout("balanced", 4, "seq"))
        out = zj.nn.dot_product_attention(q, k, v, is_causal=True, layout="balanced", axis="seq", method="ring")
        np.testing.assert_allclose(
            out[:, Layout("balanced", 2).inverse(T)],
            jax.nn.dot_product_attention(*(x[:, Layout("balanced", 2).inverse(T)] for x in (q, k, v)), is_causal=True),
            atol=1e-5,
        )
    np.testing.assert_array_equal(
        np.asarray(zj.nn.dot_product_attention(q, k, v, is_causal=True, layout="balanced")),
        np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True)),
    )
    with pytest.raises(ValueError, match=r"axis is a mesh axis name"):
        Layout("balanced", 2, "")
