"""``zerojax launch --max-restarts`` and resumable multi-process runs, tested by breaking them.

The launcher's own rules run on tiny commands (no JAX, seconds). The slow set runs the
experiments' GPT at ZeRO-3 in 4 processes under a seeded schedule of SIGKILLs (one
landing as a checkpoint is written), a SIGSTOP and a SIGTERM, and checks that the job ends
bit-identical to an uninterrupted run; and a run stopped at 4 processes and resumed at 2.
"""

import io
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax import launch
from zerojax.distributed.heartbeat import complete_steps

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "resume_job.py"


class Launched:
    def __init__(self, returncode, stdout, stderr=""):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def launcher(args, script):
    """``zerojax launch ARGS -- python -c SCRIPT``, the launcher run in this process (its
    processes are real ones): what it printed and its exit status."""
    out = io.StringIO()
    cmd = [sys.executable, "-c", textwrap.dedent(script)]
    opts = dict(zip(args[::2], args[1::2]))
    code = launch.launch(
        cmd,
        int(opts.pop("--nprocs")),
        out=out,
        grace_s=2.0,
        max_restarts=int(opts.pop("--max-restarts", 0)),
        restart_delay_s=float(opts.pop("--restart-delay", 5.0)),
        heartbeat_timeout_s=float(opts["--heartbeat-timeout"]) if "--heartbeat-timeout" in opts else None,
        finish_grace_s=float(opts.pop("--finish-grace", 120.0)),
    )
    opts.pop("--heartbeat-timeout", None)
    assert not opts, opts
    return Launched(code, out.getvalue())


def test_a_command_that_fails_at_once_is_not_restarted():
    start = time.monotonic()
    out = launcher(["--nprocs", "2", "--max-restarts", "5", "--restart-delay", "0"], "import sys; sys.exi(0)")
    assert out.returncode == 1, out.stdout
    assert 1 <= out.stdout.count("AttributeError: module 'sys' has no attribute 'exi'") <= 2  # one start
    assert "failed before any checkpoint was written: not restarting" in out.stdout
    assert "restart 1/" not in out.stdout and time.monotonic() - start < 30


def test_killed_processes_are_restarted_up_to_max_restarts():
    # Each start: process 1 kills itself; the second restart finishes (ZEROJAX_RESTART counts starts).
    script = """
        import os, signal
        if os.environ["ZEROJAX_RESTART"] != "2" and os.environ["ZEROJAX_PROCESS_ID"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        print("start", os.environ["ZEROJAX_RESTART"], "ok")
    """
    out = launcher(["--nprocs", "2", "--max-restarts", "2", "--restart-delay", "0"], script)
    assert out.returncode == 0, out.stdout
    assert out.stdout.count("was killed by SIGKILL") == 2
    assert "restart 2/2 in 0s: the job starts from the beginning (no complete checkpoint yet)" in out.stdout
    assert "[rank 1] start 2 ok" in out.stdout and "the job finished after 2 restarts" in out.stdout
    out = launcher(["--nprocs", "2", "--max-restarts", "1", "--restart-delay", "0"], script)
    assert out.returncode == 128 + signal.SIGKILL, out.stdout
    assert "no restart left (--max-restarts 1): the job did not finish" in out.stdout


def test_a_stopped_process_is_caught_by_its_heartbeat(tmp_path):
    script = """
        import os, signal, time
        from zerojax.distributed.heartbeat import start_heartbeat
        assert start_heartbeat()
        if os.environ["ZEROJAX_PROCESS_ID"] == "1":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    """
    start = time.monotonic()
    out = launcher(["--nprocs", "2", "--heartbeat-timeout", "1.5"], script)
    assert out.returncode == 1, out.stdout
    assert re.search(
        r"process 1 \(pid \d+\) stopped answering: no heartbeat for 1\.\d+s "
        r"\(--heartbeat-timeout 1\.5\)",
        out.stdout,
    ), out.stdout
    assert time.monotonic() - start < 20


