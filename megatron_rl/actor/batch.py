"""``RolloutBatch``: the token layout every part of megatron-rl uses for rollouts, and its splitting.

``tokens [B, L]`` are prompt then response ids, right-padded; every per-token quantity (log-probs, masks,
advantages, IS weights, rollout log-probs, routing, loss mask) is ``[B, L-1]``. The rule everything depends on:
**column t scores token t+1**, so response token i of row b sits at column ``prompt_lengths[b] - 1 + i``. The
layout of every field (and the multi-turn ``loss_mask``, which ``response_mask`` multiplies in): docs/actor.md.

    batch = RolloutBatch.from_sequences(prompts, responses, rollout_log_probs, pad_id=0)
    shard = batch.shard(dp_rank, dp_size).to(device)         # contiguous rows for one DP rank, once per step
    for rows, mb in shard.micro_batches(micro_batch_size=4, trim=True):   # mb.tokens is [b, max(mb.lengths)]
        ...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_rl.actor.routing import ROUTING_DTYPES, RoutingError, pack_routing

__all__ = ["RolloutBatch", "BatchError", "scatter_rows", "row_blocks", "fit_columns"]


class BatchError(ValueError):
    """A malformed rollout batch (the message names the tensor / row / field)."""


def row_blocks(num_rows: int, num_blocks: int, what: str = "rows") -> List[Tuple[int, int]]:
    """Split ``range(num_rows)`` into ``num_blocks`` contiguous [start, end) blocks whose sizes differ by
    at most one (the first ``num_rows % num_blocks`` blocks get the extra row). Every block must be
    non-empty: raises BatchError when ``num_rows < num_blocks``."""
    if num_blocks < 1:
        raise BatchError(f"cannot split {what} into {num_blocks} blocks (need >= 1)")
    if num_rows < num_blocks:
        raise BatchError(f"cannot split {num_rows} {what} into {num_blocks} non-empty blocks")
    base, extra = divmod(num_rows, num_blocks)
    out, start = [], 0
    for i in range(num_blocks):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def scatter_rows(parts: Sequence[Tuple[Tuple[int, int], torch.Tensor]], num_rows: int, width: int,
                 dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Assemble ``[num_rows, width]`` from per-micro-batch ``((start, end), values [end-start, w])``
    pieces (``w <= width``: a trimmed micro-batch); columns beyond ``w`` are 0."""
    out = torch.zeros(num_rows, width, dtype=dtype, device=device)
    for (start, end), vals in parts:
        if vals.dim() != 2 or vals.shape[0] != end - start or vals.shape[1] > width:
            raise BatchError(f"scatter_rows: piece for rows [{start}, {end}) has shape {tuple(vals.shape)}, "
                             f"expected [{end - start}, <= {width}]")
        out[start:end, : vals.shape[1]] = vals.to(dtype)
    return out


