"""Model inputs per micro-batch and one call of megatron's pipeline schedule over them.

``padded_micro_batches`` / ``packed_micro_batches`` (the ``MicroBatcher`` picks one for the job) turn a (DP-shard,
plan-ordered) ``RolloutBatch`` plus per-token tensors ([B, L-1], column t scores token t+1) into ``MicroBatch``
objects the model consumes, one per contiguous row block of ``bounds`` (``MicroBatcher.plan``: fixed
``micro_batch_size`` rows or a token budget):
  * padded rows (``PaddedRows``, ``padded_micro_batches``): each block cut to its own longest row (variable
    sequence lengths; with ``uniform``, the interleaved schedule's need, the batch's length) rounded up to
    ``groups.seq_multiple`` (TP with sequence parallel, 2 x CP with CP); per-token tensors placed at the same
    positions (one zero column at the end), then every sequence-shaped tensor cut to this CP rank's zigzag part
    (``cp_split``);
  * packed rows (``PackedRows``, ``packed_micro_batches``): each block one THD sequence ``[1, s]``
    (``PackedSeqParams``, per-segment positions, megatron's per-segment CP chunks); the per-token tensors stay
    in row layout and the model's output is gathered into it (``loss_rows``);
  * ``targets`` at position t = the row's token t+1 (the pad id at each row's last token) so the log-prob at
    position t of the model output scores token t+1 — computed on the full logits tensor, no shifted copy.

``run_schedule`` calls ``megatron.core.pipeline_parallel.get_forward_backward_func()`` (1F1B with PP,
no-pipelining otherwise; interleaved with VPP) with ``forward_step_func(mb, model) -> (output,
loss_func)``; it returns megatron's list of per-micro-batch loss_func dicts (last stage only).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import RolloutBatch, fit_columns
from megatron_rl.actor.cp import cp_gather, cp_split
from megatron_rl.actor.micro_batching import PackedLayout, pack_layout, packed_cp_gather_index, packed_cp_positions
from megatron_rl.actor.routing import (gather_micro_batch_records, micro_batch_targets, row_targets, sp_gather,
                                       sp_slice)
from megatron_rl.parallel.groups import ActorGroups

__all__ = ["MicroBatch", "PaddedRows", "PackedRows", "padded_micro_batches", "packed_micro_batches", "run_schedule",
           "actor_device"]


def actor_device() -> torch.device:
    """Where the model's inputs live: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PaddedRows:
    """A micro-batch of rows [start, end) as b rows of the model's input, right-padded to ``full_length``
    (before the CP split): the per-token inputs of the loss share the model's layout."""

    def __init__(self, start: int, end: int, full_length: int):
        self.start, self.end, self.full_length = start, end, full_length

    def loss_rows(self, y: torch.Tensor) -> torch.Tensor:
        """The model's per-position output on this rank -> the layout of ``MicroBatch.per_token`` (the same)."""
        return y

    def gather_rows(self, y: torch.Tensor, groups: ActorGroups) -> torch.Tensor:
        """Forward-only: this rank's [b, s/CP] output -> [b, full_length] whole rows (CP zigzag gather)."""
        return cp_gather(y, groups.cp_group, groups.cp_size)

    def routing_targets(self, routing: torch.Tensor, lengths: torch.Tensor, groups: ActorGroups,
                        device) -> torch.Tensor:
        """Replay targets in megatron's router token order (``routing.micro_batch_targets``)."""
        sp = groups.sequence_parallel
        return micro_batch_targets(routing, lengths, (self.start, self.end), self.full_length, groups.cp_rank,
                                   groups.cp_size, groups.tp_rank if sp else 0, groups.tp_size if sp else 1,
                                   device=device)

    def gather_records(self, local: torch.Tensor, groups: ActorGroups) -> torch.Tensor:
        """Routing recorded on this rank ``[n_layers, n_local, k]`` -> ``[b, full_length, n_layers, k]``."""
        sp = groups.sequence_parallel
        return gather_micro_batch_records(local, self.end - self.start, groups.tp_group,
                                          groups.tp_size if sp else 1, groups.cp_group, groups.cp_size)


