"""How a job entry point (``train``, ``score``) reports a config error on every rank of a launch.

    except ConfigError as exc:
        return config_error_exit(exc, "megatron_rl.train", args.config, overrides)

torchrun lists every rank that did not exit 0 in its summary -- ranks it stops with SIGTERM included -- so
one config error printed by 8 ranks ends as 8 copies plus 8 blocks of summary. Instead, one rank reports:

* an error every rank computes alike from the config text (a bad value, an unknown key, a layout): global
  rank 0 prints it, writes it into torchrun's error file ($TORCHELASTIC_ERROR_FILE, so the summary's root
  cause shows the config error, not ``<N/A>``) and exits 2 after ``REPORTER_DELAY_S``; every other rank
  exits 0 at once, so the summary lists one failure;
* an error that depends on the node's files (``actor.load_hf``, ``data.path``, the config file): local
  rank 0 of every node reports it for its node the same way (a node where the path exists cannot leave the
  others waiting), the other ranks of the node exit 0.

Started without a launcher, a config written for several ranks does not get "world_size=1 is not divisible
...": the message says how to launch it (torchrun / launch/torchrun.sh with the ``cluster:`` section's ranks)
and lists the problems the file has at that size, if any.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import List, Optional, Sequence

from megatron_rl.config import ConfigError, launch_world_size
from megatron_rl.plan import collect_job_config, world_errors

#: Seconds the reporting rank waits before it exits 2, so that the quiet ranks have exited 0 by then.
REPORTER_DELAY_S = 3.0
#: Keys whose errors depend on the node's file system.
NODE_LOCAL_KEYS = ("actor.load_hf", "data.path", "config file")


def _env_int(names: Sequence[str], env=None) -> int:
    env = os.environ if env is None else env
    for var in names:
        if env.get(var, "").strip().isdigit():
            return int(env[var])
    return 0


def launch_rank(env=None) -> int:
    """Global rank from torchrun ($RANK) or srun ($SLURM_PROCID); 0 when not launched."""
    return _env_int(("RANK", "SLURM_PROCID"), env)


def reports_config_error(message: str, env=None) -> bool:
    """Whether this rank is the one that prints ``message`` (see the module docstring)."""
    if any(k in message for k in NODE_LOCAL_KEYS):
        return _env_int(("LOCAL_RANK", "SLURM_LOCALID"), env) == 0
    return launch_rank(env) == 0


def _user_args(subcommand: str) -> List[str]:
    argv = list(sys.argv[1:])
    return argv[1:] if argv[:1] == [subcommand] else argv


def launch_hint(module: str, path: Optional[str], overrides: Sequence[str]) -> Optional[str]:
    """When this process was not started by a launcher and the config needs more than one rank: how to
    launch it, plus the problems it has at the ``cluster:`` world size. None otherwise."""
    if launch_world_size() is not None:
        return None
    try:
        cfg, errors = collect_job_config(path, overrides, world_size="cluster")
    except ConfigError:
        return None
    if not world_errors(cfg, 1):
        return None
    c = cfg.cluster
    args = " ".join(shlex.quote(a) for a in _user_args(module.rsplit(".", 1)[-1]))
    nodes = f" --nnodes {c.nodes}" if c.nodes > 1 else ""
    lines = [f"not started by torchrun / srun, but this config runs on {c.world_size} ranks (cluster: {c.nodes} "
             f"node(s) x {c.gpus_per_node} {c.device} rank(s)). Launch it with",
             f"    torchrun{nodes} --nproc-per-node {c.gpus_per_node} -m {module} {args}"]
    if module == "megatron_rl.train":
        lines.append(f"  or launch/torchrun.sh{nodes} --nproc-per-node {c.gpus_per_node} {args}"
                     + ("  (multi-node: see launch/torchrun.sh --help)" if c.nodes > 1 else ""))
    errors = [e for e in errors if e not in world_errors(cfg, c.world_size)]
    if errors:
        lines.append(f"The config also has {len(errors)} problem(s) at that size:")
        lines += [f"  - {e}" for e in errors]
    return "\n".join(lines)


def _write_torchelastic_error(prog: str, message: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"ConfigError: {message}",
                        "extraInfo": {"py_callstack": f"{prog}: {message}", "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as fh:
            json.dump(data, fh)
    except OSError:
        pass


def config_error_exit(exc: ConfigError, module: str, path: Optional[str], overrides: Sequence[str]) -> int:
    """Report ``exc`` once per launch (see the module docstring); returns the exit status: 2 on the
    reporting rank, 0 on the others."""
    prog = "megatron-rl " + module.rsplit(".", 1)[-1]
    message = launch_hint(module, path, overrides) or str(exc)
    if not reports_config_error(message):
        return 0  # the reporting rank fails the job; exiting 0 keeps this rank out of torchrun's summary
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    if launch_world_size() is not None:
        _write_torchelastic_error(prog, message)
        time.sleep(REPORTER_DELAY_S)
    return 2
