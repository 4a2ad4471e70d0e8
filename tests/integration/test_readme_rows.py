"""The README's config table runs as written: each CPU row's command, in a copy of the tree (its runs/ are the
copy's), with only ``trainer.steps=2 trainer.overwrite=true`` appended to its launch command -- no rank count
added (launch/torchrun.sh takes it from the config's cluster.gpus_per_node; the MoE row failed without
NPROC_PER_NODE=4 before). The quickstart's row is run whole by tests/integration/test_quickstart_fresh.py; the math
row's ``pip install -e ".[math]"`` is checked, not run (this venv has the extra). The LoRA rows (``actor.lora``): the
dense one's base is trained for 2 full-parameter steps (``LORA_BASE_STEPS=2``, tools/lora_base.sh), and both must
keep train == rollout (the bf16 engine's log-probs of the samples vs the fp32 trainer's, every step) while their
adapters move (lora_B of the exported adapter non-zero): the merged weight sync carries W + (alpha/r)·B·A.

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_readme_rows.py   (~2-4 min on 2 cores)
"""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.integration.lora_rows import check_lora_run
from tests.integration.test_quickstart_fresh import _copy_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MATH_EXTRA = 'pip install -e ".[math]"; '


def _cpu_rows():
    rows = []
    for line in open(os.path.join(ROOT, "README.md")):
        m = re.match(r"^\| `(configs/[^`]+\.yaml)` \| [^|]* \| `(.+)` \|$", line.strip())
        if m and "cpu" in m.group(1):
            rows.append((m.group(1), m.group(2)))
    return rows


def test_the_table_has_every_cpu_config():
    shipped = sorted(f"configs/{f}" for f in os.listdir(os.path.join(ROOT, "configs")) if "cpu" in f)
    assert sorted(c for c, _ in _cpu_rows()) == shipped


@pytest.mark.parametrize("config, command", [r for r in _cpu_rows() if r[0] != "configs/tiny_cpu.yaml"],
                         ids=lambda v: os.path.basename(v) if v.endswith(".yaml") else "")
def test_each_cpu_row_runs_as_written(tmp_path, config, command):
    if command.startswith(MATH_EXTRA):
        pytest.importorskip("math_verify")   # the extra the row installs
        command = command[len(MATH_EXTRA):]
    assert "launch/torchrun.sh" in command and command.rstrip().endswith(config), command
    clone = tmp_path / "clone"
    _copy_tree(str(clone))
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC_PER_NODE", "MEGATRON_RL_VENV")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", LORA_BASE_STEPS="2", PATH=os.path.dirname(sys.executable) + os.pathsep
               + env.get("PATH", ""))
    r = subprocess.run(["bash", "-c", command + " trainer.steps=2 trainer.overwrite=true trainer.progress=false"],
                       cwd=clone, env=env, capture_output=True, text=True, timeout=1100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import yaml
    with open(clone / config) as fh:
        cfg = yaml.safe_load(fh)
    run_dir = (clone / config).parent / cfg["trainer"]["run_dir"]  # a config's paths are relative to the file
    with open(run_dir / "metrics.jsonl") as fh:
        steps = [json.loads(line)["step"] for line in fh if line.strip()]
    assert steps == [1, 2]
    if (cfg.get("actor") or {}).get("lora"):
        check_lora_run(run_dir, tmp_path / "adapter")
    if "NPROC_PER_NODE" not in command:   # the rank count came from the config, said on one line
        assert f"rank(s) per node: cluster.gpus_per_node of {config}" in r.stderr
