"""MoE routing tensors: layout, compact storage, validation, per-micro-batch placement, agreement.

Pure functions of tensors (plus explicit process groups for the two gathers); the megatron side — the
router hook that replays / records — lives in ``megatron_rl.actor.router_replay``.

Layout (``RolloutBatch.routing``)::

    routing [B, L-1, num_moe_layers, topk]   uint8 when num_experts <= 256, else int16
    routing[b, t, j, :] = the top-k expert ids the rollout engine routed the token at POSITION t of row b
                          to in the j-th MoE layer (``RoutingSpec.moe_layers[j]`` is its layer index)

A rank of a job receives the columns of its pipeline stage's MoE layers alone (``RoutingReplay.local``
tells the two apart: dim 2 is every MoE layer or this rank's).

Only columns ``t < lengths[b] - 1`` are read: the last token's output scores nothing (an engine never
feeds the token it sampled last), and padding never indexes an expert — at those positions (and at any
padding a micro-batch adds for SP / CP) the trainer keeps its own top-k (``micro_batch_targets`` marks
them -1). Order of the k ids within a token does not matter.

Token order inside megatron's router: hidden states are [s, b, h] (s cut to this CP rank's zigzag part,
then to this TP rank's 1/TP with sequence parallel), flattened to ``s_i * b + b_i``;
``micro_batch_targets`` produces that order and ``gather_micro_batch_records`` inverts it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_rl.actor.cp import cp_gather, cp_split

__all__ = ["ROUTING_DTYPES", "RoutingError", "RoutingSpec", "routing_dtype", "pack_routing",
           "routing_valid_mask", "check_routing", "row_targets", "sp_slice", "sp_gather", "micro_batch_targets",
           "gather_micro_batch_records",
           "agreement_counts", "agreement_metrics", "routing_bytes_per_token"]

ROUTING_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)
"""Integer dtypes a routing tensor may have (engines send uint8 / int16)."""


class RoutingError(ValueError):
    """Routing that cannot be replayed (the message names the tensor, shape, row / token / layer, rank)."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype for expert ids: uint8 when ``num_experts <= 256``, else int16."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise RoutingError(f"num_experts={num_experts} does not fit int16 expert ids")


def routing_bytes_per_token(num_experts: int, num_moe_layers: int, topk: int) -> int:
    """Bytes one token's routing takes in transport (all MoE layers x top-k, compact dtype)."""
    return num_moe_layers * topk * torch.empty((), dtype=routing_dtype(num_experts)).element_size()


@dataclass(frozen=True)
class RoutingSpec:
    """What a model's routing looks like."""

    num_experts: int
    """Routed experts per MoE layer (ids in [0, num_experts))."""
    topk: int
    """Experts per token per MoE layer."""
    moe_layers: Tuple[int, ...]
    """0-based global indices of the MoE layers, in order (dim 2 of a routing tensor)."""

    @classmethod
    def from_model_config(cls, model_cfg) -> Optional["RoutingSpec"]:
        """The spec of a ``ModelConfig``; None for dense models."""
        if not model_cfg.is_moe:
            return None
        pattern = model_cfg.moe_layer_pattern()
        return cls(num_experts=int(model_cfg.num_moe_experts), topk=int(model_cfg.moe_router_topk),
                   moe_layers=tuple(i for i, p in enumerate(pattern) if p))

    @property
    def num_moe_layers(self) -> int:
        """Number of MoE layers (dim 2 of a routing tensor)."""
        return len(self.moe_layers)


def pack_routing(rows: Sequence[Optional[torch.Tensor]], lengths: Sequence[int], width: int,
                 what: str = "routing") -> Optional[torch.Tensor]:
    """Per-row engine routing ``[n_b, num_moe_layers, topk]`` (``n_b >= lengths[b] - 1``; extra tokens are
    dropped) -> ``[B, width, num_moe_layers, topk]`` in the rows' (widest) dtype, zeros beyond
    ``lengths[b] - 1``. All rows or none: raises RoutingError naming the rows that miss it, or a row with
    the wrong shape / too few tokens / a non-integer dtype."""
    if rows is None:
        return None
    missing = [b for b, r in enumerate(rows) if r is None]
    if len(missing) == len(rows):
        return None
    if missing:
        raise RoutingError(f"{what}: missing for rows {missing[:16]}{' ...' if len(missing) > 16 else ''} of "
                           f"{len(rows)} (an engine captured routing for some rollouts only)")
    if len(rows) != len(lengths):
        raise RoutingError(f"{what}: {len(rows)} rows for {len(lengths)} sequences")
    rows = [torch.as_tensor(r) for r in rows]
    shape = tuple(rows[0].shape[1:])
    dtype = rows[0].dtype
    for b, r in enumerate(rows):
        if r.dim() != 3 or tuple(r.shape[1:]) != shape:
            raise RoutingError(f"{what}[{b}] has shape {tuple(r.shape)}, expected [tokens, {shape[0] if shape else '?'}"
                               f", {shape[1] if len(shape) > 1 else '?'}] like row 0 ([tokens, moe_layers, topk])")
        if r.dtype not in ROUTING_DTYPES:
            raise RoutingError(f"{what}[{b}] has dtype {r.dtype}, expected one of {ROUTING_DTYPES}")
        need = int(lengths[b]) - 1
        if r.shape[0] < need:
            raise RoutingError(f"{what}[{b}] covers {r.shape[0]} tokens, the row needs {need} "
                               f"(prompt + response - 1: every token but the last)")
        if torch.promote_types(dtype, r.dtype) != dtype:
            dtype = torch.promote_types(dtype, r.dtype)
    out = torch.zeros((len(rows), width) + shape, dtype=dtype)
    for b, r in enumerate(rows):
        n = min(int(lengths[b]) - 1, width)
        if n > 0:
            out[b, :n] = r[:n].to(dtype)
    return out


