"""zerojax's one walk over JAX programs (zerojax._jaxpr.walk) and the boundary around
JAX's internals: only the package zerojax/_jaxpr/ names a JAX primitive, a primitive's
parameter or a private JAX module."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest

from zerojax._jaxpr import constructs, form, rules, walk
from zerojax._jaxpr.retrace import Retracer

ROOT = pathlib.Path(__file__).resolve().parent.parent / "zerojax"
BOUNDARY = ROOT / "_jaxpr"
# Modules of JAX whose contents are its program form or its internals.
_INTERNAL_MODULES = ("jax._src", "jax.extend", "jax.core", "jax.interpreters")
# Attributes of JAX's program objects that only the boundary reads: an equation's
# primitive and parameters, where it came from.
_INTERNAL_ATTRIBUTES = {
    "primitive": "an equation's primitive",
    "params": "an equation's parameters",
    "source_info": "an equation's source information",
    "ctx": "an equation's tracing context",
    "_src": "a private JAX module",
}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain of names, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_equation(node: ast.AST) -> bool:
    """Whether ``node`` names an equation the way zerojax's code does (``eqn``, ``e``, ``x.eqn``)."""
    chain = _dotted(node)
    last = chain.rsplit(".", 1)[-1] if chain else ""
    return "eqn" in last or last == "e"


def crossings(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of each place ``source`` reads JAX's internals (code only: strings
    and comments are not read). An equation's primitive or parameters are recognised by
    use: read from a value named as zerojax names equations, subscripted (``.params[k]``),
    or read through ``.get``, ``.items``, ``.values``, ``.keys``, ``.name`` or ``.bind``."""
    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(m == p or m.startswith(p + ".") for m in modules for p in _INTERNAL_MODULES):
                found.append((node.lineno, f"imports from {node.module}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if any(a.name == p or a.name.startswith(p + ".") for p in _INTERNAL_MODULES):
                    found.append((node.lineno, f"imports {a.name}"))
        elif isinstance(node, ast.Attribute):
            chain = _dotted(node)
            up = parent.get(node)
            used = (
                isinstance(up, ast.Subscript)
                and up.value is node
                or (isinstance(up, ast.Attribute) and up.attr in ("get", "items", "values", "keys", "name", "bind"))
            )
            if any(chain == p or chain.startswith(p + ".") for p in _INTERNAL_MODULES):
                if not any(
                    _dotted(node.value) == p or _dotted(node.value).startswith(p + ".") for p in _INTERNAL_MODULES
                ):  # once per chain, at its shortest
                    found.append((node.lineno, f"reads {chain}"))
            elif node.attr in _INTERNAL_ATTRIBUTES and node.attr != "_src" and (used or _is_equation(node.value)):
                found.append((node.lineno, f"reads {_INTERNAL_ATTRIBUTES[node.attr]} (.{node.attr})"))
            elif node.attr == "manual_axes" and not (
                chain.endswith("plan.manual_axes") or chain == "settings.manual_axes"
            ):
                found.append((node.lineno, "reads a mesh's manual axes (.manual_axes)"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if (
                len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in ("manual_axes", "primitive", "params", "source_info", "ctx")
            ):
                found.append((node.lineno, f"reads .{node.args[1].value} through {node.func.id}"))
    return sorted(set(found))


def test_only_the_jaxpr_package_reads_jax_internals():
    """Every other module of zerojax asks zerojax/_jaxpr/: a JAX release that moves a
    construct is then one package's change, checked the first time a program is read."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        if BOUNDARY in path.parents:
            continue
        for line, what in crossings(path.read_text()):
            bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {what}")
    assert not bad, "JAX internals read outside zerojax/_jaxpr/:\n" + "\n".join(bad)
    assert crossings((BOUNDARY / "form.py").read_text())  # the boundary itself does read them


@pytest.mark.parametrize(
    "code,what",
    [
        ("from jax._src import config", "imports from jax._src"),
        ("import jax._src.source_info_util", "imports jax._src"),
        ("from jax.extend import core", "imports from jax.extend"),
        ("from jax.extend.core import Literal", "imports from jax.extend.core"),
        ("from jax import core", "imports from jax"),
        ("x = jax._src.core.Literal", "reads jax._src"),
        ("y = jax.extend.core.primitives.scan_p", "reads jax.extend"),
        ("if eqn.primitive is p: pass", "an equation's primitive"),
        ("if e.primitive in prims: pass", "an equation's primitive"),
        ("n = f(x).primitive.name", "an equation's primitive"),
        ("out = e.params", "an equation's parameters"),
        ("n = eqn.primitive.name", "an equation's primitive"),
        ("m = eqn.ctx.cur_abstract_mesh", "an equation's tracing context"),
        ("d = eqn.params['dimension_numbers']", "an equation's parameters"),
        ("d = eqn.params.get('axes')", "an equation's parameters"),
        ("t = eqn.source_info.traceback", "source information"),
        ("m = getattr(mesh, 'manual_axes', ())", "manual_axes through getattr"),
        ("m = jax.sharding.get_abstract_mesh().manual_axes", "a mesh's manual axes"),
    ],
)
def test_the_boundary_check_finds_each_kind_of_crossing(code, what):
    found = crossings(code)
    assert found and what in found[0][1], found


