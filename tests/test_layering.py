"""The package's layering, read from the source: which part may import which.

A part is a top-level module or package of zerojax. The parts sit in an ordered list of
layers, bottom up (``LAYERS``: the program reading first, the command line last); a part
imports only parts of its own layer or below, and no two parts import each other, directly
or around a circle. Imports inside functions count (they run too, just later); ``if
TYPE_CHECKING:`` blocks do not. Between modules, no circle forms when they are imported.
No two modules share a file name (``__init__.py`` aside).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "zerojax"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


MODULES = _modules()


def _targets(node: ast.AST) -> set[str]:
    """The zerojax modules one import statement loads: ``from pkg import sub`` loads
    ``pkg.sub`` (and ``pkg``'s ``__init__`` only for names that are not submodules)."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zerojax":
        subs = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
        return subs if len(subs) == len(node.names) else subs | {node.module}
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == "zerojax"}
    return set()


def _imports(name: str, lazy: bool) -> set[str]:
    """The modules ``name`` imports when it is imported (``lazy``: also inside functions)."""
    out: set[str] = set()

    def visit(nodes, top):
        for n in nodes:
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                continue
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                if lazy and top:
                    visit(list(ast.walk(n))[1:], False)
                continue
            out.update(_targets(n))
            if top:
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(n, field, []), True)
                for h in getattr(n, "handlers", []):
                    visit(h.body, True)

    visit(ast.parse(MODULES[name].read_text()).body, True)
    return out


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(zerojax)"


# The layers, bottom up. A part (a top-level module or package of zerojax) imports only parts
# of its own layer or of the layers below it, inside functions too; and no two parts import
# each other, directly or around a circle (test_no_cycle_between_parts). A new part takes
# the lowest layer whose parts it needs, or a new layer where it sits between two.
LAYERS: list[tuple[str, set[str]]] = [
    ("the program reading (everything read of JAX's internals)", {"_jaxpr"}),
    ("leaf utilities (import no other part)", {"remat", "progress", "on_stall", "xla_flags"}),
    ("configuration and the compilation cache", {"config", "compile_cache"}),
    ("meshes, layouts, collectives, per-use gathers and the pipeline's schedule", {"sharding", "pipeline"}),
    ("the sequence layout over a context axis", {"context"}),
    ("optimizer application; tensors in files and maps", {"optim", "tensors"}),
    ("the stages' gradient programs", {"stages"}),
    ("the train state", {"state"}),
    ("the optimizer state on disk (NVMe tier)", {"nvme"}),
    ("the steps", {"step", "params", "evaluate"}),
    ("checkpoints and exports", {"checkpoint"}),
    ("the distributed runtime, resumable runs and the input pipeline", {"distributed", "resume", "data"}),
    ("reports", {"report"}),
    ("layers users build with", {"moe", "nn"}),
    ("the reference models and their weight maps", {"models", "maps"}),
    ("Flax NNX training", {"nnx"}),
    ("DeepSpeed configs, the autotuner and run monitoring", {"deepspeed", "tuning", "monitor"}),
    ("the training loop", {"loop"}),
    ("the package root and its listing", {"(zerojax)", "_surface"}),
    ("the command line and the launcher", {"cli", "launch"}),
]
LAYER_OF = {part: i for i, (_, parts) in enumerate(LAYERS) for part in parts}


def test_every_part_has_a_layer():
    parts = {_part(m) for m in MODULES}
    assert not parts - set(LAYER_OF), f"parts with no layer in LAYERS: {sorted(parts - set(LAYER_OF))}"
    assert not set(LAYER_OF) - parts, f"LAYERS names parts that do not exist: {sorted(set(LAYER_OF) - parts)}"


def test_no_part_imports_a_higher_layer():
    wrong = [
        f"{m} (layer {LAYER_OF[_part(m)]}: {LAYERS[LAYER_OF[_part(m)]][0]}) imports {t} "
        f"(layer {LAYER_OF[_part(t)]}: {LAYERS[LAYER_OF[_part(t)]][0]})"
        for m in sorted(MODULES)
        for t in sorted(_imports(m, lazy=True))
        if t in MODULES and LAYER_OF[_part(t)] > LAYER_OF[_part(m)]
    ]
    assert not wrong, "imports that go up a layer:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t) :] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_cycle_between_parts():
    # Imports inside functions count: a circle between two parts hidden by a lazy import
    # is still a circle.
    graph: dict[str, set[str]] = {_part(m): set() for m in MODULES}
    for m in MODULES:
        graph[_part(m)] |= {_part(t) for t in _imports(m, lazy=True) if t in MODULES} - {_part(m)}
    cycles = _cycles(graph)
    assert not cycles, "circles between parts:\n" + "\n".join(cycles)


def test_no_import_cycles():
    # Between modules, when they are imported (module-level imports).
    graph = {m: {t for t in _imports(m, lazy=False) if t in MODULES and t != m} for m in MODULES}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_reader_sees_the_imports():
    # The rules above are only as good as the parse: known edges must be found.
    assert "zerojax.sharding.plan" in _imports("zerojax.state", lazy=False)
    assert "zerojax.sharding.filters" in _imports("zerojax.sharding.plan", lazy=True)
    assert "zerojax.config" in _imports("zerojax.deepspeed.mapping", lazy=False)
    assert "zerojax.checkpoint.io" in _imports("zerojax.resume.run", lazy=False)
    assert "zerojax.tensors.born" in _imports("zerojax.state", lazy=False)
    assert "zerojax._jaxpr.form" in _imports("zerojax._jaxpr.walk", lazy=False)


def test_models_do_not_build_trainers():
    # A reference model is a model: states and steps are built by the code that trains it.
    wrong = [
        f"{m} imports {t}"
        for m in sorted(MODULES)
        if _part(m) == "models"
        for t in sorted(_imports(m, lazy=True))
        if _part(t) in {"state", "step", "evaluate", "params"}
    ]
    assert not wrong, "\n".join(wrong)


def test_no_two_modules_share_a_file_name():
    # A file name says which module it is: in a traceback, a review or an import, two
    # ``layout.py`` (or ``sources.py``, ``cli.py``) leave the reader to guess. Packages'
    # ``__init__.py`` are the one name every package shares.
    by_name: dict[str, list[str]] = {}
    for p in sorted(ROOT.rglob("*.py")):
        if p.name != "__init__.py":
            by_name.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    twice = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not twice, (
        "file names that stand more than once in zerojax/ (rename one to say which is which):\n"
        + "\n".join(f"{name}: {', '.join(paths)}" for name, paths in sorted(twice.items()))
    )
