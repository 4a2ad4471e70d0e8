"""braces.closing_brace, the one brace matcher, through both of its users: config interpolations (``${...}`` with
nested ``{}``, unbalanced braces reported) and the math reward's ``\\boxed{...}`` (nested braces, unclosed)."""
from megatron_rl.braces import closing_brace
from megatron_rl.config.interpolation import resolve_interpolations
from megatron_rl.tasks.rewards import extract_answer


def test_closing_brace_counts_nested_pairs_and_reports_an_unclosed_one():
    assert closing_brace("a{b{c}d}e", 1) == 7
    assert closing_brace("a{b{c}d}e", 3) == 5
    assert closing_brace("{}", 0) == 1
    assert closing_brace("{{}", 0) == -1


def test_users_match_nested_braces_and_report_unbalanced_ones():
    tree, unresolved = resolve_interpolations({"a": {"b": 3}, "x": "${oc.select:a.b,{}}", "y": "p${a.b", "z": "${a.b}"})
    assert tree["x"] == 3 and tree["z"] == 3
    assert "unbalanced braces" in unresolved["y"]
    assert extract_answer("so \\boxed{\\frac{1}{2}} and \\boxed{x", extract=("boxed",)) == "\\frac{1}{2}"
