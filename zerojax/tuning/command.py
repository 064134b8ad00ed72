"""``zerojax autotune``: the tuner on the command line.

    zerojax autotune --model gpt --d-model 512 --layers 8 --batch 64 --devices 8 --memory 16GiB
    zerojax autotune --model gpt-7.5b --batch 512 --devices 64 --device h100 --memory 80GB --dtype bfloat16
    zerojax autotune my_script:setup --devices 8 --memory 16GiB

``--model gpt`` builds the experiments' GPT (``zerojax.models.gpt``)
from ``--d-model``, ``--layers``, ``--heads``, ``--seq-len`` and ``--vocab``; ``--model NAME``
takes those from a preset of ``zerojax estimate``: the GPT presets (``gpt2-small`` …
``gpt-7.5b``) build the GPT, the Llama and Mistral presets (``llama3-8b``, ``mistral-7b``, …)
``zerojax.models``' Llama (sequences of 2048 tokens unless ``--seq-len`` says).
``module:function`` imports ``module`` (from the current directory too) and calls
``function()``, which returns ``(loss_fn, params, tx, batch)`` or
``(loss_fn, params, tx, batch, config)``; params and batch may be shapes.

Nothing is allocated: the steps are compiled ahead of time on the shapes, for ``--devices``
devices of this machine's backend (simulated CPU devices when there is no accelerator, set
before JAX starts). ``--device`` names the accelerator whose rates price the steps
(datasheet figures; default: this machine's devices, measured on the CPU backend). On
simulated CPU devices the memory is the CPU compiler's: state and batch exact for any
backend, temporaries an estimate of an accelerator's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor")
LLAMA_SEQ_LEN = 2048  # tokens per sequence of a Llama preset unless --seq-len says


def _preset_names() -> list[str]:
    from zerojax.report.estimate import MODELS

    return list(MODELS)


def parser(prog: str = "zerojax autotune") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="the ZeRO configurations that fit, fastest predicted first (compiled ahead of time; no step runs)",
    )
    ap.add_argument(
        "target",
        nargs="?",
        default=None,
        help="module:function returning (loss_fn, params, tx, batch[, config]); or give --model",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="'gpt' (the experiments' GPT, sized by the flags below) or a preset of zerojax estimate: "
        + ", ".join(_preset_names())
        + " (the Llama and Mistral presets build zerojax.models' Llama)",
    )
    ap.add_argument("--d-model", type=int, default=None, help="model width (default: the preset's; gpt: 128)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's; gpt: 4)")
    ap.add_argument(
        "--heads", type=int, default=None, help="attention heads (default: the preset's; GPT: d_model / 64)"
    )
    ap.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help=f"tokens per sequence (default: the GPT preset's; Llama presets: {LLAMA_SEQ_LEN}; gpt: 64)",
    )
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's; gpt: 256)")
    ap.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: 1 per device)")
    ap.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="adamw", help="optax optimizer of --model (default: adamw)"
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="compute dtype of --model (the tuner keeps it; module:function's config keeps its own)",
    )
    ap.add_argument("--devices", type=int, default=None, help="devices to plan for (default: all of this machine's)")
    ap.add_argument("--replicas", type=int, default=1, help="hybrid sharding: replica groups")
    ap.add_argument("--memory", required=True, help="usable memory per device: 80GiB, 16GB, 512MiB")
    ap.add_argument(
        "--device",
        default=None,
        help="rates to price the steps: h100, h200, a100, tpu-v5e, tpu-v5p, "
        "tpu-v4, or 'calibrate' (measure this machine's devices)",
    )
    ap.add_argument("--margin", type=float, default=0.10, help="added to compiled bytes (default 0.10)")
    ap.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to search (default: 0,1,2,3)")
    ap.add_argument("--accum", default=None, help="accumulation counts, e.g. 1,2,4 (default: all that divide)")
    ap.add_argument(
        "--remat",
        default="none,dots,full",
        help="remat policies to search, zerojax.remat names (default: none,dots,full)",
    )
    ap.add_argument(
        "--offload",
        default="none,optimizer,params",
        help="offload to search: none, optimizer, params (host memory) and nvme (disk, with --nvme) "
        "(default: the first three, and nvme with --nvme)",
    )
    ap.add_argument(
        "--host-memory",
        default=None,
        help="usable host memory per device (the host's RAM for offloaded state over its devices): plans "
        "must fit it too (default: unbounded)",
    )
    ap.add_argument(
        "--nvme",
        default=None,
        metavar="PATH",
        help="also search the NVMe tier (the optimizer state on disk under PATH, which must exist; its disk "
        "measured once): the lever when --host-memory is short",
    )
    ap.add_argument(
        "--ratios",
        default="1",
        help="shares of the optimizer state a host offload keeps in host memory (Offload.ratio) to search, "
        "e.g. 0.25,0.5,1 (default: 1)",
    )
    ap.add_argument("--buffer-count", type=int, default=4, help="--nvme: NVMe.buffer_count (default 4)")
    ap.add_argument(
        "--buffer-size", type=int, default=100_000_000, help="--nvme: NVMe.buffer_size in bytes (default 1e8)"
    )
    ap.add_argument("--prefetch", default="0,1", help="stage 3: layers gathered ahead of use to search (default: 0,1)")
    ap.add_argument("--gather", default="none", help="stage 3 gather dtypes: none and/or int8 (lossy)")
    ap.add_argument(
        "--context",
        default=None,
        help="context-parallel degrees to search, e.g. 1,2,4 (each sequence split over C devices; "
        "default: no context axis)",
    )
    ap.add_argument(
        "--expert",
        default=None,
        help="expert-parallel degrees to search, e.g. 1,2,4 (the experts the model annotates split over "
        "E devices; default: no expert axis)",
    )
    ap.add_argument(
        "--pipeline",
        default=None,
        help="pipeline degrees to search, e.g. 1,2,4, or auto (every degree the devices and the layer stack "
        "split into; default: no pipeline)",
    )
    ap.add_argument("--microbatches", default=None, help="the pipeline's micro-batch counts to try (default: P and 2P)")
    ap.add_argument("--exhaustive", action="store_true", help="compile every candidate the formula does not prune")
    ap.add_argument("--limit", type=int, default=10, help="plans shown (default 10)")
    ap.add_argument("--quiet", action="store_true", help="no line per candidate on stderr")
    return ap


def main(argv: Sequence[str] | None = None, prog: str = "zerojax autotune") -> int:
    ap = parser(prog)
    args = ap.parse_args(argv)
    if (args.target is None) == (args.model is None):
        ap.error("give a module:function or --model, exactly one")
    if args.devices is not None and args.devices < 1:
        ap.error(f"--devices must be >= 1, got {args.devices}")
    import jax

    if args.devices is not None:
        try:
            jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts; CPU only
        except RuntimeError:
            pass  # already started (called from Python): use what is there
    from zerojax.sharding.mesh import make_mesh
    from zerojax.tuning.budget import parse_memory
    from zerojax.tuning.candidates import SearchSpace

    try:
        budget = parse_memory(args.memory)
        nvme = None
        if args.nvme is not None:
            from zerojax.config.groups import NVMe

            nvme = NVMe(args.nvme, buffer_count=args.buffer_count, buffer_size=args.buffer_size)
        offload = args.offload.split(",")
        if args.nvme is not None and "nvme" not in offload:
            offload.append("nvme")
        space = SearchSpace(
            stages=_ints(args.stages),
            accum=None if args.accum is None else _ints(args.accum),
            remat=tuple(args.remat.split(",")),
            offload=tuple(offload),
            ratios=tuple(float(r) for r in args.ratios.split(",")),
            prefetch=_ints(args.prefetch),
            gather_dtypes=tuple(None if g == "none" else g for g in args.gather.split(",")),
            context=None if args.context is None else _ints(args.context),
            expert=None if args.expert is None else _ints(args.expert),
            pipeline=None if args.pipeline is None else "auto" if args.pipeline == "auto" else _ints(args.pipeline),
            microbatches=None if args.microbatches is None else _ints(args.microbatches),
        )
    except ValueError as e:
        ap.error(str(e))
    devices = jax.devices()
    n = args.devices or len(devices)
    if len(devices) < n:
        ap.error(
            f"--devices {n}: only {len(devices)} {devices[0].platform} devices here (set before JAX starts: "
            f"run zerojax autotune as its own command)"
        )
    try:
        mesh = make_mesh(devices[:n], replicas=args.replicas)
    except ValueError as e:
        ap.error(str(e))
    if args.model is not None:
        loss_fn, params, tx, batch, base, what = _model(args, ap, n)
    else:
        loss_fn, params, tx, batch, base = _user(args.target, ap)
        what = args.target
    base = dataclasses.replace(base, compute_dtype=args.dtype) if args.model is not None else base
    from zerojax.tuning.search import autotune

    groups = f" in {args.replicas} replica groups" if args.replicas > 1 else ""
    print(
        f"{what}; {n} {devices[0].platform} devices{groups}, {args.memory} per device; jax {jax.__version__}",
        flush=True,
    )
    try:
        result = autotune(
            loss_fn,
            params,
            tx,
            batch,
            mesh=mesh,
            memory=budget,
            config=base,
            device=args.device,
            space=space,
            margin=args.margin,
            exhaustive=args.exhaustive,
            verbose=not args.quiet,
            host_memory=args.host_memory,
            nvme=nvme,
        )
    except ValueError as e:
        print(f"zerojax autotune: {e}", file=sys.stderr)
        return 1
    print(result.table(limit=args.limit))
    print(f"\nbest: {code(result.best.config)}")
    best = result.best
    if best.context > 1 or best.expert > 1 or best.pipeline > 1:
        axes = [
            f"{k}={v}"
            for k, v in (("context", best.context), ("expert", best.expert), ("pipeline", best.pipeline))
            if v > 1
        ]
        replicas = f", replicas={args.replicas}" if args.replicas > 1 else ""
        print(f"mesh: zj.make_mesh({', '.join(axes)}{replicas})")
    if devices[0].platform == "cpu" and result.device.source == "datasheet":
        print(
            f"(memory from the CPU compiler's program on {n} simulated devices: state and batch exact, temporaries "
            f"an estimate of the {result.device.name}'s; time priced with its datasheet rates)"
        )
    return 0


def code(config) -> str:
    """The ``zj.ZeroConfig(...)`` call for ``config`` (``config.code()``): the stage, then the fields
    that differ from the defaults.

    Example:
      >>> import zerojax as zj
      >>> from zerojax.tuning.command import code
      >>> code(zj.ZeroConfig(stage=2, remat="full", grad_accum_steps=4))
      "zj.ZeroConfig(stage=2, grad_accum_steps=4, remat='full')"
    """
    return config.code()


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers (e.g. 1,2,4)") from None


def _tx(name: str):
    import optax

    return {
        "adam": lambda: optax.adam(1e-4),
        "adamw": lambda: optax.adamw(1e-4),
        "sgd": lambda: optax.sgd(1e-2),
        "adafactor": lambda: optax.adafactor(1e-3),
    }[name]()


def _model(args, ap, n: int):
    """--model's (loss_fn, params, tx, batch, base config, description): the experiments'
    GPT for 'gpt' and the GPT presets, zerojax.models' Llama for the Llama presets."""
    from zerojax.report.estimate import MODELS, GPTShape, LlamaShape

    if args.model == "gpt":
        return _gpt(GPTShape(vocab=256, seq_len=64, d_model=128, n_layers=4), args, ap, n)
    shape = MODELS.get(args.model)
    if isinstance(shape, GPTShape):
        return _gpt(shape, args, ap, n)
    if isinstance(shape, LlamaShape):
        return _llama(shape, args, ap, n)
    ap.error(f"unknown --model {args.model!r}; choose 'gpt' or one of {', '.join(MODELS)}")


