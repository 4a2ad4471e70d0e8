"""The launcher's link to its job (``megatron_rl.lifeline``), each piece with real processes and real signals:

* a command started through ``python -m megatron_rl.lifeline --parent PID`` is killed by the kernel when PID ends
  (SIGKILL: no handler of PID runs), and does not start at all when PID is not its parent;
* ``watch_job_owners`` notices within seconds that the launcher or the agent has ended;
* ``StopRequested`` takes a stop from the launcher's stop file alone (a signal that never arrived), acknowledges
  it, counts the file entry and its signal as one request, and exits at once on a second request.
"""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil

from megatron_rl.lifeline import StopChannel, watch_job_owners
from megatron_rl.testing.processes import kill_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gone_within(pid, seconds):
    try:
        psutil.Process(pid).wait(timeout=seconds)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def test_command_dies_with_its_launcher_even_on_sigkill():
    launcher = subprocess.Popen(
        ["bash", "-c", f'"{sys.executable}" -m megatron_rl.lifeline --parent $$ -- sleep 120 & echo $!; wait'],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(launcher.stdout.readline())
        deadline = time.time() + 30
        while psutil.Process(child).name() != "sleep":  # exec'd: the same pid now runs the command
            assert time.time() < deadline
            time.sleep(0.05)
        assert os.getsid(child) == child  # its own session: the launcher's process group does not hold it
        launcher.kill()
        launcher.wait()
        assert _gone_within(child, 5), "the command outlived its launcher"
    finally:
        kill_job(launcher)


def test_command_does_not_start_under_another_parent():
    r = subprocess.run([sys.executable, "-m", "megatron_rl.lifeline", "--parent", "1", "--", "echo", "started"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "started" not in r.stdout
    assert "launcher pid 1 has already ended" in r.stderr


def test_command_starts_when_it_already_leads_its_process_group():
    # a shell with job control (set -m) starts each background job as the leader of its own process group
    r = subprocess.run([sys.executable, "-m", "megatron_rl.lifeline", "--parent", str(os.getpid()), "--", "echo",
                        "started"], capture_output=True, text=True, timeout=60, process_group=0)
    assert r.returncode == 0 and r.stdout == "started\n", r.stderr


def test_rank_notices_its_launcher_ended():
    launcher = subprocess.Popen(["sleep", "120"])
    ended = threading.Event()
    messages = []
    watch_job_owners({"TORCHELASTIC_RUN_ID": "x", "MEGATRON_RL_AGENT_PID": str(os.getppid()),
                      "MEGATRON_RL_LAUNCHER_PID": str(launcher.pid)},
                     on_orphan=lambda m: (messages.append(m), ended.set()), poll_s=0.2)
    time.sleep(0.5)
    assert not ended.is_set()
    launcher.kill()
    launcher.wait()
    assert ended.wait(5)
    assert f"launch/torchrun.sh (pid {launcher.pid}) has ended" in messages[0]


def test_rank_started_after_its_agent_died_exits():
    gone = subprocess.Popen(["true"])
    gone.wait()
    ended = threading.Event()
    watch_job_owners({"TORCHELASTIC_RUN_ID": "x", "MEGATRON_RL_AGENT_PID": str(gone.pid)},
                     on_orphan=lambda m: ended.set(), poll_s=0.2)
    assert ended.wait(5)


def test_no_watch_outside_torchrun():
    assert watch_job_owners({}) is None


_RANK = textwrap.dedent("""
    import os, signal, sys, time
    from megatron_rl.trainer.signals import StopRequested
    stop = StopRequested(stop_timeout_s=0, rank=0, poll_s=0.1)
    print("ready", flush=True)
    for line in sys.stdin:          # commands from the test: 'wait' polls until a request was taken
        cmd = line.split()
        if cmd[0] == "kill":
            os.kill(os.getpid(), int(cmd[1]))
        deadline = time.time() + 10
        while not stop.requested and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)             # time for a wrongly counted second request to end the process
        print(f"requested={stop.requested} signum={stop.signum}", flush=True)
""")


def _rank(tmp_path):
    env = dict(os.environ, MEGATRON_RL_STOP_FILE=str(tmp_path / "stop"))
    proc = subprocess.Popen([sys.executable, "-c", _RANK], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def _ask(proc, cmd):
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def _write_stop(tmp_path, count, signum):
    (tmp_path / "stop.tmp").write_text(f"{count} {signum}\n")
    os.replace(tmp_path / "stop.tmp", tmp_path / "stop")


def test_stop_file_alone_stops_the_rank_and_is_acknowledged(tmp_path):
    proc = _rank(tmp_path)
    try:
        _write_stop(tmp_path, 1, signal.SIGINT)   # the launcher's request; its signal is lost
        assert _ask(proc, "wait") == f"requested=True signum={int(signal.SIGINT)}"
        pid, signum = (tmp_path / "ack.0").read_text().split()
        assert (int(pid), int(signum)) == (proc.pid, signal.SIGINT)
        # the signal for the same request arrives late: still one request, the rank keeps running
        assert _ask(proc, f"kill {int(signal.SIGINT)}") == f"requested=True signum={int(signal.SIGINT)}"
        assert proc.poll() is None
        _write_stop(tmp_path, 2, signal.SIGINT)   # a second Ctrl-C (its signal lost too): exit now
        assert proc.wait(timeout=10) == 128 + signal.SIGINT
        assert "second signal 2: exiting now without checkpoint" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_signal_first_then_file_is_one_request(tmp_path):
    proc = _rank(tmp_path)
    try:
        _write_stop(tmp_path, 1, signal.SIGTERM)  # the launcher writes the file before it signals
        assert _ask(proc, f"kill {int(signal.SIGTERM)}") == f"requested=True signum={int(signal.SIGTERM)}"
        assert proc.poll() is None and (tmp_path / "ack.0").is_file()
        assert _ask(proc, f"kill {int(signal.SIGTERM)}") == ""   # a second signal from anyone: exit now
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_stop_channel_reads_nothing_before_the_first_request(tmp_path):
    assert StopChannel.from_env({}) is None
    ch = StopChannel.from_env({"MEGATRON_RL_STOP_FILE": str(tmp_path / "stop")})
    assert ch.read() == (0, None)
    _write_stop(tmp_path, 3, 15)
    assert ch.read() == (3, 15)
