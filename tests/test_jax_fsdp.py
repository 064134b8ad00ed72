"""experiments/jax_fsdp.py: JAX's own FSDP recipe trains the experiments' GPT exactly as
single-device optax does (on every supported JAX: 0.10 has reduced shardings too)."""

import pytest

from experiments import jax_fsdp
from zerojax.models import gpt


@pytest.mark.slow  # reason: 19 s, JAX's own recipe (the comparison's, not zerojax's code) trained and checked against optax
def test_jax_fsdp_recipe_matches_single_device_optax():
    """Both variants (reshard per layer, pipelined custom_vjp), 5 AdamW steps of a 2-layer
    GPT on 8 devices, within 1e-5 of single-device optax at every step."""
    c = jax_fsdp.check(gpt.GPTConfig(d_model=32, n_layers=2, n_heads=1), steps=5, batch_size=8)
    assert len(c["reference"]) == 6 and c["reference"][-1] < c["reference"][0]
    for variant in jax_fsdp.RECIPES:
        assert c[f"{variant}_max_rel"] <= 1e-5, (variant, c[variant], c["reference"])
    assert c["ok"]