def _llama(shape, args, ap, n: int):
    """zerojax.models' Llama in a preset's shape (the flags override its sizes)."""
    import jax

    from zerojax.config import ZeroConfig
    from zerojax.models import llama

    seq = args.seq_len or LLAMA_SEQ_LEN
    try:
        cfg = llama.LlamaConfig(
            vocab=args.vocab or shape.vocab,
            d_model=args.d_model or shape.d_model,
            n_layers=args.layers or shape.n_layers,
            n_heads=args.heads or shape.n_heads,
            n_kv_heads=shape.n_kv_heads,
            head_dim=shape.head_dim or 0,
            d_ff=shape.d_ff,
            seq_len=seq,
            tie_embeddings=shape.tied,
        )
        graphdef, params = llama.init_abstract(cfg)
    except ValueError as e:
        ap.error(f"--model {args.model}: {e}")
    psi = sum(x.size for x in jax.tree.leaves(params))
    batch_size = args.batch or n
    tokens = jax.ShapeDtypeStruct((batch_size, seq + 1), "int32")
    what = (
        f"Llama ({args.model}) d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads "
        f"({cfg.n_kv_heads or cfg.n_heads} key/value), d_ff {cfg.d_ff}, seq {seq}, vocab {cfg.vocab}: Ψ = {psi:,}; "
        f"global batch {batch_size}; {args.optimizer}, {args.dtype} compute"
    )
    return llama.make_loss(graphdef), params, _tx(args.optimizer), {"tokens": tokens}, ZeroConfig(), what


