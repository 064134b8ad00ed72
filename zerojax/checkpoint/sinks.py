"""Where an export writes: one ``.safetensors`` file, or Hugging Face's sharded format.

:class:`ExportFiles` lays the files out from the tensors' shapes and dtypes alone (which
tensor goes in which file, at which offset), so that every process can write its own boxes
straight into them. The files are written under hidden ``.NAME.partial`` names and made
visible only once complete:

1. ``begin`` (process 0, after every check passed on every process): removes the earlier
   export in the way (``format="file"``: the file; ``format="hf"``: ``model.safetensors``,
   ``model-*-of-*.safetensors`` of any count, the index, ``.partial`` files of a killed
   export), then writes each file's header and sets its size.
2. Every process writes its boxes (:class:`~zerojax.tensors.safetensors_files.TensorWriter`).
3. ``commit`` (process 0, once every process has written): checks each file's header and
   size, writes ``config.json`` / ``generation_config.json`` where asked, renames the files
   into place, and writes the index last (with several files).

So a folder holds either one complete export or nothing that looks complete: killed after
1, it holds ``.partial`` files and no weights; during 3, some ``model-0000k-of-0000n``
files and no index (which a loader needs to read them), or, for one file, no
``model.safetensors`` yet.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from zerojax.tensors.safetensors_files import INDEX, SHARD, SINGLE, StoredTensor, check_file, header, nbytes

FORMATS = ("file", "hf")
PROBE = ".zerojax-export-probe-{rank}"


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5,000,000,000 bytes (decimal, as Hugging Face counts), ``"512MiB"`` ->
    binary, an int as bytes.

    Example:
      >>> parse_size("5GB"), parse_size("1MiB"), parse_size(1000)
      (5000000000, 1048576, 1000)
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m or isinstance(size, bool):
        raise ValueError(f"max_shard_size must be bytes (an int) or a size like '5GB' / '500MiB', got {size!r}.")
    unit = (m.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    out = int(float(m.group(1)) * scale)
    if out <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}.")
    return out


def natural(name: str):
    """Sort key: ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def plan_files(tensors: dict[str, tuple[tuple[int, ...], np.dtype]], max_bytes: int) -> list[list[str]]:
    """Tensors (in natural name order) into files of at most ``max_bytes`` each (a tensor
    larger than that gets a file of its own), as ``save_pretrained`` does."""
    files, current, size = [], [], 0
    for name in sorted(tensors, key=natural):
        n = nbytes(*tensors[name])
        if current and size + n > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        files.append(current)
    return files


