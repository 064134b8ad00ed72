"""Weight-map specs on random nested specs, against numpy: the tensors an export infers, the
parameter a load builds from them, and each value where a hand numpy reference puts it.

Numpy only (no JAX programs): a few hundred random specs in about a second."""

import re

import numpy as np
import pytest

from zerojax.maps import WeightMap, concat, infer_tensors, merge_dims, part, split_dim, stack, transpose
from zerojax.tensors import boxes
from zerojax.tensors.specs import AtLeast, Shapes
from zerojax.tensors.weight_map import resolve


class Arrays:
    """Tensors in memory, read and written by box as :class:`TensorFiles` does."""

    def __init__(self, arrays):
        self.arrays = arrays

    def read_box(self, name, box):
        return self.arrays[name][boxes.slices(box)].copy()

    def write_box(self, name, box, values):
        self.arrays[name][boxes.slices(box)] = values


def _least(n):
    return n.n if isinstance(n, AtLeast) else n


class RandomSpec:
    """A random spec for a parameter, with what it should mean, worked out by hand.

    :meth:`make` returns ``(spec, wanted, ref)`` for a target shape (``int`` or :class:`AtLeast`
    dimensions, as a ``part`` asks of its tensor): ``wanted(env)`` the tensors it names with
    the target each must meet, ``ref(arrays, env)`` the parameter as numpy builds it."""

    def __init__(self, rng):
        self.rng = rng
        self.count = 0
        self.uses_part = False

    def make(self, target, depth, fields=()):
        rng, rank = self.rng, len(target)
        exact = [d for d in range(rank) if isinstance(target[d], int)]
        ops = ["name"]
        if depth > 0:
            ops += ["transpose", "concat"]
            if exact:
                ops += ["part"] + (["merge_dims"] if rank < 4 else [])
                ops += ["stack"] if rank > 1 else []
            if any(d + 1 in exact for d in exact):
                ops.append("split_dim")
        op = ops[rng.integers(len(ops))]
        return getattr(self, "_" + op)(target, depth - 1, fields)

    def _name(self, target, depth, fields):
        self.count += 1
        template = f"t{self.count}" + "".join(f".{{{f}}}" for f in fields)
        return (
            template,
            lambda env: {template.format(**env): tuple(target)},
            lambda arrays, env: arrays[template.format(**env)],
        )

    def _transpose(self, target, depth, fields):
        perm = None if self.rng.random() < 0.5 else tuple(int(p) for p in self.rng.permutation(len(target)))
        p = perm if perm is not None else tuple(range(len(target)))[::-1]
        inner = [None] * len(target)
        for i, q in enumerate(p):
            inner[q] = target[i]
        spec, wanted, ref = self.make(tuple(inner), depth, fields)
        return transpose(spec, perm), wanted, lambda arrays, env: ref(arrays, env).transpose(p)

    def _stack(self, target, depth, fields):
        axis = int(self.rng.choice([d for d in range(len(target)) if isinstance(target[d], int)]))
        var = f"v{len(fields)}"
        spec, wanted, ref = self.make(target[:axis] + target[axis + 1 :], depth, (*fields, var))
        n = target[axis]
        return (
            stack(spec, axis, var),
            lambda env: {k: v for i in range(n) for k, v in wanted({**env, var: i}).items()},
            lambda arrays, env: np.stack([ref(arrays, {**env, var: i}) for i in range(n)], axis),
        )

    def _split_dim(self, target, depth, fields):
        axes = [d for d in range(len(target) - 1) if isinstance(target[d], int) and isinstance(target[d + 1], int)]
        a = int(self.rng.choice(axes))
        spec, wanted, ref = self.make(target[:a] + (target[a] * target[a + 1],) + target[a + 2 :], depth, fields)
        return split_dim(spec, a), wanted, lambda arrays, env: _split(ref(arrays, env), a, target[a + 1])

    def _merge_dims(self, target, depth, fields):
        a = int(self.rng.choice([d for d in range(len(target)) if isinstance(target[d], int)]))
        n = target[a]
        inner = int(self.rng.choice([k for k in range(1, n + 1) if n % k == 0]))
        spec, wanted, ref = self.make(target[:a] + (n // inner, inner) + target[a + 1 :], depth, fields)
        return merge_dims(spec, a, inner), wanted, lambda arrays, env: _merge(ref(arrays, env), a)

    def _concat(self, target, depth, fields):
        axis = int(self.rng.integers(len(target)))
        k = int(self.rng.integers(1, 4))
        if isinstance(target[axis], int):
            k = min(k, target[axis])
            cuts = np.sort(self.rng.choice(np.arange(1, target[axis]), k - 1, replace=False))
            sizes = np.diff([0, *cuts, target[axis]]).tolist()
        else:  # under a part: as long as the part reaches, or longer
            sizes = self.rng.integers(1, 4, k).tolist()
            sizes[-1] += max(0, target[axis].n - sum(sizes))
        parts = [self.make(target[:axis] + (s,) + target[axis + 1 :], depth, fields) for s in sizes]
        return (
            concat([p[0] for p in parts], axis, sizes=sizes),
            lambda env: {k: v for p in parts for k, v in p[1](env).items()},
            lambda arrays, env: np.concatenate([p[2](arrays, env) for p in parts], axis),
        )

    def _part(self, target, depth, fields):
        self.uses_part = True
        axis = int(self.rng.choice([d for d in range(len(target)) if isinstance(target[d], int)]))
        start, size = int(self.rng.integers(0, 3)), target[axis]
        spec, wanted, ref = self.make(target[:axis] + (AtLeast(start + size),) + target[axis + 1 :], depth, fields)
        return (
            part(spec, axis, start),
            wanted,
            lambda arrays, env: np.take(ref(arrays, env), np.arange(start, start + size), axis),
        )


def _split(x, a, cols):
    return x.reshape(x.shape[:a] + (x.shape[a] // cols, cols) + x.shape[a + 1 :])


def _merge(x, a):
    return x.reshape(x.shape[:a] + (x.shape[a] * x.shape[a + 1],) + x.shape[a + 2 :])


def _random_box(shape, rng):
    return tuple(tuple(sorted(int(v) for v in rng.choice(n + 1, 2, replace=False))) for n in shape)


@pytest.mark.parametrize("seed", range(4))
def test_random_specs_infer_build_read_and_write_as_numpy_does(seed):
    """For 100 random specs over random parameter shapes: the export's inferred tensor
    shapes are the hand-derived ones; built against tensors of those shapes, the parameter
    has its shape and reads (whole and by box) what numpy's reference builds; and a
    parameter written into the tensors reads back unchanged (export, then import)."""
    rng = np.random.default_rng(seed)
    for case in range(100):
        gen = RandomSpec(rng)
        shape = tuple(int(n) for n in rng.integers(1, 5, int(rng.integers(1, 4))))
        spec, wanted, ref = gen.make(shape, depth=int(rng.integers(1, 5)))
        where = f"seed {seed} case {case}: {spec} for a parameter {shape}"
        expected = {k: tuple(_least(n) for n in v) for k, v in wanted({}).items()}

        inferred = infer_tensors(WeightMap({"p": spec}), {"p": shape})
        assert inferred == expected, where

        arrays = {k: rng.normal(size=s).astype(np.float32) for k, s in expected.items()}
        res = resolve(WeightMap({"p": spec}), {"p": shape}, {k: (a.shape, a.dtype) for k, a in arrays.items()})
        assert res.problems() == [], where
        expr, io, want = res.exprs["p"], Arrays(arrays), ref(arrays, {})
        assert expr.shape == shape == want.shape, where
        np.testing.assert_array_equal(expr.read(boxes.full(shape), io), want, err_msg=where)
        for _ in range(3):
            box = _random_box(shape, rng)
            np.testing.assert_array_equal(expr.read(box, io), want[boxes.slices(box)], err_msg=where)

        x = rng.normal(size=shape).astype(np.float32)
        out = Arrays({k: np.full(s, np.nan, np.float32) for k, s in expected.items()})
        expr.write(boxes.full(shape), x, out)
        np.testing.assert_array_equal(expr.read(boxes.full(shape), out), x, err_msg=where)
        if not gen.uses_part:  # every element of every tensor is the parameter's: none left unwritten
            assert not any(np.isnan(a).any() for a in out.arrays.values()), where


@pytest.mark.parametrize("seed", range(2))
def test_a_tensor_of_another_shape_is_refused_never_read(seed):
    """Random part-free specs (where every tensor extent is fixed by the parameter) against
    a checkpoint with one tensor one longer or shorter in one dimension: the load reports a
    problem instead of building a parameter from the wrong elements."""
    rng = np.random.default_rng(100 + seed)
    checked = 0
    while checked < 100:
        gen = RandomSpec(rng)
        shape = tuple(int(n) for n in rng.integers(1, 5, int(rng.integers(1, 4))))
        spec, wanted, _ = gen.make(shape, depth=int(rng.integers(1, 5)))
        if gen.uses_part:
            continue
        tensors = {k: (tuple(v), np.float32) for k, v in wanted({}).items()}
        name = sorted(tensors)[int(rng.integers(len(tensors)))]
        t = list(tensors[name][0])
        if not t:
            continue
        d = int(rng.integers(len(t)))
        t[d] += 1 if t[d] == 1 or rng.random() < 0.5 else -1
        tensors[name] = (tuple(t), np.float32)
        res = resolve(WeightMap({"p": spec}), {"p": shape}, tensors)
        assert res.problems() and "p" not in res.exprs, f"{spec} for {shape} with {name} {t}: {res}"
        checked += 1


@pytest.mark.parametrize(
    ("spec", "shape", "tensors", "message"),
    [
        (part("w", 0, 4), (2, 3), {"w": (5, 3)}, r"part\(axis=0, start=4\) of extent 2 runs past w \[5, 3\]"),
        (split_dim("w", 0), (3, 4, 5), {"w": (10, 5)}, r"split_dim\(axis=0\): w \[10, 5\] does not split into rows"),
        (merge_dims("w", 0, 4), (12, 5), {"w": (3, 5, 5)}, r"p \[12, 5\] in the model, \[15, 5\] from reshape"),
        (concat(["w", "v"], 0), (5, 3), {"w": (2, 3), "v": (3, 4)}, r"concat along axis 0 of tensors whose shapes"),
        (stack("l.{i}"), (2, 3), {"l.0": (3,), "l.1": (4,)}, r"stack of tensors whose shapes differ: l.0 \[3\]"),
    ],
)
def test_each_misfit_tensor_is_named(spec, shape, tensors, message):
    res = resolve(WeightMap({"p": spec}), {"p": shape}, {k: (s, np.float32) for k, s in tensors.items()})
    assert "p" not in res.exprs
    problems = "; ".join(res.problems())
    assert re.search(message, problems), problems
    assert "read by no parameter" not in problems  # the tensors are named with their problem


def test_a_missing_tensor_is_named_where_a_concat_has_no_sizes():
    res = resolve(WeightMap({"p": concat(["a", "b"], 0)}), {"p": (5, 3)}, {"a": ((2, 3), np.float32)})
    assert res.problems() == ["missing from the checkpoint (1): b (read by p)"]


@pytest.mark.parametrize(
    ("entries", "params", "message"),
    [
        ({"p": concat(["a", "b"], 0)}, {"p": (5, 3)}, r"tensor 'a' .* concat\(...\) needs sizes=\.\.\. to export"),
        ({"p": "a", "q": "a"}, {"p": (5, 3), "q": (5, 4)}, r"tensor 'a' is mapped with shapes \[5, 3\] and \[5, 4\]"),
        ({"p": "a", "q": part("a", 0, 3)}, {"p": (5, 3), "q": (3, 3)}, r"mapped with shapes \[5, 3\] and \[>=6, 3\]"),
        (
            {"p": "a", "q": transpose("a")},
            {"p": (5, 3), "q": (5, 3, 1)},
            r"mapped with shapes \[5, 3\] and \[1, 3, 5\]",
        ),
        ({"p": part(part("a", 0, 1), 0, 2)}, {"p": (2, 3)}, r"part\(\.\.\.\) needs the extent of dimension 0 fixed"),
    ],
)
def test_an_export_refuses_what_no_shape_fits(entries, params, message):
    with pytest.raises(ValueError, match=message):
        infer_tensors(WeightMap(entries), params)


def test_a_checkpoint_shapes_lookup_ignores_the_target():
    shapes = Shapes(lambda n: ((7, 2), "float32"))
    assert shapes("w", (None, AtLeast(3))) == ((7, 2), np.dtype(np.float32))


@pytest.mark.parametrize(
    ("key", "name", "shape", "inner", "fixed"),
    [
        # an inner stack's index would hide the outer one
        ("p", "p", (3, 2, 4), stack(stack("l.{i}.e.{i}")), stack(stack("l.{i}.e.{j}", var="j"))),
        # a stack's index would hide the key's
        ("l.{i}.p", "l.1.p", (2, 4), stack("l.{i}.e.{i}"), stack("l.{i}.e.{j}", var="j")),
    ],
)
def test_one_index_name_for_two_dimensions_is_refused(key, name, shape, inner, fixed):
    """Two indices under one name would read one tensor for every outer entry, silently."""
    tensors = {f"l.{a}.e.{b}": ((4,), np.float32) for a in range(3) for b in range(2)}
    res = resolve(WeightMap({key: inner}), {name: shape}, tensors)
    assert name not in res.exprs
    problems = "; ".join(res.problems())
    assert re.search(r"stack\(\.\.\., var='i'\) inside a stack or a key that already defines \{i\}", problems)
    with pytest.raises(ValueError, match="Give each level its own name"):
        infer_tensors(WeightMap({key: inner}), {name: shape})
    # each level with its own name: every tensor of the layout is read, once
    res = resolve(WeightMap({key: fixed}), {name: shape}, tensors)
    read = {f"l.{a}.e.{b}" for a in (range(3) if key == "p" else [1]) for b in range(2)}
    assert sorted(t.name for t in res.exprs[name].tensors()) == sorted(read)
    assert set(res.extra) == set(tensors) - read and not res.missing and not res.misshapen
