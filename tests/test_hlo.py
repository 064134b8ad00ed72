"""The HLO reader (zerojax.report.hlo) on programs compiled by both ends of the JAX range.

tests/data/loops_jax0.10.hlo and loops_jax0.12.hlo are the program of tests/data/make_hlo.py
as each version compiles it (regenerate with ``python tests/data/make_hlo.py`` in each
venv): an outer loop of 3 around a scan of 5 layers, each all-gathering a 32x32 weight
and applying it to an 8x32 activation; then a reduce-scatter, an all-reduce and a cond.
The expected figures below follow from that program alone.
"""

import os

import pytest

from tests.data import make_hlo
from zerojax.report import comm, hlo
from zerojax.report.replica_groups import permute_groups
from zerojax.tuning import hlo_cost

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
OUTER, LAYERS, D = make_hlo.OUTER, make_hlo.LAYERS, make_hlo.D
ITERATIONS = OUTER * LAYERS


def _text(version: str) -> str:
    with open(os.path.join(DATA, f"loops_jax{version}.hlo")) as f:
        return f.read()


@pytest.fixture(scope="module")
def live():
    """The same program compiled by the JAX installed now."""
    return make_hlo.program().as_text()


@pytest.fixture(params=["0.10", "0.12", "live"])
def text(request, live):
    return live if request.param == "live" else _text(request.param)


def test_runs_follow_control_flow(text):
    prog = hlo.parse(text)
    assert prog.runs[prog.entry] == 1
    bodies = prog.loop_bodies()
    assert sorted(prog.runs[b] for b in bodies) == [OUTER, ITERATIONS]
    whiles = [i for c in prog.computations.values() for i in c if i.op == "while"]
    conditions = sorted(prog.runs[i.called("condition")[0]] for i in whiles)
    assert conditions == [OUTER + 1, OUTER * (LAYERS + 1)]  # a condition runs once more than its body
    branches = [
        c for i in prog.computations[prog.entry] if i.op == "conditional" for c in i.called("branch_computations")
    ]
    assert len(branches) == 2 and all(prog.runs[b] == 1 for b in branches)
    # Fusion bodies and reduction bodies are not executions of their own.
    assert prog.fused and not prog.fused & set(prog.runs)
    reducers = {
        c
        for comp in prog.computations.values()
        for i in comp
        if i.op in ("all-reduce", "reduce-scatter", "reduce")
        for c in i.called("to_apply")
    }
    assert reducers and not reducers & set(prog.runs)


def test_collectives_counted_per_run(text):
    found = comm.collectives(text)
    by_kind = {}
    for c in found:
        by_kind.setdefault(c.kind, []).append((c.bytes, c.count, c.group_size))
    assert by_kind["all-gather"] == [(D * D * 4, ITERATIONS, 4)]
    assert by_kind["reduce-scatter"] == [(8 * D * 4, 1, 4)]  # the input buffer: 8 rows per device
    assert sorted(by_kind["all-reduce"]) == [(4, 1, 4), (2 * D * 4, 1, 4)]  # the sum; the branch's
    rep = comm.communication_report(text)
    assert rep["all-gather:f32"] == {
        "count": ITERATIONS,
        "bytes": ITERATIONS * D * D * 4,
        "zero_bytes": ITERATIONS * D * D * 4,
    }
    assert rep["all-reduce:f32"]["zero_bytes"] == 2 * (4 + 2 * D * 4)


def test_loop_structure_for_overlap_checks(text):
    prog = hlo.parse(text)
    inner = max(prog.loop_bodies(), key=prog.runs.get)
    (gather,) = prog.gathers(inner)
    (matmul,) = prog.matmuls(inner)
    assert prog.reaches(inner, gather, matmul) and not prog.reaches(inner, matmul, gather)
    assert not prog.independent(inner, gather, matmul)
    assert prog.gathers(inner, "f32[32,32]") == [gather] and prog.gathers(inner, "bf16") == []
    assert prog.matmuls(prog.entry) == []


