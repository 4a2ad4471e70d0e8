"""launch/torchrun.sh for real on CPU: 2 ranks (DP=2, gloo) of ``python -m megatron_rl.train`` on the copy task with
a tiny model, overrides passed through, one log directory per rank; then ``megatron-rl report`` on that run's
metrics.jsonl (plots written, summary produced).

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_launch_e2e.py   (about 30-60 s on 2 cores)
"""
import glob
import json
import os
import subprocess
import sys

import pytest

from megatron_rl.testing.jobs import write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the table's copy_loop job with token IS alone, 5 steps (the command line's trainer.steps=2 wins), no rollout dump
JOB_OVERRIDES = ("algorithm.rollout_correction={rollout_is: token, rollout_is_threshold: 2.0}", "trainer.steps=5",
                 "trainer.dump_rollouts=false")


def test_torchrun_two_ranks_then_report(tmp_path, task_model):
    pytest.importorskip("transformers")
    model = task_model(task="copy", seed=0, hidden_size=64, num_layers=2)
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", "copy_loop", *JOB_OVERRIDES, hf=model, run_dir=run)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "--nproc-per-node", "2", "--log-dir",
                        str(tmp_path / "logs"), "--config", str(job), "trainer.steps=2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(run / "metrics.jsonl") as fh:
        steps = [json.loads(line)["step"] for line in fh if line.strip()]
    assert steps == [1, 2]                       # trainer.steps=2 override won over the YAML's 5
    for rank in (0, 1):
        logs = glob.glob(str(tmp_path / "logs" / "*" / "attempt_0" / str(rank) / "stderr.log"))
        assert len(logs) == 1, f"no log for rank {rank}"
    out0 = glob.glob(str(tmp_path / "logs" / "*" / "attempt_0" / "0" / "stdout.log"))[0]
    assert "checkpoint" in open(out0).read()     # rank 0's own output went to its log (and the console)

    rep = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "report", str(run)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    pngs = sorted(os.path.basename(p) for p in glob.glob(str(run / "report" / "*.png")))
    assert {"reward_length.png", "mismatch_kl.png", "is_ratio.png", "ess.png", "actor.png"} <= set(pngs)
    md = open(run / "report" / "report.md").read()
    assert "2 steps (1..2)" in md and "rollout_corr/k3_kl" in md
