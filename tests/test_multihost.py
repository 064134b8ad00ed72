"""Several processes on one machine (gloo CPU collectives): the multi-host path."""

import functools
import io
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax import launch as zj_launch
from zerojax.distributed import init as dist_init

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "multihost_train.py"


def launch(args, worker_args, timeout=240, worker=WORKER):
    """``zerojax launch ARGS -- python WORKER WORKER_ARGS``: what it printed, its
    exit status and seconds. The launcher runs in this process (its processes are real ones,
    and ``--timeout``, else ``timeout``, ends a hung job): a launcher process of its own
    would import JAX for nothing."""
    cmd = [sys.executable, str(worker), *worker_args]
    opts = dict(zip(args[::2], args[1::2]))
    out = io.StringIO()
    start = time.monotonic()
    code = zj_launch.launch(
        cmd,
        int(opts.pop("--nprocs")),
        int(opts.pop("--devices-per-proc")),
        timeout_s=float(opts.pop("--timeout", timeout)),
        out=out,
    )
    assert not opts, opts
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), ""), time.monotonic() - start


TX = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))


@functools.cache  # shared by the tests that compare with one device
def single_device_reference(steps=3, layers=models.LAYERS):
    """Plain optax on one device: the trained parameters every stage's multi-process run must
    equal (one reference for all stages, the global batch of each step)."""
    params, _ = models.reference_run(
        models.stacked_loss, models.stacked_params(layers=layers), TX, [models.batch(16, seed=i) for i in range(steps)]
    )
    return [np.asarray(x) for x in jax.tree.leaves(params)]


# One 2-process job (4 devices each) runs the trainings the next tests compare with one
# process: each run as a job of its own would (the worker's --run), in one start-up.
RUNS = {
    "same-batch-everywhere": ("1,2,3", "same", 1),
    "process-local-rows": ("3", "rows", 1),
    "process-local-rows-prefetched": ("2", "prefetch", 1),
    "hybrid": ("1,3", "rows", 2),
    "pipeline": ("3", "same", 1, 2),
}


@pytest.fixture(scope="module")
def match_job(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("multihost")
    runs = [f"--run={name}:" + ":".join(str(x) for x in spec) for name, spec in RUNS.items()]
    out, _ = launch(["--nprocs", "2", "--devices-per-proc", "4"], ["--out", str(out_dir), *runs], timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    return out_dir, out.stdout


def _matches_one_device(out_dir, stages, layers=models.LAYERS):
    ref = single_device_reference(layers=layers)
    for stage in stages:
        for rank in (0, 1):  # gather_params gives the full params on every process
            got = np.load(out_dir / f"params_stage{stage}_rank{rank}.npz")
            got = [got[str(i)] for i in range(len(ref))]
            err = max(np.abs(a - b).max() for a, b in zip(got, ref))
            assert err <= 1e-5, (stage, rank, err)


@pytest.mark.parametrize("name", ["same-batch-everywhere", "process-local-rows", "process-local-rows-prefetched"])
def test_two_processes_match_one(match_job, name):
    out_dir, stdout = match_job
    stages = [int(s) for s in RUNS[name][0].split(",")]
    assert "[rank 0] process 0 of 2: 4 local devices, 8 in the mesh" in stdout
    assert "[rank 1] process 1 done" in stdout
    _matches_one_device(out_dir / name, stages)
    # The 2-process checkpoint (each process wrote its shards) restores in 1 process.
    restored = zj.restore_checkpoint(
        out_dir / name / "ck", models.stacked_params(), TX, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3)
    )
    assert int(restored.step) == 3
    got = [np.asarray(x) for x in jax.tree.leaves(zj.gather_params(restored))]
    assert max(np.abs(a - b).max() for a, b in zip(got, single_device_reference())) <= 1e-5


def test_two_processes_pipeline_stages_match_one(match_job):
    """2 processes x 4 devices on zj.make_mesh(pipeline=2): each stage is one process's
    devices (the activations cross processes), and stage-3 training equals single-device
    optax on the whole batch."""
    out_dir, stdout = match_job
    for rank in (0, 1):
        assert (
            f"[rank {rank}] pipeline mesh {{'pipeline': 2, 'data': 4}}: stages hold the devices of processes [[0], [1]]"
            in stdout
        )
    _matches_one_device(out_dir / "pipeline", [3], layers=4)


def test_two_processes_hybrid_groups_match_one(match_job):
    """2 processes x 4 devices with 2 replica groups: each group is one process's devices,
    and training equals single-device optax."""
    out_dir, stdout = match_job
    for rank in (0, 1):
        assert (
            f"[rank {rank}] hybrid mesh {{'replica': 2, 'data': 4}}: groups hold the devices of processes [[0], [1]]"
        ) in stdout
    _matches_one_device(out_dir / "hybrid", [1, 3])
    # The 2-D checkpoint written by two processes restores on a 1-process 1-D mesh.
    restored = zj.restore_checkpoint(
        out_dir / "hybrid" / "ck", models.stacked_params(), TX, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=2)
    )
    got = [np.asarray(x) for x in jax.tree.leaves(zj.gather_params(restored))]
    assert max(np.abs(a - b).max() for a, b in zip(got, single_device_reference())) <= 1e-5