def routing_valid_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: column t carries routing to replay (``t < lengths[b] - 1``)."""
    t = torch.arange(width, device=lengths.device).unsqueeze(0)
    return t < (lengths.unsqueeze(1) - 1)


def check_routing(routing: torch.Tensor, lengths: torch.Tensor, spec: RoutingSpec,
                  what: str = "RolloutBatch.routing") -> Optional[str]:
    """None if ``routing`` can be replayed on a model with ``spec``, else the reason: wrong dtype / rank /
    shape (layer count, top-k), an expert id out of [0, num_experts) or a repeated expert within one
    token's top-k at a read position — naming the first offending row / token / layer."""
    if not isinstance(routing, torch.Tensor) or routing.dtype not in ROUTING_DTYPES:
        return f"{what} must be an integer tensor ({', '.join(map(str, ROUTING_DTYPES))}), got " \
               f"{getattr(routing, 'dtype', type(routing).__name__)}"
    B = int(lengths.shape[0])
    if routing.dim() != 4 or routing.shape[0] != B:
        return f"{what} has shape {tuple(routing.shape)}, expected [B, L-1, moe_layers, topk] with B = {B}"
    if routing.shape[2] != spec.num_moe_layers:
        return (f"{what} has {routing.shape[2]} MoE layers (dim 2 of shape {tuple(routing.shape)}), the model has "
                f"{spec.num_moe_layers} (layers {list(spec.moe_layers)})")
    if routing.shape[3] != spec.topk:
        return (f"{what} has top-{routing.shape[3]} expert ids (dim 3 of shape {tuple(routing.shape)}), the model "
                f"routes to moe_router_topk = {spec.topk}")
    valid = routing_valid_mask(lengths.to(routing.device), routing.shape[1])
    if bool((lengths - 1 > routing.shape[1]).any()):
        b = int((lengths - 1 > routing.shape[1]).nonzero()[0, 0])
        return f"{what} has {routing.shape[1]} columns; row {b} needs {int(lengths[b]) - 1}"
    r = routing.long()
    bad = ((r < 0) | (r >= spec.num_experts)).any(-1) & valid.unsqueeze(-1)
    if bool(bad.any()):
        b, t, j = (int(x) for x in bad.nonzero()[0])
        return (f"{what}[{b}, {t}, {j}] = {r[b, t, j].tolist()}: expert id outside [0, num_experts = "
                f"{spec.num_experts}) (row {b}, token {t}, MoE layer {j} = layer {spec.moe_layers[j]})")
    if spec.topk > 1:
        s = r.sort(dim=-1).values
        dup = (s[..., 1:] == s[..., :-1]).any(-1) & valid.unsqueeze(-1)
        if bool(dup.any()):
            b, t, j = (int(x) for x in dup.nonzero()[0])
            return (f"{what}[{b}, {t}, {j}] = {r[b, t, j].tolist()}: an expert repeats in one token's top-k "
                    f"(row {b}, token {t}, MoE layer {j})")
    return None


def row_targets(routing: torch.Tensor, lengths: torch.Tensor, rows: Tuple[int, int], width: int,
                device=None) -> torch.Tensor:
    """Rows [start, end) of ``routing`` as replay targets ``[b, width, num_moe_layers, topk]`` int64 on ``device``:
    -1 (the trainer keeps its own choice) where ``t >= lengths - 1`` and beyond the stored columns."""
    start, end = rows
    r = routing[start:end, :width].to(device=device, dtype=torch.int64)
    valid = routing_valid_mask(lengths[start:end].to(r.device), r.shape[1])
    r = torch.where(valid[:, :, None, None], r, torch.full_like(r, -1))
    if r.shape[1] < width:
        pad = r.new_full((r.shape[0], width - r.shape[1]) + tuple(r.shape[2:]), -1)
        r = torch.cat([r, pad], dim=1)
    return r


