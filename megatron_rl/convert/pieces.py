"""A tensor left in pieces: ``Pieces`` names where each source block goes in the full tensor, so a consumer copies
every block straight into its own memory (an engine's weight, a bucket) -- one pass over the bytes, casting as it
copies -- instead of assembling the full tensor first. ``hf_pieces`` maps one Megatron tensor (whole or in pieces)
to its HF tensors the way ``mapping.hf_tensors`` does, without copying: the q / k / v of a fused qkv stay strided
views over a grouped shape of their destination, a GLU's gate / up and the vocab rows are narrowed blocks.

The one rule: a ``Pieces`` may read memory its producer reuses later (a shared-memory slot): a consumer copies it out
before it asks its stream past the next ``FENCE`` (``convert.live.iter_hf_tensors(lazy=True)``).
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.mapping import ParamRule, hf_tensors

__all__ = ["Pieces", "FENCE", "from_parts", "hf_pieces", "materialize", "copy_into"]

#: Name of the marker a lazy stream yields (with None) where the pieces yielded before it are no longer valid once
#: the consumer asks for the next pair (see the module doc).
FENCE = "<fence>"

Block = Tuple[torch.Tensor, Optional[Tuple[int, ...]], Tuple[slice, ...]]


class Pieces:
    """A tensor of ``shape`` / ``dtype`` as blocks: each ``(src, vshape, index)`` fills ``dst.view(vshape)[index]``
    (``vshape`` None: ``dst[index]``) of a contiguous destination ``dst``, cast to its dtype."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, blocks: List[Block]):
        self.shape = torch.Size(shape)
        """The full tensor's shape."""
        self.dtype = dtype
        """Its dtype (the gathered pieces'; a destination of another dtype casts as it copies)."""
        self.blocks = blocks
        """The ``(src, vshape, index)`` blocks, together covering the tensor once."""

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def detach(self) -> "Pieces":
        return self

    def copy_into(self, dst: torch.Tensor) -> torch.Tensor:
        """Write every block into ``dst`` (contiguous, of ``shape``); returns ``dst``."""
        if tuple(dst.shape) != tuple(self.shape):
            raise ValueError(f"Pieces.copy_into: destination shape {tuple(dst.shape)} != {tuple(self.shape)}")
        for src, vshape, index in self.blocks:
            (dst if vshape is None else dst.view(vshape))[index].copy_(src)
        return dst

    def materialize(self) -> torch.Tensor:
        """The full tensor (new memory)."""
        return self.copy_into(torch.empty(self.shape, dtype=self.dtype, device=self.blocks[0][0].device))

    def rows(self, lo: int, hi: int) -> Union["Pieces", torch.Tensor]:
        """Rows ``[lo, hi)`` of dim 0, as blocks (a plain tensor once a block would need a grouped view)."""
        out: List[Block] = []
        for src, vshape, index in self.blocks:
            if vshape is not None:
                return self.materialize()[lo:hi]
            first = index[0] if index else slice(None)
            a = first.start or 0
            b = self.shape[0] if first.stop is None else first.stop
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out.append((src.narrow(0, s - a, e - s), None, (slice(s - lo, e - lo),) + tuple(index[1:])))
        return _simplify(Pieces((hi - lo,) + tuple(self.shape[1:]), self.dtype, out))


def _simplify(p: Pieces) -> Union[Pieces, torch.Tensor]:
    """A single block covering the whole tensor as it is: that tensor."""
    if len(p.blocks) == 1:
        src, vshape, index = p.blocks[0]
        if vshape is None and all(i == slice(None) or i == slice(0, n) for i, n in zip(index, p.shape)) \
                and tuple(src.shape) == tuple(p.shape) and src.dtype == p.dtype:
            return src
    return p


def materialize(t) -> torch.Tensor:
    """``t`` as a tensor (a ``Pieces`` assembled)."""
    return t.materialize() if isinstance(t, Pieces) else t


