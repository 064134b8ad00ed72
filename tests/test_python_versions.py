"""The README's first command on the newest Python the project supports: a fresh Python 3.13
venv installs zerojax (resolving today's JAX) and runs the demo. Python 3.11 and 3.12 run the
whole suite in CI (.ci/run)."""

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def find_python(version: str) -> str | None:
    """A Python of this version from PATH or pyenv, as .ci/run finds one."""
    root = (
        subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        if shutil.which("pyenv")
        else os.path.expanduser("~/.pyenv")
    )
    want = tuple(map(int, version.split(".")))
    check = f"import sys; sys.exit(sys.version_info[:2] != {want})"
    found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python"), reverse=True)
    for cand in [shutil.which(f"python{version}"), *found]:
        if cand and subprocess.run([cand, "-c", check]).returncode == 0:
            return cand
    return None


@pytest.mark.slow  # reason: a fresh venv with jax, flax and optax (about half a minute of installing), then the demo
def test_readme_demo_on_python_3_13(tmp_path):
    python = find_python("3.13")
    if python is None:
        pytest.fail(
            "Python 3.13 is not on PATH nor in pyenv; the project supports it, so this test needs it "
            "(pyenv install 3.13)."
        )
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    # --no-compile: the same packages, without byte-compiling every module of jax, scipy and the
    # rest ahead (what the demo imports is compiled as it is imported).
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-compile", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    # Of the tests' XLA flags (conftest.py), only the one every jaxlib knows: the venv resolves
    # another JAX, and an XLA flag its jaxlib does not know aborts the demo.
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if f.startswith("--xla_backend_optimization_level="))
    out = subprocess.run(
        [str(venv / "bin" / "python"), str(ROOT / "experiments" / "demo.py"), "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Python 3.13" in subprocess.run([str(venv / "bin" / "python"), "-VV"], capture_output=True, text=True).stdout
    assert "12Ψ/N" in out.stdout
    first, last = [float(x) for x in out.stdout.split("loss ")[-1].split(" (")[0].split(" -> ")]
    assert last < first - 1.0, out.stdout