class PackedRows:
    """A micro-batch of rows [start, end) packed into ONE sequence of ``layout.total`` positions (THD): each
    row its own segment (``micro_batching.PackedLayout``), CP ranks holding megatron's per-segment zigzag
    chunks (``packed_cp_positions``). The loss's per-token inputs stay in row layout ``[n, s_rows]``
    (``s_rows``: the longest row); the model's output is gathered into it (``loss_rows``), so the loss,
    its denominators and every metric see exactly the rows of an unpacked micro-batch."""

    def __init__(self, start: int, end: int, layout: PackedLayout, s_rows: int, groups: ActorGroups, device):
        self.start, self.end, self.layout, self.s_rows = start, end, layout, s_rows
        self.full_length = layout.total
        n = end - start
        # index maps built on the host (boolean indexing there costs no device sync), moved once
        cpu = torch.device("cpu")
        row, col = layout.row_col(device=cpu)
        if groups.cp_size > 1:
            segs = layout.segments
            positions = packed_cp_positions(segs, groups.cp_rank, groups.cp_size, device=cpu)
            self.gather_index = packed_cp_gather_index(segs, groups.cp_size, device=cpu).to(device)
        else:
            positions = torch.arange(layout.total, device=cpu)
            self.gather_index = None
        # src_full[r, c]: packed position of (row r, column c); -1 where the row has no token
        real = row >= 0
        real_pos = torch.arange(layout.total, device=cpu)[real]
        src_full = torch.full((n, s_rows), -1, dtype=torch.int64, device=cpu)
        src_full[row[real], col[real]] = real_pos
        # src_local[r, c]: index into this CP rank's positions; -1 where another CP rank holds it
        local_of = torch.full((layout.total,), -1, dtype=torch.int64, device=cpu)
        local_of[positions] = torch.arange(positions.numel())
        src_local = torch.where(src_full >= 0, local_of[src_full.clamp(min=0)], src_full)
        self.positions = positions.to(device)
        self.real_pos, self.real_row, self.real_col = (x.to(device) for x in (real_pos, row[real], col[real]))
        self.src_full, self.src_local = src_full.to(device), src_local.to(device)
        self.held = self.src_local >= 0
        """[n, s_rows] bool: (row, column) positions this CP rank computes (every real one without CP)."""

    @staticmethod
    def _take(y: torch.Tensor, src: torch.Tensor, fill=0) -> torch.Tensor:
        """``y [1, m, ...]`` at ``src [n, w]`` (``fill`` where src is -1); differentiable."""
        flat = y.reshape(y.shape[1], *y.shape[2:])
        ext = torch.cat([flat, flat.new_full((1,) + tuple(flat.shape[1:]), fill)])
        return ext[torch.where(src >= 0, src, torch.full_like(src, flat.shape[0]))]

    def place(self, x: torch.Tensor, fill) -> torch.Tensor:
        """Row-layout ``x [n, s_rows, ...]`` -> this CP rank's packed positions ``[1, s_loc, ...]`` (``fill`` at
        padding)."""
        full = x.new_full((self.layout.total,) + tuple(x.shape[2:]), fill)
        full[self.real_pos] = x[self.real_row, self.real_col]
        return full[self.positions].unsqueeze(0)

    def loss_rows(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's ``[1, s_loc]`` output -> ``[n, s_rows]`` rows (0 where another CP rank holds it)."""
        return self._take(y, self.src_local)

    def gather_rows(self, y: torch.Tensor, groups: ActorGroups) -> torch.Tensor:
        """Forward-only: this rank's ``[1, s_loc, ...]`` output -> ``[n, s_rows, ...]`` whole rows."""
        return self._take(self._gather_seq(y, groups), self.src_full)

    def _gather_seq(self, y: torch.Tensor, groups: ActorGroups) -> torch.Tensor:
        if self.gather_index is None:
            return y
        parts = [torch.empty_like(y) for _ in range(groups.cp_size)]
        dist.all_gather(parts, y.contiguous(), group=groups.cp_group)
        full = torch.empty((y.shape[0], self.layout.total) + tuple(y.shape[2:]), dtype=y.dtype, device=y.device)
        full[:, self.gather_index] = torch.cat(parts, dim=1)
        return full

    def routing_targets(self, routing: torch.Tensor, lengths: torch.Tensor, groups: ActorGroups,
                        device) -> torch.Tensor:
        """Replay targets ``[n_layers, n_local, k]`` in megatron's router token order for the packed sequence
        (-1: the trainer's own choice at each row's last token and at padding)."""
        r = row_targets(routing, lengths, (self.start, self.end), self.s_rows, device)
        sp = groups.sequence_parallel
        seq = sp_slice(self.place(r, -1)[0], groups.tp_rank if sp else 0, groups.tp_size if sp else 1)
        return seq.permute(1, 0, 2).contiguous()                   # [NL, s_loc / SP, k]

    def gather_records(self, local: torch.Tensor, groups: ActorGroups) -> torch.Tensor:
        """Routing recorded on this rank ``[n_layers, n_local, k]`` -> ``[n, s_rows, n_layers, k]`` (-1 where
        the row has no token)."""
        sp = groups.sequence_parallel
        x = sp_gather(local.permute(1, 0, 2), groups.tp_group, groups.tp_size if sp else 1)   # [s_loc, NL, k]
        return self._take(self._gather_seq(x.unsqueeze(0), groups), self.src_full, fill=-1)


@dataclass
class MicroBatch:
    """Inputs of one micro-batch on this rank (sequence dims already cut to this CP rank)."""

    rows: Tuple[int, int]
    """[start, end) rows of the (DP-shard, plan-ordered) batch."""
    full_length: int
    """Sequence length s of the model input before the CP split (padded rows: the padded row length; packed:
    the packed length)."""
    tokens: torch.Tensor
    """[b, s/CP] int64 input ids (packed: b = 1)."""
    position_ids: torch.Tensor
    """[b, s/CP] int64 positions (0-based per row; packed: per segment)."""
    targets: torch.Tensor
    """[b, s/CP] int64: the token each position scores (token t+1 for position t; the pad id at each row's last
    token)."""
    layout: "PaddedRows | PackedRows"
    """Where each row's positions are in the model input, and the way back (``loss_rows``, ``gather_rows``,
    routing targets and records)."""
    per_token: Dict[str, Optional[torch.Tensor]] = field(default_factory=dict)
    """Per-token tensors of the loss in the layout ``layout.loss_rows`` returns: [b, s/CP] for padded rows,
    [n, s_rows] rows for packed ones (``response_mask`` 0 where another CP rank holds the position)."""
    seq_valid_tokens: Optional[torch.Tensor] = None
    """[n] float64 valid tokens of each whole row under ``per_token['response_mask']`` (before the CP
    split) — what seq-mean-token-mean divides by."""
    packed_seq_params: Optional[object] = None
    """megatron's ``PackedSeqParams`` (THD, cu_seqlens) of a packed micro-batch; None for padded rows."""

    @property
    def model_kwargs(self) -> Dict[str, object]:
        """Keyword arguments of the model call beyond (tokens, position_ids, attention_mask)."""
        return {} if self.packed_seq_params is None else {"packed_seq_params": self.packed_seq_params}


def _check_per_token(batch: RolloutBatch, per_token: Optional[Dict[str, Optional[torch.Tensor]]]):
    per_token = per_token or {}
    B, Lm1 = batch.num_rows, batch.max_length - 1
    for name, t in per_token.items():
        if t is not None and tuple(t.shape) != (B, Lm1):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [B, L-1] = [{B}, {Lm1}] "
                             f"(column t scores token t+1 of RolloutBatch.tokens)")
    return per_token


