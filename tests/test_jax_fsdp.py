"""experiments/jax_fsdp.py: JAX's own FSDP recipe (jax >= 0.11) trains the experiments' GPT
exactly as single-device optax does; on an older JAX the script says what it needs."""

import jax
import pytest

from experiments import gpt, jax_fsdp

JAX = tuple(int(p) for p in jax.__version__.split(".")[:2])


def test_jax_fsdp_recipe_matches_single_device_optax():
    """Both variants (reshard per layer, pipelined custom_vjp), 5 AdamW steps of a 2-layer
    GPT on 8 devices, within 1e-5 of single-device optax at every step. On a JAX older than
    the recipe needs, the script refuses with the version it needs and the one it found."""
    if JAX < jax_fsdp.MIN_JAX:
        found = jax.__version__.replace(".", r"\.")
        with pytest.raises(RuntimeError, match=r"needs jax>=0\.11 .*this is jax " + found):
            jax_fsdp.main(["--d-model", "32", "--layers", "2", "--batch", "8", "--check-only"])
        return
    c = jax_fsdp.check(gpt.GPTConfig(d_model=32, n_layers=2, n_heads=1), steps=5, batch_size=8)
    assert len(c["reference"]) == 6 and c["reference"][-1] < c["reference"][0]
    for variant in jax_fsdp.RECIPES:
        assert c[f"{variant}_max_rel"] <= 1e-5, (variant, c[variant], c["reference"])
    assert c["ok"]
