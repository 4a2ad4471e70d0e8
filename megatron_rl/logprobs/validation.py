"""Input checks for the vocab-parallel log-prob functions, run before any expensive work.

Local checks (types, dtypes, shapes, temperature, target range) are computed on every rank; the
cross-rank checks (same token count, same vocab partition size, same target ids on every TP rank)
cost ONE small int64 MAX all-reduce over ``tp_group``. Local problems are folded into that same
all-reduce as flags, so when any rank finds a problem every rank raises (no rank is left waiting in
a later collective). Non-finite logits are not checked here: they are detected for free from the
per-token statistics after the TP combine (see ``combine.py``) and located by ``locate_nonfinite``.

Usage (internal)::

    info = check_inputs(logits2d, targets1d, shape, tp_group, temperature, chunk_size, "logits_shard")
    info.rank, info.world_size, info.vocab_start, info.vocab_size
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PartitionInfo:
    """Where this rank's vocab slice sits (megatron ``VocabUtility`` convention)."""

    rank: int  #: rank of this process inside ``tp_group`` (0 without a group)
    world_size: int  #: tensor_model_parallel_size (1 without a group)
    partition_vocab_size: int  #: V/TP, the last dimension of the shard
    vocab_start: int  #: first global token id owned by this rank (``rank * partition_vocab_size``)
    vocab_size: int  #: global vocab size V = partition_vocab_size * world_size


def group_rank_and_size(tp_group) -> tuple[int, int]:
    """(rank, world_size) inside ``tp_group``; (0, 1) for ``None``. Raises if torch.distributed is off."""
    if tp_group is None:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("tp_group was given but torch.distributed is not initialised "
                         "(pass tp_group=None for a single process)")
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def check_temperature(temperature) -> float:
    """Temperature must be a finite real number > 0; returns it as a float."""
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(f"temperature must be a scalar, got a tensor of shape {tuple(temperature.shape)}")
        temperature = temperature.item()
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a real number > 0, got {type(temperature).__name__}")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature <= 0.0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    return temperature


def check_chunk_size(chunk_size) -> Optional[int]:
    """``chunk_size`` is None (automatic) or an int >= 1 (tokens per chunk)."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    return chunk_size


def check_float_tensor(t, name: str, min_dim: int = 1) -> None:
    """``t`` is a floating tensor of dtype fp32/bf16/fp16 with at least ``min_dim`` dims and no empty last dim."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(t.shape)}")
    if t.shape[-1] == 0:
        raise ValueError(f"{name} has an empty last dimension: shape {tuple(t.shape)}")


def check_targets(target_ids, expected_shape, device, name: str = "target_ids") -> None:
    """``target_ids`` is an integer tensor of ``expected_shape`` on ``device``."""
    if not isinstance(target_ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(target_ids).__name__}")
    if target_ids.dtype.is_floating_point or target_ids.dtype.is_complex or target_ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {target_ids.dtype}")
    if tuple(target_ids.shape) != tuple(expected_shape):
        raise ValueError(f"{name} has shape {tuple(target_ids.shape)} but the logits' leading dims are "
                         f"{tuple(expected_shape)}")
    if target_ids.device != device:
        raise ValueError(f"{name} is on {target_ids.device} but the logits are on {device}")


def _first_bad_target(flat_targets: torch.Tensor, vocab_size: int, shape) -> tuple[int, str]:
    bad = (flat_targets < 0) | (flat_targets >= vocab_size)
    count = int(bad.sum())
    if count == 0:
        return 0, ""
    first = int(bad.nonzero()[0, 0])
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(shape))) if len(shape) else ()
    return count, (f"target_ids has {count} id(s) outside [0, {vocab_size}) (vocab size = partition "
                   f"size x tensor_model_parallel_size); first at index {pos}: {int(flat_targets[first])}")


def target_range_error(flat_targets: torch.Tensor, vocab_size: int, token_shape) -> str:
    """The error message for target ids outside [0, vocab_size) ("" when all are inside)."""
    return _first_bad_target(flat_targets, vocab_size, token_shape)[1]


