"""``launch/slurm.sbatch`` for real: a private Slurm controller and node daemon (``megatron_rl.testing.slurm``)
run ``sbatch launch/slurm.sbatch`` on the tiny copy-task config (2 gloo ranks through torchrun, embedded engine),
and the job's metrics equal those of the same config started directly with ``launch/torchrun.sh`` (same seed;
timings excluded) — the reference run is an independent launch of the same job outside Slurm. A second job
starts an SGLang server with ``SGLANG_MODE=colocated`` (srun step, ``launch/sglang_server.sh``) and syncs weights
to it in ``distributed`` mode. Both jobs run on one private cluster (the ``slurm_cluster`` fixture); the reference
job (``tiny_reference``, made once per test run) runs while the first Slurm job does.

Skipped with the reason when ``slurm-wlm`` is missing and cannot be installed (needs root + apt-get).
One node only: Debian's slurmd is built without multiple-slurmd support, so the several-host part of the
cluster path is covered by tests/integration/test_multihost.py (network namespaces).
"""
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.rollout.sglang_server import find_free_port, sglang_available, sglang_python
from megatron_rl.testing.slurm import SlurmCluster, ensure_slurm_installed
from tests.integration.test_train_loop_sglang import _assert_step1_kl_matches_hf_fp32

pytestmark = [pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")

#: Overrides of configs/tiny_cpu.yaml for a 2-rank (DP=2) job of 2 small steps.
TINY = ["cluster.gpus_per_node=2", "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
        "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "actor.micro_batch_size=8", "trainer.steps=2",
        "trainer.save_interval=0", "trainer.progress=false", "actor.ppo_mini_batches=1",
        "algorithm.filter_groups.enable=false"]


def comparable(metrics):
    """Metrics without wall-clock values (timing/*, perf/*, time)."""
    return [{k: v for k, v in m.items() if k != "time" and not k.startswith(("timing/", "perf/"))} for m in metrics]


def metric_differences(got, ref):
    """``[(step, key, got, ref)]`` where two runs' comparable metrics differ (empty when equal)."""
    out = [(i + 1, "<steps>", len(got), len(ref))] if len(got) != len(ref) else []
    for i, (g, r) in enumerate(zip(comparable(got), comparable(ref))):
        out += [(i + 1, k, g.get(k), r.get(k)) for k in sorted(set(g) | set(r)) if g.get(k) != r.get(k)]
    return out


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def tiny_model(path):
    from megatron_rl.tasks.char_tokenizer import build_task_model

    return build_task_model(str(path), task="copy", seed=0, hidden_size=64, num_layers=2)


def torchrun_reference(tmp, model, extra=(), timeout=500):
    """The tiny job started directly with launch/torchrun.sh (2 ranks): its metrics."""
    run = tmp / "ref_run"
    r = subprocess.run(["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "--nproc-per-node", "2", "--log-dir",
                        str(tmp / "ref_logs"), "--config", CONFIG, *TINY, f"actor.load_hf={model}",
                        f"trainer.run_dir={run}", *extra],
                       # CHECK=0: the reference's metrics do not depend on the launcher's config check (one
                       # interpreter start less; the Slurm job under test runs its check)
                       cwd=ROOT, env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", CHECK="0"),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    return metrics


class TinyReference:
    """The tiny model and its job launched directly with launch/torchrun.sh on 2 ranks of one host: the reference
    of the Slurm and several-host jobs of the same model and config, made once per test run. Under pytest-xdist
    the workers share it through the run's common temp directory and a lock file: the first worker that needs a
    piece makes it, the others wait for it and read it."""

    def __init__(self, root: Path):
        self.dir = root / "tiny_reference"
        self.model = str(self.dir / "model")      #: the tiny model's HF directory (``tiny_model``)
        self.run_dir = self.dir / "ref_run"       #: the reference job's trainer.run_dir
        self.log_dir = self.dir / "ref_logs"      #: its torchrun --log-dir (per-rank logs)
        self._lock = root / "tiny_reference.lock"
        self._metrics = None
        self._made("model", lambda: tiny_model(self.model))

    def _made(self, piece, make):
        """Run ``make`` once per test run (under the lock; a piece whose maker failed is made again)."""
        done = self.dir / f"{piece}.done"
        if done.exists():   # made: no wait for a worker that holds the lock for another piece
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self._lock, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                make()
                done.touch()

    def metrics(self):
        """The reference job's metrics (the job runs on the first call of the test run; later calls read them)."""
        if self._metrics is None:
            def make():
                shutil.rmtree(self.run_dir, ignore_errors=True)
                shutil.rmtree(self.log_dir, ignore_errors=True)
                torchrun_reference(self.dir, self.model)
            self._made("ref_run", make)
            self._metrics = read_metrics(self.run_dir)
        return self._metrics


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """The run's ``TinyReference`` (model built now; the reference job on the first ``.metrics()``)."""
    base = tmp_path_factory.getbasetemp()
    return TinyReference(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """One private Slurm cluster for this file's jobs (skipped when slurm-wlm cannot be installed)."""
    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=os.cpu_count()) as cluster:
        yield cluster


@pytest.mark.timeout(1200)
def test_sbatch_slurm_script_matches_torchrun(tmp_path, slurm_cluster, tiny_reference):
    cluster, model = slurm_cluster, tiny_reference.model
    run = tmp_path / "slurm_run"
    out = tmp_path / "job.out"
    job = cluster.sbatch(["--nodes=1", "--gpus-per-node=0", f"--output={out}", "--chdir", ROOT,
                          os.path.join(ROOT, "launch", "slurm.sbatch"), "--config", CONFIG, *TINY,
                          f"actor.load_hf={model}", f"trainer.run_dir={run}"],
                         cwd=ROOT, env={"GPUS_PER_NODE": "2", "LAUNCH_MODE": "torchrun", "PYTHON": sys.executable,
                                        "LOG_DIR": str(tmp_path / "logs"), "OMP_NUM_THREADS": "1",
                                        "RDZV_PORT": str(find_free_port())})
    try:
        ref = tiny_reference.metrics()   # made (unless another test made it already) while the Slurm job runs
    finally:
        state = cluster.wait_job(job, timeout=800)
    text = out.read_text() if out.exists() else "<no job output>"
    assert state == "COMPLETED", f"job {job}: {state}\n{text[-4000:]}\nslurmd: {cluster.log_tail('slurmd')}"
    got = read_metrics(run)
    assert [m["step"] for m in got] == [1, 2], text[-3000:]
    assert not metric_differences(got, ref), metric_differences(got, ref)
    assert "slurm.sbatch" in text and "trainer exited with status 0" in text


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not sglang_available()[0], reason=sglang_available()[1])
def test_sbatch_with_colocated_sglang_server(tmp_path, slurm_cluster, tiny_reference):
    """SGLANG_MODE=colocated: slurm.sbatch starts an SGLang server with srun (through launch/sglang_server.sh, which
    drops the step's SLURM_* variables), waits for it, and the trainer syncs weights to it in ``distributed``
    mode. Step 1's mismatch KL equals HF transformers' fp32 recompute; step 2 runs on the synced weights."""
    cluster, model = slurm_cluster, tiny_reference.model
    run = tmp_path / "slurm_run"
    out = tmp_path / "job.out"
    logs = tmp_path / "logs"
    job = cluster.sbatch(["--nodes=1", "--gpus-per-node=0", f"--output={out}", "--chdir", ROOT,
                          os.path.join(ROOT, "launch", "slurm.sbatch"), "--config", CONFIG, *TINY,
                          f"actor.load_hf={model}", f"trainer.run_dir={run}", "rollout.weight_sync=distributed",
                          "trainer.dump_rollouts=true"],
                         cwd=ROOT, env={"GPUS_PER_NODE": "2", "LAUNCH_MODE": "torchrun", "PYTHON": sys.executable,
                                        "LOG_DIR": str(logs), "OMP_NUM_THREADS": "1", "RDZV_PORT": str(find_free_port()),
                                        "SGLANG_MODE": "colocated", "SGLANG_MODEL": model, "SGLANG_DEVICE": "cpu",
                                        "SGLANG_TP": "1",
                                        "SGLANG_PORT": str(find_free_port()), "SGLANG_READY_TIMEOUT": "500",
                                        "MEGATRON_RL_SGLANG_PYTHON": sglang_python(),
                                        # the config checks (slurm.sbatch's, torchrun.sh's) run in the first job
                                        "CHECK": "0"})
    state = cluster.wait_job(job, timeout=1000)
    text = out.read_text() if out.exists() else "<no job output>"
    server_logs = "".join(p.read_text()[-2000:] for p in logs.glob("sglang-*.log"))
    assert state == "COMPLETED", f"job {job}: {state}\n{text[-4000:]}\nserver: {server_logs}"
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2], text[-3000:]
    with open(run / "rollouts.jsonl") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    assert {r["weight_version"] for r in recs if r["step"] == 2} == {"step-1"}
    _assert_step1_kl_matches_hf_fp32(model, metrics, recs)