class ExportFiles:
    """The files of one export (see the module docstring).

    Args:
      out: the file (``format="file"``) or folder (``"hf"``).
      tensors: ``{name: (shape, dtype)}``.
      max_bytes: the largest file of the ``"hf"`` format.
      metadata: each file's ``__metadata__``.
      configs: ``{file name: JSON object}`` written beside the weights (``"hf"``).
    """

    def __init__(
        self,
        out: str,
        format: str,
        tensors: dict[str, tuple],
        *,
        max_bytes: int,
        metadata: dict,
        configs: dict[str, dict] | None = None,
    ):
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
        self.format, self.tensors, self.configs = format, tensors, dict(configs or {})
        if format == "file":
            self.folder = os.path.dirname(os.path.abspath(out))
            self.groups, self.names = [sorted(tensors, key=natural)], [os.path.basename(out)]
        else:
            self.folder, self.groups = os.path.abspath(out), plan_files(tensors, max_bytes)
            self.names = (
                [SINGLE]
                if len(self.groups) == 1
                else [f"model-{k + 1:05d}-of-{len(self.groups):05d}.safetensors" for k in range(len(self.groups))]
            )
        self.partial = [os.path.join(self.folder, f".{n}.partial") for n in self.names]
        self.heads, self.places = [], {}
        for path, group in zip(self.partial, self.groups):
            head, offsets = header(group, tensors, metadata)
            self.heads.append(head)
            for name in group:
                shape, dtype = tensors[name]
                self.places[name] = StoredTensor(name, path, np.dtype(dtype), tuple(shape), offsets[name])
        self.sizes = [len(h) + sum(self.places[n].nbytes for n in g) for h, g in zip(self.heads, self.groups)]
        self.weight_map = {t: n for n, g in zip(self.names, self.groups) for t in g}

    def probe(self, rank: int) -> str:
        """Checks that this process can create files in the output folder (creating the
        folder of an ``"hf"`` export); leaves a probe file there for :meth:`sees`."""
        if self.format == "hf":
            if os.path.exists(self.folder) and not os.path.isdir(self.folder):
                raise NotADirectoryError(f"the export folder {self.folder!r} is a file.")
            os.makedirs(self.folder, exist_ok=True)
        elif not os.path.isdir(self.folder):
            raise FileNotFoundError(f"the folder {self.folder!r} for the output file does not exist; create it first.")
        path = os.path.join(self.folder, PROBE.format(rank=rank))
        try:
            with open(path, "wb") as f:
                f.write(b"zerojax export probe\n")
        except OSError as e:
            raise type(e)(
                e.errno,
                f"cannot write in the export folder {self.folder!r} ({e.strerror}); export to a "
                "folder this process may write",
            ) from None
        return path

    def sees(self, rank: int) -> None:
        """Checks that this process sees process 0's probe: one filesystem for the job."""
        if rank and not os.path.exists(os.path.join(self.folder, PROBE.format(rank=0))):
            raise FileNotFoundError(
                f"this process does not see the files process 0 writes in {self.folder!r}: "
                "the export folder must be on a filesystem every process sees."
            )

    def unprobe(self, rank: int) -> None:
        try:
            os.remove(os.path.join(self.folder, PROBE.format(rank=rank)))
        except FileNotFoundError:
            pass

    def stale(self) -> list[str]:
        """The files of an earlier export that :meth:`begin` removes."""
        if self.format == "file":
            out = os.path.join(self.folder, self.names[0])
            return [out] if os.path.lexists(out) else []
        return sorted(
            os.path.join(self.folder, f)
            for f in os.listdir(self.folder)
            if f in (INDEX, SINGLE)
            or SHARD.match(f)
            or f.startswith(PROBE.format(rank=""))
            or (f.startswith(".model") and f.endswith(".safetensors.partial"))
        )

    def begin(self) -> None:
        """Process 0: removes the earlier export, then writes the headers (see the module docstring)."""
        index = os.path.join(self.folder, INDEX)
        stale = self.stale()
        for path in sorted(stale, key=lambda p: p != index):  # the index first: it vouches for the rest
            try:
                os.remove(path)
            except FileNotFoundError:  # (another process's probe, removed by its owner meanwhile)
                pass
        for path, head, size in zip(self.partial, self.heads, self.sizes):
            with open(path, "wb") as f:
                f.write(head)
                f.truncate(size)

    def commit(self) -> None:
        """Process 0, every process's boxes written: checks, configs, renames, index."""
        for path, group in zip(self.partial, self.groups):
            check_file(path, group, self.tensors)
        for name, doc in self.configs.items():
            write_json(os.path.join(self.folder, name), doc)
        for path, name in zip(self.partial, self.names):
            os.replace(path, os.path.join(self.folder, name))
        if self.format == "hf" and len(self.names) > 1:
            total = sum(t.nbytes for t in self.places.values())
            write_json(
                os.path.join(self.folder, INDEX),
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.weight_map.items()))},
            )

    def cleanup(self) -> None:
        """Process 0, after a failure: removes the partial files."""
        for path in self.partial:
            if os.path.exists(path):
                os.remove(path)


def write_json(path: str, doc: dict) -> None:
    """``doc`` as JSON at ``path``, atomically (a temporary file, synced, renamed)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
