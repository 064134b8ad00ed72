"""The weight map: which checkpoint tensors each of a model's parameters is made of.

A :class:`WeightMap` says, for each parameter (by its dotted name, as
:func:`zerojax.tensors.names.tensor_names` gives it), how it is made of checkpoint tensors:

    >>> from zerojax.maps import WeightMap, stack, transpose
    >>> llama_like = WeightMap({
    ...     "embed.embedding": "model.embed_tokens.weight",                       # as stored
    ...     "blocks.q.kernel": stack(transpose("model.layers.{i}.self_attn.q_proj.weight")),
    ...     "head.kernel": transpose("lm_head.weight"),                           # torch [out, in]
    ... })

A string is a tensor; the specs around it (:mod:`zerojax.tensors.specs`) compose. A key may
carry ``{name}`` fields (``"layers_{i}.q.kernel"``) that its spec's names use too.

:func:`resolve` builds each parameter's expression (:mod:`zerojax.tensors.expressions`)
against a checkpoint's tensors and collects what does not fit; :func:`infer_tensors` builds
them against the shapes the parameters imply, for an export, where no checkpoint says them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from zerojax.tensors.expressions import Expr
from zerojax.tensors.specs import MissingTensor, Name, Recorded, Shapes, Spec, as_spec


def _key_pattern(key: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", key)
    rx = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts))
    return re.compile(rx + r"\Z")


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """Parameters (dotted names; keys may hold ``{field}`` parts) -> specs of tensors.

    Attributes:
      entries: ``(parameter name, spec)`` pairs (a mapping is accepted).
      ignore: ``fnmatch`` patterns of checkpoint tensors no parameter reads (they are
        otherwise refused as extra).
      identity: parameters with no entry are the tensor of their own name (zerojax's own
        export format).
      hf_config: the source checkpoint's ``config.json`` (a dict), or None. An export with
        ``format="hf"`` writes it beside the weights, its dtype updated (see
        :func:`zerojax.export_weights`); it plays no part in mapping (maps compare, hash and
        print without it).
      generation_config: the source's ``generation_config.json`` (a dict), or None; written
        beside ``config.json``.
    """

    entries: Any = ()
    ignore: tuple[str, ...] = ()
    identity: bool = False
    hf_config: dict | None = dataclasses.field(default=None, compare=False, repr=False)
    generation_config: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        entries = tuple(self.entries.items()) if isinstance(self.entries, Mapping) else tuple(self.entries)
        for k, _ in entries:
            if not isinstance(k, str):
                raise TypeError(f"WeightMap keys are parameter names (str), got {k!r}.")
        object.__setattr__(self, "entries", tuple((k, as_spec(s)) for k, s in entries))
        ignore = (self.ignore,) if isinstance(self.ignore, str) else tuple(self.ignore)
        object.__setattr__(self, "ignore", ignore)
        for field in ("hf_config", "generation_config"):
            object.__setattr__(self, field, json_object(getattr(self, field), f"WeightMap.{field}"))

    def spec_for(self, name: str) -> tuple[Spec, dict] | None:
        for key, spec in self.entries:
            m = _key_pattern(key).match(name)
            if m:
                return spec, {k: int(v) for k, v in m.groupdict().items()}
        return (Name(name.replace("{", "{{").replace("}", "}}")), {}) if self.identity else None

    def ignored(self, tensor: str) -> bool:
        return any(fnmatch.fnmatchcase(tensor, p) for p in self.ignore)


def json_object(value: Any, what: str) -> dict | None:
    """A private copy of a JSON object (a config), or None; refuses anything else."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} is a config as a dict (the JSON object of config.json), got {type(value).__name__}.")
    try:
        return json.loads(json.dumps(dict(value)))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON (as config.json is): {e}.") from None


IDENTITY = WeightMap(identity=True)


