"""Resolve Hydra / OmegaConf ``${...}`` interpolations inside one YAML tree (what verl's configs use).

    tree, unresolved = resolve_interpolations(yaml_tree)
    # unresolved: {"trainer.default_local_dir": "${oc.env:HOME} uses resolver 'oc.env', ..."}

Handled, as OmegaConf evaluates them: ``${a.b.c}`` (absolute), ``${.x}`` / ``${..x}`` (relative to the node that
holds the value), ``${oc.select:a.b.c,default}`` (the value at ``a.b.c`` when the file has it, else ``default``
read as YAML, else null), references to whole sub-trees, references to other interpolations, and interpolations
inside a longer string (``checkpoints/${trainer.project_name}``). Anything else -- another resolver
(``oc.env``, ``oc.eval``), a reference to a key the file does not have, a cycle -- is left as written and
reported with the key that holds it. Hydra's ``???`` (a mandatory value not given) is reported the same way.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import yaml

from megatron_rl.braces import closing_brace

_MISSING = object()


class Unresolved(Exception):
    """An interpolation this module cannot evaluate (the message says why)."""


def _spans(text: str) -> List[Tuple[int, int]]:
    """(start, end) of each top-level ``${...}`` in ``text`` (braces inside, e.g. a ``{}`` default, nest)."""
    out, i = [], 0
    while True:
        start = text.find("${", i)
        if start < 0:
            return out
        j = closing_brace(text, start + 1)
        if j < 0:
            raise Unresolved(f"{text!r}: unbalanced braces")
        out.append((start, j + 1))
        i = j + 1


def _lookup(root: Any, parts: List[str]) -> Any:
    node = root
    for p in parts:
        if not isinstance(node, dict) or p not in node:
            return _MISSING
        node = node[p]
    return node


class _Resolver:
    def __init__(self, root: Dict[str, Any]):
        self.root = root
        self.active: List[str] = []

    def value(self, v: Any, where: List[str]) -> Any:
        """``v`` (held at path ``where``) with every interpolation evaluated; raises Unresolved."""
        if isinstance(v, dict):
            return {k: self.value(x, where + [str(k)]) for k, x in v.items()}
        if isinstance(v, list):
            return [self.value(x, where + [str(i)]) for i, x in enumerate(v)]
        if not isinstance(v, str) or "${" not in v:
            return v
        spans = _spans(v)
        if len(spans) == 1 and spans[0] == (0, len(v)):
            return self.expr(v[2:-1], where)
        out, last = [], 0
        for s, e in spans:
            out.append(v[last:s])
            got = self.expr(v[s + 2:e - 1], where)
            out.append("null" if got is None else str(got))
            last = e
        return "".join(out) + v[last:]

    def expr(self, body: str, where: List[str]) -> Any:
        body = body.strip()
        if ":" in body.split(",", 1)[0] and not body.startswith("oc.select:"):
            raise Unresolved(f"${{{body}}} uses resolver {body.split(':', 1)[0]!r}, which is evaluated when verl "
                             f"runs, not in the file")
        default: Any = _MISSING
        if body.startswith("oc.select:"):
            ref, sep, raw = body[len("oc.select:"):].partition(",")
            if sep:
                try:
                    default = yaml.safe_load(raw.strip()) if raw.strip() else None
                except yaml.YAMLError as exc:
                    raise Unresolved(f"${{{body}}}: cannot read its default {raw.strip()!r}: {exc}") from None
            else:
                default = None
        else:
            ref = body
        ref = ref.strip()
        parts = self._path(ref, where)
        key = ".".join(parts)
        found = _lookup(self.root, parts)
        if found is _MISSING or found == "???":
            if default is not _MISSING:
                return self.value(default, where[:-1] + ["<default>"])
            raise Unresolved(f"${{{body}}} refers to {key}, which the file does not set")
        if key in self.active:
            raise Unresolved(f"${{{body}}}: a cycle through {key}")
        self.active.append(key)
        try:
            return self.value(found, parts)
        finally:
            self.active.pop()

    @staticmethod
    def _path(ref: str, where: List[str]) -> List[str]:
        if not ref.startswith("."):
            return [p for p in ref.split(".") if p]
        dots = len(ref) - len(ref.lstrip("."))
        base = where[:-1]  # the node that holds the value
        base = base[:len(base) - (dots - 1)] if dots > 1 else base
        return base + [p for p in ref[dots:].split(".") if p]


def resolve_interpolations(tree: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """(tree with every resolvable interpolation replaced by its value, {dotted key: why it was left as written}
    for the rest, including Hydra's mandatory ``???``)."""
    r = _Resolver(tree)
    unresolved: Dict[str, str] = {}

    def walk(node: Any, where: List[str]) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, where + [str(k)]) for k, v in node.items()}
        key = ".".join(where)
        if node == "???":
            unresolved[key] = "??? (a value verl requires and the file does not give)"
            return node
        try:
            return r.value(node, where)
        except Unresolved as exc:
            unresolved[key] = str(exc)
            return node

    return walk(tree, []), unresolved


def lookup(tree: Dict[str, Any], dotted: str, default: Optional[Any] = None) -> Any:
    """The value at ``dotted`` in nested ``tree`` (``default`` when a level is missing)."""
    found = _lookup(tree, dotted.split("."))
    return default if found is _MISSING else found
