"""Path-valued config keys: the marker that says a dataclass field holds a path, and how its value resolves.

    run_dir: str = path_field("runs/default")                  # a file or directory
    load_hf: Optional[str] = path_field(None, kind=HUB)          # a directory or an HF hub id
    reward_fn: Optional[str] = path_field(None, kind=IMPORT)     # "file.py:fn" (the file part) or "module:fn"
    tree = resolve_tree_paths(tree, SECTION_CLASSES, base_dir)   # config/load.py, once per file

The rule (docs/running.md#paths-in-a-config): a value written in a config FILE expands ``~`` and resolves relative to the
file's directory; an HF hub id (``Qwen/Qwen3-8B``) is left alone: a ``HUB`` value resolves only when it starts
with ``/ ./ ../ ~`` or names something that exists beside the config file. Command-line overrides resolve
against the current directory (``~`` expanded), as a shell argument would. A file's relative path found only
from the current directory (the old rule) is a problem (``moved_path_errors``), never a silent move.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = ["PATH", "HUB", "IMPORT", "path_field", "path_kind", "resolve_path", "resolve_tree_paths",
           "moved_path_errors"]

PATH = "path"
"""A file or directory (data files, the run directory, ...): always resolved."""
HUB = "hub"
"""A local directory or an HF hub id: resolved only when it looks like a path (``/ ./ ../ ~``) or exists there."""
IMPORT = "import"
"""``"path/to/file.py:name"`` (the file part resolved) or ``"module:name"`` / a built-in name (left alone)."""

_META = "megatron_rl.path_kind"
#: Output directories (``moved_path_errors``): one counts as found from the current directory only when it holds a
#: run's outputs (``RUN_MARKERS``, the first of trainer/run_dir.py's RUN_OUTPUTS); an unrelated directory of that
#: name there (or a transient weight_sync directory) says nothing.
OUTPUT_DIRS = ("trainer.run_dir", "rollout.weight_sync_dir")
RUN_MARKERS = ("metrics.jsonl", "checkpoints")
_PATH_PREFIXES = ("/", "./", "../", "~")


def path_field(default: Any = None, *, kind: str = PATH, **kwargs) -> Any:
    """A dataclass field whose value is a path of ``kind`` (``PATH``, ``HUB`` or ``IMPORT``)."""
    if kind not in (PATH, HUB, IMPORT):
        raise ValueError(f"path_field: unknown kind {kind!r}")
    return dataclasses.field(default=default, metadata={_META: kind}, **kwargs)


def path_kind(f: dataclasses.Field) -> Optional[str]:
    """The path kind a dataclass field was marked with (None: not a path)."""
    return f.metadata.get(_META)


def resolve_path(value: Any, kind: str, base_dir: str) -> Any:
    """``value`` resolved against ``base_dir`` by the rule of ``kind`` (module docstring); a value that is not a
    string (null, a wrong type the type check reports) is returned unchanged."""
    if not isinstance(value, str) or not value:
        return value
    if kind == IMPORT:
        file, sep, name = value.rpartition(":")
        if not sep or not file.endswith(".py"):
            return value  # "module:fn", "math", "copy": import names, not paths
        return f"{resolve_path(file, PATH, base_dir)}:{name}"
    expanded = os.path.expanduser(value)
    joined = os.path.normpath(os.path.join(base_dir, expanded))
    if kind == HUB and not value.startswith(_PATH_PREFIXES) and not os.path.exists(joined):
        return value  # an HF hub id, or a directory that is not beside the config file
    return joined


def _path_values(tree: Any, sections: Mapping[str, type]):
    """(dotted key, kind, value) of every path-marked field set in the nested config dict ``tree`` (a list value
    gives one entry per element)."""
    if not isinstance(tree, dict):
        return
    for where, cls in sections.items():
        node: Any = tree
        for part in where.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        for f in dataclasses.fields(cls):
            kind = path_kind(f)
            if kind is None or f.name not in node:
                continue
            values = node[f.name] if isinstance(node[f.name], list) else [node[f.name]]
            for value in values:
                yield f"{where}.{f.name}", kind, value


def moved_path_errors(tree: Any, sections: Mapping[str, type], base_dir: str, cwd: str,
                      skip: Sequence[str] = ()) -> List[str]:
    """One problem per relative path of the config FILE ``tree`` (unresolved values) that names nothing beside the
    file (``base_dir``) but something from the current directory ``cwd``: a config written when relative paths
    were read from the current directory would otherwise read or write another place without a word. ``skip``:
    dotted keys the command line overrides."""
    errs = []
    for key, kind, value in _path_values(tree, sections):
        if key in skip or kind == HUB or not isinstance(value, str) or not value:
            continue
        part = value.rpartition(":")[0] if kind == IMPORT else value
        if not part or part.startswith(("/", "~")) or (kind == IMPORT and not part.endswith(".py")):
            continue
        beside, here = os.path.normpath(os.path.join(base_dir, part)), os.path.normpath(os.path.join(cwd, part))
        found = (any(os.path.exists(os.path.join(here, m)) for m in RUN_MARKERS) if key in OUTPUT_DIRS
                 else os.path.exists(here))
        if beside != here and not os.path.exists(beside) and found:
            errs.append(f"{key}: {value!r} is read from the config file's directory ({beside}: nothing there), "
                        f"not from the current directory, where {here} exists: write "
                        f"{os.path.relpath(here, base_dir)!r} (relative to the file) or an absolute path "
                        f"(docs/running.md#paths-in-a-config)")
    return errs


def resolve_tree_paths(tree: Any, sections: Mapping[str, type], base_dir: str) -> Any:
    """A copy of the nested config dict ``tree`` with every path-marked field of ``sections`` (dotted section ->
    dataclass) resolved against ``base_dir``; a ``List[str]`` field resolves each element."""
    if not isinstance(tree, dict):
        return tree
    out: Dict[str, Any] = dict(tree)
    for where, cls in sections.items():
        parent, node = None, out
        for part in where.split("."):
            child = node.get(part) if isinstance(node, dict) else None
            if not isinstance(child, dict):
                node = None
                break
            child = dict(child)
            node[part] = child
            parent, node = node, child
        if node is None or parent is None:
            continue
        for f in dataclasses.fields(cls):
            kind = path_kind(f)
            if kind is None or f.name not in node:
                continue
            value = node[f.name]
            if isinstance(value, list):
                node[f.name] = [resolve_path(v, kind, base_dir) for v in value]
            else:
                node[f.name] = resolve_path(value, kind, base_dir)
    return out
