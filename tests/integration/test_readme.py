"""The configuration reference (docs/config_reference.md, linked from the README) is the generator's output
(docs cannot drift from the dataclass docstrings), the README names the two set-up commands that .ci/run
relies on, and no shipped text points at files outside the repository."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_config_reference_is_current_and_linked():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.ops.config_reference"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=120).stdout
    doc = open(os.path.join(ROOT, "docs", "config_reference.md")).read()
    assert doc == out, ("docs/config_reference.md is stale: regenerate it with "
                        "python -m megatron_rl.ops.config_reference > docs/config_reference.md")
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "](docs/config_reference.md)" in readme
    assert "| key | type | default | description |" not in readme  # the tables live in the generated file


def test_readme_commands_match_ci():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "bash tools/run_tests.sh" in readme and "bash tools/run_tests.sh" in ci
    assert "bash tools/quickstart.sh" in readme and os.path.isfile(os.path.join(ROOT, "tools", "quickstart.sh"))


def test_docs_reference_no_paths_outside_the_repository():
    """README, docs, launch scripts and the SGLang stand-ins' README must not send readers to files that do
    not ship (a design document, absolute paths of the machine the project was written on)."""
    files = ["README.md", "docs/config_reference.md", "megatron_rl/platform/sglang_cpu/README.md"]
    files += [os.path.join("launch", f) for f in os.listdir(os.path.join(ROOT, "launch"))]
    bad = []
    for f in files:
        text = open(os.path.join(ROOT, f)).read()
        for m in re.finditer(r"/work/\S+|design\.md", text):
            bad.append(f"{f}: {m.group(0)}")
    assert not bad, bad
