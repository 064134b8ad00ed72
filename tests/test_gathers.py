"""zerojax.sharding.gathers: on a data x context x tensor mesh the loss's batched gathers
(jnp.take_along_axis, optax's integer-label cross-entropy) are evaluated as a select and a
sum. Checked here against JAX's own gather, values and gradients, on one device (the
rewrite does not depend on the mesh); the Llama trained on such a mesh is in
tests/test_context.py."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zerojax._jaxpr import constructs
from zerojax.sharding import gathers

BOTH = types.SimpleNamespace(tensor=2, context=2)  # what gathers.wrap reads of a plan


def _rewritten(fn):
    rewritten = gathers.wrap(BOTH, fn)
    assert rewritten is not fn
    assert gathers.wrap(types.SimpleNamespace(tensor=2, context=1), fn) is fn  # one axis alone: untouched
    return rewritten


def _no_batched_gather(fn, *args):
    def eqns(jaxpr):
        for e in jaxpr.eqns:
            yield e
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from eqns(getattr(sub, "jaxpr", sub))

    return not any(
        constructs.is_gather(e) and constructs.has_batching_dims(e) for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)
    )


@pytest.mark.parametrize(
    "case", ["cross-entropy", "middle axis", "several per row", "out of range fill", "out of range clip"]
)
def test_take_along_axis_is_rewritten_exactly(case):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 6, 10)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 10, (2, 6)), jnp.int32)
    if case == "cross-entropy":
        fn = lambda x, t: optax.softmax_cross_entropy_with_integer_labels(x, t).mean()
    elif case == "middle axis":  # the picked axis in the middle: one position per (row, feature)
        fn = lambda x, t: (jnp.take_along_axis(x, t[:, :1, None] * jnp.arange(10) % 6, axis=1) ** 2).sum()
    elif case == "several per row":  # indices with a dimension of their own (3 picks per row)
        fn = lambda x, t: (jnp.take_along_axis(x, t[:, :, None] * jnp.array([1, 0, 1]) % 10, axis=-1) ** 2).sum()
    elif case == "out of range fill":  # JAX's default: NaN where an index is out of range
        targets = targets.at[0, 0].set(12)
        fn = lambda x, t: jnp.take_along_axis(x, t[..., None], axis=-1, mode="fill")
    else:
        targets = targets.at[0, 0].set(12)
        fn = lambda x, t: jnp.take_along_axis(x, t[..., None], axis=-1, mode="clip")
    ours = _rewritten(fn)
    assert _no_batched_gather(ours, logits, targets) and not _no_batched_gather(fn, logits, targets)
    np.testing.assert_array_equal(np.asarray(jax.jit(ours)(logits, targets)), np.asarray(fn(logits, targets)))
    if np.ndim(fn(logits, targets)) == 0:
        np.testing.assert_allclose(jax.grad(ours)(logits, targets), jax.grad(fn)(logits, targets), rtol=1e-6, atol=1e-7)


def test_keywords_and_trees_pass_through():
    fn = lambda p, b, rng=None: ({"loss": jnp.take_along_axis(p["w"], b[..., None], -1).sum()}, rng)
    p, b = {"w": jnp.arange(12.0).reshape(3, 4)}, jnp.array([0, 3, 1])
    out, rng = _rewritten(fn)(p, b, rng=jnp.ones(2))
    assert float(out["loss"]) == 0 + 7 + 9 and rng.shape == (2,)


def test_another_batched_gather_is_refused_with_its_line():
    """A batched gather of another form (here a window of two along the picked axis) would
    abort the process on such a mesh: refused, naming the line."""

    def fn(x, i):
        dn = jax.lax.GatherDimensionNumbers(
            offset_dims=(1,),
            collapsed_slice_dims=(),
            start_index_map=(1,),
            operand_batching_dims=(0,),
            start_indices_batching_dims=(0,),
        )
        return jax.lax.gather(x, i, dn, slice_sizes=(1, 2), mode="clip").sum()

    with pytest.raises(
        ValueError,
        match=r"gathers with batching dimensions at .*test_gathers.py:\d+ .* Index with "
        r"jnp.take_along_axis",
    ):
        _rewritten(fn)(jnp.ones((3, 5)), jnp.zeros((3, 1), jnp.int32))