@dataclasses.dataclass
class Resolution:
    """Each parameter's expression, and what does not fit."""

    exprs: dict[str, Expr]
    unmapped: list[str]
    missing: dict[str, list[str]]  # parameter -> tensors it needs that the checkpoint lacks
    misshapen: list[str]
    extra: list[str]
    errors: list[str]
    present: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # ... and those it has

    def absent(self, optional: Callable[[str], bool] = lambda name: False) -> list[str]:
        """The parameters ``optional`` accepts that the map does not name or the checkpoint
        lacks entirely: they are taken from elsewhere (an init function, given values)."""
        return [n for n in self.unmapped if optional(n)] + [
            n for n in self.missing if optional(n) and not self.present.get(n)
        ]

    def problems(self, optional: Callable[[str], bool] = lambda name: False) -> list[str]:
        out = []
        unmapped = [n for n in self.unmapped if not optional(n)]
        if unmapped:
            out.append(f"parameters the map does not name ({len(unmapped)}): {_short(unmapped)}")
        missing = sorted({t for n, ts in self.missing.items() if not optional(n) for t in ts})
        if missing:
            params = [n for n in self.missing if not optional(n)]
            out.append(
                f"missing from the checkpoint ({len(missing)}): {_short(missing)} (read by {_short(params, 10)})"
            )
        partial = [
            f"{n} (has {_short(self.present[n], 3)}; lacks {_short(self.missing[n], 3)})"
            for n in self.missing
            if optional(n) and self.present.get(n)
        ]
        if partial:
            out.append(
                f"optional parameters partly in the checkpoint, neither loadable nor to initialise "
                f"({len(partial)}): {'; '.join(partial)}"
            )
        if self.extra:
            out.append(f"in the checkpoint but read by no parameter ({len(self.extra)}): {_short(self.extra)}")
        if self.misshapen:
            out.append(f"shapes differ ({len(self.misshapen)}): {'; '.join(self.misshapen)}")
        return out + self.errors


def _short(names: list[str], n: int = 40) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def resolve(wmap: WeightMap, params: dict[str, tuple[int, ...]], tensors: dict[str, tuple]) -> Resolution:
    """Builds each parameter's expression against the checkpoint's ``tensors`` (``{name:
    (shape, dtype)}``) and collects every unmapped parameter, missing, extra and
    mis-shaped tensor."""
    shapes = Shapes(lambda name: tensors[name])
    res = Resolution({}, [], {}, [], [], [])
    used: set[str] = set()
    for name, shape in params.items():
        found = wmap.spec_for(name)
        if found is None:
            res.unmapped.append(name)
            continue
        spec, env = found
        try:
            expr = spec.build(tuple(shape), env, shapes)
        except MissingTensor:
            wanted = _named(spec, tuple(shape), env)
            res.missing[name] = sorted(n for n in wanted if n not in tensors)
            res.present[name] = sorted(n for n in wanted if n in tensors)
            continue
        except ValueError as e:
            res.errors.append(f"{name}: {e}")
            used.update(_named(spec, tuple(shape), env))  # reported here, not again as extra
            continue
        used.update(t.name for t in expr.tensors())
        if tuple(expr.shape) != tuple(shape):
            res.misshapen.append(f"{name} {list(shape)} in the model, {list(expr.shape)} from {expr.describe()}")
            continue
        res.exprs[name] = expr
    # A tensor a parameter with missing ones names is reported with it, not as extra.
    named = {t for ts in res.present.values() for t in ts}
    res.extra = sorted(t for t in tensors if t not in used and t not in named and not wmap.ignored(t))
    return res


def _named(spec: Spec, shape, env) -> set[str]:
    """Every tensor ``spec`` names for a parameter of ``shape`` (present or not)."""
    recorded = Recorded(unknown=0)
    try:
        spec.build(shape, env, recorded)
    except ValueError:
        pass
    return set(recorded.shapes)


def infer_tensors(wmap: WeightMap, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The tensors an export writes and their shapes, from the parameters' shapes: each
    spec built against :class:`~zerojax.tensors.specs.Recorded` shapes. A fused tensor only
    :func:`~zerojax.tensors.specs.part` reads is as long as its parts reach."""
    recorded = Recorded()
    for name, shape in params.items():
        found = wmap.spec_for(name)
        if found is None:
            raise ValueError(f"the map names no tensor for parameter {name!r}; add an entry for it.")
        spec, env = found
        spec.build(tuple(shape), env, recorded)
    return recorded.exact()
