"""Shipped configs run for tests through ``launch/torchrun.sh`` (``launch_config``), the quickstart's step count as
shipped (``STEPS``) and ``tools/quickstart_results.py`` as a module (``results_tool``): shared by
test_quickstart_fresh.py, test_objectives_learn.py and test_tool_task_learns.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(ROOT, "configs", "tiny_cpu.yaml")) as _fh:
    #: The quickstart's steps, as shipped.
    STEPS = int(yaml.safe_load(_fh)["trainer"]["steps"])


def results_tool():
    """``tools/quickstart_results.py`` as a module (its ``main(argv)`` returns the results dict)."""
    spec = importlib.util.spec_from_file_location("quickstart_results", os.path.join(ROOT, "tools",
                                                                                      "quickstart_results.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launch_config(tmp_path, config: str, model: str, steps: int, nproc: int, *overrides, timeout: float = 2400):
    """``configs/<config>`` on ``nproc`` ranks through launch/torchrun.sh for ``steps`` steps with ``actor.load_hf``
    at ``model`` (plus ``overrides``), the run in ``tmp_path/run``, no checkpoints; returns the run directory."""
    run = tmp_path / "run"
    # CHECK=0: no config check in a separate interpreter before torchrun (the launcher's check has its own tests
    # in test_launcher_commands.py; these runs' subject is what the job learns)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", NPROC_PER_NODE=str(nproc), CHECK="0")
    r = subprocess.run(["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "--log-dir", str(tmp_path / "logs"),
                        "--config", os.path.join(ROOT, "configs", config), f"actor.load_hf={model}",
                        f"trainer.run_dir={run}", f"trainer.steps={steps}", "trainer.save_interval=0",
                        "trainer.progress=false", *overrides],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run

