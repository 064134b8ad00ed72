"""Eight simulated CPU devices for every test, set before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _xla_knows(flag: str) -> bool:
    """Whether the installed jaxlib accepts ``flag`` in ``XLA_FLAGS`` (an unknown flag aborts
    the process, so a throwaway one tries it). About a second, once per run: the workers and
    the processes the tests start inherit the decision through the environment."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


# Compile speed. Most of a test's time is XLA compiling small 8-device programs it runs a
# few times, so the tests compile them cheaply; ZEROJAX_TEST_FULL_OPT=1 keeps XLA's
# defaults. Each flag is added unless XLA_FLAGS sets it already, and only where the
# installed jaxlib knows it:
# - LLVM's optimisation of the CPU code off (XLA's default is level 3). XLA's HLO passes,
#   which decide the collectives, fusion, buffers and memory the tests check, run as
#   always: the compiled HLO text, memory_analysis() and cost_analysis() are the same at
#   both levels, and results agree to rounding (tests/test_compile_options.py).
# - XLA:CPU's older (non-MLIR) fusion code generator, where the jaxlib still has it (jax
#   0.10 does, 0.12 does not): it compiles a step in about half the time. It forms other
#   CPU fusions, so the optimised HLO text and cost_analysis()'s bytes differ; the
#   collectives, memory_analysis(), flops and results to rounding do not
#   (tests/test_compile_options.py holds both).
# flag -> whether only some jaxlibs know it (then a throwaway process tries it first)
_FAST_COMPILE = {"--xla_backend_optimization_level=0": False, "--xla_cpu_use_fusion_emitters=false": True}
if os.environ.get("ZEROJAX_TEST_FULL_OPT") != "1" and "PYTEST_XDIST_WORKER" not in os.environ:
    for _flag, _some_jaxlibs in _FAST_COMPILE.items():
        if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", "") and (not _some_jaxlibs or _xla_knows(_flag)):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

# One persistent compilation cache for the test workers of one run: many tests compile the
# same program (the same model under single-device optax, the same step at another
# parametrisation). A cached executable is the one XLA compiled, with the same HLO text,
# memory and cost analysis. Set in this process only, not through the environment: a
# multi-process job on these 8 device ids must not load a single-process executable.
# Each run has its own directory (the workers share it; a day-old run's is removed): an
# executable loaded from an earlier run deadlocked once in XLA's CPU collectives (a stage-2
# fp16 step with 4 micro-batches: the devices met different collectives), which a fresh
# compile in the same run never did. ZEROJAX_TEST_COMPILE_CACHE="" turns the cache off.
_CACHE = os.environ.get(
    "ZEROJAX_TEST_COMPILE_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax-tests"),
)
if _CACHE:
    _RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    if "PYTEST_XDIST_WORKER" not in os.environ and os.path.isdir(_CACHE):  # the controller, before workers
        import shutil
        import time

        for _old in os.listdir(_CACHE):  # runs of over a day ago (a run in progress keeps its own)
            _path = os.path.join(_CACHE, _old)
            if _old != _RUN and time.time() - os.path.getmtime(_path) > 86400:
                shutil.rmtree(_path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", os.path.join(_CACHE, _RUN))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

NUM_DEVICES = 8


def pytest_report_header(config):
    return f"jax {jax.__version__}; XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')!r}"


def pytest_configure(config):
    if len(jax.devices()) != NUM_DEVICES:
        raise pytest.UsageError(
            f"tests need {NUM_DEVICES} simulated CPU devices, JAX has {len(jax.devices())}: "
            "JAX was initialised before tests/conftest.py could set jax_num_cpu_devices."
        )


@pytest.fixture(scope="session")
def devices():
    return jax.devices()


# Every compiled program stays loaded while its jit cache holds it, and XLA:CPU maps each
# one's code into the process: a worker that compiles a thousand tests' programs reaches the
# kernel's limit of memory maps per process (vm.max_map_count, 65,530 by default), and the
# next compile dies in XLA with a segmentation fault (measured: about 150 maps per test that
# compiles a step; CI's run crashed at its last tests). Past a threshold the caches are
# cleared between tests: only programs used again recompile (the persistent cache has most).
def _map_limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):  # not Linux: no such limit to watch
        return None


_MAP_LIMIT = _map_limit()


def pytest_runtest_teardown(item, nextitem):
    if _MAP_LIMIT is None:
        return
    with open("/proc/self/maps", "rb") as f:
        maps = f.read().count(b"\n")
    if maps > _MAP_LIMIT // 2:
        import gc

        jax.clear_caches()
        gc.collect()
