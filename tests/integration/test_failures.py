"""A failure on one rank ends the job on every rank, with the cause, in bounded time — never a hang.

Each test runs the real launcher (``launch/torchrun.sh``, 2 gloo ranks, TP=2 so both ranks write checkpoint files, the copy task on a tiny
model) with one fault injected by ``tests/integration/faults/sitecustomize.py`` (a disk error or a hang in one rank's
checkpoint writer, a rank SIGKILLed mid-step, the loss raising on one rank, the engine refusing a weight
sync, a rank stuck in a step) and asserts:

* the job exits non-zero within ``BOUND_S`` seconds of the fault, and no rank process is left;
* its output names the cause and the rank;
* the last COMPLETE checkpoint is intact, no partial checkpoint is marked COMPLETE, and ``--resume``
  continues from the last COMPLETE one (resumed once: past the partial checkpoint a disk error left).

The resumed job is the loss test's job: it continues the disk-error run (writing step 2's checkpoint anew, COMPLETE)
and the loss raises in its next step -- one job serves both claims instead of a resume that only finishes.

The SIGTERM tests use one process (no torchrun, which would SIGKILL a stuck rank itself after 30 s) whose
checkpoint writer hangs in a queue-like wait, exactly as the quickstart hung without psutil: the second
signal, or ``trainer.stop_timeout_s`` after the first, must end it.

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_failures.py   (~3-4 min on 2 cores)
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_rl.tasks.char_tokenizer import build_task_model
from megatron_rl.rollout.sglang_server import find_free_port
from megatron_rl.testing.jobs import write_job
from megatron_rl.testing.processes import kill_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(ROOT, "tests", "integration", "faults")
BOUND_S = 60
#: marks this test process's jobs (a pytest running beside this one starts jobs with faults of its own)
OWNER = str(os.getpid())

#: the table's 2-rank copy_tp2 job cut to 3 steps, a checkpoint every step, every wait bounded at 120 s
JOB_OVERRIDES = ("trainer.steps=3", "trainer.save_interval=1", "trainer.checkpoint_timeout_s=120",
                 "trainer.stop_timeout_s=120")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_task_model(str(tmp_path_factory.mktemp("model") / "m"), task="copy", seed=0, hidden_size=32,
                            num_layers=1)


def _env(fault=None):
    # CHECK=0: the launcher's config check before torchrun (one more interpreter start per job) is
    # test_launcher_commands' subject, not these tests'
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", CHECK="0")
    env["PYTHONPATH"] = os.pathsep.join([FAULTS, ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.pop("MEGATRON_RL_FAULT", None)
    if fault:
        env["MEGATRON_RL_FAULT"] = fault
    env["MEGATRON_RL_FAULT_OWNER"] = OWNER
    return env


def _torchrun(tmp_path, model_dir, fault=None, overrides=(), resume=False):
    """Run the job; returns (returncode, output, end time)."""
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", "copy_tp2", *JOB_OVERRIDES, hf=model_dir, run_dir=run)
    cmd = ["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "--nproc-per-node", "2", "--log-dir",
           str(tmp_path / ("logs_resume" if resume else "logs")), "--config", str(job), *overrides]
    if resume:
        cmd.append("trainer.resume=true")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(fault), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        kill_job(proc)  # never leave a job behind, even when the test fails
    return proc.returncode, out, time.time()


def _fault_time(out):
    m = re.search(r"FAULT \S+ rank=\d+ step=\d+ t=([\d.]+)", out)
    assert m, "the fault never fired:\n" + out[-4000:]
    return float(m.group(1))


def _complete(run):
    root = run / "checkpoints"
    return sorted(int(d.split("_")[1]) for d in os.listdir(root) if (root / d / "COMPLETE").is_file())


def _steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_failed_fast(rc, out, end):
    assert rc != 0, out[-4000:]
    assert end - _fault_time(out) < BOUND_S, f"job took {end - _fault_time(out):.0f} s to end:\n{out[-4000:]}"


@pytest.fixture(scope="module")
def write_error_run(tmp_path_factory, model_dir):
    """The job whose rank 1 fails to write its step-2 checkpoint: (its directory, returncode, output, end time).
    The loss test resumes it."""
    tmp_path = tmp_path_factory.mktemp("write_error")
    return (tmp_path, *_torchrun(tmp_path, model_dir, fault="ckpt_write_error:1:2"))


def test_checkpoint_write_error_on_one_rank_fails_every_rank(write_error_run):
    tmp_path, rc, out, end = write_error_run
    _assert_failed_fast(rc, out, end)
    # every rank raises, and every rank's error names the failing rank and the cause
    errors = [line for line in out.splitlines()
              if line.startswith("[default") and "CheckpointWriteError" in line and "step 2" in line]
    assert len({line.split(":")[0] for line in errors}) == 2, out[-4000:]   # [default0] and [default1]
    assert all("rank 1: writing" in line and "No space left on device" in line for line in errors), errors
    assert _complete(tmp_path / "run") == [1]                      # step_2 exists but is not COMPLETE
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()


def test_checkpoint_writer_hang_ends_at_checkpoint_timeout(tmp_path, model_dir):
    rc, out, end = _torchrun(tmp_path, model_dir, fault="ckpt_hang:0:1",
                             overrides=["trainer.checkpoint_timeout_s=10"])
    _assert_failed_fast(rc, out, end)
    assert ("rank 0: checkpoint of step 1 did not finish within 10 s (trainer.checkpoint_timeout_s)"
            in out), out[-4000:]
    assert "write_bucket" in out                                   # the stack shows where it hung
    assert _complete(tmp_path / "run") == []


def test_rank_killed_mid_step_ends_the_job(tmp_path, model_dir):
    rc, out, end = _torchrun(tmp_path, model_dir, fault="kill:1:2")
    _assert_failed_fast(rc, out, end)
    assert re.search(r"rank\s*:\s*1 .*\n.*exitcode\s*:\s*-9", out) or "Signal 9 (SIGKILL)" in out, out[-4000:]
    assert _complete(tmp_path / "run") == [1]   # (resume past a failed step: the write-error test above)


def test_resume_past_a_partial_checkpoint_then_loss_raising_on_one_rank_ends_the_job(write_error_run, model_dir):
    tmp_path = write_error_run[0]
    run = tmp_path / "run"
    assert _complete(run) == [1] and (run / "checkpoints" / "step_2").is_dir()   # the disk-error test's state
    # the resumed job trains step 2 (its first train step), checkpoints it, and the loss raises in step 3 (its second)
    rc, out, end = _torchrun(tmp_path, model_dir, fault="loss_raise:1:2", resume=True)
    assert f"resumed from {run / 'checkpoints' / 'step_1'}" in out, out[-4000:]
    _assert_failed_fast(rc, out, end)
    assert "policy loss failed (injected by tests/integration/faults)" in out
    assert re.search(r"\[default1\].*RuntimeError: policy loss failed", out), out[-4000:]
    assert _complete(run) == [1, 2]          # the partial step_2 was written anew, COMPLETE
    assert _steps(run) == [1, 2]             # the history continues from step 1; step 3 never finished


def test_weight_sync_failure_is_raised_on_every_rank(tmp_path, model_dir):
    rc, out, end = _torchrun(tmp_path, model_dir, fault="sync_error:0:2")
    _assert_failed_fast(rc, out, end)
    for r in (0, 1):
        assert re.search(rf"\[default{r}\].*engine refused weights step-2", out), out[-4000:]
    assert _complete(tmp_path / "run") == [1]      # step 2 trained but its weights never reached the engine


def test_stuck_phase_ends_at_phase_timeout(tmp_path, model_dir):
    rc, out, end = _torchrun(tmp_path, model_dir, fault="train_hang:1:2", overrides=["trainer.phase_timeout_s=10"])
    _assert_failed_fast(rc, out, end)
    assert "rank 1: train of step 2 did not finish within 10 s (trainer.phase_timeout_s)" in out, out[-4000:]
    assert _complete(tmp_path / "run") == [1]


# ---- signals on a rank that is really blocked (one process, no torchrun) ----------------------------

def _single(tmp_path, model_dir, fault, overrides=()):
    env = _env(fault)
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(find_free_port()))
    run = tmp_path / "run"
    args = [sys.executable, "-m", "megatron_rl.train", f"actor.load_hf={model_dir}", f"trainer.run_dir={run}",
            "rollout.max_new_tokens=4", "rollout.n_samples_per_prompt=2", "data.prompts_per_step=2",
            "trainer.progress=false", "actor.micro_batch_size=4", "trainer.steps=5", "trainer.save_interval=1",
            *overrides]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_fault(proc, timeout=180):
    lines = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("FAULT "):
            return lines
    proc.kill()
    raise AssertionError("the fault never fired:\n" + "".join(lines[-50:]))


def _finish(proc, lines, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"the blocked rank did not exit within {timeout} s:\n" + "".join(lines[-40:]))
    return "".join(lines) + out


def test_second_sigterm_ends_a_rank_blocked_in_the_checkpoint_writer(tmp_path, model_dir):
    proc = _single(tmp_path, model_dir, "ckpt_hang:0:1")
    try:
        lines = _wait_for_fault(proc)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(3.0)
        assert proc.poll() is None                    # first signal: waits for the step end (it is blocked)
        proc.send_signal(signal.SIGTERM)
        out = _finish(proc, lines, 20)
    finally:
        kill_job(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "received signal 15: checkpointing at the end of this step" in out
    assert "rank 0: second signal 15: exiting now without checkpoint" in out
    assert "write_bucket" in out                      # stacks printed: where it was blocked
    assert _complete(tmp_path / "run") == []


def test_stop_timeout_ends_a_blocked_rank_after_one_sigterm(tmp_path, model_dir):
    proc = _single(tmp_path, model_dir, "ckpt_hang:0:2", overrides=["trainer.stop_timeout_s=5"])
    try:
        lines = _wait_for_fault(proc)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        out = _finish(proc, lines, 30)
        took = time.time() - t0
    finally:
        kill_job(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert 4 <= took < 30, took
    assert "has not finished its step and checkpoint (trainer.stop_timeout_s)" in out
    assert _complete(tmp_path / "run") == [1]        # the previous COMPLETE checkpoint is untouched


def test_no_rank_process_is_left_behind():
    """Runs last in this file: every job above ended all of its ranks (jobs of other test processes aside)."""
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"])
            if p.info["cmdline"] and "megatron_rl.train" in " ".join(p.info["cmdline"])
            and _environ(p).get("MEGATRON_RL_FAULT_OWNER") == OWNER]
    assert left == []


def _environ(p):
    try:
        return p.environ()
    except psutil.Error:
        return {}
