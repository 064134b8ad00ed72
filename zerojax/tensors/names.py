"""Tensor names for parameter paths: the dotted names exports write and loads match.

A parameter's path is ``jax.tree_util.keystr`` of its key path (``['blocks']['linear']
['kernel'].value``); its tensor name is the keys joined by dots without a trailing
``.value`` attribute (a flax.nnx Variable's value): ``blocks.linear.kernel``.
"""

from __future__ import annotations

import re

# One key of a ``jax.tree_util.keystr`` path: a dict key (``['w']``, the repr of a str), another
# key or sequence index (``[0]``), or an attribute (``.value``).
_KEY = re.compile(r"""\[(?P<q>['"])(?P<str>.*?)(?P=q)\]|\[(?P<other>[^\]]*)\]|\.(?P<attr>[A-Za-z_]\w*)""")


def path_keys(path: str) -> list[tuple[str, str]]:
    """A ``keystr`` path as ``(kind, name)`` keys, kind ``"key"`` (dict key or index) or
    ``"attr"`` (attribute); raises on a path it cannot read.

    Example:
      >>> path_keys("['blocks'][0].value")
      [('key', 'blocks'), ('key', '0'), ('attr', 'value')]
    """
    keys, pos = [], 0
    for m in _KEY.finditer(path):
        if m.start() != pos:
            break
        pos = m.end()
        if m.group("attr") is not None:
            keys.append(("attr", m.group("attr")))
        else:
            keys.append(("key", m.group("str") if m.group("q") else m.group("other")))
    if pos != len(path):
        raise ValueError(f"cannot read the parameter path {path!r} (at character {pos}).")
    return keys


def leaf_name(path: str) -> str:
    """``"['layers']['w']"`` / ``"['blocks']['linear']['kernel'].value"`` -> ``"layers.w"`` /
    ``"blocks.linear.kernel"``: the keys joined by dots, without a trailing ``.value``
    attribute (a flax.nnx Variable's value). A dict key named ``"value"`` stays:
    ``"['attn']['value']"`` -> ``"attn.value"``.

    Example:
      >>> leaf_name("['blocks']['linear']['kernel'].value"), leaf_name("['attn']['value']")
      ('blocks.linear.kernel', 'attn.value')
    """
    if path == "<root>":  # a single array as the whole parameter tree
        return path
    keys = path_keys(path)
    if keys and keys[-1] == ("attr", "value"):
        keys = keys[:-1]
    return ".".join(name for _, name in keys)


def tensor_names(paths: list[str]) -> list[str]:
    """Dotted names for parameter paths; raises when two paths map to the same name."""
    names, seen = [], {}
    for path in paths:
        name = leaf_name(path)
        if name in seen:
            raise ValueError(
                f"parameter paths {seen[name]} and {path} both become the tensor name {name!r} in "
                "a safetensors file; rename one of them (e.g. avoid '.' inside dict keys)."
            )
        seen[name] = path
        names.append(name)
    return names
