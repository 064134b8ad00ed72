"""The Python blocks of docs/*.md: each one runs, or says it is a fragment.

A block runs unless the line before its fence is ``<!-- fragment -->`` (a piece of a
program: it uses names the reader brings, a file or a package the docs do not ship). A
file's blocks run in order in one namespace, as the README's do (tests/test_readme.py).
``<!-- slow -->`` before a block that runs puts it in the slow set (its file's blocks run
again there, in order), for the ones that train or compile for more than a few seconds.
Every ``zj.``/``zerojax.`` name in any block, fragments included, must exist.

A file's blocks run in a fresh working directory (docs/fault_tolerance.md's loop writes
its checkpoints under ``ckpt/``).
"""

import importlib
import pathlib
import re

import pytest

import zerojax as zj

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def blocks(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """(line, marker, code) of each Python block: marker is "fragment", "slow" or ""."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        marker = re.fullmatch(r"<!-- (fragment|slow)(?::.*)? -->", before)
        found.append((text[: m.start()].count("\n") + 1, marker.group(1) if marker else "", m.group(1)))
    return found


def run(path: pathlib.Path, with_slow: bool) -> int:
    namespace: dict = {}
    ran = 0
    for line, marker, code in blocks(path):
        if marker == "fragment" or (marker == "slow" and not with_slow):
            continue
        exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
        ran += 1
    return ran


FAST = [p for p in DOCS if any(m == "" for _, m, _ in blocks(p))]
SLOW = [p for p in DOCS if any(m == "slow" for _, m, _ in blocks(p))]


@pytest.mark.parametrize("path", FAST, ids=lambda p: p.name)
def test_docs_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(path, with_slow=False) >= 1


def test_the_fault_tolerance_loop_resumes(tmp_path, monkeypatch, capsys):
    """docs/fault_tolerance.md's script, run twice in one folder: the first trains 30
    steps (the loss falls) and saves; the second resumes at step 30 and trains none."""
    monkeypatch.chdir(tmp_path)
    path = ROOT / "docs" / "fault_tolerance.md"
    run(path, with_slow=False)
    first = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"step \d+, loss (\S+)", first)]
    assert "starting at step 0" in first and len(losses) == 3, first
    assert losses[2] < 0.5 * losses[0], losses
    run(path, with_slow=False)
    second = capsys.readouterr().out
    assert "resuming at step 30" in second and "loss" not in second.split("resuming at step 30")[1], second


@pytest.mark.slow  # reason: these blocks train a model or compile several steps (20-60 s each on 2 cores)
@pytest.mark.parametrize("path", SLOW, ids=lambda p: p.name)
def test_docs_slow_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(path, with_slow=True) >= 1


def test_every_block_runs_or_is_marked_and_names_what_exists():
    """Each block is runnable (tested above) or marked; the names of zerojax it uses exist."""
    assert DOCS and sum(len(blocks(p)) for p in DOCS) >= 20
    missing = []
    for path in DOCS:
        for line, _, code in blocks(path):
            for name in re.findall(r"\b(?:zj|zerojax)(?:\.[A-Za-z_]\w*)+", code):
                obj, parts = zj, name.split(".")
                for i, part in enumerate(parts[1:], 1):
                    if not hasattr(obj, part):  # a submodule its package does not import: import it
                        try:
                            obj = importlib.import_module(".".join(["zerojax", *parts[1 : i + 1]]))
                            continue
                        except ImportError:
                            missing.append(f"{path.name}:{line}: {name}")
                            break
                    obj = getattr(obj, part)
        # Names taken with "from zerojax.x import y", then used as y.attr.
        for line, _, code in blocks(path):
            for module, names in re.findall(r"^from (zerojax[\w.]*) import ([\w, ]+)$", code, flags=re.M):
                mod = importlib.import_module(module)
                for name in (n.strip() for n in names.split(",")):
                    obj = getattr(mod, name, None)
                    if obj is None:
                        missing.append(f"{path.name}:{line}: {module}.{name}")
                        continue
                    for attr in re.findall(rf"\b{name}\.([A-Za-z_]\w*)", code):
                        if not hasattr(obj, attr):
                            missing.append(f"{path.name}:{line}: {module}.{name}.{attr}")
    assert not missing, missing