def sp_slice(r: torch.Tensor, sp_rank: int, sp_size: int) -> torch.Tensor:
    """This sequence-parallel rank's part of ``r`` (positions on dim 0), as megatron splits activations."""
    if sp_size == 1:
        return r
    if r.shape[0] % sp_size:
        raise RoutingError(f"micro-batch of {r.shape[0]} positions per CP rank is not divisible by the "
                           f"sequence-parallel size {sp_size}")
    return r.chunk(sp_size, dim=0)[sp_rank]


def sp_gather(x: torch.Tensor, sp_group=None, sp_size: int = 1) -> torch.Tensor:
    """Inverse of ``sp_slice`` over ``sp_group`` (positions on dim 0). Collective when ``sp_size > 1``."""
    if sp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(sp_size)]
    dist.all_gather(parts, x.contiguous(), group=sp_group)
    return torch.cat(parts, dim=0)


def micro_batch_targets(routing: torch.Tensor, lengths: torch.Tensor, rows: Tuple[int, int], full_length: int,
                        cp_rank: int = 0, cp_size: int = 1, sp_rank: int = 0, sp_size: int = 1,
                        device=None) -> torch.Tensor:
    """The replay targets of one micro-batch in megatron's router token order: ``[num_moe_layers,
    n_local, topk]`` int64, ``n_local = (full_length / cp_size / sp_size) * b``; -1 where the trainer keeps
    its own choice (``t >= lengths - 1``, micro-batch padding)."""
    r = row_targets(routing, lengths, rows, full_length, device)
    r = sp_slice(cp_split(r, cp_rank, cp_size).transpose(0, 1), sp_rank, sp_size)   # [s_cp / SP, b, NL, k]
    nl, k = r.shape[2], r.shape[3]
    return r.reshape(-1, nl, k).permute(1, 0, 2).contiguous()


def gather_micro_batch_records(local: torch.Tensor, b: int, sp_group=None, sp_size: int = 1, cp_group=None,
                               cp_size: int = 1) -> torch.Tensor:
    """Inverse of ``micro_batch_targets`` for routing recorded on this rank: ``local [n_layers, n_local,
    topk]`` -> ``[b, s, n_layers, topk]`` (whole sequences: all-gather over the sequence-parallel group,
    then the CP zigzag gather). Collective over ``sp_group`` / ``cp_group`` when their size is > 1."""
    nl, n, k = local.shape
    x = sp_gather(local.permute(1, 0, 2).reshape(n // b, b, nl, k), sp_group, sp_size)   # [s_loc, b, NL, k]
    return cp_gather(x.transpose(0, 1).contiguous(), cp_group, cp_size)


def agreement_counts(own: torch.Tensor, reference: torch.Tensor, valid: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Counts of (token, layer, k) where an expert of ``reference`` is among ``own``'s top-k (as sets).

    ``own`` / ``reference`` ``[B, W, NL, k]`` (the same NL layers: e.g. the ones this rank holds), ``valid
    [B, W]`` bool. Returns float64 ``per_layer [NL]`` (matches), ``per_token [B, W]`` (matches of the token over
    those layers) and ``tokens`` (valid positions)."""
    hit = (reference.long().unsqueeze(-1) == own.long().unsqueeze(-2)).any(-1)     # [B, W, NL, k]
    hit = hit & valid[:, :, None, None]
    return {"per_layer": hit.sum(dim=(0, 1, 3)).to(torch.float64),
            "per_token": hit.sum(dim=(2, 3)).to(torch.float64),
            "tokens": valid.sum().to(torch.float64)}


def agreement_metrics(per_layer: torch.Tensor, tokens_all_agree: float, tokens: float, spec: RoutingSpec,
                      prefix: str = "rollout_corr/router") -> Dict[str, float]:
    """Metrics from ``agreement_counts`` summed over all ranks: ``{prefix}_agreement`` (fraction of
    (token, layer, k)), ``{prefix}_token_agreement`` (fraction of tokens whose every layer agrees) and
    ``{prefix}_agreement_layer{i}`` per MoE layer (i = global layer index). Empty when no token counted."""
    n, k = float(tokens), spec.topk
    if n <= 0:
        return {}
    out = {f"{prefix}_agreement": float(per_layer.sum()) / (n * k * spec.num_moe_layers),
           f"{prefix}_token_agreement": float(tokens_all_agree) / n}
    for j, layer in enumerate(spec.moe_layers):
        out[f"{prefix}_agreement_layer{layer}"] = float(per_layer[j]) / (n * k)
    return out
