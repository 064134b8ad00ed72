"""The ``zerojax`` command line.

    zerojax export CHECKPOINT_DIR OUT.safetensors [--step N] [--dtype float32|bfloat16]
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
    args = ap.parse_args(argv)
    if args.command == "export":
        from zerojax.checkpoint.export import export_weights

        try:
            shapes = export_weights(args.checkpoint_dir, args.out, step=args.step, dtype=args.dtype)
        except (FileNotFoundError, ValueError) as e:
            print(f"zerojax export: {e}", file=sys.stderr)
            return 1
        n = sum(int(__import__("math").prod(s)) for s in shapes.values())
        print(f"wrote {len(shapes)} tensors, {n:,} parameters ({args.dtype}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
