"""launch/torchrun.sh for real on CPU: 2 ranks (DP=2, gloo) of ``python -m megatron_rl.train`` on the copy task with
a tiny model, overrides passed through, one log directory per rank; then ``megatron-rl report`` on that run's
metrics.jsonl (plots written, summary produced).

The run is the test run's tiny reference job (``tiny_reference`` of tests/integration/test_slurm_real.py:
configs/tiny_cpu.yaml with 2-rank overrides, launched once and shared with the Slurm and several-host tests that
compare their metrics with it); its token IS and token-k3 rejection give the report's correction plots.

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_launch_e2e.py   (about 30-60 s on 2 cores)
"""
import glob
import os
import subprocess
import sys

import pytest

from tests.integration.test_slurm_real import tiny_reference  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torchrun_two_ranks_then_report(tmp_path, tiny_reference):
    pytest.importorskip("transformers")
    metrics = tiny_reference.metrics()           # launch/torchrun.sh --nproc-per-node 2 ... trainer.steps=2
    assert [m["step"] for m in metrics] == [1, 2]    # the command line's trainer.steps=2 won over the YAML's 200
    logs = str(tiny_reference.log_dir)
    for rank in (0, 1):
        found = glob.glob(os.path.join(logs, "*", "attempt_0", str(rank), "stderr.log"))
        assert len(found) == 1, f"no log for rank {rank}"
    out0 = glob.glob(os.path.join(logs, "*", "attempt_0", "0", "stdout.log"))[0]
    assert "checkpoint" in open(out0).read()     # rank 0's own output went to its log (and the console)

    out = tmp_path / "report"                    # the shared run directory is left as it is
    rep = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "report", str(tiny_reference.run_dir),
                          "--out", str(out)], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    pngs = sorted(os.path.basename(p) for p in glob.glob(str(out / "*.png")))
    assert {"reward_length.png", "mismatch_kl.png", "is_ratio.png", "ess.png", "actor.png"} <= set(pngs)
    md = open(out / "report.md").read()
    assert "2 steps (1..2)" in md and "rollout_corr/k3_kl" in md
