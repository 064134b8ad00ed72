"""Eight simulated CPU devices for every test, set before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# One persistent compilation cache for the test workers: many tests compile the same
# program (the same model under single-device optax, the same step at another
# parametrisation). A cached executable is the one XLA compiled, with the same HLO text,
# memory and cost analysis. Set in this process only, not through the environment: a
# multi-process job on these 8 device ids must not load a single-process executable.
# ZEROJAX_TEST_COMPILE_CACHE="" turns it off.
_CACHE = os.environ.get(
    "ZEROJAX_TEST_COMPILE_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax-tests"),
)
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

NUM_DEVICES = 8


def pytest_configure(config):
    if len(jax.devices()) != NUM_DEVICES:
        raise pytest.UsageError(
            f"tests need {NUM_DEVICES} simulated CPU devices, JAX has {len(jax.devices())}: "
            "JAX was initialised before tests/conftest.py could set jax_num_cpu_devices."
        )


@pytest.fixture(scope="session")
def devices():
    return jax.devices()