def padded_micro_batches(batch: RolloutBatch, bounds: Sequence[Tuple[int, int]], groups: ActorGroups,
                         per_token: Optional[Dict[str, Optional[torch.Tensor]]] = None,
                         uniform: bool = False) -> List[MicroBatch]:
    """Cut ``batch`` (and ``per_token`` [B, L-1] tensors; None values stay None) into micro-batches of padded rows,
    one per contiguous row block of ``bounds`` (``MicroBatcher.plan``): each cut to its own longest row, or, with
    ``uniform`` (every micro-batch one shape, the interleaved schedule's need), all to the batch's length."""
    per_token = _check_per_token(batch, per_token)
    mult = groups.seq_multiple
    dev = actor_device()
    out = []
    for start, end in bounds:
        mb = batch.select(start, end, trim=not uniform, multiple_of=mult)
        s = mb.max_length
        b = end - start
        tokens = mb.tokens.to(dev)
        targets = torch.cat([tokens[:, 1:], tokens.new_full((b, 1), batch.pad_id)], dim=1)
        pos = torch.arange(s, dtype=torch.int64, device=dev).unsqueeze(0).expand(b, s).contiguous()
        rows, svt = _per_token_rows(per_token, start, end, s, dev)
        extras = {k: None if v is None else cp_split(v, groups.cp_rank, groups.cp_size) for k, v in rows.items()}
        out.append(MicroBatch(rows=(start, end), full_length=s,
                              tokens=cp_split(tokens, groups.cp_rank, groups.cp_size),
                              position_ids=cp_split(pos, groups.cp_rank, groups.cp_size),
                              targets=cp_split(targets, groups.cp_rank, groups.cp_size),
                              layout=PaddedRows(start, end, s), per_token=extras, seq_valid_tokens=svt))
    return out