@pytest.mark.slow  # reason: 15 s of processes started and stopped; no JAX program differs by version
def test_launcher_stops_the_job_when_a_process_dies(tmp_path):
    out, elapsed = launch(
        ["--nprocs", "2", "--devices-per-proc", "4"],
        ["--out", str(tmp_path), "--stages", "3", "--steps", "200", "--die-after", "1"],
    )
    assert out.returncode == 3, out.stdout[-3000:]
    assert "zerojax.launch: process 1" in out.stdout and "exited with status 3" in out.stdout
    assert "process 0 done" not in out.stdout
    assert elapsed < 90


@pytest.mark.slow  # reason: two processes waiting out JAX's heartbeat; its property's only check: CI runs the slow set
def test_without_launcher_survivors_fail_within_the_heartbeat_timeout(tmp_path):
    """Process 1 dies; process 0, left alone, must not wait forever."""
    port = __import__("zerojax.launch", fromlist=["free_port"]).free_port()
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            ZEROJAX_COORDINATOR=f"127.0.0.1:{port}",
            ZEROJAX_NUM_PROCESSES="2",
            ZEROJAX_PROCESS_ID=str(rank),
            ZEROJAX_LOCAL_DEVICES="4",
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    "--out",
                    str(tmp_path),
                    "--stages",
                    "3",
                    "--steps",
                    "200",
                    "--die-after",
                    "1",
                ],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    start = time.monotonic()
    outs = [p.communicate(timeout=120)[0] for p in procs]
    elapsed = time.monotonic() - start
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0, outs[0][-2000:]
    assert "heartbeat timeout" in outs[0] or "another task died" in outs[0]
    assert elapsed < 90  # the worker sets heartbeat_timeout_s=10


