"""Score recorded rollouts (metrics-only mode): ``megatron-rl score --config X --rollouts R.jsonl --out S.jsonl``.

Run under torchrun like training (any parallel layout in the config)::

    torchrun --nproc-per-node 4 -m megatron_rl.score --config configs/tiny_cpu.yaml \\
        --rollouts runs/tiny_cpu/rollouts.jsonl --checkpoints runs/tiny_cpu/checkpoints --out scored.jsonl

Input: one JSON object per line with ``prompt_ids``, ``response_ids`` and ``rollout_log_probs`` (one per
response token, e.g. saved from SGLang's ``output_token_logprobs``; training writes this format with
``trainer.dump_rollouts=true``). The actor recomputes every response token's log-prob at the configured
layout and temperature (``rollout.temperature``), ``algorithm.rollout_correction`` runs over the whole
file (exact global metrics), and rank 0 writes ``--out`` (each input record plus ``train_log_probs``)
and prints the ``rollout_corr/*`` metrics — diagnose an engine's mismatch before training with it.

Weight versions: records written by training carry ``weight_version`` ("step-N": generated with the
weights after N steps). Records are only scored against the weights that generated them:

* one version (or none recorded): scored with the config's weights (``actor.load_hf``); a version other
  than "step-0" prints a warning unless ``--checkpoints`` loads ``step_N``;
* several versions: ``--checkpoints RUN_DIR/checkpoints`` scores each version's records with its own
  checkpoint (``step_N``; "step-0" = ``actor.load_hf``) and prints the metrics per version; or
  ``--weight-version V`` (repeatable) keeps only those versions' records (the rest are counted in a
  warning). Without either the file is refused, listing its versions.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank, set before torch is imported

import torch.distributed as dist  # noqa: E402

from megatron_rl.actor import RolloutBatch  # noqa: E402
from megatron_rl.actor.schedule import actor_device  # noqa: E402
from megatron_rl.cli.config_errors import config_error_exit, launch_rank  # noqa: E402
from megatron_rl.cli.entry import module_main, register  # noqa: E402
from megatron_rl.config import ConfigError  # noqa: E402
from megatron_rl.plan import load_job_config  # noqa: E402
from megatron_rl.correction import compute_rollout_correction  # noqa: E402
from megatron_rl.jsonl import read_json_objects  # noqa: E402
from megatron_rl.parallel.state import shutdown_distributed  # noqa: E402
from megatron_rl.platform.warnings import install_known_message_filter  # noqa: E402
from megatron_rl.trainer.job import setup_distributed  # noqa: E402

#: Version of the weights before the first step (the config's actor.load_hf).
INITIAL_VERSION = "step-0"


def read_rollouts(path: str) -> List[dict]:
    """Records of a rollouts JSONL file; errors name the line and the missing / bad field."""
    if not os.path.isfile(path):
        raise ValueError(f"--rollouts: {path!r} does not exist")
    out = []
    for i, rec in read_json_objects(path):
        for k in ("prompt_ids", "response_ids", "rollout_log_probs"):
            if k not in rec:
                raise ValueError(f"{path}:{i}: missing field {k!r}")
        if len(rec["rollout_log_probs"]) != len(rec["response_ids"]):
            raise ValueError(f"{path}:{i}: {len(rec['response_ids'])} response_ids but "
                             f"{len(rec['rollout_log_probs'])} rollout_log_probs")
        out.append(rec)
    if not out:
        raise ValueError(f"--rollouts: {path!r} holds no records")
    return out


@dataclass
class VersionGroup:
    """The records of one weight version and the checkpoint that holds those weights."""

    version: Optional[str]
    """The records' ``weight_version`` (None: not recorded)."""
    indices: List[int]
    """Positions of the records in the input file."""
    checkpoint: Optional[str]
    """Checkpoint directory to load before scoring them (None: the config's weights)."""