def test_cost_model_counts_every_iteration(text):
    matmul_flops = 2 * 8 * D * D
    sizes = hlo_cost.matmul_sizes(text)
    assert sum(f for _, f in sizes) == ITERATIONS * matmul_flops
    flops, _ = hlo_cost.parsed_cost(text)
    once, _ = hlo_cost.parsed_cost(text, per_iteration=False)
    extra, _ = hlo_cost.extra_iterations(text)
    assert flops - once == pytest.approx(extra)
    assert extra >= (ITERATIONS - 1) * matmul_flops


def test_both_versions_read_alike():
    """What the reader reports does not depend on which JAX printed the program."""
    reports = [comm.communication_report(_text(v)) for v in ("0.10", "0.12")]
    assert reports[0] == reports[1]
    assert hlo_cost.matmul_sizes(_text("0.10")) == hlo_cost.matmul_sizes(_text("0.12"))


# Instructions as the GPU backend prints them (async collectives), in a minimal program.
_ASYNC = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped (p: f32[64]) -> f32[16] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%p), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[16], y: f32[64]) -> f32[64] {
  %x = f32[16]{0} parameter(0)
  %y = f32[64]{0} parameter(1)
  %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%x), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %ars = f32[64]{0} all-reduce-start(%agd), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
  %ard = f32[64]{0} all-reduce-done(%ars)
  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%ard), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[64]{0} collective-permute-done(%cps)
  %as = ((f32[64]{0}), f32[16]{0}) async-start(%y), calls=%wrapped
  %ad = f32[16]{0} async-done(%as), calls=%wrapped
  ROOT %r = f32[64]{0} add(%cpd, %y)
}
"""


def test_async_collectives_count_their_results():
    found = {c.kind: (c.bytes, c.count, c.groups) for c in comm.collectives(_ASYNC)}
    assert found["all-gather"] == (64 * 4, 1, ((0, 1, 2, 3),))  # the result, not operand + result
    assert found["all-reduce"] == (64 * 4, 1, ((0, 1), (2, 3)))
    assert found["collective-permute"] == (64 * 4, 1, ((0, 1, 2, 3),))
    assert found["reduce-scatter"] == (64 * 4, 1, ((0, 1, 2, 3),))  # inside the async wrapper
    assert set(hlo.parse(_ASYNC).runs) == {"main", "wrapped"}


def test_permute_groups_and_mesh_axes():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    assert permute_groups("source_target_pairs={{0,2},{2,0},{1,3},{3,1}}") == [[0, 2], [1, 3]]
    assert permute_groups("channel_id=1") is None
    with pytest.raises(ValueError, match="source_target_pairs"):
        permute_groups("source_target_pairs={{0,1,2}}")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("replica", "data"))
    rep = comm.communication_report(_ASYNC.replace("{{0,1},{1,2},{2,3},{3,0}}", "{{0,1},{1,0},{2,3},{3,2}}"), mesh=mesh)
    assert rep["by_axis"]["data"]["count"] == 2  # the all-reduce and the permute, within rows


def test_shapes():
    assert hlo.shape_bytes("(f32[4,128]{1,0}, bf16[8]{0}, s32[])") == 4 * 128 * 4 + 16 + 4
    assert hlo.tuple_elements("(f32[2]{0}, (s32[], u8[4]{0}))") == ["f32[2]{0}", "(s32[], u8[4]{0})"]
    assert hlo.tuple_elements("f32[2,3]{1,0}") == ["f32[2,3]{1,0}"]
    assert hlo.shape_dims("f32[2,3]{1,0}") == [2, 3] and hlo.shape_elements("f32[2,3]{1,0}") == 6
    assert hlo.shape_dtype("(bf16[2], f32[])") == "bf16"
    with pytest.raises(ValueError, match="q7"):
        hlo.shape_bytes("q7[4]")


def test_bad_input():
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo.parse("%f (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n")
    with pytest.raises(TypeError, match="as_text"):
        hlo.parse(b"ENTRY")
    missing = _ASYNC.replace("calls=%wrapped\n  %ad", "calls=%absent\n  %ad")
    with pytest.raises(ValueError, match="absent"):
        _ = hlo.parse(missing).runs
