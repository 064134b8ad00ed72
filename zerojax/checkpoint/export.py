"""Weights out of a run: one ``.safetensors`` file, or Hugging Face's sharded format.

One pipeline serves every export: a source (:mod:`zerojax.checkpoint.export_sources`: a live
state's shards, written by the process that holds them, or a checkpoint directory's leaves,
read one at a time by process 0) through the map (:mod:`zerojax.tensors.weight_map`, run
backwards: names, transposes, unstacked layers, fused parts) into the files
(:mod:`zerojax.checkpoint.sinks`). No array is gathered; a process holds one piece of one
shard (or, from a checkpoint directory, one parameter) at a time.

Every check that can fail runs before the first byte is written, and its outcome is agreed
by every process (:mod:`zerojax.tensors.processes`): the map (every element of every
tensor written exactly once, dtypes the format holds), the output folder (writable by every
process, one filesystem for all), and the float16 range of each process's own shards. A
failure in one process raises on every process, naming the process and the problem; a
process that fails while writing stops every other one within about a second, and one that
dies outright is given up on after ``timeout_s`` without progress. Either way nothing is
left that looks complete (see :mod:`zerojax.checkpoint.sinks`).

A tensor that two parameters read (a model's untied head loaded from a tied checkpoint's
embedding) is written once, under its own name, and the second parameter is compared with
what the first wrote: equal, the export goes on; different (training moved them apart),
every process raises, naming both parameters and the largest difference.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from zerojax.checkpoint import lora as lora_
from zerojax.checkpoint.configs import exported, source_configs
from zerojax.checkpoint.export_sources import CheckpointSource, ExportSource, StateSource
from zerojax.checkpoint.sinks import FORMATS, ExportFiles, natural, parse_size
from zerojax.progress import progress
from zerojax.state import ZeroState
from zerojax.tensors import boxes
from zerojax.tensors.casts import as_dtype, cast, is_float, narrows_range
from zerojax.tensors.coverage import Duplicate, cover
from zerojax.tensors.processes import DEFAULT_TIMEOUT_S, Processes
from zerojax.tensors.safetensors_files import TensorFiles, TensorWriter, dtype_code
from zerojax.tensors.weight_map import IDENTITY, WeightMap, infer_tensors, resolve
from zerojax.tensors.weights import storage_expr

__all__ = ["EXPORT_DTYPES", "export_weights"]

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
PIECE_BYTES = 64 * 2**20  # the largest piece of a shard cast and written at once


def export_weights(
    source: Any,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str = "float32",
    show_progress: bool | None = False,
    format: str = "file",
    map: WeightMap | None = None,
    max_shard_size: int | str = "5GB",
    lora: str = "merge",
    hf_config: dict | str | os.PathLike | None = None,
    generation_config: dict | str | os.PathLike | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, tuple[int, ...]]:
    """Writes the weights of ``source`` to ``out`` in ``dtype`` (float32, bfloat16 or
    float16; integer parameters keep their own); returns ``{tensor name: shape}``.

    ``source``: a live ``ZeroState`` (every process writes the shards its own devices hold,
    straight into the files), or a checkpoint directory (step ``step``, default the latest;
    process 0 reads one parameter at a time). Every process of a job calls it.

    ``format="file"``: one ``.safetensors`` file at ``out``. ``format="hf"``: Hugging Face's
    sharded files in the folder ``out``: ``model-0000k-of-0000n.safetensors`` files of at most
    ``max_shard_size`` (``"5GB"``, decimal as Hugging Face counts, or bytes) and
    ``model.safetensors.index.json``, or one ``model.safetensors``. Earlier exports' weight
    files in the folder (``model.safetensors``, shards of any count, an index) are removed,
    so that the folder holds exactly this export.

    ``map``: a :class:`zerojax.maps.WeightMap` naming, transposing, unstacking and fusing the
    parameters into the checkpoint's tensors: the map that loads them (``zj.maps.
    llama_map()``) serves. Default: each parameter under its own dotted name. Every element
    of every tensor is written by exactly one parameter: parts (``part``) and concatenations
    that overlap or leave a gap are refused, naming the elements. A tensor two parameters
    read is written once and the second is checked equal to it (see the module docstring).

    ``lora``: ``"merge"`` (default: each ``nnx.LoRALinear`` kernel written as ``kernel +
    lora_a @ lora_b``, the adapters left out: a plain model any loader reads), ``"adapters"``
    (the adapters alone, under the map's names for them), or ``"keep"`` (every parameter).

    ``config.json``: with ``format="hf"`` (and not ``lora="adapters"``), the source
    checkpoint's config is written beside the weights, its ``dtype`` / ``torch_dtype``
    updated (see :mod:`zerojax.checkpoint.configs`), and its ``generation_config.json``
    where it had one. The config comes from ``hf_config`` (a dict, a ``config.json`` path,
    or the source checkpoint's folder, whose ``generation_config.json`` comes too), else
    from ``map.hf_config``; ``generation_config`` (a dict or a path) overrides either. With
    neither, no config is written (``from_pretrained`` then needs the model's
    ``config.json`` copied in) and any in the folder is left as it is.

    Trainable parameters are written from their fp32 masters; frozen ones as the run stored
    them (``ZeroConfig.frozen_dtype``). A ``format="file"`` export's metadata
    ``stored_dtypes`` (JSON) names each tensor's stored dtype (:func:`stored_dtypes`).

    Refused before any byte is written, on every process: float16 values beyond its range
    (65504: export in bfloat16, which has float32's range), a folder a process cannot write
    or does not share with process 0, and every problem of the map. ``timeout_s``: a
    process that neither finishes a phase nor makes progress for this long is given up on
    (the others raise ``TimeoutError``). ``show_progress``: a progress bar over the
    parameters on stderr (``None``: on a terminal only, as ``zerojax export`` does).

    Load the result with :func:`zerojax.load_weights`, ``safetensors.numpy.load_file``,
    or (``format="hf"`` with a config) ``transformers``' ``from_pretrained(out)``.
    """
    # A state on this process's devices alone is exported by this process alone; otherwise
    # every process takes part (a checkpoint directory: process 0 reads and writes).
    local = isinstance(source, ZeroState) and source.plan.replicated.is_fully_addressable
    group = Processes("export_weights", timeout_s, collective=not local)
    job, error = None, None
    try:
        job = _Job(
            source,
            out,
            step=step,
            dtype=dtype,
            format=format,
            wmap=map,
            max_shard_size=max_shard_size,
            lora=lora,
            hf_config=hf_config,
            generation_config=generation_config,
            show_progress=show_progress,
        )
    except Exception as e:  # noqa: BLE001 (agreed by every process, then raised)
        error = e
    group.agree("plan", error, when="before writing anything")
    return job.run(group)


class _Job:
    """One export, planned from shapes alone: what each parameter writes, and where."""

    def __init__(
        self,
        source,
        out,
        *,
        step,
        dtype,
        format,
        wmap,
        max_shard_size,
        lora,
        hf_config,
        generation_config,
        show_progress,
    ):
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}.")
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
        wmap = IDENTITY if wmap is None else wmap
        if not isinstance(wmap, WeightMap):
            raise TypeError(f"map must be a zj.maps.WeightMap, got {type(wmap).__name__}.")
        max_bytes = parse_size(max_shard_size)
        out = os.fspath(out)
        if format == "file" and os.path.isdir(out):
            raise IsADirectoryError(
                f"{out!r} is a folder; format='file' writes one file: name the file, or pass "
                "format='hf' to write Hugging Face's sharded files into the folder."
            )
        if isinstance(source, ZeroState):
            if step is not None:
                raise ValueError("step= picks a step of a checkpoint directory; a state is exported as it is.")
            src: ExportSource = StateSource(source)
        else:
            src = CheckpointSource(source, step)
        self.source, self.show_progress, self.merged = src, show_progress, {}
        self.chosen, merges = lora_.select(src.names, lora, src.what)
        self.merges = merges
        target = as_dtype(dtype)
        self.out_dtype = {n: target if is_float(src.dtypes[n]) else src.dtypes[n] for n in self.chosen}
        shapes = {n: src.shapes[n] for n in self.chosen}
        try:
            inferred = infer_tensors(wmap, shapes)
            res = resolve(wmap, shapes, {t: (s, np.dtype(np.float32)) for t, s in inferred.items()})
            if res.problems():
                raise ValueError(". ".join(res.problems()))
            self.duplicates = cover(res.exprs, inferred)
        except ValueError as e:
            raise ValueError(f"the map cannot export {src.what}: {e}") from None
        self.exprs = res.exprs
        tensors = self._tensors(inferred)
        skip = {(d.param, d.tensor) for d in self.duplicates}
        stored: dict[str, set[str]] = {}
        for n, e in self.exprs.items():
            for t, _ in e.boxes(boxes.full(tuple(e.shape))):
                if (n, t) not in skip:
                    stored.setdefault(t, set()).add(src.stored[n])
        configs = {}
        explicit = hf_config is not None or generation_config is not None
        if format == "hf" and lora != "adapters":
            config, generation = source_configs(hf_config, generation_config, wmap.hf_config, wmap.generation_config)
            configs = exported(config, generation, dtype=dtype, tensors=list(tensors))
        elif explicit:
            raise ValueError(
                "hf_config / generation_config are written beside a Hugging Face model export: "
                "format='hf' without lora='adapters'."
            )
        if format == "hf":
            metadata = {"format": "pt"}
        else:
            metadata = {
                "format": "zerojax",
                **src.metadata,
                "stored_dtypes": json.dumps({t: "/".join(sorted(s)) for t, s in stored.items()}),
            }
        self.files = ExportFiles(out, format, tensors, max_bytes=max_bytes, metadata=metadata, configs=configs)

    def _tensors(self, inferred: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
        """``{tensor: (shape, dtype)}``: the dtype of the parameters written into it."""
        written: dict[str, dict[np.dtype, str]] = {}
        for n, e in self.exprs.items():
            for t, _ in e.boxes(boxes.full(tuple(e.shape))):
                written.setdefault(t, {}).setdefault(self.out_dtype[n], n)
        out = {}
        for t in sorted(inferred, key=natural):
            dtypes = written[t]
            if len(dtypes) > 1:
                raise ValueError(
                    f"tensor {t!r} would hold parameters of different dtypes ("
                    + ", ".join(f"{p!r}: {d}" for d, p in dtypes.items())
                    + "); map them to tensors of their own."
                )
            (d,) = dtypes
            dtype_code(d)  # a dtype safetensors has
            out[t] = (tuple(inferred[t]), d)
        return out

    # -- running it, on every process ----------------------------------------------------------

    def run(self, group: Processes) -> dict[str, tuple[int, ...]]:
        files, rank, probed = self.files, group.rank, False
        try:
            group.start("checks")
            error = None
            try:
                adapters = self.source.whole(sorted({x for ab in self.merges.values() for x in ab}))
                self.merged = {k: (adapters[a], adapters[b]) for k, (a, b) in self.merges.items() if a in adapters}
                if self.source.writes:  # (a checkpoint directory: process 0 alone writes)
                    files.probe(rank)
                    probed = True
                self._pass("check", group)
            except BaseException as e:  # noqa: BLE001
                error = e
            group.agree("checks", error, when="before writing anything")
            error = None
            try:
                if self.source.writes:
                    files.sees(rank)
            except BaseException as e:  # noqa: BLE001
                error = e
            group.agree("folder", error, when="before writing anything")
        finally:
            if probed:
                files.unprobe(rank)
        try:
            error = None
            if rank == 0:
                try:
                    files.begin()
                except BaseException as e:  # noqa: BLE001
                    error = e
            group.agree("begin", error, when="before writing any tensor")
            group.start("data")
            error = None
            try:
                with TensorWriter(files.places) as writer:
                    self._pass("write", group, writer)
            except BaseException as e:  # noqa: BLE001
                error = e
            group.agree("data", error, when="while writing (no file was completed)")
            if self.duplicates:
                group.start("verify")
                error = None
                try:
                    self._verify(group)
                except BaseException as e:  # noqa: BLE001
                    error = e
                group.agree("verify", error, when="after writing (no file was completed)")
            error = None
            if rank == 0:
                try:
                    files.commit()
                except BaseException as e:  # noqa: BLE001
                    error = e
            group.agree("commit", error, when="while completing the files")
        except BaseException:
            if rank == 0:
                files.cleanup()
            raise
        return {t: tuple(s) for t, (s, _) in files.tensors.items()}

    def _narrows(self, n: str) -> bool:
        return narrows_range(np.float32 if n in self.merged else self.source.dtypes[n], self.out_dtype[n])

    def _pass(self, mode: str, group: Processes, sink: Any = None) -> None:
        """Runs this process's boxes of the parameters through the map into ``sink``:
        ``"check"``, the float16 range of those whose cast narrows; ``"write"``, into the
        files (regions another parameter writes left out); ``"verify"``, the duplicated
        regions into a comparison."""
        names = self.chosen
        if mode == "write" and group.rank == 0:
            names = progress(
                names, "export", unit="tensor", disable=None if self.show_progress is None else not self.show_progress
            )
        for n in names:
            dups = [d for d in self.duplicates if d.param == n]
            if (mode == "check" and not self._narrows(n)) or (mode == "verify" and not dups):
                continue
            expr = self.exprs[n]
            if n in self.merged:  # kernel + a @ b in fp32, cast (and range-checked) as it is written
                expr = lora_.LowRankAdd(expr, *self.merged[n])
            sexpr = storage_expr(expr, self.source.layout(n))
            out = _Cast(
                n, self.out_dtype[n], _Null() if mode == "check" else sink if mode == "write" else _Compare(dups, sink)
            )
            if mode != "check":
                out = _Regions([(d.tensor, d.box) for d in dups], keep=mode == "verify", inner=out)
            for box, values in self.source.chunks(n, PIECE_BYTES):
                group.alive()
                sexpr.write(box, values, out)

    def _verify(self, group: Processes) -> None:
        """Reads back what the writer of each duplicated region wrote and compares this
        process's boxes of the parameter that reads it too."""
        diffs: dict[Duplicate, float] = {}
        with TensorFiles(None, self.files.places) as files:
            self._pass("verify", group, (files, diffs))
        bad = [(d, x) for d, x in diffs.items() if x != 0]
        if bad:
            raise ValueError(
                "; ".join(
                    f"parameters {d.param!r} and {d.writer!r} both read tensor {d.tensor!r}, and they differ by up to "
                    f"{x:.4g}: the export writes the tensor once, from {d.writer!r}, and would drop what {d.param!r} "
                    f"learnt. Tie them in the model (one parameter for both), or export with a map that gives "
                    f"{d.param!r} a tensor of its own instead of {self.exprs[d.param].describe()} (a head read from the "
                    "embedding: transpose('lm_head.weight'))"
                    for d, x in bad
                )
                + "."
            )


class _Null:
    def write_box(self, tensor, box, values):
        pass


class _Cast:
    """Casts (checked: float16's range) what is written of parameter ``name``."""

    def __init__(self, name: str, dtype, inner):
        self.name, self.dtype, self.inner = name, dtype, inner

    def write_box(self, tensor, box, values):
        self.inner.write_box(
            tensor,
            box,
            cast(
                f"parameter {self.name!r}", values, self.dtype, fix="export in bfloat16 (float32's range) or float32."
            ),
        )


class _Regions:
    """Passes on the writes inside (``keep``) or outside the ``(tensor, box)`` regions."""

    def __init__(self, regions: list[tuple[str, boxes.Box]], keep: bool, inner):
        self.regions, self.keep, self.inner = regions, keep, inner

    def write_box(self, tensor, box, values):
        inside = False
        for t, r in self.regions:
            if t == tensor and boxes.intersect(box, r) is not None:
                if boxes.intersect(box, r) != tuple(box):
                    raise AssertionError(f"a write {box} of {tensor!r} straddles the region {r}.")
                inside = True
        if inside == self.keep:
            self.inner.write_box(tensor, box, values)


class _Compare:
    """Records, per duplicated region, the largest difference between what is written to
    it and what the file holds."""

    def __init__(self, dups: list[Duplicate], target):
        self.dups, (self.files, self.diffs) = dups, target

    def write_box(self, tensor, box, values):
        d = next(d for d in self.dups if d.tensor == tensor and boxes.intersect(box, d.box) == tuple(box))
        got = self.files.read_box(tensor, box).astype(np.float64)
        want = np.asarray(values).astype(np.float64)
        both_nan = np.isnan(got) & np.isnan(want)
        diff = np.where(both_nan, 0.0, np.abs(got - want))
        diff = np.where(np.isnan(diff), np.inf, diff)
        self.diffs[d] = max(self.diffs.get(d, 0.0), float(diff.max()) if diff.size else 0.0)
