"""The weight sync sits below the engines: nothing in ``megatron_rl/weight_sync/`` imports an engine (or the
trainer or the job config), and an engine imports from ``weight_sync/`` only its endpoint contract, the version
tags, its receiver end, the layouts and the server-side loader's flags (docs/weight_sync.md, "Below the engines").
Read from the modules' own import statements."""
import ast
import pathlib

import megatron_rl

ROOT = pathlib.Path(megatron_rl.__file__).parent
ENGINE_SIDE = ("megatron_rl.weight_sync.endpoint", "megatron_rl.weight_sync.versions",
               "megatron_rl.weight_sync.receivers.", "megatron_rl.weight_sync.layout",
               "megatron_rl.weight_sync.server_loader")


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_weight_sync_imports_no_engine_trainer_or_job_config():
    bad = [(str(p.relative_to(ROOT)), m) for p in (ROOT / "weight_sync").rglob("*.py") for m in _imports(p)
           if m.startswith(("megatron_rl.rollout", "megatron_rl.trainer", "megatron_rl.config"))]
    assert bad == []


def test_engines_import_only_the_engine_side_of_the_weight_sync():
    bad = [(str(p.relative_to(ROOT)), m) for p in (ROOT / "rollout").rglob("*.py") for m in _imports(p)
           if m.startswith("megatron_rl.weight_sync") and not m.startswith(ENGINE_SIDE)]
    assert bad == []
