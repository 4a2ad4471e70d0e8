"""The README's main-job command, proven in its own environment: ``bash tools/quickstart.sh`` in a fresh copy
of the tree, which creates its own clean venv exactly as a new user's first run does (torch, then the
project's ``install_requires`` only: no dev extra, no SGLang). The test suite's venv installs more
(SGLang pulls psutil in, for one), so it hides missing dependencies; this test does not.

Short run: 12 steps with a checkpoint at step 10 (the path that hung without psutil) and at the end.
Asserts exit 0, both checkpoints COMPLETE, the report written, and that the venv really is the lean one.

Run: pytest tests/integration/test_quickstart_fresh.py   (~2-4 min on 2 cores with a warm pip cache)
"""
import os
import shutil
import subprocess

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _copy_tree(dst):
    """What a clone would hold: tracked files and untracked files git does not ignore (the working
    tree as it is, so a local run tests the uncommitted change too); no .venv, runs/ or caches."""
    if os.path.isdir(os.path.join(ROOT, ".git")):
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                               capture_output=True).stdout.decode().split("\0")
        for rel in filter(None, files):
            src = os.path.join(ROOT, rel)
            if not os.path.isfile(src):  # deleted in the working tree
                continue
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel))
    else:
        shutil.copytree(ROOT, dst, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".venv", "runs", "__pycache__", "*.egg-info", ".pytest_cache"))


def _clean_env():
    """The environment of a new shell: nothing of the test venv (PATH entry, VIRTUAL_ENV, PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "MEGATRON_RL_VENV", "PYTHONHOME") and not k.startswith("PYTEST")}
    venv_bin = os.path.join(ROOT, ".venv", "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and os.path.realpath(p) != os.path.realpath(venv_bin))
    return env


def test_quickstart_from_a_fresh_copy_with_its_own_venv(tmp_path):
    clone = tmp_path / "clone"
    _copy_tree(str(clone))
    assert not (clone / ".venv").exists()
    r = subprocess.run(["bash", "tools/quickstart.sh", "trainer.steps=12", "trainer.save_interval=10"],
                       cwd=clone, env=_clean_env(), capture_output=True, text=True, timeout=1400)
    out = r.stdout[-6000:] + r.stderr[-6000:]
    assert r.returncode == 0, out
    ckpts = clone / "runs" / "tiny_cpu" / "checkpoints"
    assert (ckpts / "step_10" / "COMPLETE").is_file(), out
    assert (ckpts / "step_12" / "COMPLETE").is_file(), out
    assert (clone / "runs" / "tiny_cpu" / "report" / "report.md").is_file(), out
    # the venv is the main job's own: the project and its install_requires, nothing of the test extras
    py = str(clone / ".venv" / "bin" / "python")
    probe = subprocess.run([py, "-c", "import importlib.util as u; "
                            "print([m for m in ('sglang', 'pytest', 'triton') if u.find_spec(m)])"],
                           capture_output=True, text=True, env=_clean_env(), timeout=120)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr
