"""Check that megatron_rl's imports point down: print back-up imports, import loops and imports inside functions.

Reads every module of ``megatron_rl/`` with the AST (nothing is imported or run). ``LAYERS`` below is the
declared order of the packages, lowest first (docs/architecture.md explains each layer); a package may import
its own layer and the layers below it. A "back-up import" is one module importing a module of a higher layer;
a "loop" is a set of modules that import each other, counting imports made inside functions too (an import
moved into a function hides a loop, it does not remove it). ``if TYPE_CHECKING:`` imports never run and are
not counted. ``from pkg import name`` where ``pkg/__init__.py`` only re-exports ``name`` counts as an import of
the submodule that defines it.

    python tools/import_layers.py                   # summary + every back-up import and loop; exit 1 on a loop
    python tools/import_layers.py --in-function     # also list every import of megatron_rl inside a function
    python tools/import_layers.py --max-back-up 5   # exit 1 also when more than 5 package pairs import back up
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_rl"

#: the layers, lowest first: each entry names the top-level packages / modules of megatron_rl on that layer
LAYERS: List[Tuple[str, ...]] = [
    ("numerics", "braces", "jsonl", "imports", "tokenizer", "worker_pipes", "lifeline", "platform", "algo",
     "errors"),                                   # errors shared by the engines and weight sync
    ("parallel", "logprobs"),                    # layouts and process groups; vocab-parallel log-probs
    ("models", "losses", "correction"),          # model build; the loss and correction math
    ("convert", "tasks", "lora"),                # HF <-> Megatron weights and checkpoints; prompts and rewards; LoRA
    ("config",),                                 # the job's YAML as typed sections
    ("actor",),                                  # the Megatron actor: log-probs, train step, checkpoints
    ("weight_sync",),                            # trainer -> engine weight transfer
    ("rollout", "envs"),                         # rollout engines; multi-turn environments
    ("ops", "plan"),                             # memory plan, run report, config reference; the job plan
    ("trainer",),                                # the RL loop
    ("cli", "score", "train"),                   # entry points
    ("testing",),                                # test helpers shipped with the package
]


def _layer_of() -> Dict[str, int]:
    return {name: i for i, names in enumerate(LAYERS) for name in names}


class Module:
    """One parsed file of the package."""

    def __init__(self, name: str, path: str, is_package: bool):
        self.name, self.path, self.is_package = name, path, is_package
        with open(path, encoding="utf-8") as fh:
            self.tree = ast.parse(fh.read(), path)
        self.reexports: Dict[str, str] = {}
        """name -> the module it is imported from at module level (only read for ``__init__`` files)."""


def discover(root: str = ROOT) -> Dict[str, Module]:
    """Every module of the package by dotted name."""
    mods = {}
    base = os.path.join(root, PACKAGE)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), root)[:-3].split(os.sep)
            is_package = rel[-1] == "__init__"
            name = ".".join(rel[:-1] if is_package else rel)
            mods[name] = Module(name, os.path.join(dirpath, fn), is_package)
    return mods


def _absolute(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.name.split(".")
    base = parts if mod.is_package else parts[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(mod: Module):
    """(node, in_function) for every import statement of the module, outside ``if TYPE_CHECKING:`` blocks."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    yield from walk_one(sub, in_function)
                continue
            yield from walk_one(child, in_function)

    def walk_one(child, in_function):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from walk(child, inner)

    yield from walk(mod.tree, False)


def _targets(mods: Dict[str, Module], mod: Module, node) -> List[str]:
    """The package modules an import statement loads (re-exports of a package's ``__init__`` followed)."""
    out = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name:
                out.append(name)
        return out
    src = _absolute(mod, node)
    if src not in mods:
        return out
    for alias in node.names:
        full = f"{src}.{alias.name}"
        if full in mods:
            out.append(full)
        else:
            out.append(_follow(mods, src, alias.name))
    return out


