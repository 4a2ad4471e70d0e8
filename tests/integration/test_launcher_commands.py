"""The commands the README gives, through the real launcher (``launch/torchrun.sh``, 2 gloo ranks, a tiny model):

* a config error is found before torchrun starts: exit 2, the message alone (no torchrun summary, no traceback);
* Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) and SIGTERM to the launcher: the ranks
  finish the step, checkpoint, and the job exits 0 with one line naming the checkpoint -- no SignalException
  traceback from the torchrun agent -- and the launcher says in one line that every rank confirmed the stop (also
  where `ps` is missing: the launcher finds the ranks in /proc);
* a launcher that ends without a word (SIGKILL while the ranks train, SIGHUP while they start) takes its job with
  it: the torchrun agent and every rank end within seconds;
* Ctrl-C while the ranks are still starting (one rank paused as its interpreter starts, before its stop watcher
  exists; the other building its job): the same clean stop, after the first step -- not a KeyboardInterrupt in
  one rank and a failed job (torchrun >= 2.x hands its ranks a default SIGINT unless told which signals to
  handle: launch/torchrun.sh sets PET_SIGNALS_TO_HANDLE);
* Ctrl-C while a multi-node rendezvous still waits for another node (no rank exists): torchrun ends at once, the
  launcher says so in one line and exits 130, with no traceback and nothing left running;
* ``--resume`` after the overrides continues from that checkpoint, the history reading 1..N+1.

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_launcher_commands.py   (~2-3 min on 2 cores)
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from megatron_rl.rollout.sglang_server import find_free_port
from megatron_rl.testing.jobs import wait_for_steps, write_job
from megatron_rl.testing.processes import kill_job, terminal_signals

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "launch", "torchrun.sh")

FAULTS = os.path.join(ROOT, "tests", "integration", "faults")


def _env(fault=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID",
                                                             "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS",
                                                             "MEGATRON_RL_FAULT")}
    if fault:  # tests/integration/faults/sitecustomize.py
        env["PYTHONPATH"] = os.pathsep.join([FAULTS, ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        env["MEGATRON_RL_FAULT"] = fault
    # CHECK=0: the config check before torchrun (one more interpreter start per job) is tested on its own below
    return dict(env, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CHECK="0")


def _steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _launch(tmp_path, job, *args, logs="logs", fault=None, env=None, stdout_file=None):
    """``launch/torchrun.sh`` with launcher options ``args``, then ``--config job``; the output piped (or written to
    ``stdout_file``)."""
    out = open(stdout_file, "w") if stdout_file else subprocess.PIPE
    try:
        return subprocess.Popen(["bash", LAUNCH, "--nproc-per-node", "2", "--log-dir", str(tmp_path / logs), *args,
                                 "--config", str(job)], cwd=ROOT, env=env or _env(fault), stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=terminal_signals)
    finally:
        if stdout_file:
            out.close()


def _stop_after_two_steps(proc, run, send):
    """Wait until two steps were logged, then ``send(proc)``; returns (output, seconds from signal to exit)."""
    try:
        wait_for_steps(proc, run / "metrics.jsonl", 2, timeout=300, poll=0.3)
        t0 = time.time()
        send(proc)
        out, _ = proc.communicate(timeout=240)
        return out, time.time() - t0
    finally:
        kill_job(proc)  # never leave a job behind: launcher, agent (its own session) and ranks


def _assert_clean_stop(proc, out, run, signum):
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-4000:]
    done = _steps(run)[-1]
    ckpt = run / "checkpoints" / f"step_{done}"
    assert (ckpt / "COMPLETE").is_file(), out[-4000:]
    stop_lines = [line for line in out.splitlines() if "stopped by signal" in line]
    assert len(stop_lines) == 1 and f"stopped by signal {signum} after step {done}: checkpoint {ckpt}" in \
        stop_lines[0], out[-4000:]
    assert out.count(f"received signal {signum}") == 1, out[-4000:]   # one acknowledgement, not one per rank
    confirmed = [line for line in out.splitlines() if line.startswith("launch/torchrun.sh: ")]
    assert confirmed == [f"launch/torchrun.sh: {signal.Signals(signum).name} reached all 2 ranks on "
                         f"{socket.gethostname().split('.')[0]}: they checkpoint after this step and exit (a second "
                         f"signal stops them at once)"], out[-4000:]
    return done


def test_config_error_is_reported_before_torchrun_starts(tmp_path, copy_model):
    job = write_job(tmp_path / "job.yaml", "copy_tp2", hf=copy_model, run_dir=tmp_path / "run")
    t0 = time.time()
    r = subprocess.run(["bash", LAUNCH, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), "--config",
                        str(job), "actor.lr=abc"], cwd=ROOT, env=dict(_env(), CHECK="1"), capture_output=True,
                       text=True, timeout=120)
    took = time.time() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("actor.lr: expected a number, got 'abc' (str)") == 1, r.stderr
    assert "torch.distributed" not in r.stderr and "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 3, r.stderr
    assert not (tmp_path / "logs").exists()          # torchrun never started
    assert took < 60, took


def test_ctrl_c_checkpoints_exits_0_and_resume_continues_through_the_launcher(tmp_path, copy_model):
    job = write_job(tmp_path / "job.yaml", "copy_tp2", hf=copy_model, run_dir=tmp_path / "run")
    run = tmp_path / "run"
    proc = _launch(tmp_path, job)
    # a terminal's Ctrl-C: SIGINT to the foreground process group (the launcher's)
    out, took = _stop_after_two_steps(proc, run, lambda p: os.killpg(p.pid, signal.SIGINT))
    done = _assert_clean_stop(proc, out, run, signal.SIGINT)
    # --resume among the overrides, as the README writes it
    r = subprocess.run(["bash", LAUNCH, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs2"), "--config",
                        str(job), f"trainer.steps={done + 1}", "--resume"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{done}'} at step {done}" in r.stdout + r.stderr
    assert _steps(run) == list(range(1, done + 2))


def test_sigterm_to_the_launcher_checkpoints_and_exits_0_also_without_ps(tmp_path, copy_model):
    job = write_job(tmp_path / "job.yaml", "copy_tp2", hf=copy_model, run_dir=tmp_path / "run")
    run = tmp_path / "run"
    no_ps = tmp_path / "bin"   # a slim container without procps: the launcher must find the ranks without `ps`
    no_ps.mkdir()
    (no_ps / "ps").write_text("#!/bin/sh\necho 'ps: command not found' >&2\nexit 127\n")
    (no_ps / "ps").chmod(0o755)
    env = _env()
    proc = _launch(tmp_path, job, env=dict(env, PATH=f"{no_ps}{os.pathsep}{env['PATH']}"))
    out, took = _stop_after_two_steps(proc, run, lambda p: p.send_signal(signal.SIGTERM))
    _assert_clean_stop(proc, out, run, signal.SIGTERM)
    assert took < 120, took


def test_ctrl_c_while_the_ranks_start_stops_cleanly_after_the_first_step(tmp_path, copy_model):
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", "copy_tp2", hf=copy_model, run_dir=tmp_path / "run")
    proc = _launch(tmp_path, job, fault="start_pause:1:8")
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # the output, as it comes
    reader.start()
    try:
        deadline = time.time() + 300
        while not any("FAULT start_pause rank=1" in line for line in lines):  # rank 1's interpreter is starting
            assert proc.poll() is None and time.time() < deadline, "".join(lines)[-4000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=240)
        reader.join(timeout=30)
    finally:
        kill_job(proc)
    out = "".join(lines)
    assert _assert_clean_stop(proc, out, run, signal.SIGINT) == 1


def test_ctrl_c_during_the_rendezvous_exits_130_at_once(tmp_path, copy_model):
    port = find_free_port()  # for the c10d rendezvous; the second node never comes
    job = write_job(tmp_path / "job.yaml", "copy_tp2", hf=copy_model, run_dir=tmp_path / "run")
    proc = _launch(tmp_path, job, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "alone",
                   stdout_file=tmp_path / "out.txt")
    try:
        deadline = time.time() + 120
        while not any("torch.distributed.run" in _cmd(p) for p in psutil.Process(proc.pid).children(recursive=True)):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "out.txt").read_text()[-4000:]
            time.sleep(0.2)
        time.sleep(3)  # the agent is in the rendezvous (it waits for the second node up to its timeout)
        agent_and_all = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        took = time.time() - t0
        gone, alive = psutil.wait_procs(agent_and_all, timeout=20)
    finally:
        kill_job(proc)
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 130, out[-4000:]
    assert took < 10, (took, out[-4000:])
    assert "launch/torchrun.sh: SIGINT before any rank started: torchrun stopped, nothing to checkpoint" in out, out
    assert "Traceback" not in out, out[-4000:]
    assert not alive, [_cmd(p)[:120] for p in alive]


def _cmd(p):
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # ended (or a zombie) meanwhile
        return ""


def _job_processes(launcher_pid, nranks, timeout):
    """The agent and the ``nranks`` ranks under the launcher, once they all exist."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        procs = psutil.Process(launcher_pid).children(recursive=True)
        ranks = [p for p in procs if "megatron_rl.train" in _cmd(p) and "torch.distributed.run" not in _cmd(p)]
        if len(ranks) == nranks:
            return procs
        time.sleep(0.2)
    raise AssertionError(f"{nranks} ranks did not start within {timeout} s")


@pytest.mark.parametrize("when,sig", [("starting", signal.SIGHUP), ("training", signal.SIGKILL)])
def test_a_job_never_outlives_its_launcher(tmp_path, copy_model, when, sig):
    job = write_job(tmp_path / "job.yaml", "copy_tp2", hf=copy_model, run_dir=tmp_path / "run")
    proc = _launch(tmp_path, job)
    try:
        job_procs = _job_processes(proc.pid, 2, timeout=120)
        if when == "training":
            wait_for_steps(proc, tmp_path / "run" / "metrics.jsonl", 1, timeout=300, poll=0.3)
            job_procs = psutil.Process(proc.pid).children(recursive=True)
        assert any("torch.distributed.run" in _cmd(p) for p in job_procs)
        assert all(os.getsid(p.pid) != os.getsid(proc.pid) for p in job_procs
                   if "megatron_rl" in _cmd(p))  # out of reach of the launcher's group
        t0 = time.time()
        proc.send_signal(sig)   # the launcher alone, as kill -9 or a closed terminal does
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(job_procs, timeout=20)
        assert not alive, [_cmd(p)[:120] for p in alive]
        assert time.time() - t0 < 20
    finally:
        kill_job(proc)
