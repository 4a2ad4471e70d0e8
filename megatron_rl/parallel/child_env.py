"""The environment of every process the project starts: the parent's, minus the launcher's rendezvous variables.

A trainer rank started by torchrun or srun carries variables that say "you are rank R of a job of W processes,
meet the others at MASTER_ADDR:MASTER_PORT" (torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_*``,
``ROLE_*``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_*`` — ``TORCHELASTIC_USE_AGENT_STORE=True`` turns
every ``tcp://`` store torch makes into a client of the agent's store; Slurm: ``SLURM_*``, ``PMI_*``, ``PMIX_*``).
A child that inherits them believes it is part of the job: an SGLang server's scheduler waits forever at
"Init parallel begin" as a client of a store nobody serves. ``child_environment()`` is the one place that
decides what a child keeps; everything that spawns a process (SGLang servers, reward workers, the launch
scripts through this file run as a script) uses it.

Usage::

    subprocess.Popen(cmd, env=child_environment({"OMP_NUM_THREADS": "1"}))

As a script (stdlib only, so any interpreter can run it without importing the package)::

    python megatron_rl/parallel/child_env.py -- CMD ARGS...   # exec CMD (same pid) in the cleaned environment
"""
from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

__all__ = ["LAUNCHER_VARIABLES", "LAUNCHER_PREFIXES", "is_launcher_variable", "launcher_variables",
           "child_environment"]

#: Exact names set by torchrun / torch.distributed.elastic for its workers.
LAUNCHER_VARIABLES = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT",
})

#: Name prefixes of launcher variables: torchrun's role and elastic-agent variables, Slurm's job/step
#: variables and the PMI/PMIx wire-up of MPI-style launchers.
LAUNCHER_PREFIXES = ("ROLE_", "TORCHELASTIC_", "SLURM_", "PMI_", "PMIX_")


def is_launcher_variable(name: str) -> bool:
    """Whether ``name`` belongs to the launcher's rendezvous (a child must not inherit it)."""
    return name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)


def launcher_variables(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The launcher variables present in ``env`` (default ``os.environ``), sorted."""
    env = os.environ if env is None else env
    return sorted(k for k in env if is_launcher_variable(k))


def child_environment(extra: Optional[Mapping[str, str]] = None,
                      base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) without launcher variables, then ``extra`` on top.

    ``extra`` is applied last and is not filtered: a caller that deliberately gives a child a variable
    (e.g. a server's own ``MASTER_PORT``) gets it."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if not is_launcher_variable(k)}
    env.update(extra or {})
    return env


def _main(argv: list[str]) -> None:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: child_env.py -- CMD [ARGS...]  (exec CMD without the launcher's rendezvous variables)")
    try:
        os.execvpe(argv[0], argv, child_environment())
    except OSError as e:
        sys.exit(f"child_env.py: cannot exec {argv[0]!r}: {e}")


if __name__ == "__main__":
    _main(sys.argv[1:])