def _follow(mods: Dict[str, Module], src: str, name: str, depth: int = 0) -> str:
    m = mods[src]
    if m.is_package and name in m.reexports and depth < 8:
        nxt = m.reexports[name]
        return _follow(mods, nxt, name, depth + 1) if nxt in mods else src
    return src


def _collect_reexports(mods: Dict[str, Module]) -> None:
    for m in mods.values():
        if not m.is_package:
            continue
        for node in m.tree.body:
            if isinstance(node, ast.ImportFrom):
                src = _absolute(m, node)
                for alias in node.names:
                    if src in mods and f"{src}.{alias.name}" not in mods:
                        m.reexports[alias.asname or alias.name] = src


def graph(mods: Dict[str, Module]):
    """edges[(a, b)] = [(line, in_function), ...] for every import of module b by module a (a != b)."""
    _collect_reexports(mods)
    edges: Dict[Tuple[str, str], List[Tuple[int, bool]]] = defaultdict(list)
    for m in mods.values():
        for node, in_function in _imports(m):
            for t in _targets(mods, m, node):
                if t != m.name and not m.name.startswith(t + "."):  # a package's own __init__ is no edge
                    edges[(m.name, t)].append((node.lineno, in_function))
    return edges


def loops(nodes: List[str], edges) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    succ = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        work = [(v, iter(sorted(succ[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ[w]))))
                    advanced = True
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(out)


def layer(module: str, layers: Dict[str, int]) -> Optional[int]:
    """The layer of a module (by its top-level name under the package); None for the package's own __init__."""
    parts = module.split(".")
    return layers.get(parts[1]) if len(parts) > 1 else None


def back_up_imports(edges, layers: Dict[str, int]) -> List[Tuple[str, str, int]]:
    """(importer, imported, first line) for every import of a higher layer's module."""
    out = []
    for (a, b), sites in sorted(edges.items()):
        la, lb = layer(a, layers), layer(b, layers)
        if la is not None and lb is not None and la < lb:
            out.append((a, b, min(s[0] for s in sites)))
    return out


def _top(module: str) -> str:
    return module.split(".")[1]


def unplaced(mods: Dict[str, Module], layers: Dict[str, int]) -> List[str]:
    """Top-level packages / modules of the package that LAYERS does not name."""
    tops = {m.split(".")[1] for m in mods if m.count(".") >= 1}
    return sorted(tops - set(layers))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=ROOT, help="repository root (default: this checkout)")
    p.add_argument("--in-function", action="store_true", help="list every package import made inside a function")
    p.add_argument("--max-back-up", type=int, default=None, help="fail when more back-up imports remain")
    args = p.parse_args(argv)

    mods = discover(args.root)
    edges = graph(mods)
    layers = _layer_of()
    missing = unplaced(mods, layers)
    circles = loops(list(mods), edges)
    back = back_up_imports(edges, layers)
    inner = sorted({(mods[a].path, line) for (a, b), sites in edges.items() for line, f in sites if f})

    pairs = sorted({(_top(a), _top(b)) for a, b, _ in back})
    print(f"{len(mods)} modules, {len(edges)} module imports; {len(pairs)} back-up imports between packages "
          f"({len(back)} between modules); {len(circles)} loops; {len(inner)} imports of the package inside "
          f"functions")
    for pa, pb in pairs:
        print(f"back-up import: {pa} (layer {layers[pa]}) -> {pb} (layer {layers[pb]})")
        for a, b, line in back:
            if (_top(a), _top(b)) == (pa, pb):
                print(f"  {a} -> {b} (line {line})")
    for comp in circles:
        ties = [f"{a} -> {b} (line {edges[(a, b)][0][0]})" for a in comp for b in comp if (a, b) in edges]
        print(f"loop: {', '.join(comp)}\n  " + "\n  ".join(ties))
    if args.in_function:
        for path, line in inner:
            print(f"in function: {os.path.relpath(path, args.root)}:{line}")
    for name in missing:
        print(f"not placed in LAYERS: {PACKAGE}.{name}")
    failed = bool(circles) or bool(missing) or (args.max_back_up is not None and len(pairs) > args.max_back_up)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
