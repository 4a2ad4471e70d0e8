"""Entry point of RL training: ``python -m megatron_rl.train --config X.yaml [key.sub=value ...]``.

Launch with torchrun (or srun, one task per GPU) — every rank runs this module::

    torchrun --nproc-per-node 4 -m megatron_rl.train --config configs/tiny_cpu.yaml trainer.steps=50

The config is loaded and validated against $WORLD_SIZE before any process group is created, so a bad
value fails in seconds with the dotted key named; so do a ``trainer.run_dir`` holding another run's outputs
(unless ``--resume`` or ``trainer.overwrite=true``), a ``data.reward_fn`` that cannot import and a
``data.val_files`` file with no usable row.
``--resume`` continues from the newest complete checkpoint in ``trainer.run_dir``. ``--check-world-size N``
runs these checks alone for N ranks and exits (0 silently, 2 with the problems): ``launch/torchrun.sh``
runs it before starting torchrun. Same as ``megatron-rl train``.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import List, Optional, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank, set before torch is imported

from megatron_rl.cli.build_hint import build_command  # noqa: E402
from megatron_rl.cli.config_errors import config_error_exit  # noqa: E402
from megatron_rl.cli.entry import module_main, register  # noqa: E402
from megatron_rl.config import ConfigError  # noqa: E402
from megatron_rl.plan import collect_job_config, load_job_config  # noqa: E402
from megatron_rl.config.epochs import epochs_line  # noqa: E402
from megatron_rl.lifeline import watch_job_owners  # noqa: E402
from megatron_rl.parallel.state import shutdown_distributed  # noqa: E402
from megatron_rl.platform.warnings import install_known_message_filter  # noqa: E402
from megatron_rl.tasks.custom import task_import_error  # noqa: E402
from megatron_rl.tasks.reward_fn import reward_import_error  # noqa: E402
from megatron_rl.tasks.val_set import val_file_problems  # noqa: E402
from megatron_rl.trainer.loop import train  # noqa: E402
from megatron_rl.trainer.run_dir import run_dir_error  # noqa: E402
from megatron_rl.trainer.signals import StopRequested  # noqa: E402


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments shared by ``python -m megatron_rl.train`` and ``megatron-rl train``."""
    p.add_argument("--config", required=False, default=None, help="YAML job config (see configs/)")
    # two flags, not one with an optional value: `--resume key=value` must leave the override alone
    p.add_argument("--resume", dest="resume", action="store_const", const="true", default=None,
                   help="continue from the newest complete checkpoint in trainer.run_dir (none there: a new run at "
                        "step 0)")
    p.add_argument("--resume=required", dest="resume", action="store_const", const="required",
                   help="the same, but a run_dir without a complete checkpoint is refused")
    p.add_argument("--check-only", action="store_true", help="validate the config and exit")
    p.add_argument("--check-world-size", type=int, default=None, metavar="N",
                   help="validate for N ranks (config, run directory, reward imports) and exit: silent when OK, "
                        "the problems alone and status 2 otherwise (what launch/torchrun.sh runs first)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-5 trainer.steps=10")


def run(args: argparse.Namespace) -> int:
    """Load + validate, then train; returns the exit code."""
    install_known_message_filter()  # megatron's known CPU notices: once, on rank 0
    watch_job_owners()  # under torchrun: exit when the agent or launch/torchrun.sh has ended
    overrides = list(args.overrides) + ([f"trainer.resume={args.resume}"] if args.resume else [])
    restart = restart_count()
    if restart > 0:  # an elastic restart / Slurm requeue continues its own run: never wiped; `required` kept
        overrides += [f"trainer.resume={'required' if args.resume == 'required' else 'true'}",
                      "trainer.overwrite=false"]
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[megatron-rl] restart {restart} of this job: continuing from its newest complete checkpoint, if "
                  f"it has one", flush=True)
    if args.check_world_size is not None:  # before torchrun: every problem at once, the message alone
        return _launch_check(args.config, overrides, args.check_world_size)
    try:
        cfg = load_job_config(args.config, overrides, world_size=args.check_world_size)
        problems = start_problems(cfg)
        if problems:
            raise ConfigError("cannot start:\n  - " + "\n  - ".join(problems))
    except ConfigError as exc:  # once per launch, with how to launch when torchrun was forgotten
        return config_error_exit(exc, "megatron_rl.train", args.config, overrides)
    if cfg.trainer.epochs is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"[megatron-rl] {epochs_line(cfg)}", flush=True)
    if args.check_only:
        print("config OK")
        return 0
    # SIGTERM / SIGINT from here on (also while the job is built) stop the job after its first step, with a
    # checkpoint; under launch/torchrun.sh a signal that came earlier (ignored until now) is in the stop file
    stop = StopRequested(stop_timeout_s=cfg.trainer.stop_timeout_s)
    try:
        train(cfg, stop)
    finally:
        stop.restore()
    shutdown_distributed()
    return 0


