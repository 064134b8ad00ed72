"""The package's layering, read from the source: which module may import which.

Layers, bottom up: the JAX boundary (``_jaxpr``: everything read of JAX's internals) imports
no other part of zerojax; the core (configuration, sharding, optimizer application, state,
steps, checkpoints, the distributed runtime, resumable runs, reports) never imports the
layers users build with on top of it (``nn``, ``models``, ``nnx``, ``moe``, ``tuning``,
``deepspeed``, the command line and the launcher) nor the package root; ``sharding`` sits
below the state, the steps and checkpoints; and no two modules import each other, directly
or around a circle, when they are imported. Imports inside functions count for the layers
(they run too, just later); ``if TYPE_CHECKING:`` blocks do not count.
"""

import ast
import pathlib

import pytest

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


CORE = {
    "config",
    "params",
    "sharding",
    "optim",
    "remat",
    "context",
    "state",
    "step",
    "evaluate",
    "checkpoint",
    "distributed",
    "resume",
    "report",
    "compile_cache",
    "xla_flags",
}
ABOVE_CORE = {"nn", "models", "nnx", "moe", "tuning", "deepspeed", "cli", "launch", "(zerojax)", "maps"}
ABOVE_SHARDING = {"state", "step", "evaluate", "checkpoint", "distributed", "resume"}
RULES = [
    ("the JAX boundary", {"_jaxpr"}, CORE | ABOVE_CORE),
    ("the core", CORE, ABOVE_CORE),
    ("sharding", {"sharding"}, ABOVE_SHARDING | ABOVE_CORE),
]


@pytest.mark.parametrize("layer, below, above", RULES, ids=[r[0] for r in RULES])
def test_lower_layers_never_import_upper_ones(layer, below, above):
    wrong = [
        f"{m} imports {t}"
        for m in sorted(MODULES)
        if _part(m) in below
        for t in sorted(_imports(m, lazy=True))
        if _part(t) in above
    ]
    assert not wrong, f"{layer} must not import {sorted(above)}:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: {t for t in _imports(m, lazy=False) if t in MODULES and t != m} for m in MODULES}
    cycles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t) :] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_reader_sees_the_imports():
    # The rules above are only as good as the parse: known edges must be found.
    assert "zerojax.sharding.plan" in _imports("zerojax.state", lazy=False)
    assert "zerojax.sharding.filters" in _imports("zerojax.sharding.plan", lazy=True)
    assert "zerojax.config" in _imports("zerojax.deepspeed.mapping", lazy=False)
    assert "zerojax.checkpoint.io" in _imports("zerojax.resume.run", lazy=False)
    assert "zerojax._jaxpr.form" in _imports("zerojax._jaxpr.walk", lazy=False)
