"""Eight simulated CPU devices for every test, set before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