def _checkpoint_dir(checkpoints: str, version: str) -> Optional[str]:
    m = re.fullmatch(r"step-(\d+)", version)
    if not m:
        return None
    path = os.path.join(checkpoints, f"step_{int(m.group(1))}")
    return path if os.path.isfile(os.path.join(path, "COMPLETE")) else None


def plan_versions(records: Sequence[dict], checkpoints: Optional[str] = None,
                  keep: Sequence[str] = ()) -> Tuple[List[VersionGroup], List[str]]:
    """(groups to score in order, warnings) for ``records``; raises ValueError when records would be
    scored against weights that did not generate them (see the module docstring)."""
    by_version: Dict[Optional[str], List[int]] = {}
    for i, r in enumerate(records):
        by_version.setdefault(r.get("weight_version"), []).append(i)
    warnings: List[str] = []
    counts = ", ".join(f"{v or 'unrecorded'}: {len(ix)}" for v, ix in by_version.items())
    if keep:
        unknown = [v for v in keep if v not in by_version]
        if unknown:
            raise ValueError(f"--weight-version {', '.join(unknown)}: no such records (versions in the file: {counts})")
        dropped = sum(len(ix) for v, ix in by_version.items() if v not in keep)
        if dropped:
            warnings.append(f"skipping {dropped} record(s) of other weight versions (--weight-version "
                            f"{' '.join(keep)}; file: {counts})")
        by_version = {v: ix for v, ix in by_version.items() if v in keep}
    if checkpoints is None:
        if len(by_version) > 1:
            raise ValueError(f"the rollouts come from {len(by_version)} weight versions ({counts}); scoring them "
                             f"against one set of weights would mix policies. Pass --checkpoints RUN_DIR/checkpoints "
                             f"to score each version with its own checkpoint, or --weight-version V to keep one")
        (version,) = by_version
        if version not in (None, INITIAL_VERSION):
            warnings.append(f"the rollouts were generated by weight version {version}; they are scored with the "
                            f"config's weights (actor.load_hf) -- pass --checkpoints RUN_DIR/checkpoints to load "
                            f"that version's checkpoint")
        return [VersionGroup(version, by_version[version], None)], warnings
    if not os.path.isdir(checkpoints):
        raise ValueError(f"--checkpoints: {checkpoints!r} is not a directory")
    groups, missing = [], []
    for version, ix in by_version.items():
        if version in (None, INITIAL_VERSION):
            groups.append(VersionGroup(version, ix, None))
            if version is None:
                warnings.append(f"{len(ix)} record(s) without weight_version: scored with the config's weights")
            continue
        path = _checkpoint_dir(checkpoints, version)
        if path is None:
            missing.append(f"{version} ({len(ix)} record(s))")
        else:
            groups.append(VersionGroup(version, ix, path))
    if missing:
        have = sorted(d for d in os.listdir(checkpoints) if os.path.isfile(os.path.join(checkpoints, d, "COMPLETE")))
        raise ValueError(f"--checkpoints {checkpoints}: no complete checkpoint for weight version(s) "
                         f"{', '.join(missing)} (complete checkpoints: {', '.join(have) or 'none'}); keep the "
                         f"versions that have one with --weight-version")
    # the config's weights first: a checkpoint, once loaded, replaces them
    groups.sort(key=lambda g: g.checkpoint is not None)
    return groups, warnings


def _score_records(actor, cfg, records: List[dict]):
    """(metrics, per-record train log-probs on rank 0 else None) of ``records`` with the actor's weights."""
    # multi-turn records carry loss_mask (environment tokens 0): the correction then sees model tokens only
    masks = [r.get("loss_mask") or [1] * len(r["response_ids"]) for r in records]
    batch = RolloutBatch.from_sequences([r["prompt_ids"] for r in records], [r["response_ids"] for r in records],
                                        [r["rollout_log_probs"] for r in records],
                                        loss_masks=masks if any("loss_mask" in r for r in records) else None)
    shard = batch.shard(actor.dp_rank, actor.dp_size).to(actor_device())  # where the actor's log-probs are
    lp, _ = actor.compute_log_probs(shard, cfg.rollout.temperature, compute_entropy=False)
    res = compute_rollout_correction(lp, shard.rollout_log_probs, shard.response_mask,
                                     cfg.algorithm.rollout_correction, group=actor.dp_group)
    per_row = [t.tolist() for t in shard.response_values(lp.cpu())]  # one device-to-host copy, not one per row
    gathered = [None] * actor.dp_size
    dist.all_gather_object(gathered, per_row, group=actor.dp_group)
    rows = [r for part in gathered for r in part] if dist.get_rank() == 0 else None
    return res.metrics, rows


