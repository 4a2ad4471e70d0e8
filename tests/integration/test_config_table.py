"""The shipped GPU configs fit by their own planner, and docs/configs.md is the generator's output.

Every ``configs/*.yaml`` other than ``*_cpu`` is planned by the real CLI (``megatron-rl check --strict``: exit 3
when a stage needs more than ``cluster.gpu_memory_gb``); the peak is re-read from the table ``check`` prints
and compared with the GPU memory of the file's ``cluster:`` section read straight from the YAML.

    pytest tests/integration/test_config_table.py
"""
import os
import re

import pytest
import yaml

from megatron_rl.cli.config_table import config_rows, gpu_configs, markdown
from megatron_rl.testing.cli import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_there_are_gpu_configs():
    names = {os.path.basename(c) for c in gpu_configs()}
    assert {"qwen2.5_7b_1x8.yaml", "qwen3_30b_a3b_2x8.yaml"} <= names and not any("_cpu" in n for n in names)


@pytest.mark.parametrize("config", gpu_configs())
def test_every_shipped_gpu_config_fits_by_check(config):
    with open(os.path.join(ROOT, config)) as fh:
        gpu_gb = yaml.safe_load(fh)["cluster"]["gpu_memory_gb"]
    r = run_cli("check", config, "--strict", cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, f"{config}: exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    # the TOTAL column of every stage (GiB per rank) is within the file's GPU memory
    totals = [float(ln.split()[-1]) for ln in r.stdout.splitlines() if re.match(r"^\s+\d+\s+\d+\s+[\d.]", ln)]
    assert totals and max(totals) <= gpu_gb, (config, totals, gpu_gb)
    # the header claims only what check plans: no distributed optimizer while check reports it off
    with open(os.path.join(ROOT, config)) as fh:
        header = "".join(ln for ln in fh if ln.startswith("#")).lower()
    if "distributed optimizer off" in r.stdout:
        assert "distributed optimizer." not in header and "distributed optimizer," not in header, config


def test_docs_configs_md_is_the_generators_output():
    with open(os.path.join(ROOT, "docs", "configs.md")) as fh:
        on_disk = fh.read()
    rows = config_rows()
    assert on_disk == markdown(rows), "regenerate: python -m megatron_rl.cli.config_table > docs/configs.md"
    assert all(r.status == 0 and r.fits for r in rows), [(r.config, r.peak_gib) for r in rows if not r.fits]
