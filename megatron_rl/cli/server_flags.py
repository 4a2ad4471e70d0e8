"""The ``launch/sglang_server.sh`` options a job's SGLang servers need, read from the job's config.

    python -m megatron_rl.cli.server_flags CONFIG [key.sub=value ...]    # one option per line

``launch/slurm.sbatch`` starts its servers with these (then ``SGLANG_EXTRA_ARGS``):

* ``--routed-experts`` when ``actor.routing_replay: r3``: the server returns each token's routed experts
  (SGLang's ``--enable-return-routed-experts``), which r3 replays; ``SGLangEngine`` refuses a server without it
  when the job is built;
* ``--delta-loader`` when ``rollout.weight_sync_delta``: the server registers our delta-sync loader;
* ``--lora-rank R`` / ``--lora-targets LIST`` when ``rollout.lora_sync: adapter`` with ``rollout.engine: sglang``:
  the server serves ``actor.lora``'s adapters (``--enable-lora``, ``rollout.sglang_lora_flags``).
"""
from __future__ import annotations

import sys
from typing import List, Optional, Sequence

from megatron_rl.config import ConfigError
from megatron_rl.config.load import read_job_config
from megatron_rl.plan import replay_of
from megatron_rl.plan.checks import Unbuilt
from megatron_rl.rollout.sglang_lora_flags import adapter_lora, sglang_lora_targets

__all__ = ["server_options", "main"]


def server_options(cfg) -> List[str]:
    """The ``launch/sglang_server.sh`` options the servers of job config ``cfg`` need."""
    options = ["--routed-experts"] if replay_of(cfg).needs_rollout_routing else []  # the plan's replay mode
    options += ["--delta-loader"] if cfg.rollout.weight_sync_delta else []
    lora = adapter_lora(cfg.actor.lora, cfg.rollout)
    if lora is not None:
        options += ["--lora-rank", str(int(lora.rank)), "--lora-targets", ",".join(sglang_lora_targets(lora))]
    return options


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print ``server_options`` of ``CONFIG [overrides]``; exit 2 naming the problem when the file cannot be read
    (other config problems are ``megatron-rl check``'s to report)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    try:
        # the two keys read here need no checks across keys (megatron-rl check runs those before any server)
        cfg, _ = read_job_config(args[0], args[1:])
    except ConfigError as exc:
        print(f"server_flags: {exc}", file=sys.stderr)
        return 2
    try:
        options = server_options(cfg)
    except ValueError as exc:  # a LoRA target SGLang has no module for (megatron-rl check refuses it too)
        print(f"server_flags: {exc}", file=sys.stderr)
        return 2
    except Unbuilt as exc:  # actor.routing_replay refused for this model (megatron-rl check names it too)
        print(f"server_flags: {'; '.join(exc.problems)}", file=sys.stderr)
        return 2
    for option in options:
        print(option)
    return 0


if __name__ == "__main__":
    sys.exit(main())