def _print_metrics(metrics: Dict[str, float], header: Optional[str] = None) -> None:
    if header:
        print(header)
    width = max(len(k) for k in metrics)
    for k, v in metrics.items():
        print(f"{k:<{width}}  {v:.6g}")


def score(cfg, records: List[dict], out_path: Optional[str], groups: Optional[List[VersionGroup]] = None) -> dict:
    """Recompute, correct, write; returns the metrics (identical on every rank). ``groups`` (from
    :func:`plan_versions`; default: every record with the config's weights) are scored one after the
    other, each with its checkpoint; with several groups the keys are ``"<version>/<metric>"``."""


    actor = setup_distributed(cfg)
    groups = groups or [VersionGroup(None, list(range(len(records))), None)]
    out_rows: Dict[int, list] = {}
    result: Dict[str, float] = {}
    for g in groups:
        if g.checkpoint is not None:
            actor.load_checkpoint(g.checkpoint)
        metrics, rows = _score_records(actor, cfg, [records[i] for i in g.indices])
        if dist.get_rank() == 0:
            out_rows.update(zip(g.indices, rows))
            header = None if len(groups) == 1 else (f"weight version {g.version or 'unrecorded'} "
                                                    f"({len(g.indices)} records, "
                                                    f"{g.checkpoint or 'actor.load_hf'}):")
            _print_metrics(metrics, header)
        if len(groups) == 1:
            result = metrics
        else:
            result.update({f"{g.version or 'unrecorded'}/{k}": v for k, v in metrics.items()})
    if dist.get_rank() == 0 and out_path:
        with open(out_path, "w") as fh:
            for i in sorted(out_rows):
                fh.write(json.dumps({**records[i], "train_log_probs": out_rows[i]}) + "\n")
    dist.barrier()
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML job config (model, parallel, rollout.temperature, correction)")
    p.add_argument("--rollouts", required=True, help="JSONL with prompt_ids, response_ids, rollout_log_probs")
    p.add_argument("--out", default=None, help="JSONL to write (records + train_log_probs)")
    p.add_argument("--checkpoints", default=None,
                   help="training checkpoints (RUN_DIR/checkpoints): records of weight_version step-N are scored "
                        "with step_N")
    p.add_argument("--weight-version", action="append", default=[], metavar="V",
                   help="score only the records of this weight_version (repeatable)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.temperature=0.7")


def run(args: argparse.Namespace) -> int:
    install_known_message_filter()  # megatron's known CPU notices: once, on rank 0
    try:
        cfg = load_job_config(args.config, list(args.overrides))
    except ConfigError as exc:  # once per launch, with how to launch when torchrun was forgotten
        return config_error_exit(exc, "megatron_rl.score", args.config, list(args.overrides))
    try:
        records = read_rollouts(args.rollouts)
        groups, warnings = plan_versions(records, args.checkpoints, args.weight_version)
    except ValueError as exc:
        print(f"megatron-rl score: {exc}", file=sys.stderr)
        return 2
    for w in warnings if launch_rank() == 0 else []:
        print(f"megatron-rl score: warning: {w}", file=sys.stderr)
    score(cfg, records, args.out, groups)
    shutdown_distributed()
    return 0


def add_parser(subparsers) -> None:
    """Register ``megatron-rl score``."""
    register(subparsers, "score", "recompute log-probs of recorded rollouts and print mismatch metrics", __doc__, add_arguments, run)


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("python -m megatron_rl.score", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
