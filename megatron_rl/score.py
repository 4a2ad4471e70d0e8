"""Score recorded rollouts (metrics-only mode): ``megatron-rl score --config X --rollouts R.jsonl --out S.jsonl``.

Run under torchrun like training (any parallel layout in the config)::

    torchrun --nproc-per-node 4 -m megatron_rl.score --config configs/tiny_cpu.yaml \
        --rollouts runs/tiny_cpu/rollouts.jsonl --out scored.jsonl

Input: one JSON object per line with ``prompt_ids``, ``response_ids`` and ``rollout_log_probs`` (one per
response token, e.g. saved from SGLang's ``output_token_logprobs``; training writes this format with
``trainer.dump_rollouts=true``). The actor recomputes every response token's log-prob at the configured
layout and temperature (``rollout.temperature``), ``algorithm.rollout_correction`` runs over the whole
file (exact global metrics), and rank 0 writes ``--out`` (each input record plus ``train_log_probs``)
and prints the ``rollout_corr/*`` metrics — diagnose an engine's mismatch before training with it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from megatron_rl.cli.entry import module_main, register
from megatron_rl.jsonl import read_json_objects


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


def score(cfg, records: List[dict], out_path: Optional[str]) -> dict:
    """Recompute, correct, write; returns the metrics (identical on every rank)."""
    import torch.distributed as dist

    from megatron_rl.actor import RolloutBatch
    from megatron_rl.correction import compute_rollout_correction
    from megatron_rl.trainer.loop import setup_distributed

    actor = setup_distributed(cfg)
    batch = RolloutBatch.from_sequences([r["prompt_ids"] for r in records], [r["response_ids"] for r in records],
                                        [r["rollout_log_probs"] for r in records])
    shard = batch.shard(actor.dp_rank, actor.dp_size)
    lp, _ = actor.compute_log_probs(shard, cfg.rollout.temperature, compute_entropy=False)
    res = compute_rollout_correction(lp, shard.rollout_log_probs, shard.response_mask,
                                     cfg.algorithm.rollout_correction, group=actor.dp_group)
    per_row = [t.tolist() for t in shard.response_values(lp)]
    gathered = [None] * actor.dp_size
    dist.all_gather_object(gathered, per_row, group=actor.dp_group)
    if dist.get_rank() == 0:
        rows = [r for part in gathered for r in part]
        if out_path:
            with open(out_path, "w") as fh:
                for rec, tl in zip(records, rows):
                    fh.write(json.dumps({**rec, "train_log_probs": tl}) + "\n")
        width = max(len(k) for k in res.metrics)
        for k, v in res.metrics.items():
            print(f"{k:<{width}}  {v:.6g}")
    dist.barrier()
    return res.metrics


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML job config (model, parallel, rollout.temperature, correction)")
    p.add_argument("--rollouts", required=True, help="JSONL with prompt_ids, response_ids, rollout_log_probs")
    p.add_argument("--out", default=None, help="JSONL to write (records + train_log_probs)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.temperature=0.7")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_rl.config import ConfigError, load_job_config

    try:
        cfg = load_job_config(args.config, list(args.overrides))
        records = read_rollouts(args.rollouts)
    except (ConfigError, ValueError) as exc:
        print(f"megatron-rl score: {exc}", file=sys.stderr)
        return 2
    score(cfg, records, args.out)
    return 0


def add_parser(subparsers) -> None:
    """Register ``megatron-rl score``."""
    register(subparsers, "score", "recompute log-probs of recorded rollouts and print mismatch metrics", __doc__, add_arguments, run)


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("python -m megatron_rl.score", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
