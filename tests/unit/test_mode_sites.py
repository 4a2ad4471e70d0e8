"""Each choice of a job is built once, by the job plan: no trainer module builds a routing-replay mode or a
response budget from the config itself (issue 47's "one site" target; ``replay_of`` / ``budget_of`` are for
tools and tests without a job's plan). Read from the AST, nothing is imported."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILDERS = {"replay_of", "budget_of", "replay_mode", "_replay", "_budget", "dynamic_sampling_of", "_dynamic_sampling"}


def _nodes(path: str):
    with open(path, encoding="utf-8") as fh:
        return list(ast.walk(ast.parse(fh.read(), path)))


def _scan(package: str, found_in, skip_testing: bool = False):
    """Every ``found_in(path)`` hit of the modules under ``megatron_rl/<package>``."""
    found = []
    for dirpath, _dirs, files in os.walk(os.path.join(ROOT, "megatron_rl", package)):
        if skip_testing and os.sep + "testing" in dirpath:
            continue
        found += [hit for fn in files if fn.endswith(".py") for hit in found_in(os.path.join(dirpath, fn))]
    return found


def _calls(path: str):
    for node in _nodes(path):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            if name in BUILDERS or (owner == "ResponseBudget" and name == "of"):
                yield f"{os.path.relpath(path, ROOT)}:{node.lineno} {ast.unparse(f)}"


def test_no_trainer_module_builds_the_replay_mode_or_the_budget():
    found = _scan("trainer", _calls)
    assert not found, f"the trainer builds a choice the job plan builds (take the plan's object): {found}"


def _enable_reads(path: str):
    for node in _nodes(path):
        if isinstance(node, ast.Attribute) and node.attr == "enable" and "filter_groups" in ast.unparse(node.value):
            yield f"{os.path.relpath(path, ROOT)}:{node.lineno}"


def test_no_trainer_module_decides_dynamic_sampling_again():
    # the plan decides (plan.dynamic_sampling: the section when enabled, else None); the trainer wraps on that
    found = _scan("trainer", _enable_reads)
    assert not found, f"the trainer reads algorithm.filter_groups.enable (take plan.dynamic_sampling): {found}"


def test_the_scan_sees_a_fallback(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f(cfg, replay=None, budget=None):\n    return (replay or replay_of(cfg), budget or "
                 "plan.budget_of(cfg), ResponseBudget.of(cfg.rollout, cfg.multi_turn))\n")
    assert len(list(_calls(str(p)))) == 3


def _offload_checks_without_precision(path: str):
    for node in _nodes(path):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "offload_errors":
            if not any(k.arg == "precision" for k in node.keywords):
                yield f"{os.path.relpath(path, ROOT)}:{node.lineno}"


def test_the_optimizer_offload_check_is_asked_with_the_jobs_precision():
    # without precision= offload_errors falls back to what actor.bf16 asks (Precision.requested): a second
    # Precision beside the plan's; the actor's optimizer and the plan pass theirs
    found = _scan("", _offload_checks_without_precision, skip_testing=True)
    assert not found, f"offload_errors without the job's precision: {found}"
