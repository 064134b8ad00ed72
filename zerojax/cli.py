"""The ``zerojax`` command line.

zerojax export CHECKPOINT_DIR OUT.safetensors [--step N] [--dtype float32|bfloat16|float16]
zerojax export CHECKPOINT_DIR OUT_DIR --format hf --map llama|mistral|qwen2|qwen3|mixtral|qwen3_moe|qwen2_moe [--max-shard-size 5GB]
               [--lora merge] [--hf-config SOURCE_MODEL_DIR]
zerojax export CHECKPOINT_DIR OUT_DIR --format hf --hf-config SOURCE_MODEL_DIR   (the map from its config)
zerojax estimate --params 7B --devices 64 [--largest-layer N] [--replicas R] [--tensor T]
                 [--dtype float32|bfloat16|float16] [--optimizer adam|adamw|sgd|adafactor]
zerojax estimate --model llama3-8b --devices 8
zerojax estimate --model llama3-8b --devices 8 --offload optimizer --nvme
zerojax launch --nprocs 2 [--devices-per-proc 4] -- python train.py [args...]
zerojax autotune --model gpt --d-model 512 --layers 8 --batch 64 --devices 8 --memory 16GiB
zerojax autotune my_script:setup --devices 8 --memory 16GiB   (see zerojax/tuning/command.py)
zerojax --version
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # its own parser: everything after "--" is the command to run
        from zerojax.launch import main as launch_main

        return launch_main(argv[1:], prog="zerojax launch")
    if argv[:1] == ["autotune"]:  # its own parser, and the device count is set before JAX starts
        from zerojax.tuning.command import main as autotune_main

        return autotune_main(argv[1:], prog="zerojax autotune")
    ap = argparse.ArgumentParser(prog="zerojax", description="zerojax tools")
    ap.add_argument("--version", action="version", version=f"zerojax {version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "launch",
        add_help=False,
        help="start a local multi-process job: zerojax launch --nprocs N ... -- command [args...]",
    )
    sub.add_parser(
        "autotune",
        add_help=False,
        help="the ZeRO configurations that fit a memory budget, fastest predicted first (no trial run)",
    )
    ex = sub.add_parser("export", help="consolidated weights from a checkpoint (zero_to_fp32)")
    ex.add_argument("checkpoint_dir")
    ex.add_argument("out", help="output .safetensors file (--format file) or folder (--format hf)")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ex.add_argument(
        "--format",
        choices=["file", "hf"],
        default="file",
        help="one file, or Hugging Face's sharded files (model-0000k-of-0000n.safetensors + index)",
    )
    ex.add_argument(
        "--map",
        default=None,
        help="tensor names: a family's map (" + ", ".join(_ready_maps()) + ") or module:attribute "
        "(a zj.maps.WeightMap, or a function of no arguments returning one); default: the map of "
        "--hf-config's config.json (zj.models.from_hf), else the parameters' own dotted names",
    )
    ex.add_argument("--max-shard-size", default="5GB", help="largest file of --format hf (5GB, 500MiB, bytes)")
    ex.add_argument(
        "--lora",
        choices=["merge", "adapters", "keep"],
        default="merge",
        help="LoRA adapters folded into their kernels (default), alone, or kept as parameters",
    )
    ex.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="--format hf: the source model's config.json (or its folder, with generation_config.json), "
        "written beside the weights with the exported dtype; default: the map's, else none",
    )
    es = sub.add_parser("estimate", help="model-state memory per device: ZeRO paper, DeepSpeed and zerojax")
    es.add_argument(
        "--params",
        type=_count,
        default=None,
        help="parameter count: 7B, 1.3b, 350M, 125k, 1.5e9, 7_000_000 (K/M/B/T suffixes)",
    )
    es.add_argument("--model", default=None, help="a model config: " + ", ".join(_model_names()))
    es.add_argument("--devices", type=int, required=True, help="devices on the data axis")
    es.add_argument(
        "--pipeline",
        type=int,
        default=1,
        help="pipeline stages (zj.make_mesh(pipeline=P)); needs --model or --stack-params",
    )
    es.add_argument(
        "--stack-params",
        type=_count,
        default=None,
        help="parameters of the layer stack the pipeline splits (with --params and --pipeline), e.g. 6.5B",
    )
    es.add_argument(
        "--largest-layer",
        type=_count_or_zero,
        default=0,
        help="parameters of the largest layer (DeepSpeed's ZeRO-3 figure), e.g. 500M",
    )
    es.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="compute dtype of the zerojax column (fp32 masters either way)",
    )
    es.add_argument(
        "--optimizer",
        choices=["adam", "adamw", "sgd", "adafactor"],
        default="adam",
        help="optimizer of the zerojax column: adam/adamw 8 bytes of state per parameter, "
        "sgd (no momentum) 0, adafactor ~0 (factored moments; a lower bound)",
    )
    es.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="hybrid sharding: replica groups (the state is sharded over devices/replicas)",
    )
    es.add_argument(
        "--tensor",
        type=int,
        default=1,
        help="tensor parallelism beside ZeRO: tensor degree T (each device holds 1/T of every "
        "parameter; ZeRO shards over devices/(replicas*T))",
    )
    es.add_argument(
        "--offload",
        choices=["none", "optimizer", "optimizer+params"],
        default="none",
        help="also print the state per memory tier (device, host, disk) with this offload (ZeroConfig.offload)",
    )
    es.add_argument(
        "--nvme",
        action="store_true",
        help="with --offload: the optimizer state on disk (the NVMe tier) instead of host memory",
    )
    es.add_argument(
        "--ratio",
        type=float,
        default=1.0,
        help="with --offload: the share of the optimizer state offloaded (Offload.ratio), in (0, 1]",
    )
    es.add_argument("--buffer-count", type=int, default=4, help="--nvme: NVMe.buffer_count")
    es.add_argument("--buffer-size", type=_count, default=100_000_000, help="--nvme: NVMe.buffer_size in bytes")
    fd = sub.add_parser("from-deepspeed", help="the ZeroConfig of a DeepSpeed JSON config")
    fd.add_argument("config", help="a DeepSpeed JSON config, e.g. ds_config.json")
    fd.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="auto",
        help='fill an "auto" value: a DeepSpeed key (scheduler.params.total_num_steps=1000) or a '
        "TrainingArguments field (learning_rate=3e-4); VALUE is read as JSON when it parses, "
        "else as a string; repeatable",
    )
    fd.add_argument(
        "--pipeline-stages",
        type=int,
        default=None,
        metavar="P",
        help="the PipelineModule's num_stages: gradient_accumulation_steps become the pipeline's micro-batches",
    )
    args = ap.parse_args(argv)
    if args.command == "from-deepspeed":
        import json

        from zerojax.deepspeed import translate

        auto = {}
        for item in args.auto:
            key, sep, text = item.partition("=")
            if not sep or not key:
                ap.error(f"--set takes KEY=VALUE (e.g. --set scheduler.params.total_num_steps=1000), got {item!r}")
            try:
                auto[key] = json.loads(text)
            except json.JSONDecodeError:
                auto[key] = text
        try:
            t = translate(args.config, auto=auto, pipeline_stages=args.pipeline_stages)
        except (OSError, ValueError, TypeError) as e:
            print(f"zerojax from-deepspeed: {e}", file=sys.stderr)
            return 2
        print(f"config = {t.code()}")
        says = []
        if t.shard_size is not None:
            says.append(f"refused unless {t.shard_size} divides the device count")
        if t.context is not None:
            says.append(f"each sequence over {t.context} devices")
        if t.tensor is not None:
            says.append(f"the weights the model annotates split over {t.tensor} devices")
        if t.expert is not None:
            says.append(f"the routed experts over {t.expert} devices")
        if says:
            print(f"mesh = {t.mesh_code()}  # {'; '.join(says)}")
        if t.optimizer:
            print(f"tx = {t.optimizer}")
        elif t.schedule:
            print(f"schedule = {t.schedule}  # the optimizer's learning_rate")
        print(f"monitor = {t.monitor.code()}  # step = monitor.watch(step)")
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
        if args.tensor < 1 or (args.devices // args.replicas) % args.tensor:
            ap.error(
                f"--tensor must be >= 1 and divide the {args.devices // args.replicas} devices of a replica "
                f"group, got {args.tensor}"
            )
        psi, layer, stack = args.params, args.largest_layer, args.stack_params
        if args.model is not None:
            if args.model not in estimate.MODELS:
                ap.error(f"unknown --model {args.model!r}; choose from {', '.join(estimate.MODELS)}")
            shape = estimate.MODELS[args.model]
            psi, layer = shape.num_params(), layer or shape.largest_layer_params()
            stack = stack or shape.n_layers * shape.block_params()
        if args.pipeline > 1 and stack is None:
            ap.error("--pipeline needs the layer stack's size: give --model, or --stack-params with --params")
        if args.nvme and args.offload == "none":
            ap.error("--nvme keeps the optimizer state on disk: give --offload optimizer (or optimizer+params)")
        if args.offload != "none" and (args.replicas, args.tensor, args.pipeline) != (1, 1, 1):
            ap.error("--offload's tier table is for the data axis alone: leave out --replicas, --tensor and --pipeline")
        if not 0 < args.ratio <= 1 or (args.ratio < 1 and args.offload == "none"):
            ap.error(f"--ratio must be in (0, 1], with --offload; got {args.ratio}")
        if args.buffer_count < 2 or args.buffer_size < 1:
            ap.error(f"--buffer-count must be >= 2 and --buffer-size >= 1, got {args.buffer_count}, {args.buffer_size}")
        print(
            estimate.table(
                psi,
                args.devices,
                layer,
                replicas=args.replicas,
                compute_dtype=args.dtype,
                optimizer=args.optimizer,
                tensor=args.tensor,
                pipeline=args.pipeline,
                stack_params=stack or 0.0,
            )
        )
        if args.offload != "none":
            print()
            print(
                estimate.tier_table(
                    psi,
                    args.devices,
                    offload=args.offload,
                    nvme=args.nvme,
                    compute_dtype=args.dtype,
                    optimizer=args.optimizer,
                    buffers=(args.buffer_count, args.buffer_size),
                    ratio=args.ratio,
                )
            )
        return 0
    if args.command == "export":
        from zerojax.checkpoint.export import export_weights

        try:
            wmap = None if args.map is None else _load_map(args.map)
            if wmap is None and args.hf_config is not None:  # the source's config says its family and tensors
                from zerojax.models import from_hf

                wmap = from_hf(args.hf_config)[1]
            shapes = export_weights(
                args.checkpoint_dir,
                args.out,
                step=args.step,
                dtype=args.dtype,
                show_progress=None,
                format=args.format,
                map=wmap,
                max_shard_size=args.max_shard_size,
                lora=args.lora,
                hf_config=args.hf_config,
            )
        except (OSError, ValueError, TypeError) as e:
            print(f"zerojax export: {e}", file=sys.stderr)
            return 1
        n = sum(math.prod(s) for s in shapes.values())
        print(f"wrote {len(shapes)} tensors, {n:,} parameters ({args.dtype}) to {args.out}")
        if args.format != "file":
            return 0
        from zerojax.tensors.safetensors_files import stored_dtypes

        narrow = {k: v for k, v in stored_dtypes(args.out).items() if v not in ("float32", "float64")}
        if narrow:
            print(
                f"{len(narrow)} frozen tensors were stored by the run in {', '.join(sorted(set(narrow.values())))} "
                f"(ZeroConfig.frozen_dtype='compute') and hold that rounding: {', '.join(narrow)}"
            )
    return 0


def _ready_maps() -> list[str]:
    from zerojax.models.hf_map import FAMILY_TENSORS

    return sorted(FAMILY_TENSORS)


def _load_map(spec: str):
    """A WeightMap from a ready map's name or ``module:attribute``."""
    import importlib

    from zerojax import maps

    if spec in _ready_maps():
        return maps.family_map(spec)
    if ":" not in spec:
        raise ValueError(f"--map {spec!r}: use a ready map ({', '.join(_ready_maps())}) or module:attribute.")
    module, attr = spec.split(":", 1)
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--map {spec!r}: {e}") from None
    obj = obj() if callable(obj) and not isinstance(obj, maps.WeightMap) else obj
    if not isinstance(obj, maps.WeightMap):
        raise TypeError(f"--map {spec!r} is a {type(obj).__name__}, not a zj.maps.WeightMap.")
    return obj


def version() -> str:
    """The installed zerojax's version (its package metadata; ``zerojax.__version__`` where
    the package is not installed).

    Example:
      >>> import zerojax
      >>> from zerojax.cli import version
      >>> version() == zerojax.__version__
      True
    """
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("zerojax")
    except PackageNotFoundError:
        import zerojax

        return zerojax.__version__


def _count(text: str) -> int:
    """argparse type of a parameter count (7B, 1.5e9, ...): its errors name the forms taken."""
    from zerojax.report.estimate import parse_count

    try:
        return parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count_or_zero(text: str) -> int:
    from zerojax.report.estimate import parse_count

    try:
        return parse_count(text, allow_zero=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model_names() -> list[str]:
    from zerojax.report.estimate import MODELS

    return list(MODELS)


if __name__ == "__main__":
    sys.exit(main())