def _per_token_rows(per_token: Dict[str, Optional[torch.Tensor]], start: int, end: int, width: int, dev):
    """Rows [start, end) of each per-token [B, L-1] tensor at positions [0, width): columns [0, width-1) of the
    batch tensor, then one zero column (the last position scores nothing); None stays None. Also the valid
    tokens of each whole row under ``response_mask`` (float64 [n], None without one)."""
    out: Dict[str, Optional[torch.Tensor]] = {}
    svt = None
    for name, t in per_token.items():
        out[name] = None if t is None else fit_columns(fit_columns(t[start:end].to(dev), width - 1), width)
        if name == "response_mask" and t is not None:
            svt = (out[name] != 0).sum(dim=-1).to(torch.float64)
    return out, svt


def packed_micro_batches(batch: RolloutBatch, bounds: Sequence[Tuple[int, int]], groups: ActorGroups,
                         per_token: Optional[Dict[str, Optional[torch.Tensor]]] = None,
                         uniform: bool = False) -> List[MicroBatch]:
    """``padded_micro_batches`` with each block of rows packed into one sequence (see ``PackedRows``); with
    ``uniform`` every packed sequence has the longest one's length (a longer trailing pad segment)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    per_token = _check_per_token(batch, per_token)
    dev = actor_device()
    row_mult = groups.dims.cp_row_multiple
    lengths = batch.lengths.tolist()   # one host copy for the whole pass
    layouts = [pack_layout(lengths[s:e], row_multiple=row_mult, total_multiple=groups.seq_multiple)
               for s, e in bounds]
    if uniform:  # every micro-batch the same shape (a longer trailing pad segment)
        longest = max(lay.total for lay in layouts)
        layouts = [dataclasses.replace(lay, total=longest) for lay in layouts]
    tokens_all = batch.tokens.to(dev)
    lengths_all = batch.lengths.to(dev)
    out = []
    for (start, end), lay in zip(bounds, layouts):
        s_rows = max(max(lengths[start:end]), 2)
        pr = PackedRows(start, end, lay, s_rows, groups, dev)
        rows_tok = tokens_all[start:end, :s_rows]
        nxt = torch.cat([rows_tok[:, 1:], rows_tok.new_full((end - start, 1), batch.pad_id)], dim=1)
        col = torch.arange(s_rows, device=dev).unsqueeze(0)
        nxt = torch.where(col + 1 < lengths_all[start:end].unsqueeze(1), nxt, torch.full_like(nxt, batch.pad_id))
        extras, svt = _per_token_rows(per_token, start, end, s_rows, dev)
        if extras.get("response_mask") is not None:
            extras["response_mask"] = extras["response_mask"] * pr.held   # another CP rank computes the rest
        cu, cu_pad = lay.cu_seqlens(device=dev), lay.cu_seqlens_padded(device=dev)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                              cu_seqlens_kv_padded=cu_pad, max_seqlen_q=lay.max_seqlen(),
                              max_seqlen_kv=lay.max_seqlen())
        out.append(MicroBatch(rows=(start, end), full_length=lay.total,
                              tokens=pr.place(rows_tok, batch.pad_id),
                              position_ids=lay.position_ids(device=dev)[pr.positions].unsqueeze(0),
                              targets=pr.place(nxt, batch.pad_id),
                              layout=pr, per_token=extras, seq_valid_tokens=svt, packed_seq_params=psp))
    return out


def run_schedule(model_chunks: Sequence[torch.nn.Module], micro_batches: List[MicroBatch],
                 forward_step: Callable[[MicroBatch, torch.nn.Module], Tuple[torch.Tensor, Callable]],
                 forward_only: bool, vp_group_size: Optional[int] = None) -> List[dict]:
    """One pass of megatron's schedule over ``micro_batches``; returns the loss_func dicts (last stage).
    ``vp_group_size``: the interleaved schedule's ``microbatch_group_size_per_vp_stage`` (``MicroBatcher``; None
    without interleaving)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("run_schedule: no micro-batches")
    if vp_group_size is not None:
        from megatron.core.utils import get_model_config

        get_model_config(model_chunks[0]).microbatch_group_size_per_vp_stage = vp_group_size

    def step(data_iterator, model):
        return forward_step(next(data_iterator), model)

    its = [iter(micro_batches) for _ in model_chunks]
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=its if len(its) > 1 else its[0], model=list(model_chunks),
        num_microbatches=len(micro_batches),
        seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
        micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
        forward_only=forward_only)
