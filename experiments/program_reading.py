"""What a JAX release zerojax cannot read costs: stages 2 and 3 with and without program reading.

On a JAX whose program form zerojax does not know (or with ``ZEROJAX_NO_PROGRAM_READING=1``)
every feature takes a path that reads no program (README, "JAX versions"): stage 3 gathers
every parameter before the loss instead of each layer where it runs, stage 2 reduce-scatters
every gradient after backward, and the config's per-layer remat is not applied. This script
builds each step both ways on the experiments' GPT in one process and shows, per device:

- the compiled program's memory (argument + output - alias + temp, and temp alone) and its
  collectives (all-gathers, reduce-scatters), read from the compiled program;
- the step time, the runs interleaved (median ms after a warm-up), and its ratio to the run
  that reads the program;
- the loss after the timed steps, which must agree between the two paths.

On simulated CPU devices collectives are memory copies on the compute's cores, so the time
ratio says little about a GPU; the memory columns hold on any backend.

    python experiments/program_reading.py [--d-model 256 --layers 8 --batch 16 --repeats 5 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import harness  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax._jaxpr import check  # noqa: E402
from zerojax.report.comm import collectives  # noqa: E402

MIB = 2**20
RUNS = [  # (stage, remat)
    (2, "none"),
    (3, "none"),
    (3, "full"),
]


def _build(cfg, stage: int, remat: str, batch: int, read: bool):
    """A compiled step, its state after one warm-up step and the batch, traced with program
    reading on or off (the decision is taken when the step is traced, and kept)."""
    before = os.environ.get(check.ENV)
    os.environ[check.ENV] = "0" if read else "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", check.ProgramReadingOff)
            config = zj.ZeroConfig(stage=stage, remat=remat)
            state, step, compiled = harness.compile_step(cfg, zj.make_mesh(), config, batch=batch)
            tokens = next(data.windows(data.stdlib_bytes(1 << 20), batch, cfg.seq_len))
            state, _ = step(state, tokens)  # traced and compiled here, under the setting above
    finally:
        if before is None:
            os.environ.pop(check.ENV, None)
        else:
            os.environ[check.ENV] = before
    return state, step, compiled, tokens


def main(argv: list[str] | None = None) -> list[dict]:
    ap = harness.add_gpt_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    t0 = time.perf_counter()
    built, rows = {}, []
    for stage, remat in RUNS:
        for read in (True, False):
            state, step, compiled, tokens = _build(cfg, stage, remat, args.batch, read)
            mem = zj.report.compiled_bytes(compiled)
            kinds = [c.kind for c in collectives(compiled.as_text())]
            built[(stage, remat, read)] = [state, step, tokens]
            rows.append(
                {
                    "stage": stage,
                    "remat": remat,
                    "read": "yes" if read else "no",
                    "total_mib": mem["total"] / MIB,
                    "temp_mib": mem["temp"] / MIB,
                    "gathers": kinds.count("all-gather"),
                    "scatters": kinds.count("reduce-scatter"),
                }
            )

    def runner(key):
        held = built[key]

        def run():
            held[0], metrics = held[1](held[0], held[2])
            return metrics["loss"]

        return run

    times = harness.side_by_side({key: runner(key) for key in built}, args.repeats)
    for row in rows:
        key = (row["stage"], row["remat"], row["read"] == "yes")
        row["ms"] = harness.median_ms(times[key])
        row["vs_read"] = row["ms"] / harness.median_ms(times[(key[0], key[1], True)])
        row["loss"] = float(built[key][1](built[key][0], built[key][2])[1]["loss"])
    print(harness.header(cfg, f"batch {args.batch}, AdamW, program read or not"))
    print(
        harness.table(
            rows,
            {
                "stage": "{stage}",
                "remat": "{remat}",
                "program read": "{read}",
                "compiled MiB/device": "{total_mib:.2f}",
                "temp MiB": "{temp_mib:.2f}",
                "all-gathers": "{gathers}",
                "reduce-scatters": "{scatters}",
                "ms/step": "{ms:.1f}",
                "vs read": "{vs_read:.2f}x",
                "loss after": "{loss:.6f}",
            },
        )
    )
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
