"""tools/tool_task_table.py: docs/multi_turn.md's table of 20-step window means, checked against means computed by
hand from the records, with the commit stamp and a missing key shown as '-'."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("tool_task_table", os.path.join(ROOT, "tools", "tool_task_table.py"))
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def test_windows_and_render():
    recs = [{"step": s, "reward/mean": s / 100, "multi_turn/tool_calls_per_traj": 1.0 if s > 20 else 0.0,
             "actor/entropy": 2.0} for s in range(1, 46)]
    rows = tool.windows(recs)
    assert [r["steps"] for r in rows] == ["1-20", "21-40", "41-45"]
    assert abs(rows[0]["reward/mean"] - sum(range(1, 21)) / 20 / 100) < 1e-12
    assert abs(rows[2]["reward/mean"] - sum(range(41, 46)) / 5 / 100) < 1e-12
    assert rows[1]["multi_turn/tool_calls_per_traj"] == 1.0 and "multi_turn/turns_mean" not in rows[0]
    page = tool.render("runs/x", rows, "abc1234", 1.5)
    assert page.startswith("Measured at commit abc1234") and "1.50 s/step" in page
    assert "| 1-20 | 0.105 | 0.000 | - | - | 2.000 |" in page
