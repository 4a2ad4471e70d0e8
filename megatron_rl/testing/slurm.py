"""A real, private Slurm cluster on this machine for tests: one ``slurmctld`` and one ``slurmd`` (Debian ``slurm-wlm``).

``ensure_slurm_installed()`` installs the packages with apt when they are missing (returns a reason string when
that is impossible, for ``pytest.skip``). ``SlurmCluster(workdir)`` writes its own ``slurm.conf`` (no munge:
``auth/none``, ``cred/none``; process tracking by process group; its own ports and spool directories under
``workdir``), starts both daemons in the foreground as children of this process and waits until the node is
idle; ``stop()`` ends them by pid. Client commands find the cluster through ``env()`` (``SLURM_CONF``). One
cluster runs several jobs in turn: ``wait_job`` reaps the jobs' orphans that a subreaper test process inherits
(``reap_orphans``), which would otherwise hold each job in COMPLETING for 60 s and then drain the node.

Usage::

    with SlurmCluster(tmp_path / "slurm", cpus=2) as cluster:
        job_id = cluster.sbatch(["launch/slurm.sbatch", "--config", "job.yaml"], cwd=repo)
        state = cluster.wait_job(job_id, timeout=600)        # "COMPLETED", "FAILED", ...
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.parallel.child_env import child_environment
from megatron_rl.rollout.sglang_server import find_free_port
from megatron_rl.testing.processes import reap_orphans

__all__ = ["ensure_slurm_installed", "SlurmCluster", "SlurmError"]

_DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "srun", "sinfo")


class SlurmError(RuntimeError):
    """The private cluster did not start or a job could not be submitted; the message names the daemon log."""


def ensure_slurm_installed(timeout_s: float = 600.0) -> Optional[str]:
    """Install ``slurm-wlm`` with apt if its commands are missing. Returns None when ready, else the reason."""
    if all(shutil.which(c) for c in _DAEMONS):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm is not installed and cannot be installed here (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm"]):
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"{' '.join(cmd)} did not finish in {timeout_s:.0f} s"
        if r.returncode != 0:
            return f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-500:]}"
    missing = [c for c in _DAEMONS if not shutil.which(c)]
    return f"slurm-wlm installed but {missing} are not on PATH" if missing else None


class SlurmCluster:
    """One controller and one node daemon with a private configuration under ``workdir``."""

    def __init__(self, workdir, cpus: Optional[int] = None, start_timeout_s: float = 60.0):
        self.workdir = Path(workdir)
        self.cpus = cpus or os.cpu_count() or 1
        self.node = socket.gethostname().split(".")[0]
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.workdir / "slurm.conf"

    def env(self, extra: Optional[dict] = None) -> dict:
        """An environment for Slurm client commands against this cluster (without any outer job's variables)."""
        return child_environment(dict({"SLURM_CONF": str(self.conf)}, **(extra or {})))

    def _write_conf(self) -> None:
        w = self.workdir
        for d in ("state", "spool", "log"):
            (w / d).mkdir(parents=True, exist_ok=True)
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        self.conf.write_text(f"""\
ClusterName=mrltest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={find_free_port()}
SlurmdPort={find_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={w / 'state'}
SlurmdSpoolDir={w / 'spool'}
SlurmctldPidFile={w / 'slurmctld.pid'}
SlurmdPidFile={w / 'slurmd.pid'}
SlurmctldLogFile={w / 'log' / 'slurmctld.log'}
SlurmdLogFile={w / 'log' / 'slurmd.log'}
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
InactiveLimit=0
KillWait=10
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")

    def start(self) -> "SlurmCluster":
        """Write the configuration, start ``slurmctld -D`` and ``slurmd -D``, wait until the node is idle."""
        self._write_conf()
        env = self.env()
        try:
            for name, args in (("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)]),
                               ("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])):
                log = open(self.workdir / "log" / f"{name}.out", "ab")
                self.procs[name] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True)
                log.close()
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        state = ""
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SlurmError(f"{name} exited with {p.returncode}: {self.log_tail(name)}")
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True,
                               timeout=30)
            state = (r.stdout.strip() or r.stderr.strip())
            if r.returncode == 0 and state.rstrip("*") == "idle":
                return
            time.sleep(0.25)
        raise SlurmError(f"node {self.node} not idle after {self.start_timeout_s:.0f} s (sinfo: {state!r}); "
                         f"slurmctld: {self.log_tail('slurmctld')}\nslurmd: {self.log_tail('slurmd')}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of a daemon's log (``slurmctld`` or ``slurmd``)."""
        text = ""
        for f in (self.workdir / "log" / f"{name}.log", self.workdir / "log" / f"{name}.out"):
            if f.exists():
                text += f.read_text(errors="replace")[-chars:]
        return text[-chars:]

    def sbatch(self, args: Sequence[str], cwd=None, env: Optional[dict] = None) -> int:
        """Submit a batch job; returns its id. Refused (``SlurmError``) while the node is not usable (e.g.
        drained by an earlier job): the job would wait for it forever."""
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T %E"], env=self.env(), capture_output=True, text=True,
                           timeout=30)
        state = r.stdout.strip() or r.stderr.strip()
        if r.returncode != 0 or state.startswith(("drain", "down", "fail", "inval")):
            raise SlurmError(f"node {self.node} is not usable (sinfo: {state!r}); slurmd: {self.log_tail('slurmd')}")
        r = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=self.env(env), capture_output=True,
                           text=True, timeout=60)
        if r.returncode != 0:
            raise SlurmError(f"sbatch {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ...)."""
        r = subprocess.run(["scontrol", "show", "job", str(job_id)], env=self.env(), capture_output=True,
                           text=True, timeout=30)
        m = re.search(r"JobState=(\w+)", r.stdout)
        return m.group(1) if m else f"UNKNOWN ({r.stderr.strip()})"

    def wait_job(self, job_id: int, timeout: float, poll_s: float = 1.0) -> str:
        """Wait until the job leaves PENDING/RUNNING/COMPLETING (``scontrol`` every ``poll_s`` s); cancel it past
        ``timeout`` and raise."""
        deadline = time.monotonic() + timeout
        while True:
            reap_orphans()
            state = self.job_state(job_id)
            if state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return state
            if time.monotonic() >= deadline:
                subprocess.run(["scancel", str(job_id)], env=self.env(), timeout=30)
                raise SlurmError(f"job {job_id} still {state} after {timeout:.0f} s (cancelled)")
            time.sleep(poll_s)

    def stop(self) -> None:
        """Stop the daemons by pid (slurmd first): SIGTERM, then SIGKILL after 15 s."""
        for name in ("slurmd", "slurmctld"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
