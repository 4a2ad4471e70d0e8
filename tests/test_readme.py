"""The README's configuration reference is the generator's output (docs cannot drift from the
dataclass docstrings), and the README names the two set-up commands that .ci/run relies on."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_reference_in_readme_is_current():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.ops.config_reference"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    section = "## Configuration reference" + out[len("# Configuration reference"):]
    section = section.replace("\n## `", "\n### `")
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert section.strip() in readme, ("README's configuration reference is stale: regenerate it with "
                                       "python -m megatron_rl.ops.config_reference")


def test_readme_commands_match_ci():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "bash tools/run_tests.sh" in readme and "bash tools/run_tests.sh" in ci
    assert "bash tools/quickstart.sh" in readme and os.path.isfile(os.path.join(ROOT, "tools", "quickstart.sh"))
