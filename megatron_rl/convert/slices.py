"""One model chunk's shard read slice by slice, from a HF safetensors directory or a converted directory of
any layout.

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

A converted directory saved for another layout (:func:`read_chunk_from_converted`) is read the same way:
``cut_plan`` of each saved shard says which file and local name hold each full tensor and which of its
positions (``split_selection``), so each target position is read from the saved shard that holds it.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_rl.convert import storage
from megatron_rl.convert.checks import CheckpointFormatError, LayoutError, check_state_dict
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.mapping import ParamRule, combine, drop_mtp_layers, hf_row_sources, param_rules
from megatron_rl.convert.partition import CutEntry, RankCoords, cut_plan
from megatron_rl.convert.shard_files import ShardLayout, dense_keys, expert_keys
from megatron_rl.convert.storage import ReadCount, SafetensorsReader

Tensor = torch.Tensor

__all__ = ["check_hf_tensors", "read_chunk_shard", "read_chunk_from_converted"]


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


def _read_block(reader: SafetensorsReader, name: str, dim: int, positions: Tensor) -> Tensor:
    """Positions ``positions`` (>= 0, in order) of tensor ``name`` along ``dim``: one slice read per run of
    consecutive positions (a gated fc1 block is two runs), so exactly those positions are read."""
    if positions.numel() == 0:
        return reader.read(name, dim, 0, 0)
    breaks = ((positions[1:] - positions[:-1]) != 1).nonzero().flatten() + 1
    bounds = [0] + breaks.tolist() + [positions.numel()]
    runs = [reader.read(name, dim, int(positions[lo]), int(positions[hi - 1]) + 1)
            for lo, hi in zip(bounds[:-1], bounds[1:])]
    return runs[0] if len(runs) == 1 else torch.cat(runs, dim)


def _assemble(index: Tensor, part_of: Tensor, row_of: Tensor, dim: int,
              read: Callable[[int, Tensor], Tensor]) -> Tensor:
    """Positions ``index`` along ``dim`` (-1: zeros) of a tensor whose position i is position ``row_of[i]`` of
    source ``part_of[i]``; ``read(part, positions)`` returns those positions of one source along ``dim``."""
    valid = index >= 0
    src = index[valid]
    parts, rows = part_of[src], row_of[src]
    if bool(valid.all()) and bool((parts == parts[0]).all()):
        return read(int(parts[0]), rows)
    out: Optional[Tensor] = None
    at = valid.nonzero().flatten()
    for i in sorted(set(parts.tolist())):
        mine = parts == i
        piece = read(i, rows[mine])
        if out is None:
            out = piece.new_zeros(piece.shape[:dim] + (index.numel(),) + piece.shape[dim + 1:])
        out.index_copy_(dim, at[mine], piece)
    if out is None:  # only padding rows: dtype and other dims from an empty read
        empty = read(int(part_of[0]), torch.zeros(0, dtype=torch.long))
        out = empty.new_zeros(empty.shape[:dim] + (index.numel(),) + empty.shape[dim + 1:])
    return out


def _read_rows(reader: SafetensorsReader, rule: ParamRule, index: Tensor, g: HFGeometry) -> Tensor:
    """Rows ``index`` of the Megatron tensor of ``rule`` (-1: zero padding rows), read from its HF rows."""
    part_of, row_of = hf_row_sources(rule, g)
    return _assemble(index, part_of, row_of, 0, lambda i, rows: _read_block(reader, rule.hf_names[i], 0, rows))


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


def _saved_locations(mcore_dir: str, g: HFGeometry, saved: ShardLayout,
                     names: List[str]) -> Dict[str, Dict[int, Tuple[str, CutEntry]]]:
    """For each full tensor name: {split rank: (shard file, its entry in that shard)} of the layout the
    converted directory was saved with (one copy per split rank: replicas are equal)."""
    args = (g.num_layers, g.tie_word_embeddings, g.num_moe_experts or 0)
    files = [(storage.dense_file(mcore_dir, t, p), saved.coords(t, p), dict(experts=False))
             for t, p in dense_keys(saved)]
    files += [(storage.expert_file(mcore_dir, e, t, p), saved.coords(pp_rank=p, ep_rank=e, etp_rank=t),
               dict(dense=False)) for e, t, p in expert_keys(g, saved)]
    where: Dict[str, Dict[int, Tuple[str, CutEntry]]] = {}
    for path, coords, which in files:
        for entry in cut_plan(names, coords, *args, padded_vocab_size=saved.padded_vocab(g.vocab_size), **which):
            where.setdefault(entry.full_name, {}).setdefault(entry.rank, (path, entry))
    return where


def read_chunk_from_converted(mcore_dir: str, g: HFGeometry, saved: ShardLayout, coords: RankCoords,
                              padded_vocab_size: Optional[int] = None, count: Optional[ReadCount] = None
                              ) -> Dict[str, Tensor]:
    """The state dict of the model chunk at ``coords`` from a converted directory saved with layout ``saved``
    (any other layout), reading only the positions the chunk holds from the saved shards that hold them;
    bytes read are added to ``count``. A missing shard file raises naming it."""
    rules = {r.mcore_name: r for r in param_rules(g)}
    where = _saved_locations(mcore_dir, g, saved, list(rules))
    readers: Dict[str, SafetensorsReader] = {}
    count = count if count is not None else ReadCount()

    def reader(path: str) -> SafetensorsReader:
        if path not in readers:
            if not os.path.isfile(path):
                raise CheckpointFormatError(f"{mcore_dir}: missing shard file {path} of layout {saved.to_dict()}")
            readers[path] = SafetensorsReader([path], count)
        return readers[path]

    out: Dict[str, Tensor] = {}
    for entry in cut_plan(list(rules), coords, g.num_layers, g.tie_word_embeddings, g.num_moe_experts or 0,
                          padded_vocab_size):
        shape = rules[entry.full_name].mcore_shape
        dim_t, want = entry.selection(shape)
        held = where[entry.full_name]
        sources = sorted(held)
        dim = held[sources[0]][1].selection(shape)[0]
        if dim is None:  # saved whole: the target's positions straight from the first copy
            dim, want = (0, torch.arange(shape[0])) if dim_t is None else (dim_t, want)
            owner, local = torch.full((shape[dim],), sources[0], dtype=torch.long), torch.arange(shape[dim])
        else:
            if dim_t not in (None, dim):
                raise LayoutError(f"{entry.full_name}: split along dim {dim_t} here but {dim} in {mcore_dir}")
            want = torch.arange(shape[dim]) if dim_t is None else want
            owner = torch.full((shape[dim],), -1, dtype=torch.long)
            local = owner.clone()
            for r in sources:
                idx = held[r][1].selection(shape)[1]
                ok = idx >= 0
                owner[idx[ok]], local[idx[ok]] = r, torch.arange(idx.numel())[ok]
            if bool((owner < 0).any()):
                raise CheckpointFormatError(f"{mcore_dir}: no saved shard holds all of {entry.full_name}")

        def read(r: int, rows: Tensor, dim: int = dim, held=held) -> Tensor:
            path, saved_entry = held[r]
            return _read_block(reader(path), saved_entry.local_name, dim, rows)

        out[entry.local_name] = _assemble(want, owner, local, dim, read)
    return out