@pytest.mark.parametrize(
    "env,want",
    [
        (
            {"ZEROJAX_COORDINATOR": "h:1", "ZEROJAX_NUM_PROCESSES": "4", "ZEROJAX_PROCESS_ID": "2"},
            dist_init.Launch("zerojax", "h:1", 4, 2),
        ),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_PROCID": "5"}, dist_init.Launch("slurm", None, 16, 5)),
        ({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3"}, dist_init.Launch("openmpi", None, 8, 3)),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, dist_init.Launch("single")),
        ({}, dist_init.Launch("single")),
    ],
)
def test_launcher_detection(env, want):
    assert zj.distributed.detect(env=env) == want


def test_detection_errors():
    with pytest.raises(ValueError, match=r"missing \['num_processes', 'process_id'\]"):
        zj.distributed.detect(coordinator_address="h:1", env={})
    with pytest.raises(ValueError, match="ZEROJAX_NUM_PROCESSES"):
        zj.distributed.detect(env={"ZEROJAX_COORDINATOR": "h:1"})


def test_launcher_needs_a_command(capsys):
    """In this process: ``python -m zerojax.launch`` starts from the same main (the shared
    two-process job above runs it as a module), and an interpreter only to print a usage
    error costs seconds."""
    from zerojax import launch as launcher

    with pytest.raises(SystemExit) as e:
        launcher.main(["--nprocs", "2"])
    assert e.value.code == 2 and "give the command after --" in capsys.readouterr().err


@pytest.mark.slow  # reason: 2 processes, a 10 s step timeout; test_step_timeout_finishes_the_save_in_flight_and_says_so
def test_a_stalled_process_is_noticed_within_the_step_timeout(tmp_path):
    """Process 1 hangs (alive, still heartbeating); process 0's step times out and exits."""
    out, elapsed = launch(
        ["--nprocs", "2", "--devices-per-proc", "4", "--timeout", "200"],
        ["--out", str(tmp_path), "--stages", "3", "--steps", "200", "--stall-after", "2", "--step-timeout", "10"],
    )
    assert out.returncode == 1, out.stdout[-3000:]
    assert "[rank 0] zerojax: the train step did not finish within timeout_s=10s on process 0" in out.stdout
    assert "zerojax.launch: process 0" in out.stdout
    assert elapsed < 100


def test_step_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        zj.make_train_step(
            models.stacked_loss, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(), timeout_s=0
        )


@pytest.mark.slow  # reason: 13 s, two processes and four exports that fail
def test_an_export_that_fails_in_one_process_raises_on_every_process(tmp_path):
    """Two processes export one stage-3 state; each failure happens in process 1's part
    only, and every process raises naming process 1 and the problem, within a bounded
    time, leaving nothing that looks complete (see tests/workers/export_failures_job.py)."""
    out, _ = launch(
        ["--nprocs", "2", "--devices-per-proc", "4"],
        ["--out", str(tmp_path)],
        timeout=300,
        worker=ROOT / "tests" / "workers" / "export_failures_job.py",
    )
    assert out.returncode == 0, out.stdout[-4000:]
    r = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    visible = lambda name: (
        sorted(p.name for p in (tmp_path / name).iterdir() if not p.name.startswith("."))
        if (tmp_path / name).exists()
        else []
    )
    everything = lambda name: sorted(p.name for p in (tmp_path / name).iterdir()) if (tmp_path / name).exists() else []
    # A float16 overflow in process 1's shard only: refused on both before a byte is written.
    assert not r[0]["overflow_held_here"] and r[1]["overflow_held_here"]
    for k in (0, 1):
        assert r[k]["overflow"]["type"] == "ValueError"
        assert r[k]["overflow"]["message"].startswith(
            "export_weights failed before writing anything; on process 1 of 2: parameter 'w' has values up to 1e+05, "
            "beyond float16's range (65504)"
        )
    assert r[1]["overflow_untouched"] and visible("overflow") == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    # A full disk in process 1 while process 0 is still writing: process 0 stops within a
    # poll (0.25 s) and the box it is writing (0.2 s here), long before it would finish.
    for k in (0, 1):
        assert r[k]["disk"]["type"] == "OSError"
        assert r[k]["disk"]["message"] == (
            "export_weights failed while writing (no file was completed); on process 1 "
            "of 2: [Errno 28] No space left on device (injected)"
        )
    assert r[0]["disk"]["t"] - r[1]["disk_injected"] < 1.0, (r[0]["disk"], r[1]["disk_injected"])
    assert r[1]["disk"]["t"] - r[1]["disk_injected"] < 1.5
    assert r[0]["disk_writes"] < r[0]["all_writes"]
    assert everything("disk") == []
    # A tied head that training moved away from the embedding, in process 1's shard only.
    assert not r[0]["tied_held_here"] and r[1]["tied_held_here"]
    for k in (0, 1):
        assert r[k]["tied"]["type"] == "ValueError"
        assert (
            "on process 1 of 2: parameters 'head.kernel' and 'emb' both read tensor 'emb.weight', and they differ "
            "by up to 0.25"
        ) in r[k]["tied"]["message"]
    assert everything("tied") == []
    # Process 1 stalls: process 0 gives up after timeout_s=2, naming it.
    assert r[0]["stall"]["type"] == "TimeoutError"
    assert "process 1 of 2 neither finished 'data' nor made progress for 2 s" in r[0]["stall"]["message"]
    assert 2.0 <= r[0]["stall"]["t"] - r[1]["stall_injected"] < 3.0
    assert r[1]["stall"]["type"] is not None and visible("stall") == []


@pytest.mark.slow  # reason: 11 s, two processes; the same path is checked against one process in the default set
def test_readme_multihost_example_runs_on_a_fresh_machine(tmp_path):
    """The README's local multi-host command, as written, into an output directory that
    does not exist yet: it trains like single-device optax, writes its files, and prints
    no gloo connection chatter."""
    import re

    import jax.numpy as jnp

    from experiments import multihost

    readme = (ROOT / "README.md").read_text()
    (cmd,) = re.findall(r"^python -m zerojax\.launch .*experiments/multihost\.py.*$", readme, flags=re.M)
    out_dir = tmp_path / "fresh" / "run"
    args = [sys.executable if a == "python" else a for a in cmd.replace("/tmp/run", str(out_dir)).split()]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert not [l for l in lines if "Gloo" in l], lines
    assert sum("loss" in l for l in lines) == 5 and len(lines) <= 10, lines
    assert (out_dir / "ckpt").is_dir()
    # The same run on one device with plain optax.
    tx, params = optax.adamw(1e-2), jax.tree.map(jnp.asarray, multihost.init_params())
    opt = tx.init(params)
    for step in range(5):
        grads = jax.grad(multihost.loss_fn)(params, multihost.global_batch(step))
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    got = np.load(out_dir / "params.npz")
    want = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert set(got.files) == set(want)
    for k, x in want.items():
        np.testing.assert_allclose(got[k], x, rtol=1e-4, atol=1e-5, err_msg=k)
