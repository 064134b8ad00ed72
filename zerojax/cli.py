"""The ``zerojax`` command line.

    zerojax export CHECKPOINT_DIR OUT.safetensors [--step N] [--dtype float32|bfloat16]
    zerojax estimate --params 7.5e9 --devices 64 [--largest-layer N] [--replicas R]
    zerojax estimate --model gpt2-xl --devices 8
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zerojax", description="zerojax tools")
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="consolidated weights from a checkpoint (zero_to_fp32)")
    ex.add_argument("checkpoint_dir")
    ex.add_argument("out", help="output .safetensors file")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    es = sub.add_parser("estimate", help="model-state memory per device: ZeRO paper and DeepSpeed")
    es.add_argument("--params", type=float, default=None, help="parameter count, e.g. 7.5e9")
    es.add_argument("--model", default=None, help="a model config: " + ", ".join(_model_names()))
    es.add_argument("--devices", type=int, required=True, help="devices on the data axis")
    es.add_argument("--largest-layer", type=float, default=0.0, help="parameters of the largest layer")
    es.add_argument("--replicas", type=int, default=1,
                    help="hybrid sharding: replica groups (the state is sharded over devices/replicas)")
    fd = sub.add_parser("from-deepspeed", help="the ZeroConfig of a DeepSpeed JSON config")
    fd.add_argument("config", help="a DeepSpeed JSON config, e.g. ds_config.json")
    args = ap.parse_args(argv)
    if args.command == "from-deepspeed":
        from zerojax.deepspeed import translate

        try:
            t = translate(args.config)
        except (OSError, ValueError, TypeError) as e:
            print(f"zerojax from-deepspeed: {e}", file=sys.stderr)
            return 2
        print(f"config = {t.code()}")
        if t.shard_size is not None:
            print(f"mesh = {t.mesh_code()}  # {t.shard_size} must divide the device count")
        if t.optimizer:
            print(f"tx = {t.optimizer}")
        if t.message():
            print(t.message(), file=sys.stderr)
        return 0
    if args.command == "estimate":
        from zerojax.report import estimate

        if (args.params is None) == (args.model is None):
            ap.error("give exactly one of --params or --model")
        if args.devices < 1:
            ap.error(f"--devices must be >= 1, got {args.devices}")
        if args.replicas < 1 or args.devices % args.replicas:
            ap.error(f"--replicas must be >= 1 and divide --devices {args.devices}, got {args.replicas}")
        psi, layer = args.params, args.largest_layer
        if args.model is not None:
            if args.model not in estimate.MODELS:
                ap.error(f"unknown --model {args.model!r}; choose from {', '.join(estimate.MODELS)}")
            shape = estimate.MODELS[args.model]
            psi, layer = shape.num_params(), layer or shape.largest_layer_params()
        print(estimate.table(psi, args.devices, layer, replicas=args.replicas))
        return 0
    if args.command == "export":
        from zerojax.checkpoint.export import export_weights

        try:
            shapes = export_weights(args.checkpoint_dir, args.out, step=args.step, dtype=args.dtype)
        except (FileNotFoundError, ValueError) as e:
            print(f"zerojax export: {e}", file=sys.stderr)
            return 1
        n = sum(int(__import__("math").prod(s)) for s in shapes.values())
        print(f"wrote {len(shapes)} tensors, {n:,} parameters ({args.dtype}) to {args.out}")
        from zerojax.checkpoint.export import stored_dtypes

        narrow = {k: v for k, v in stored_dtypes(args.out).items() if v not in ("float32", "float64")}
        if narrow:
            print(f"{len(narrow)} frozen tensors were stored by the run in {', '.join(sorted(set(narrow.values())))} "
                  f"(ZeroConfig.frozen_dtype='compute') and hold that rounding: {', '.join(narrow)}")
    return 0


def _model_names() -> list[str]:
    from zerojax.report.estimate import MODELS

    return list(MODELS)


if __name__ == "__main__":
    sys.exit(main())