def test_a_preempted_job_is_restarted_and_a_sigterm_to_the_launcher_is_passed_on(tmp_path):
    script = """
        import os, sys
        sys.exit(75 if os.environ["ZEROJAX_RESTART"] == "0" else 0)
    """
    out = launcher(["--nprocs", "2", "--max-restarts", "1", "--restart-delay", "0"], script)
    assert out.returncode == 0, out.stdout
    assert "saved and stopped on a preemption notice (status 75)" in out.stdout
    assert "restart 1/1" in out.stdout
    # SIGTERM to the launcher reaches every process, and their status is the launcher's.
    marker = tmp_path / "ready"
    script = f"""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
        open("{marker}." + os.environ["ZEROJAX_PROCESS_ID"], "w").close()
        time.sleep(60)
    """
    cmd = [
        sys.executable,
        "-m",
        "zerojax.launch",
        "--nprocs",
        "2",
        "--max-restarts",
        "3",
        "--",
        sys.executable,
        "-c",
        textwrap.dedent(script),
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    deadline = time.monotonic() + 30
    while not all(os.path.exists(f"{marker}.{r}") for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=30)
    assert p.returncode == 75, stdout
    assert "SIGTERM: passing it to every process" in stdout and "restart" not in stdout


def test_a_worker_stuck_after_the_others_finished_is_bounded_and_named():
    script = """
        import os, sys, time
        if os.environ["ZEROJAX_PROCESS_ID"] == "1":
            time.sleep(60)
    """
    start = time.monotonic()
    out = launcher(["--nprocs", "2", "--finish-grace", "1"], script)
    assert out.returncode == 1, out.stdout
    assert re.search(
        r"process 1 \(pid \d+\) still running 1s after process 0 finished with status 0: stuck after the last step",
        out.stdout,
    ), out.stdout
    assert time.monotonic() - start < 20


def test_the_stopped_process_is_named_when_another_aborts_because_of_it():
    # A SIGSTOPped coordinator makes the others abort (JAX's coordination client): the
    # launcher names the stopped process, not the one that aborted first.
    script = """
        import os, signal, time
        from zerojax.distributed.heartbeat import start_heartbeat
        assert start_heartbeat()
        if os.environ["ZEROJAX_PROCESS_ID"] == "0":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(1.0)
        os.abort()
    """
    out = launcher(["--nprocs", "2", "--heartbeat-timeout", "60"], script)
    assert out.returncode == 1, out.stdout
    assert re.search(
        r"process 0 \(pid \d+\) stopped answering \(it is stopped \(SIGSTOP or a debugger\)\); then process 1 "
        r"\(pid \d+\) was killed by SIGABRT",
        out.stdout,
    ), out.stdout


def test_a_run_that_refuses_to_go_on_is_not_restarted():
    script = """
        import sys
        from zerojax.distributed.heartbeat import write_refusal
        write_refusal("RunOwnedError: the run folder /ck is being written by another job, job A")
        sys.exit(1)
    """
    out = launcher(["--nprocs", "2", "--max-restarts", "3", "--restart-delay", "0"], script)
    assert out.returncode == 1, out.stdout
    assert "refused to go on: RunOwnedError: the run folder /ck is being written by another job, job A" in out.stdout
    assert "not restarting: a restart would be refused the same way" in out.stdout and "restart 1/" not in out.stdout


def test_launcher_options_are_checked(capsys):
    for args, match in [
        (["--max-restarts", "-1"], "--max-restarts must be an int >= 0"),
        (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be > 0"),
        (["--restart-delay", "-2"], "--restart-delay must be >= 0"),
        (["--finish-grace", "-1"], "--finish-grace must be >= 0"),
    ]:
        with pytest.raises(SystemExit) as e:
            launch.main(["--nprocs", "1", *args, "--", "true"])
        assert e.value.code == 2 and match in capsys.readouterr().err


# -- the real thing (slow) -------------------------------------------------------------------

STEPS, SAVE_EVERY = 15, 3
CHAOS_PROCS = 2  # every fault path needs two processes; more only add start-up time on 2 cores
CHAOS_STEP_S = 0.15  # the chaos job's least step time (the worker's --sleep)


class _Lines:
    """The launcher's output, kept line by line, each line shown to ``watch`` as it comes."""

    def __init__(self, watch=None):
        self.lines, self.watch = [], watch

    def write(self, text):
        self.lines.append(text)
        if self.watch:
            self.watch(text)

    def flush(self):
        pass


def job(out, args, *, nprocs=4, devices_per_proc=1, steps=STEPS, worker_args=(), watch=None):
    """``zerojax launch ARGS -- python resume_job.py ...`` on ``nprocs`` processes of
    ``devices_per_proc`` devices each: its exit status, output and seconds (``watch`` sees
    each line as it comes). The launcher runs in this process (its processes are real ones,
    and its ``--timeout`` ends a hung job): a launcher process of its own would import JAX
    for nothing."""
    worker = [str(WORKER), "--dir", str(out / "ck"), "--out", str(out / "out"), "--steps", str(steps)]
    cmd = [sys.executable, *worker, "--save-every", str(SAVE_EVERY), *worker_args]
    opts = dict(zip(args[::2], args[1::2]))
    lines = _Lines(watch)
    start = time.monotonic()
    code = launch.launch(
        cmd,
        nprocs,
        devices_per_proc,
        timeout_s=float(opts.pop("--timeout")),
        out=lines,
        max_restarts=int(opts.pop("--max-restarts", 0)),
        restart_delay_s=float(opts.pop("--restart-delay", 5.0)),
        heartbeat_timeout_s=float(opts.pop("--heartbeat-timeout")) if "--heartbeat-timeout" in opts else None,
        preempt_grace_s=float(opts.pop("--preempt-grace", 120.0)),
    )
    assert not opts, opts
    return code, "".join(lines.lines), time.monotonic() - start


def final_params(out):
    got = np.load(out / "out" / "params.npz")
    return [got[str(i)] for i in range(len(got.files))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 2-process job run through once: its final parameters, seconds and folder (its
    checkpoints of steps 3, 6, ..., 15 stay, for tests to copy)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    code, log, seconds = job(out, ["--timeout", "300"], nprocs=CHAOS_PROCS)
    assert code == 0, log[-4000:]
    return final_params(out), seconds, out


class Chaos:
    """Fires a seeded schedule of faults at a launched job, reading its output as it comes."""

    def __init__(self, seed, faults):
        self.rng = np.random.default_rng(seed)
        self.faults = list(faults)
        self.fired, self.pids, self.resume, self.trigger, self.resumes = [], {}, None, None, []
        self.lock = threading.Lock()

    def __call__(self, line):
        if m := re.match(r"\[rank (\d+)\] process \d+ pid (\d+)", line):
            self.pids[int(m[1])] = int(m[2])
        elif "zerojax.launch: restart" in line:
            self.pids, self.resume, self.trigger = {}, None, None
        elif m := re.match(r"\[rank 0\] zerojax.resume: (?:resuming at step (\d+)|no checkpoint)", line):
            self.resume = int(m[1] or 0)
            self.resumes.append(self.resume)
            if len(self.fired) < len(self.faults):
                kind = self.faults[len(self.fired)]
                k = self.resume + int(self.rng.integers(1, 4))
                if kind == "SIGKILL in a save":  # the step whose completion writes a checkpoint
                    k = (k // SAVE_EVERY + 1) * SAVE_EVERY
                self.trigger = min(k, STEPS - 2)
        elif (m := re.match(r"\[rank 0\] step (\d+) loss", line)) and self.trigger is not None:
            done = int(m[1]) + 1  # steps complete once this one's Run.completed returns
            if done >= self.trigger and len(self.pids) == CHAOS_PROCS:
                kind = self.faults[len(self.fired)]
                rank = int(self.rng.integers(0, CHAOS_PROCS))
                delay = 0.0 if kind == "SIGKILL in a save" else float(self.rng.uniform(0.0, 0.3))
                sig = {"SIGSTOP": signal.SIGSTOP, "SIGTERM": signal.SIGTERM}.get(kind, signal.SIGKILL)
                threading.Timer(delay, os.kill, (self.pids[rank], sig)).start()
                self.fired.append((kind, rank, done, round(delay, 3)))
                self.trigger = None


@pytest.mark.slow  # reason: six starts of a 2-process job (about 2-3 minutes on 2 cores)
def test_chaos_ends_bit_identical_to_an_uninterrupted_run(tmp_path, uninterrupted):
    faults = ["SIGKILL in a save", "SIGKILL", "SIGSTOP", "SIGTERM", "SIGKILL"]
    chaos = Chaos(seed=48, faults=np.random.default_rng(48).permutation(faults).tolist())
    code, log, seconds = job(
        tmp_path,
        [
            "--max-restarts",
            str(len(faults)),
            "--restart-delay",
            "0.5",
            "--heartbeat-timeout",
            "5",
            "--preempt-grace",
            "60",
            "--timeout",
            "600",
        ],
        nprocs=CHAOS_PROCS,
        # Steps of at least CHAOS_STEP_S: a fault's delay (up to 0.3 s after its trigger)
        # then lands within about two steps. Without it a fast machine runs 15 steps in a
        # fraction of a second: a SIGTERM can arrive after the last step (no preemption to
        # see) and a SIGKILL several steps and a save past its trigger (more repeats than
        # the bound below allows).
        worker_args=["--sleep", str(CHAOS_STEP_S)],
        watch=chaos,
    )
    assert code == 0, log[-6000:]
    assert len(chaos.fired) == len(faults), (chaos.fired, log[-4000:])
    restarts = re.findall(r"zerojax.launch: restart \d+/\d+", log)
    assert len(restarts) == len(faults), log[-4000:]
    ref, ref_seconds, _ = uninterrupted
    got = final_params(tmp_path)
    assert len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref))
    ran = [int(s) for s in re.findall(r"\[rank 0\] step (\d+) loss", log)]
    assert sorted(set(ran)) == list(range(STEPS))
    # At most the steps since the last complete checkpoint repeat (a preemption repeats none).
    assert len(ran) - STEPS <= len(faults) * SAVE_EVERY, ran
    assert "preemption notice: saved step" in log and "stopped answering" in log
    # Every checkpoint the faults left that looks complete restores, with its run record.
    steps = complete_steps(tmp_path / "ck")
    assert steps and steps[-1] == STEPS
    from zerojax.models import gpt

    cfg = gpt.GPTConfig(vocab=256, seq_len=16, d_model=32, n_layers=2, n_heads=2, dropout=0.1)
    params = gpt.init_abstract(cfg)[1]
    mesh = zj.make_mesh(jax.devices()[:CHAOS_PROCS])
    target = zj.abstract_state(
        params, optax.adamw(1e-2), mesh=mesh, config=zj.ZeroConfig(stage=3), rng=jax.random.key(7)
    )
    for s in steps:
        state = zj.restore_checkpoint(tmp_path / "ck", target, step=s)
        assert int(state.step) == s and zj.checkpoint.checkpoint_extra(tmp_path / "ck", s)["step"] == s
    print(
        f"\nchaos: faults (kind, rank, steps done, delay s) {chaos.fired}; starts at steps {chaos.resumes}; "
        f"restarts {len(restarts)}; steps run {len(ran)} for {STEPS} "
        f"({len(ran) - STEPS} repeated); {seconds:.0f}s against {ref_seconds:.0f}s uninterrupted "
        f"({seconds - ref_seconds:.0f}s lost)"
    )


@pytest.mark.slow  # reason: two starts of a multi-process job and one of a process (about a minute on 2 cores)
def test_elastic_four_processes_then_two(tmp_path):
    # No dropout: its keys are per device and micro-batch, so another device count draws other masks.
    # SGD: AdamW would scale the rounding noise of the attention key bias's gradient (zero in
    # exact arithmetic) up to steps of the learning rate's size, on any change of device count.
    def run(nprocs, steps, out, devices_per_proc=1):
        code, log, _ = job(
            out,
            ["--timeout", "300"],
            nprocs=nprocs,
            devices_per_proc=devices_per_proc,
            steps=steps,
            worker_args=["--dropout", "0", "--optimizer", "sgd"],
        )
        assert code == 0, log[-4000:]
        return log

    # The uninterrupted reference: the same 4-device mesh in one process (one start-up where
    # four processes on 2 cores took a third of the test); the resumed run is the multi-process one.
    run(1, 9, tmp_path / "ref", devices_per_proc=4)
    run(4, 5, tmp_path / "run")  # checkpoints 3 and 5 (the last step); then 2 processes resume at 5
    log = run(2, 9, tmp_path / "run")
    assert "on 2 devices grad_accum_steps becomes 2 (2 rows per device per micro-batch)" in log, log[-3000:]
    assert "resuming at step 5" in log
    got, ref = final_params(tmp_path / "run"), final_params(tmp_path / "ref")
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print(
        f"\nelastic 4 -> 2 processes: largest parameter difference {max(np.abs(a - b).max() for a, b in zip(got, ref)):.1e}"
    )


@pytest.mark.slow  # reason: one more start of a 2-process job beside the shared uninterrupted one (about 20 s on 2 cores)
def test_damage_that_one_process_sees_is_skipped_on_every_process_and_the_step_saved_again(tmp_path, uninterrupted):
    # The folder a job stopped after step 6 leaves (checkpoints 3 and 6): the uninterrupted
    # run's, without its later checkpoints (each step's checkpoint is written the same way,
    # whether or not the job goes on).
    ref, _, ref_out = uninterrupted
    ck = tmp_path / "ck"
    shutil.copytree(ref_out / "ck", ck)
    later = [p for p in ck.iterdir() if p.name.isdigit() and int(p.name) > 6]
    assert complete_steps(ck) == [3, 6, 9, 12, 15] and len(later) == 3
    for p in later:
        shutil.rmtree(p)
    assert complete_steps(ck) == [3, 6]
    files = [p for p in (ck / "6" / "state" / "ocdbt.process_1" / "d").iterdir() if p.stat().st_size > 64]
    assert files
    for p in files:  # the data files process 1 wrote of step 6, which process 1 alone reads back
        with open(p, "r+b") as f:
            f.truncate(16)
    start = time.monotonic()
    code, log, _ = job(tmp_path, ["--timeout", "300"], nprocs=CHAOS_PROCS)
    assert code == 0, log[-6000:]
    assert time.monotonic() - start < 300  # no hang: before, both processes waited about 350 s
    damaged = f"zerojax.resume: checkpoint {ck / '6'} is damaged"
    assert re.search(rf"\[rank 1\] {re.escape(damaged)} \(.*; unreadable on process 1\)", log), log[-6000:]
    assert f"[rank 0] {damaged} (it reads on this process, not on process 1)" in log, log[-6000:]
    assert all(f"[rank {r}] zerojax.resume: resuming at step 3" in log for r in (0, 1)), log[-6000:]
    assert f"moved the damaged checkpoint aside to {ck / '6.damaged'}" in log
    # Step 6 was saved again (a save at or below a damaged step was skipped, and reported as saved).
    assert complete_steps(ck) == [3, 6, 9, 12, 15] and (ck / "6.damaged").is_dir()
    got = final_params(tmp_path)
    assert len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref))
