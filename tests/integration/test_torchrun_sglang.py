"""The RL loop with a real SGLang server under the real launcher (``launch/torchrun.sh``, not forked ranks).

torchrun gives each rank ``RANK``, ``WORLD_SIZE``, ``MASTER_*`` and ``TORCHELASTIC_USE_AGENT_STORE=True``; a server
that inherits them waits forever at "Init parallel begin" (issue 21). Jobs (2 ranks, DP=2, 2 steps each, 3 in async mode):

* ``rollout.sglang_launch=true`` (rank 0 starts the server, with a clean environment whatever the sync mode):
  tensor + sync;
* an external server (the copy model's server this pytest process shares, ``copy_sglang_server``; a server
  started with ``launch/sglang_server.sh`` serves a torchrun job in test_multihost.py), two jobs against it:
  distributed + sync, then disk + async.

Every mode runs under torchrun once (each mode's own exactness is proven against a real server in
test_weight_sync_sglang.py); a launched server per mode would add two server start-ups and jobs for no
further claim.

Every mode runs in sync and ``disk`` runs in async too (async in memory: ``test_train_loop_sglang.py``).

Each job: both steps logged, step 2's rollouts carry weight version ``step-1`` (the sync reached the server),
and — on a server that holds the initial checkpoint — step 1's mismatch KL equals the one recomputed with HF
transformers' fp32 forward (independent reference). Skipped when sglang is not importable.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from megatron_rl.rollout.sglang_server import find_free_port, sglang_available
from megatron_rl.testing.sglang_script import load_from_disk
from megatron_rl.testing.processes import kill_job
from tests.integration.test_train_loop_sglang import _assert_step1_kl_matches_hf_fp32

_OK, _REASON = sglang_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_REASON), pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JOB = """\
rollout:
  engine: sglang
  max_new_tokens: 4
  n_samples_per_prompt: 4
data:
  task: copy
  prompts_per_step: 4
actor:
  lr: 1.0e-3
  micro_batch_size: 4
  load_hf: {model}
trainer:
  steps: 2
  run_dir: {run}
  progress: false
  dump_rollouts: true
"""


@pytest.fixture(scope="module")
def model(task_model):
    return task_model(task="copy", seed=0, hidden_size=64, num_layers=2)


def run_torchrun_job(tmp, model, overrides, timeout=420, nproc=2, async_lag=False):
    """``launch/torchrun.sh`` with ``nproc`` ranks on the job above (2 steps; 3 with ``async_lag``, so that the
    last step's rollouts come from synced weights); returns (metrics, rollouts) of the run."""
    run = tmp / "run"
    job = tmp / "job.yaml"
    job.write_text(JOB.format(model=model, run=run))
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    cmd = ["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "--nproc-per-node", str(nproc), "--log-dir",
           str(tmp / "logs"), "--config", str(job), *overrides, f"trainer.steps={3 if async_lag else 2}"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)   # torchrun forwards it; rank 0 stops the server it launched
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            kill_job(p)
            out, _ = p.communicate(timeout=60)
        server_log = run / "sglang_server.log"
        pytest.fail(f"torchrun job not done after {timeout} s:\n{out[-4000:]}\n"
                    f"server log: {server_log.read_text()[-2000:] if server_log.exists() else '-'}")
    assert p.returncode == 0, out[-5000:]
    with open(run / "metrics.jsonl") as fh:
        metrics = [json.loads(line) for line in fh if line.strip()]
    with open(run / "rollouts.jsonl") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    steps = 3 if async_lag else 2
    assert [m["step"] for m in metrics] == list(range(1, steps + 1)), out[-3000:]
    versions = {r["weight_version"] for r in recs if r["step"] == steps}
    if async_lag:   # the last step's rollouts come from a synced version (staleness 1: not the initial one)
        assert versions and "step-0" not in versions, versions
    else:           # synced after step 1, before step 2's rollouts
        assert versions == {"step-1"}, versions
    return metrics, recs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sync,mode", [("tensor", "sync")])
def test_launched_server_under_torchrun(tmp_path, model, sync, mode):
    metrics, recs = run_torchrun_job(tmp_path, model, [
        "rollout.sglang_launch=true", f"rollout.sglang_port={find_free_port()}", f"rollout.weight_sync={sync}",
        f"rollout.mode={mode}"], async_lag=mode == "async")
    _assert_step1_kl_matches_hf_fp32(model, metrics, recs)   # step 1 is generated on the initial weights


@pytest.mark.timeout(900)
def test_external_server_under_torchrun(tmp_path, model, copy_sglang_server):
    assert copy_sglang_server.model_dir == model
    url = copy_sglang_server.get().url
    load_from_disk(url, model, "step-0")   # the initial checkpoint, whatever an earlier test left on the server
    common = [f'rollout.sglang_urls=["{url}"]']
    (tmp_path / "a").mkdir()
    metrics, recs = run_torchrun_job(tmp_path / "a", model, common + [
        "rollout.weight_sync=distributed", "rollout.mode=sync"])
    _assert_step1_kl_matches_hf_fp32(model, metrics, recs)   # the server had the initial weights
    (tmp_path / "b").mkdir()
    run_torchrun_job(tmp_path / "b", model, common + ["rollout.weight_sync=disk", "rollout.mode=async"],
                     async_lag=True)