@pytest.mark.parametrize(
    "code",
    [
        "s = 'optimizer.params.lr'  # a string, not code",
        "axes = plan.manual_axes",
        "axes = self.plan.manual_axes",
        "axes = settings.manual_axes(mesh)",
        "leaves = jax.tree.leaves(state.params)",
        "out = self.primitive(eqn, ins)",
        "from jax.sharding import PartitionSpec",
        "import jax.numpy as jnp",
    ],
)
def test_the_boundary_check_leaves_the_rest(code):
    assert crossings(code) == []


def test_equations_visits_every_nested_program():
    def f(x):
        def body(c, r):
            return jax.lax.cond(r[0] > 0, lambda a: jax.jit(jnp.sin)(a), jnp.cos, c), None

        return jax.checkpoint(lambda x: jax.lax.scan(body, x[0], x)[0])(x)

    eqns = list(walk.equations(jax.make_jaxpr(f)(jnp.ones((3, 2))).jaxpr))
    names = [form.name(e) for e in eqns]
    assert constructs.is_remat(eqns[0])
    for n in ("scan", "cond", "jit", "sin", "cos"):
        assert n in names, (n, names)
    assert names.index("scan") < names.index("cond") < names.index("jit") < names.index("sin")


class _Reads(walk.Dataflow):
    """Which inputs each value reads (bit sets), following every construct."""

    def literal(self, value):
        return 0

    def constant(self, value):
        return 0

    def primitive(self, eqn, ins):
        d = 0
        for x in ins:
            d |= x
        return [d] * len(eqn.outvars)

    def join(self, a, b):
        return a | b


def _reads(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    jaxpr, consts = form.open_jaxpr(closed)
    return _Reads().run(jaxpr, [0] * len(consts), [1 << i for i in range(len(args))])


def test_dataflow_follows_loop_carries_to_a_fixed_point():
    # the carry passes a's bit to b's slot one round later: only a fixed point sees it
    def loop(a, b, c):
        return jax.lax.fori_loop(0, 3, lambda i, s: (s[1], s[0], s[2]), (a, b, c))

    assert _reads(loop, 1.0, 2.0, 3.0) == [0b011, 0b011, 0b100]

    def scanned(a, b, xs):
        (p, q), ys = jax.lax.scan(lambda s, x: ((s[1], s[0] * x), s[0]), (a, b), xs)
        return p, q, ys

    assert _reads(scanned, 1.0, 2.0, jnp.ones(4)) == [0b111, 0b111, 0b111]

    def branch(a, b, c):
        return jax.lax.cond(a > 0, lambda b, c: (b, b), lambda b, c: (c, b), b, c)

    assert _reads(branch, 1.0, 2.0, 3.0) == [0b110, 0b010]  # the index is not a value of either branch's


def test_dataflow_counts_constructs_it_does_not_follow_whole():
    class CallsOnly(_Reads):
        follows = frozenset({"call"})

    def loop(a, b):
        return jax.lax.fori_loop(0, 3, lambda i, s: (s[0] * 2, s[1] + 1), (a, b))

    closed = jax.make_jaxpr(loop)(1.0, 2.0)
    jaxpr, _ = form.open_jaxpr(closed)
    assert CallsOnly().run(jaxpr, [], [1, 2]) == [3, 3]
    assert _reads(loop, 1.0, 2.0) == [1, 2]


def test_retracer_replaces_equations_inside_every_sub_program():
    class SinToCos(Retracer):
        def replace(self, eqn, ins):
            return [jnp.cos(ins[0])] if form.name(eqn) == "sin" else None

    def f(x):
        y = jax.checkpoint(jnp.sin)(x)
        y = y + jax.lax.scan(lambda c, r: (c + jnp.sin(r), None), 0.0, x)[0]
        return y + jax.nn.relu(jax.jit(jnp.sin)(x))

    def g(x):
        y = jax.checkpoint(jnp.cos)(x)
        y = y + jax.lax.scan(lambda c, r: (c + jnp.cos(r), None), 0.0, x)[0]
        return y + jax.nn.relu(jax.jit(jnp.cos)(x))

    x = jnp.linspace(-1.0, 1.0, 5)
    closed = jax.make_jaxpr(f)(x)
    (got,) = SinToCos().evaluate(closed, [x])
    assert jnp.allclose(got, g(x))
    again = SinToCos().program(closed)  # a program again, with no sin left in it
    assert not any(form.name(e) == "sin" for e in walk.equations(form.open_jaxpr(again)[0]))
    grad = jax.grad(lambda x: SinToCos().evaluate(closed, [x])[0].sum())(x)
    assert jnp.allclose(grad, jax.grad(lambda x: g(x).sum())(x))


def test_reshape_groups():
    assert rules.reshape_groups((2, 8, 4), (2, 32)) == ((0,), (1, 2))
    assert rules.reshape_groups((2, 8, 4), (16, 4)) == ((0, 1), (2,))
    assert rules.reshape_groups((2, 8), (2, 2, 4)) == ((0,), (1,), (1,))
    assert rules.reshape_groups((2, 1, 8), (2, 8, 1)) == ((0,), (2,), ())
    assert rules.reshape_groups((6, 4), (4, 6)) == ((0, 1), (0, 1))
