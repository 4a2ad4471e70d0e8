"""launch/slurm.sbatch with JUDGE_MODEL (DRY_RUN=1 command lines): the judge servers take the last nodes, run the
judge's model through launch/sglang_server.sh, are waited for, and their URLs reach the job as reward.judge.urls
only -- never rollout.sglang_urls (weight sync would overwrite a judge listed there). The overrides round-trip
through the config loader."""
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Q7 = "configs/qwen2.5_7b_1x8.yaml"
SLURM = {"DRY_RUN": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_GPUS_ON_NODE": "8",
         "SLURM_NNODES": "3"}


def _run(env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGLANG_", "JUDGE_", "MASTER_", "RDZV",
                                                                  "LAUNCH_MODE", "DRY_RUN", "CHECK"))}
    e.update({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env})
    return subprocess.run(["bash", os.path.join(ROOT, "launch", "slurm.sbatch"), "--config", Q7], capture_output=True,
                          text=True, env=e, cwd=ROOT, timeout=300)


def _cmds(stdout):
    return [shlex.split(line[2:].rstrip(" &")) for line in stdout.splitlines()
            if line.startswith("+ ") and not line.startswith("+ wait_ready")]


def test_judge_servers_on_their_own_nodes_never_weight_synced():
    r = _run(dict(SLURM, CHECK="0", SGLANG_MODE="separate", SGLANG_MODEL="/ckpt/q7", JUDGE_MODEL="/ckpt/judge",
                  JUDGE_TP="4", JUDGE_EXTRA_ARGS="--context-length 4096"))
    assert r.returncode == 0, r.stderr
    server, judge, train = _cmds(r.stdout)
    assert server[server.index("--model") + 1] == "/ckpt/q7" and "--nodelist=gpu08" in server
    assert judge == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu09", "--output=logs/4242/judge-gpu09.log",
                     os.path.join(ROOT, "launch", "sglang_server.sh"), "--model", "/ckpt/judge", "--host", "0.0.0.0",
                     "--port", "30100", "--tp", "4", "--", "--context-length", "4096"]
    assert "wait_ready: curl -sf -m 5 http://gpu08:30000/health" in r.stdout
    assert "wait_ready: curl -sf -m 5 http://gpu09:30100/health" in r.stdout
    assert "--nodelist=gpu07" in train and "--nnodes" in train and train[train.index("--nnodes") + 1] == "1"
    ovs = train[train.index("--config") + 2:]
    assert ovs == ["rollout.engine=sglang", 'rollout.sglang_urls=["http://gpu08:30000"]', "reward.judge.enable=true",
                   'reward.judge.urls=["http://gpu09:30100"]']
    from megatron_rl.config.load import apply_overrides, read_config_file   # the loader reads them back
    tree = apply_overrides(read_config_file(Q7), ovs)
    assert tree["reward"]["judge"]["urls"] == ["http://gpu09:30100"]
    assert tree["rollout"]["sglang_urls"] == ["http://gpu08:30000"]


def test_judge_nodes_must_leave_training_nodes():
    r = _run(dict(SLURM, CHECK="0", JUDGE_MODEL="/ckpt/judge", JUDGE_NODES="3"))
    assert r.returncode == 2 and "JUDGE_NODES=3 must be in [1, 3)" in r.stderr
    r = _run(dict(SLURM, CHECK="0", JUDGE_MODEL="/ckpt/judge", JUDGE_NODES="2", SGLANG_MODE="separate",
                  SGLANG_MODEL="/ckpt/q7"))
    assert r.returncode == 2 and "SGLANG_NODES=1 must be in [1, 1)" in r.stderr
