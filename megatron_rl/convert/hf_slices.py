"""One model chunk's shard read straight from a HF safetensors directory, slice by slice.

Each rank reads only the rows / columns it holds (``safe_open(...).get_slice(name)[...]``), so its host
memory grows by its shard, not by the checkpoint: which tensors a chunk holds and how each is split comes
from :func:`megatron_rl.convert.partition.cut_plan` / ``split_selection``, which HF rows a Megatron row is
made of from :func:`megatron_rl.convert.mapping.hf_row_sources` (QKV interleave per query group, gated
``[gate; up]``). Every byte goes through one ``storage.SafetensorsReader``, which counts them::

    reader = storage.SafetensorsReader.for_hf_dir(hf_dir)
    sd = read_chunk_shard(reader, geom, coords, padded_vocab_size=model_cfg.vocab_size)
    reader.count.bytes_read  # <= the shard's bytes (padding rows are zeros, never read)

Column-split tensors (TP / ETP splits of dim 0, vocab blocks with zero padding) read, per HF tensor, the one
contiguous block of rows they come from; row-parallel ones (dim 1) a block of columns; replicated ones the
whole tensor. Memory on top of the shard: the pieces of one tensor while it is assembled. The ``lm_head``
of a tied checkpoint is not read (the embedding is the output layer).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_rl.convert.checks import check_state_dict
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.mapping import ParamRule, combine, drop_mtp_layers, hf_row_sources, param_rules
from megatron_rl.convert.partition import RankCoords, cut_plan
from megatron_rl.convert.storage import SafetensorsReader

Tensor = torch.Tensor

__all__ = ["check_hf_tensors", "read_chunk_shard"]


def check_hf_tensors(reader: SafetensorsReader, g: HFGeometry) -> List[ParamRule]:
    """The Megatron tensors of ``g`` with their HF sources, after checking from the file headers alone (no
    weight read) that the checkpoint holds exactly the HF tensors of ``g`` with their shapes (the error
    names every missing / unexpected / misshapen tensor)."""
    rules = param_rules(g)
    headers = drop_mtp_layers({n: torch.empty(reader.shape(n), device="meta") for n in reader.keys()}, g)
    optional = ("lm_head.weight",) if g.tie_word_embeddings else ()
    check_state_dict(headers, {n: s for r in rules for n, s in zip(r.hf_names, r.hf_shapes)},
                     f"HF checkpoint ({g.architecture})", optional=optional)
    return rules


def _contiguous(rows: Tensor) -> bool:
    return bool(torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + rows.numel())))


def _read_block(reader: SafetensorsReader, name: str, dim: int, positions: Tensor) -> Tensor:
    """Positions ``positions`` (>= 0) of HF tensor ``name`` along ``dim``: one slice read of the block they
    span, indexed when they are not that block in order."""
    lo, hi = int(positions.min()), int(positions.max()) + 1
    block = reader.read(name, dim, lo, hi)
    return block if _contiguous(positions) else block.index_select(dim, positions - lo)


def _read_rows(reader: SafetensorsReader, rule: ParamRule, index: Tensor, g: HFGeometry) -> Tensor:
    """Rows ``index`` of the Megatron tensor of ``rule`` (-1: zero padding rows), read from its HF rows."""
    part_of, row_of = hf_row_sources(rule, g)
    valid = index >= 0
    src = index[valid]
    parts, rows = part_of[src], row_of[src]
    if bool(valid.all()) and bool((parts == parts[0]).all()):
        return _read_block(reader, rule.hf_names[int(parts[0])], 0, rows)
    out: Optional[Tensor] = None
    at = valid.nonzero().flatten()
    for i, name in enumerate(rule.hf_names):
        mine = parts == i
        if not bool(mine.any()):
            continue
        piece = _read_block(reader, name, 0, rows[mine])
        if out is None:
            out = piece.new_zeros((index.numel(),) + tuple(piece.shape[1:]))
        out.index_copy_(0, at[mine], piece)
    if out is None:  # only padding rows: dtype from an empty read
        empty = reader.read(rule.hf_names[0], 0, 0, 0)
        out = empty.new_zeros((index.numel(),) + tuple(empty.shape[1:]))
    return out


def _read_tensor(reader: SafetensorsReader, rule: ParamRule, dim: Optional[int], index: Optional[Tensor],
                 g: HFGeometry) -> Tensor:
    """Positions ``index`` along ``dim`` of the Megatron tensor of ``rule`` (None: the whole tensor)."""
    if dim == 0:
        return _read_rows(reader, rule, index, g)
    if dim is None:
        return combine(rule, [reader.read(n) for n in rule.hf_names], g)
    # a column block: every HF part keeps all its rows, so the parts combine as whole tensors do
    return combine(rule, [_read_block(reader, n, dim, index) for n in rule.hf_names], g)


def read_chunk_shard(reader: SafetensorsReader, g: HFGeometry, coords: RankCoords,
                     padded_vocab_size: Optional[int] = None, dense: bool = True,
                     experts: bool = True) -> Dict[str, Tensor]:
    """The state dict (local-spec names, stage-local layers, EP-local experts) of the model chunk at
    ``coords``, equal to cutting it from the full state dict, reading only its slices from ``reader``.
    ``padded_vocab_size``: rows of the embedding / output layer after zero padding; ``dense`` /
    ``experts``: include the non-expert / routed-expert tensors."""
    rules = {r.mcore_name: r for r in check_hf_tensors(reader, g)}
    plan = cut_plan(list(rules), coords, g.num_layers, g.tie_word_embeddings, g.num_moe_experts or 0,
                    padded_vocab_size, dense, experts)
    out: Dict[str, Tensor] = {}
    for entry in plan:
        rule = rules[entry.full_name]
        out[entry.local_name] = _read_tensor(reader, rule, *entry.selection(rule.mcore_shape), g)
    return out