def check_partition(flat_targets: torch.Tensor, token_shape, partition_vocab_size: int,
                    tp_group, what: str = "logits_shard", defer_range_check: bool = False) -> PartitionInfo:
    """Target range check plus the cross-rank consistency check (one int64 MAX all-reduce).

    Checks, identically on every rank: target ids in [0, V); the same number of tokens, the same
    partition vocab size and the same target ids (order-sensitive checksum) on every TP rank.
    ``defer_range_check`` (single process only): skip the range check here - the caller checks the
    targets on the device together with its own results (no extra host synchronisation) and raises
    ``target_range_error`` from its forward, or - when a gradient will be taken - from its backward,
    before the gradient is returned.
    """
    rank, world = group_rank_and_size(tp_group)
    vocab_size = partition_vocab_size * world
    if world == 1:
        if not defer_range_check:
            n_bad, bad_msg = _first_bad_target(flat_targets, vocab_size, token_shape)
            if n_bad:
                raise ValueError(bad_msg)
        return PartitionInfo(rank, world, partition_vocab_size, 0, vocab_size)
    n_bad, bad_msg = _first_bad_target(flat_targets, vocab_size, token_shape)
    n = flat_targets.numel()
    # order-sensitive checksum of the targets (wrap-around in int64 is fine: equal inputs, equal sums)
    weights = torch.arange(1, n + 1, device=flat_targets.device, dtype=torch.int64) % 1000003 + 1
    csum = int((flat_targets.to(torch.int64) * weights).sum()) if n else 0
    local = torch.tensor([n, -n, partition_vocab_size, -partition_vocab_size, csum, -csum, n_bad],
                         dtype=torch.int64, device=flat_targets.device)
    red = local.clone()
    dist.all_reduce(red, op=dist.ReduceOp.MAX, group=tp_group)
    red = red.tolist()
    problems = []
    if red[0] != -red[1]:
        problems.append(f"the number of tokens differs across TP ranks (this rank {rank}: {n}; "
                        f"min {-red[1]}, max {red[0]})")
    if red[2] != -red[3]:
        problems.append(f"the vocab partition of {what} differs across TP ranks (this rank {rank}: "
                        f"{partition_vocab_size}; min {-red[3]}, max {red[2]}); megatron's VocabUtility "
                        f"needs equal per-partition vocab sizes")
    if not problems and red[4] != -red[5]:
        problems.append("target_ids differ across TP ranks (every TP rank must pass the same target ids)")
    if red[6] > 0:
        problems.append(bad_msg if n_bad else f"target_ids on another TP rank are outside [0, {vocab_size})")
    if problems:
        raise ValueError(f"TP rank {rank}/{world}: " + "; ".join(problems))
    return PartitionInfo(rank, world, partition_vocab_size, rank * partition_vocab_size, vocab_size)


def locate_nonfinite(logits2d: torch.Tensor, bad_rows: torch.Tensor, token_shape, rank: int,
                     name: str = "logits_shard", chunk_rows: int = 256) -> str:
    """Error message for non-finite logits: local count and first position, scanning only bad rows.

    ``bad_rows`` are the flat token indices whose combined statistics were not finite (identical on
    all ranks); the scan (error path only) counts NaN/inf values of this rank's shard in those rows.
    """
    rows = bad_rows.nonzero().flatten()
    n_rows = rows.numel()
    first_tok = int(rows[0]) if n_rows else -1
    count, first = 0, None
    for i in range(0, n_rows, chunk_rows):
        idx = rows[i:i + chunk_rows]
        nf = ~torch.isfinite(logits2d.index_select(0, idx))
        count += int(nf.sum())
        if first is None and nf.any():
            r, c = nf.nonzero()[0].tolist()
            first = (int(idx[r]), c)
    def pos(flat):
        return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(token_shape))) \
            if len(token_shape) else ()
    if count:
        tok, col = first
        return (f"{name} on TP rank {rank} has {count} non-finite value(s) (NaN/inf) in {n_rows} token(s); "
                f"first at token index {pos(tok)}, local vocab column {col}")
    return (f"{name} has non-finite values (NaN/inf) on another TP rank, affecting {n_rows} token(s); "
            f"first at token index {pos(first_tok)}")