def restart_count() -> int:
    """How many times the launcher restarted this job (torchrun ``--max-restarts``: TORCHELASTIC_RESTART_COUNT;
    a Slurm requeue: SLURM_RESTART_COUNT); 0 for a first start."""
    counts = [os.environ.get(k, "0") for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")]
    return max(int(c) if c.strip().isdigit() else 0 for c in counts)


def start_problems(cfg) -> List[str]:
    """What stops a valid config from starting here, found before any process group exists: a run directory
    holding another run's outputs, a reward function that cannot import, a validation file with no usable row."""
    t = cfg.trainer
    problems = [run_dir_error(t.run_dir, t.resume, t.overwrite), reward_import_error(cfg.data.reward_fn),
                task_import_error(cfg.data.task, cfg.data.task_kwargs), *val_file_problems(cfg.data)]
    return [p for p in problems if p]


def launch_problems(path: Optional[str], overrides: List[str], world_size: int) -> Tuple[List[str], Optional[str]]:
    """(every problem that stops the job at ``world_size``, how to build a missing ``actor.load_hf``): the config's
    own problems and the start problems (run directory, reward import, validation files) together -- a launcher
    lists them all at once, as ``megatron-rl check`` does, not one per attempt. Raises ConfigError when the file
    itself cannot be read."""
    cfg, problems = collect_job_config(path, overrides, world_size=world_size)
    keys = {_key(p) for p in problems}
    try:
        start = start_problems(cfg)
    except Exception as exc:  # noqa: BLE001 - a start check on a config that is already invalid
        start = [] if problems else [f"cannot start: {type(exc).__name__}: {exc}"]
    problems += [p for p in start if _key(p) not in keys]
    hint = build_command(path, cfg) if any(p.startswith("actor.load_hf:") for p in problems) else None
    return problems, hint


def _key(problem: str) -> str:
    """The dotted key a problem names first (``data.reward_fn: ...`` and ``data.reward_fn='x' ...`` alike)."""
    return re.split(r"[:= ]", problem, maxsplit=1)[0]


def _launch_check(path: Optional[str], overrides: List[str], world_size: int) -> int:
    try:
        problems, hint = launch_problems(path, overrides, world_size)
    except ConfigError as exc:
        print(f"megatron-rl train: {exc}", file=sys.stderr, flush=True)
        return 2
    if not problems:
        return 0
    print(f"megatron-rl train: {len(problems)} problem(s) at world size {world_size}:\n  - " + "\n  - ".join(problems),
          file=sys.stderr, flush=True)
    if hint:
        print(f"hint: build actor.load_hf first: {hint}", file=sys.stderr, flush=True)
    return 2


def add_parser(subparsers) -> None:
    """Register ``megatron-rl train``."""
    register(subparsers, "train", "RL training (run under torchrun / srun)", __doc__, add_arguments, run)


def main(argv: Optional[List[str]] = None) -> int:
    # torch's @record: under torchrun the failing rank's exception becomes the job summary's root cause
    # (imported here: torch is heavy and `megatron-rl --help` builds this module's parser)
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(module_main)("python -m megatron_rl.train", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