def copy_into(t, dst: torch.Tensor) -> None:
    """Copy ``t`` (a tensor, or a ``Pieces`` block by block) into ``dst``, casting to its dtype."""
    if isinstance(t, Pieces):
        t.copy_into(dst)
    else:
        dst.copy_(t)


def from_parts(parts: Sequence[torch.Tensor], kind: str, full_shape: Sequence[int], dtype: torch.dtype) -> Pieces:
    """The full tensor of TP / ETP pieces ``parts`` (rank order) split as ``kind`` (``partition.param_kind``):
    ``partition.merge_tensors`` without the copy."""
    size, blocks = len(parts), []
    if kind in ("row", "expert_row"):
        n = full_shape[1] // size
        blocks = [(p, None, (slice(None), slice(r * n, (r + 1) * n))) for r, p in enumerate(parts)]
    elif kind in ("vocab", "column"):
        n = full_shape[0] // size
        blocks = [(p, None, (slice(r * n, (r + 1) * n),)) for r, p in enumerate(parts)]
    elif kind in ("glu_column", "expert_glu_column"):
        half = full_shape[0] // 2
        n = half // size
        for r, p in enumerate(parts):
            gate, up = p.chunk(2, 0)
            blocks += [(gate, None, (slice(r * n, (r + 1) * n),)), (up, None, (slice(half + r * n, half + (r + 1) * n),))]
    else:
        raise ValueError(f"from_parts: kind {kind!r} is not split")
    return Pieces(full_shape, dtype, blocks)


def _qkv(t: Union[torch.Tensor, Pieces], g: HFGeometry) -> Optional[List[Pieces]]:
    """q, k, v of a fused qkv as strided blocks over the grouped shape ``(groups, rows per group, ...)`` of each
    destination; None when a block does not hold whole query groups."""
    ng, d, hpg = g.num_query_groups, g.kv_channels, g.num_heads_per_group
    p = t if isinstance(t, Pieces) else Pieces(t.shape, t.dtype, [(t, None, ())])
    rest, per = tuple(p.shape[1:]), (hpg + 2) * d
    outs: List[List[Block]] = [[], [], []]
    for src, vshape, index in p.blocks:
        first = index[0] if index else slice(None)
        if vshape is not None or any(i != slice(None) for i in index[1:]):
            return None
        a = first.start or 0
        b = p.shape[0] if first.stop is None else first.stop
        if a % per or b % per:
            return None
        q, k, v = src.reshape((b - a) // per, per, *rest).split([hpg * d, d, d], dim=1)
        for out, part, rows in zip(outs, (q, k, v), (hpg * d, d, d)):
            out.append((part, (ng, rows) + rest, (slice(a // per, b // per),)))
    return [Pieces((ng * rows,) + rest, p.dtype, out) for out, rows in zip(outs, (hpg * d, d, d))]


def hf_pieces(rule: ParamRule, t: Union[torch.Tensor, Pieces], g: HFGeometry,
              vocab_rows: Optional[int] = None) -> Iterator[Tuple[str, Union[torch.Tensor, Pieces]]]:
    """``mapping.hf_tensors(rule, t[:vocab_rows], g)`` without copies: (HF name, tensor or ``Pieces``) pairs."""
    if isinstance(t, Pieces) and vocab_rows is not None:
        t = t.rows(0, vocab_rows)
    elif vocab_rows is not None:
        t = t[:vocab_rows]
    if not isinstance(t, Pieces) and rule.combine != "qkv":
        return hf_tensors(rule, t, g)  # plain tensors: views already (no copy)
    if tuple(t.shape) != tuple(rule.mcore_shape):
        return hf_tensors(rule, materialize(t), g)  # raises, naming the tensor
    if rule.combine == "copy":
        return zip(rule.hf_names, [t])
    if rule.combine == "qkv":
        parts = _qkv(t, g)
        return hf_tensors(rule, materialize(t), g) if parts is None else zip(rule.hf_names, parts)
    h = t.shape[0] // 2
    return zip(rule.hf_names, [t.rows(0, h), t.rows(h, 2 * h)])
