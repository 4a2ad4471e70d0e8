"""Module docstrings stay short: what the module is for and its one non-obvious rule (issue 47's target: no
module docstring of megatron_rl over 25 lines); long explanations belong in docs/. Read from the AST, nothing
is imported."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_LINES = 25


def _docstring_lines(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def test_no_module_docstring_is_over_25_lines():
    long = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "megatron_rl")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for fn in filenames:
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                n = _docstring_lines(path)
                if n > MAX_LINES:
                    long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, f"module docstrings over {MAX_LINES} lines (move the detail to docs/): {sorted(long)}"


def test_the_count_sees_a_long_docstring(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""' + "\n" * 26 + '"""\nx = 1\n')
    assert _docstring_lines(str(p)) == 27
    p.write_text("x = 1\n")
    assert _docstring_lines(str(p)) == 0
