"""XLA:CPU deadlocks running a multi-device executable loaded from JAX's persistent
compilation cache, where a fresh compile of the same program runs.

    python experiments/xla_cpu_cache_deadlock.py     # a table of 4 processes (docs/design.md)

The program is a zerojax train step: 8 CPU devices, stage 2, float16 compute with dynamic
loss scaling, 4 micro-batches, a 5-layer MLP whose dims (13, 20, 7) do not divide 8. Each
run is a new process sharing one fresh cache directory: the first compiles, the second
would load the first one's executable. Run as zerojax runs it (the step kept out of the
cache on the CPU, zerojax/compile_cache.py) both train; with that turned off, the second
process loads the executable and its devices wait in different collectives until XLA's
collective timeout (set short here) aborts it. Nothing in the program is nondeterministic
in its collectives' order: a fresh compile runs it every time, and the same HLO loaded
back does not, so the fault is in how XLA:CPU rebuilds a loaded executable (its loop and
conditional bodies; see "Executables loaded from the compilation cache on the CPU" in
docs/design.md).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time


def child(cache: str, guarded: bool) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    import jax.numpy as jnp
    import numpy as np
    import optax

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import zerojax as zj

    if not guarded:  # what a step compiled with the cache as JAX leaves it would do
        zj.compile_cache.applies = lambda mesh: False
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)
    params = {"inp": f(13, 20), "layers": [f(20, 20) for _ in range(3)], "out": f(20, 7), "b": jnp.zeros((20,))}

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["inp"] + p["b"])
        for w in p["layers"]:
            h = h + jnp.tanh(h @ w)
        return jnp.mean((h @ p["out"] - b["y"]) ** 2)

    mesh, tx = zj.make_mesh(), optax.adam(1e-3)
    cfg = zj.ZeroConfig(stage=2, compute_dtype="float16", grad_accum_steps=4)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(loss, tx, mesh=mesh, config=cfg)
    for i in range(5):
        r = np.random.default_rng(i)
        batch = {
            "x": jnp.asarray(r.normal(size=(64, 13)), jnp.float32),
            "y": jnp.asarray(r.normal(size=(64, 7)), jnp.float32),
        }
        state, m = step(state, batch)
    entries = sorted({e.split("-")[0] for e in os.listdir(cache)})
    print(f"trained, loss {float(m['loss']):.4f}; step programs in the cache: {'jit_step' in entries}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", metavar="CACHE_DIR")
    ap.add_argument("--unguarded", action="store_true")
    ap.add_argument("--timeout", type=int, default=10, help="XLA's collective timeout (seconds)")
    args = ap.parse_args()
    if args.child:
        return child(args.child, guarded=not args.unguarded)
    import jax

    env = dict(
        os.environ,
        XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") + f" --xla_cpu_collective_call_terminate_timeout_seconds={args.timeout}"
        ),
    )
    print(f"jax {jax.__version__}, 8 CPU devices\n")
    print("| step compiled | process | exit | seconds | last line |\n|---|---|---|---|---|")
    for guarded in (True, False):
        with tempfile.TemporaryDirectory() as cache:
            for run in ("first (compiles)", "second (same cache)"):
                t0 = time.perf_counter()
                cmd = [sys.executable, __file__, "--child", cache] + ([] if guarded else ["--unguarded"])
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout * 20 + 300)
                out = (
                    (p.stdout.strip().splitlines() or [""])[-1]
                    if p.returncode == 0
                    else next(
                        (
                            line
                            for line in p.stderr.splitlines()
                            if "timeout" in line.lower() or "deadlock" in line.lower()
                        ),
                        "aborted",
                    )
                )
                mode = "as zerojax does" if guarded else "into the cache"
                print(f"| {mode} | {run} | {p.returncode} | {time.perf_counter() - t0:.1f} | {out.strip()[:110]} |")


if __name__ == "__main__":
    main()