def _gpt(shape, args, ap, n: int):
    """The experiments' GPT: (loss_fn, params, tx, batch, base config, description)."""
    import jax

    from zerojax.config import ZeroConfig
    from zerojax.models import gpt

    d = args.d_model or shape.d_model
    seq = args.seq_len or shape.seq_len
    try:
        cfg = gpt.GPTConfig(
            vocab=args.vocab or shape.vocab,
            seq_len=seq,
            d_model=d,
            n_layers=args.layers or shape.n_layers,
            n_heads=args.heads or max(1, d // 64),
            mlp_ratio=shape.mlp_ratio,
        )
    except ValueError as e:
        ap.error(str(e))
    graphdef, params = gpt.init_abstract(cfg)
    batch_size = args.batch or n
    tokens = jax.ShapeDtypeStruct((batch_size, seq), "int32")  # inputs and targets: a sequence that splits
    tx = _tx(args.optimizer)
    what = (
        f"GPT d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, seq {seq}, vocab {cfg.vocab}: "
        f"Ψ = {cfg.num_params():,}; global batch {batch_size}; {args.optimizer}, {args.dtype} compute"
    )
    return gpt.make_loss(graphdef), params, tx, {"inputs": tokens, "targets": tokens}, ZeroConfig(), what


def _user(target: str, ap) -> tuple[Any, Any, Any, Any, Any]:
    from zerojax.config import ZeroConfig

    module_name, sep, fn_name = target.partition(":")
    if not sep or not module_name or not fn_name:
        ap.error(f"target must be module:function (e.g. train:setup), got {target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        ap.error(f"cannot load {target}: {e}")
    out = fn()
    if not isinstance(out, tuple) or len(out) not in (4, 5):
        ap.error(
            f"{target}() must return (loss_fn, params, tx, batch) or (loss_fn, params, tx, batch, config), "
            f"got {type(out).__name__}"
        )
    base = out[4] if len(out) == 5 else ZeroConfig()
    if not isinstance(base, ZeroConfig):
        ap.error(f"{target}()'s fifth value must be a zj.ZeroConfig, got {type(base).__name__}")
    return out[0], out[1], out[2], out[3], base