@dataclass
class RolloutBatch:
    """Prompt + response token sequences of one batch, right-padded (see the module docstring)."""

    tokens: torch.Tensor
    """[B, L] int64 token ids: prompt then response, right-padded with ``pad_id``."""
    prompt_lengths: torch.Tensor
    """[B] int64 prompt tokens per row (>= 1: the first response token is scored at column p-1)."""
    lengths: torch.Tensor
    """[B] int64 prompt + response tokens per row (<= L)."""
    rollout_log_probs: Optional[torch.Tensor] = None
    """[B, L-1] float32 rollout engine log-probs of the response tokens (column t scores token t+1),
    0 outside the response; None when the engine gave none."""
    pad_id: int = 0
    """Id used for right padding (any valid id: padded positions are never scored)."""
    routing: Optional[torch.Tensor] = None
    """[B, L-1, moe_layers, topk] MoE expert ids (uint8 when experts <= 256, else int16) the rollout engine
    routed the token at position t to, per MoE layer (every MoE layer, or only the layers of this rank's
    pipeline stage, as a job's ranks receive it); read only for t < lengths - 1 (the last token's output scores
    nothing); None when the engine captured no routing. See ``megatron_rl.actor.routing``."""
    loss_mask: Optional[torch.Tensor] = None
    """[B, L-1] float32 0/1: 1 at column t iff token t+1 was sampled by the model (0 at environment tokens of a
    multi-turn trajectory; values outside the response are not read); None = every response token is the
    model's. Multiplied into ``response_mask``."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       rollout_log_probs: Optional[Sequence[Sequence[float]]] = None, pad_id: int = 0,
                       pad_to: Optional[int] = None,
                       routing: Optional[Sequence[Optional[torch.Tensor]]] = None,
                       loss_masks: Optional[Sequence[Sequence[int]]] = None) -> "RolloutBatch":
        """Build from per-row prompt ids, response ids and (optionally) the engine's per-response-token
        log-probs, per-row MoE routing (``[tokens >= prompt + response - 1, moe_layers, topk]`` each,
        e.g. ``Rollout.routed_experts``; all rows or none) and per-response-token loss masks (1 model-sampled,
        0 environment; ``Trajectory.loss_mask``; None = all ones). ``pad_to`` pads L to at least this length.
        Raises BatchError naming the row on empty prompts, log-prob or loss-mask lists whose length differs
        from the response's, loss masks that are not 0/1, or routing missing for some rows / of the wrong
        shape."""
        if len(prompts) != len(responses):
            raise BatchError(f"from_sequences: {len(prompts)} prompts but {len(responses)} responses")
        if rollout_log_probs is not None and len(rollout_log_probs) != len(responses):
            raise BatchError(f"from_sequences: {len(responses)} responses but {len(rollout_log_probs)} "
                             f"rollout_log_probs rows")
        if loss_masks is not None and len(loss_masks) != len(responses):
            raise BatchError(f"from_sequences: {len(responses)} responses but {len(loss_masks)} loss_masks rows")
        if not prompts:
            raise BatchError("from_sequences: empty batch")
        for b, (p, r) in enumerate(zip(prompts, responses)):
            if len(p) < 1:
                raise BatchError(f"from_sequences: row {b} has an empty prompt (need >= 1 prompt token: "
                                 f"the first response token is scored from the last prompt position)")
            if rollout_log_probs is not None and len(rollout_log_probs[b]) != len(r):
                raise BatchError(f"from_sequences: row {b} has {len(r)} response tokens but "
                                 f"{len(rollout_log_probs[b])} rollout log-probs")
            if loss_masks is not None:
                if len(loss_masks[b]) != len(r):
                    raise BatchError(f"from_sequences: row {b} has {len(r)} response tokens but "
                                     f"{len(loss_masks[b])} loss_masks entries")
                bad = [x for x in loss_masks[b] if x not in (0, 1)]
                if bad:
                    raise BatchError(f"from_sequences: row {b} loss_masks must hold only 0/1 (1 model-sampled, "
                                     f"0 environment), got {bad[0]!r}")
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        L = max(max(lengths), 2, pad_to or 0)
        # padded host rows first, one tensor each (a tensor write per row costs more than the whole batch)
        pad = int(pad_id)
        tokens = torch.tensor([[*p, *r] + [pad] * (L - n) for p, r, n in zip(prompts, responses, lengths)],
                              dtype=torch.int64).reshape(len(prompts), L)
        lp = None if rollout_log_probs is None else _response_columns(prompts, rollout_log_probs, L - 1)
        lm = None if loss_masks is None else _response_columns(prompts, loss_masks, L - 1)
        try:
            packed = pack_routing(routing, lengths, L - 1, what="from_sequences: routing")
        except RoutingError as e:
            raise BatchError(str(e)) from None
        return cls(tokens=tokens, prompt_lengths=torch.as_tensor([len(p) for p in prompts], dtype=torch.int64),
                   lengths=torch.as_tensor(lengths, dtype=torch.int64), rollout_log_probs=lp, pad_id=int(pad_id),
                   routing=packed, loss_mask=lm)

    def to(self, device) -> "RolloutBatch":
        """The batch with its token, length, rollout log-prob and loss-mask tensors on ``device`` (the actor's device:
        the loop moves each step's shard once, so the correction meets the actor's log-probs on one device).
        ``routing`` stays where it is (host memory; the replay moves each micro-batch's targets to the router's
        device). ``self`` when nothing moves."""
        device = torch.device(device)
        lp, lm = self.rollout_log_probs, self.loss_mask
        if self.tokens.device == device and all(x is None or x.device == device for x in (lp, lm)):
            return self
        return RolloutBatch(tokens=self.tokens.to(device), prompt_lengths=self.prompt_lengths.to(device),
                            lengths=self.lengths.to(device), rollout_log_probs=None if lp is None else lp.to(device),
                            pad_id=self.pad_id, routing=self.routing, loss_mask=None if lm is None else lm.to(device))

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise BatchError naming the field if shapes / dtypes / lengths are inconsistent."""
        t = self.tokens
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.int64:
            raise BatchError(f"RolloutBatch.tokens must be an int64 [B, L] tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        B, L = t.shape
        if B < 1 or L < 2:
            raise BatchError(f"RolloutBatch.tokens shape {tuple(t.shape)}: need B >= 1 and L >= 2")
        for name in ("prompt_lengths", "lengths"):
            v = getattr(self, name)
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (B,) or v.dtype != torch.int64:
                raise BatchError(f"RolloutBatch.{name} must be int64 [{B}], got "
                                 f"{getattr(v, 'dtype', type(v).__name__)} {tuple(getattr(v, 'shape', ()))}")
        for name in ("prompt_lengths", "lengths", "rollout_log_probs", "loss_mask"):
            v = getattr(self, name)
            if isinstance(v, torch.Tensor) and v.device != t.device:
                raise BatchError(f"RolloutBatch.{name} is on {v.device} but tokens on {t.device}: move the whole "
                                 f"batch with RolloutBatch.to(device)")
        bad = (self.prompt_lengths < 1) | (self.lengths < self.prompt_lengths) | (self.lengths > L)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise BatchError(f"RolloutBatch row {b}: need 1 <= prompt_length ({int(self.prompt_lengths[b])}) <= "
                             f"length ({int(self.lengths[b])}) <= L ({L})")
        lp = self.rollout_log_probs
        if lp is not None and (not isinstance(lp, torch.Tensor) or tuple(lp.shape) != (B, L - 1)
                               or not lp.is_floating_point()):
            raise BatchError(f"RolloutBatch.rollout_log_probs must be a float [B, L-1] = [{B}, {L - 1}] tensor "
                             f"(column t scores token t+1), got {tuple(getattr(lp, 'shape', ()))}")
        m = self.loss_mask
        if m is not None:
            if not isinstance(m, torch.Tensor) or tuple(m.shape) != (B, L - 1) or m.dtype != torch.float32:
                raise BatchError(f"RolloutBatch.loss_mask must be a float32 [B, L-1] = [{B}, {L - 1}] tensor "
                                 f"(column t: 1 iff token t+1 was sampled by the model), got "
                                 f"{getattr(m, 'dtype', type(m).__name__)} {tuple(getattr(m, 'shape', ()))}")
            not01 = (m != 0) & (m != 1)
            if bool(not01.any()):
                b, t = (int(i) for i in not01.nonzero()[0])
                raise BatchError(f"RolloutBatch.loss_mask[{b}, {t}] = {float(m[b, t])}: must be 0 or 1")
        r = self.routing
        if r is not None and (not isinstance(r, torch.Tensor) or r.dtype not in ROUTING_DTYPES or r.dim() != 4
                              or tuple(r.shape[:2]) != (B, L - 1)):
            raise BatchError(f"RolloutBatch.routing must be an integer [B, L-1, moe_layers, topk] tensor with "
                             f"[B, L-1] = [{B}, {L - 1}], got {getattr(r, 'dtype', type(r).__name__)} "
                             f"{tuple(getattr(r, 'shape', ()))}")

    # ------------------------------------------------------------------ derived tensors
    @property
    def num_rows(self) -> int:
        """B."""
        return int(self.tokens.shape[0])

    @property
    def max_length(self) -> int:
        """L (padded length of ``tokens``)."""
        return int(self.tokens.shape[1])

    @property
    def response_mask(self) -> torch.Tensor:
        """[B, L-1] float32: 1 at column t iff token t+1 is a response token sampled by the model (times
        ``loss_mask``: environment tokens are 0)."""
        t = torch.arange(1, self.max_length, device=self.tokens.device).unsqueeze(0)
        mask = ((t >= self.prompt_lengths.unsqueeze(1)) & (t < self.lengths.unsqueeze(1))).to(torch.float32)
        return mask if self.loss_mask is None else mask * self.loss_mask

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] int64 response tokens per row (model and environment tokens)."""
        return self.lengths - self.prompt_lengths

    @property
    def targets(self) -> torch.Tensor:
        """[B, L-1] int64: the token each column scores (``tokens[:, 1:]``)."""
        return self.tokens[:, 1:]

    def response_values(self, values: torch.Tensor) -> List[torch.Tensor]:
        """Per row, the [response_len] entries of a [B, L-1] per-token tensor at the response columns
        (inverse of the placement ``from_sequences`` does for rollout log-probs)."""
        if tuple(values.shape[:2]) != (self.num_rows, self.max_length - 1):
            raise BatchError(f"response_values: expected [{self.num_rows}, {self.max_length - 1}], "
                             f"got {tuple(values.shape)}")
        return [values[b, int(p) - 1: int(n) - 1] for b, (p, n) in
                enumerate(zip(self.prompt_lengths.tolist(), self.lengths.tolist()))]

    # ------------------------------------------------------------------ splitting
    def select(self, start: int, end: int, trim: bool = False, multiple_of: int = 1) -> "RolloutBatch":
        """Rows [start, end). ``trim``: cut L to the longest selected row (at least 2), i.e. micro-batches
        of variable length without the batch's padding. L is then rounded up to ``multiple_of`` (e.g. TP
        for sequence parallel, 2 x CP for context parallel) by padding with ``pad_id``."""
        if not 0 <= start < end <= self.num_rows:
            raise BatchError(f"select: rows [{start}, {end}) outside [0, {self.num_rows})")
        L = max(int(self.lengths[start:end].max()), 2) if trim else self.max_length
        L = -(-L // multiple_of) * multiple_of
        tokens = self.tokens[start:end, : min(L, self.max_length)]
        if L > self.max_length:  # rounding up beyond the batch's own padding
            tokens = torch.cat([tokens, tokens.new_full((end - start, L - self.max_length), self.pad_id)], 1)
        lp = None
        if self.rollout_log_probs is not None:
            lp = fit_columns(self.rollout_log_probs[start:end], L - 1)
        lm = None
        if self.loss_mask is not None:
            lm = fit_columns(self.loss_mask[start:end], L - 1)
        routing = None
        if self.routing is not None:  # columns on dim 1: cut, or zero-pad (never read beyond lengths - 1)
            routing = fit_columns(self.routing[start:end].transpose(1, -1), L - 1).transpose(1, -1).contiguous()
        return RolloutBatch(tokens=tokens.contiguous(), prompt_lengths=self.prompt_lengths[start:end].clone(),
                            lengths=self.lengths[start:end].clone(), rollout_log_probs=lp, pad_id=self.pad_id,
                            routing=routing, loss_mask=lm)

    def take(self, rows: Sequence[int]) -> "RolloutBatch":
        """The rows ``rows`` (any order, each once or more), same padded length L (a token-budget plan's
        permutation, ``megatron_rl.actor.micro_batching``)."""
        if not len(rows):
            raise BatchError("take: no rows")
        bad = [r for r in rows if not 0 <= int(r) < self.num_rows]
        if bad:
            raise BatchError(f"take: row {bad[0]} outside [0, {self.num_rows})")
        idx = torch.as_tensor([int(r) for r in rows], dtype=torch.int64, device=self.tokens.device)

        def pick(x):
            return None if x is None else x.index_select(0, idx.to(x.device)).contiguous()

        return RolloutBatch(tokens=pick(self.tokens), prompt_lengths=pick(self.prompt_lengths),
                            lengths=pick(self.lengths), rollout_log_probs=pick(self.rollout_log_probs),
                            pad_id=self.pad_id, routing=pick(self.routing), loss_mask=pick(self.loss_mask))

    def shard(self, rank: int, size: int) -> "RolloutBatch":
        """This data-parallel rank's contiguous block of rows (sizes differ by at most one)."""
        if not 0 <= rank < size:
            raise BatchError(f"shard: rank {rank} outside data-parallel size {size}")
        start, end = row_blocks(self.num_rows, size, "rollout rows over data-parallel ranks")[rank]
        return self.select(start, end)

    def micro_batches(self, micro_batch_size: int, trim: bool = True,
                      multiple_of: int = 1) -> List[Tuple[Tuple[int, int], "RolloutBatch"]]:
        """Consecutive micro-batches of ``micro_batch_size`` rows (the last may be smaller), each with its
        ``(start, end)`` rows; ``trim`` cuts each to its own longest row; lengths are rounded up to
        ``multiple_of``."""
        if micro_batch_size < 1:
            raise BatchError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [((s, min(s + micro_batch_size, self.num_rows)),
                 self.select(s, min(s + micro_batch_size, self.num_rows), trim=trim, multiple_of=multiple_of))
                for s in range(0, self.num_rows, micro_batch_size)]


def fit_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or zero-pad the last dim of ``x`` to ``width``."""
    if x.shape[-1] >= width:
        return x[..., :width].contiguous()
    pad = x.new_zeros(*x.shape[:-1], width - x.shape[-1])
    return torch.cat([x, pad], dim=-1)


def _response_columns(prompts: Sequence[Sequence[int]], values: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """``[B, width]`` float32: row b holds ``values[b]`` (one per response token) at columns
    ``len(prompts[b]) - 1 ...`` (the ``RolloutBatch`` layout of per-response-token values), 0 elsewhere."""
    rows = []
    for p, v in zip(prompts, values):
        row = [0.0] * width
        row[len(p) - 1: len(p) - 1 + len(v)] = [float(x) for x in v]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), width)
