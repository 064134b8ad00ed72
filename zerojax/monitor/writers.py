"""Where a run's records go: the terminal, JSON lines, CSV, TensorBoard, Weights & Biases.

A writer takes records ``write(kind, step, values)`` (``kind`` ``"train"``, ``"eval"`` or
``"compile"``; ``values`` plain floats), one-off notices ``note(text)`` and ``close()``.
:class:`~zerojax.monitor.Monitor` calls them on process 0 only.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from typing import Any, TextIO

__all__ = ["CSV", "JSONL", "Console", "History", "ProgressBar", "TensorBoard", "WandB", "Writer"]


class Writer:
    """The writer protocol; the base class ignores notices and has nothing to close."""

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def note(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}.")
    return v


def _si(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


# Console columns: (metric, label, format)
_COLUMNS = (
    ("loss", "loss", lambda v: f"{v:.4f}"),
    ("eval_loss", "eval loss", lambda v: f"{v:.4f}"),
    ("learning_rate", "lr", lambda v: f"{v:.3e}"),
    ("grad_norm", "grad", lambda v: f"{v:.3g}"),
    ("loss_scale", "scale", lambda v: f"{v:g}"),
    ("skipped_steps", "skipped", lambda v: f"{int(v)}"),
    ("step_time_s", "", lambda v: f"{v * 1e3:.1f} ms/step"),
    ("tokens_per_s", "", lambda v: f"{_si(v)} tok/s"),
    ("samples_per_s", "", lambda v: f"{_si(v)} samples/s"),
    ("mfu", "MFU", lambda v: f"{100 * v:.1f}%"),
    ("memory_in_use_bytes", "mem", lambda v: f"{v / 2**30:.2f} GiB"),
    ("memory_peak_bytes", "peak", lambda v: f"{v / 2**30:.2f} GiB"),
)


class Console(Writer):
    """One line every ``every`` train steps (and the first), every eval record, the
    compile time and each notice, on ``stream`` (default: stdout, flushed).

    Example:
      >>> import io
      >>> from zerojax.monitor import Console
      >>> out = io.StringIO()
      >>> c = Console(every=2, stream=out)
      >>> for k in (1, 2, 3):
      ...     c.write("train", k, {"loss": 2.5 - k / 10, "step_time_s": 0.0123})
      >>> print(out.getvalue().strip())
      step 1 | loss 2.4000 | 12.3 ms/step
      step 2 | loss 2.3000 | 12.3 ms/step
    """

    def __init__(self, every: int = 10, stream: TextIO | None = None) -> None:
        self.every = _positive_int("Console every", every)
        self._stream = stream

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        if kind == "compile":
            self._print(f"step {step}: compiled in {values['compile_s']:.1f} s")
            return
        if kind == "train" and step != 1 and step % self.every:
            return
        parts = [f"step {step}" if kind == "train" else f"{kind} at step {step}"]
        shown = set()
        for key, label, fmt in _COLUMNS:
            if key in values:
                parts.append(f"{label} {fmt(values[key])}".strip())
                shown.add(key)
        parts += [f"{k} {v:.4g}" for k, v in values.items() if k not in shown and not k.startswith("memory_")]
        self._print(" | ".join(parts))

    def note(self, text: str) -> None:
        self._print(text)


class ProgressBar(Writer):
    """A tqdm bar of ``total`` steps on stderr, with the loss, tokens/s and ms/step beside
    it; notices print above it. ``disable=None``: shown on a terminal only, not in CI
    (:func:`zerojax.progress.quiet`); ``False``: always.

    Example:
      >>> from zerojax.monitor import ProgressBar
      >>> bar = ProgressBar(total=2)  # hidden here: stderr is no terminal
      >>> bar.write("train", 1, {"loss": 2.0}); bar.close()
    """

    def __init__(self, total: int | None = None, disable: bool | None = None) -> None:
        from zerojax.progress import bar

        self._bar = bar(total, "train", unit="step", disable=disable)

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        if kind != "train":
            return
        shown = {"loss": f"{values['loss']:.4f}"} if "loss" in values else {}
        if "tokens_per_s" in values:
            shown["tok/s"] = _si(values["tokens_per_s"])
        if "step_time_s" in values:
            shown["ms/step"] = f"{values['step_time_s'] * 1e3:.1f}"
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(step - self._bar.n)

    def note(self, text: str) -> None:
        self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()


class History(Writer):
    """Keeps the records in memory: ``records`` is a list of ``{"kind", "step", ...values}``,
    and :meth:`values` one metric's values over a kind's records (to plot or summarise).

    Example:
      >>> from zerojax.monitor import History
      >>> h = History()
      >>> h.write("train", 1, {"loss": 2.0}); h.write("train", 2, {"loss": 1.5})
      >>> h.values("loss")
      [2.0, 1.5]
    """

    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.records.append({"kind": kind, "step": step, **values})

    def values(self, metric: str, kind: str = "train") -> list[float]:
        return [r[metric] for r in self.records if r["kind"] == kind and metric in r]


class JSONL(Writer):
    """One JSON object per record and line: ``{"kind", "step", ...values}``; flushed per
    line, so a killed run keeps every record written. ``append``: continue the file (a
    resumed run); ``makedirs``: create its folder.

    Example:
      >>> import json, os, tempfile
      >>> from zerojax.monitor import JSONL
      >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
      >>> w = JSONL(path); w.write("train", 1, {"loss": 2.0}); w.close()
      >>> json.loads(open(path).read())
      {'kind': 'train', 'step': 1, 'loss': 2.0}
    """

    def __init__(self, path: str | os.PathLike, append: bool = False, makedirs: bool = False) -> None:
        self.path = os.fspath(path)
        _parent(self.path, makedirs)
        self._file = open(self.path, "a" if append else "w")

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        self._file.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class CSV(Writer):
    """A CSV of the records: columns ``kind, step`` and every metric seen so far. A record
    with a metric the header lacks rewrites the file with the wider header (earlier rows
    get empty cells), so no value is ever dropped. ``makedirs``: create the file's folder.

    Example:
      >>> import csv, os, tempfile
      >>> from zerojax.monitor import CSV
      >>> path = os.path.join(tempfile.mkdtemp(), "run.csv")
      >>> w = CSV(path)
      >>> w.write("train", 1, {"loss": 2.0}); w.write("eval", 1, {"eval_loss": 2.5}); w.close()
      >>> [dict(r) for r in csv.DictReader(open(path))]
      [{'kind': 'train', 'step': '1', 'loss': '2.0', 'eval_loss': ''}, {'kind': 'eval', 'step': '1', 'loss': '', 'eval_loss': '2.5'}]
    """

    def __init__(self, path: str | os.PathLike, makedirs: bool = False) -> None:
        self.path = os.fspath(path)
        _parent(self.path, makedirs)
        self._columns: list[str] = ["kind", "step"]
        self._rows: list[dict] = []
        self._file = open(self.path, "w", newline="")
        self._writer = csv.DictWriter(self._file, self._columns)
        self._writer.writeheader()

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        row = {"kind": kind, "step": step, **values}
        self._rows.append(row)
        new = [k for k in row if k not in self._columns]
        if new:
            self._columns += new
            self._file.close()
            self._file = open(self.path, "w", newline="")
            self._writer = csv.DictWriter(self._file, self._columns)
            self._writer.writeheader()
            self._writer.writerows(self._rows)
        else:
            self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoard(Writer):
    """TensorBoard scalars ``"{kind}/{metric}"`` at the record's step, through
    ``tensorboardX`` (``pip install 'zerojax[monitor]'``); event files under ``logdir``."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "zj.monitor.TensorBoard writes through tensorboardX: pip install 'zerojax[monitor]' "
                "(or pip install tensorboardX)."
            ) from e
        self.logdir = os.fspath(logdir)
        self._writer = SummaryWriter(self.logdir)

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self._writer.add_scalar(f"{kind}/{k}", v, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB(Writer):
    """Weights & Biases: each record is one ``wandb.log({"{kind}/{metric}": value},
    step=step)``; ``init`` keywords go to ``wandb.init`` (``project``, ``name``,
    ``mode="offline"``, ...). Needs ``wandb`` installed (``pip install wandb``)."""

    def __init__(self, **init: Any) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("zj.monitor.WandB writes through wandb: pip install wandb.") from e
        self._wandb = wandb
        self._run = wandb.init(**init)

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        self._run.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def note(self, text: str) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


def _parent(path: str, makedirs: bool) -> None:
    """The file's folder exists, or is made with ``makedirs`` (a typo'd path is refused by
    default rather than writing the metrics somewhere unexpected)."""
    parent = os.path.dirname(os.path.abspath(path))
    if makedirs:
        os.makedirs(parent, exist_ok=True)
    elif not os.path.isdir(parent):
        raise FileNotFoundError(
            f"no directory {parent!r} for the metrics file {path!r}: create it first (or pass makedirs=True)."
        )
