"""Process-group start-up from the launcher's environment (torchrun or Slurm srun, one task per GPU).

* torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
* ``srun --ntasks-per-node=<gpus>`` sets SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NODELIST
  (the master is the first host of the compact node list; MASTER_PORT defaults to 29500).
* neither: one process ("single"); its store listens on any free port unless MASTER_PORT is set (two
  single-process jobs on one machine must not meet at 29500).

Usage::

    env = resolve_launch_env()          # pure: reads os.environ (or a given mapping)
    init_distributed()                  # NCCL on GPU (sets the CUDA device: cuda_device_index), gloo on CPU

``parse_slurm_nodelist("node[01-03,07],gpu5")`` -> ["node01", "node02", "node03", "node07", "gpu5"].
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional

import torch

__all__ = ["LaunchEnv", "parse_slurm_nodelist", "resolve_launch_env", "init_distributed", "cuda_device_index"]

DEFAULT_MASTER_PORT = 29500


def _split_top_level(s: str) -> List[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM_NODELIST {s!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"SLURM_NODELIST {s!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p for p in (x.strip() for x in parts) if p]


def _expand_ranges(body: str, full: str) -> List[str]:
    out = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise ValueError(f"SLURM_NODELIST {full!r}: bad range {item!r} (expected N or N-M)")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"SLURM_NODELIST {full!r}: descending range {item!r}")
        width = len(lo)  # zero padding follows the lower bound, as Slurm does
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def parse_slurm_nodelist(nodelist: str) -> List[str]:
    """Expand a Slurm compact host list (``a[1-3,7]b[01-02],c``; brackets may appear several times
    in one name, expanded as a product in order) into host names, in Slurm's order."""
    if not nodelist or not nodelist.strip():
        raise ValueError("SLURM_NODELIST is empty")
    hosts: List[str] = []
    for part in _split_top_level(nodelist.strip()):
        names = [""]
        for m in re.finditer(r"([^\[\]]+)|\[([^\[\]]*)\]", part):
            if m.group(1) is not None:
                names = [n + m.group(1) for n in names]
            else:
                names = [n + x for n in names for x in _expand_ranges(m.group(2), nodelist)]
        hosts.extend(names)
    return hosts


@dataclass
class LaunchEnv:
    """Where this process sits in the job, resolved from the launcher's environment."""

    rank: int
    """Global rank (RANK or SLURM_PROCID)."""
    local_rank: int
    """Rank on this node = GPU index (LOCAL_RANK or SLURM_LOCALID)."""
    world_size: int
    """Total processes (WORLD_SIZE or SLURM_NTASKS)."""
    master_addr: str
    """Rendezvous host (MASTER_ADDR, else first host of SLURM_NODELIST / SLURM_JOB_NODELIST)."""
    master_port: int
    """Rendezvous port (MASTER_PORT, default 29500; a single process without MASTER_PORT: 0, any free port)."""
    launcher: str
    """'torchrun', 'slurm' or 'single' (no launcher variables: one process)."""


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def resolve_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Resolve rank / world / master from torchrun variables, else Slurm's, else a single process.
    Raises ValueError naming the variable when values are missing or inconsistent."""
    env = os.environ if env is None else env
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        addr = env.get("MASTER_ADDR", "127.0.0.1")
    elif "SLURM_PROCID" in env:
        launcher = "slurm"
        missing = [k for k in ("SLURM_NTASKS", "SLURM_LOCALID") if k not in env]
        if missing:
            raise ValueError(f"Slurm launch: SLURM_PROCID is set but {missing} are not "
                             f"(run one task per GPU with srun)")
        rank, world, local = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID")
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        else:
            nodelist = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise ValueError("Slurm launch: neither MASTER_ADDR nor SLURM_NODELIST is set")
            addr = parse_slurm_nodelist(nodelist)[0]
    else:
        launcher, rank, world, local = "single", 0, 1, 0
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            port = 0  # nobody else joins: the store takes a free port (a fixed one collides with another job's)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{launcher} launch: rank={rank} is outside world_size={world}")
    if local < 0:
        raise ValueError(f"{launcher} launch: local rank {local} < 0")
    return LaunchEnv(rank=rank, local_rank=local, world_size=world, master_addr=addr,
                     master_port=port, launcher=launcher)


def cuda_device_index(launch: LaunchEnv, visible: int) -> int:
    """The CUDA device of this rank among the ``visible`` ones: its local rank when the node's GPUs are all
    visible; 0 when a Slurm task sees exactly one GPU (``srun --gpus-per-task=1`` / ``--gpu-bind`` give each task
    its own device as index 0). ``RuntimeError`` naming the local rank and the count otherwise."""
    if 0 <= launch.local_rank < visible:
        return launch.local_rank
    if visible == 1 and launch.launcher == "slurm":
        return 0
    raise RuntimeError(f"{launch.launcher} launch: local rank {launch.local_rank} but only {visible} GPU(s) visible to "
                       f"this process (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                       f"give each node's ranks all its GPUs, or each Slurm task exactly one")


def init_distributed(backend: Optional[str] = None, timeout_s: float = 1800.0,
                     env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Create the default process group from the launcher environment (no-op if one exists).

    NCCL with ``torch.cuda.set_device(local_rank)`` when CUDA is available, gloo otherwise (megatron's CPU
    patches come with ``initialize_model_parallel``). ``timeout_s`` bounds every collective of the group
    (``trainer.collective_timeout_s``). Returns the resolved ``LaunchEnv``."""
    import torch.distributed as dist

    launch = resolve_launch_env(env)
    if dist.is_initialized():
        if dist.get_world_size() != launch.world_size or dist.get_rank() != launch.rank:
            raise RuntimeError(f"process group already initialised as rank {dist.get_rank()}/"
                               f"{dist.get_world_size()}, environment says {launch.rank}/{launch.world_size}")
        return launch
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(cuda_device_index(launch, torch.cuda.device_count()))
    dist.init_process_group(
        backend=backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank, world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return launch
