"""Eight simulated CPU devices for every test, set before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of small programs and runs each a few times: LLVM's own
# optimisation of the CPU code is most of the compile time and buys nothing here (about a
# quarter of the suite's time). XLA's HLO passes, which decide the collectives, fusion and
# memory the tests check, run as always; numerics are unchanged (no fast-math either way).
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

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
