"""Checkpoints <-> a live, parallel Megatron model: the one loader, gatherer and exporter.

Every function takes this rank's ``ActorGroups`` and never reads megatron's global state. Loading checks the
checkpoint's config.json against ``model_cfg`` and reads only this rank's shard; gathering is collective over
the TP / EP / ETP groups of each stage, one full parameter at a time, and the exporter's full model exists only
on global rank 0's host (no rank stages more than one tensor on its device). Details: docs/convert.md.

    load_checkpoint_into_model(chunks, "hf_or_converted_dir", model_cfg, groups)     # every rank
    for hf_name, tensor in iter_hf_tensors(chunks, model_cfg, target.geometry, groups):  # stream, per stage
        ...
    export_model_to_hf(chunks, model_cfg, target, "out_dir", groups)        # rank 0 writes the HF directory
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_rl.convert import api, storage
from megatron_rl.convert.checks import CheckpointMismatchError, check_state_dict
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.hf_config import infer_hf_model_type, megatron_to_hf_config
from megatron_rl.convert.slices import read_chunk_from_converted, read_chunk_shard
from megatron_rl.convert.mapping import hf_tensors, param_rules
from megatron_rl.convert.model_state import canonical_state_dict, load_state_dict_into_model
from megatron_rl.convert.pieces import FENCE, hf_pieces, materialize
from megatron_rl.convert.partition import (RankCoords, cut_state_dict, expert_index, layer_range, merge_tensors,
                                           param_kind, split_layer_name)
from megatron_rl.convert.shard_files import ShardLayout
from megatron_rl.models.config import ModelConfig
from megatron_rl.parallel.devices import recv_, send_
from megatron_rl.parallel.groups import ActorGroups

Tensor = torch.Tensor

__all__ = ["HFTarget", "hf_target", "check_model_config_matches", "chunk_coords", "load_checkpoint_into_model",
           "load_full_state_dict_into_model", "iter_full_tensors", "iter_hf_tensors", "is_stage_leader",
           "gather_full_state_dict", "gather_hf_state_dict", "export_model_to_hf"]

_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")

#: How a chunk's tensors are read (``view``): its canonical state dict -> the (name, tensor) pairs to export
#: (e.g. ``lora.merge.merged_items``: adapters merged into their base weights). None: the state dict as it is.
TensorView = Optional[Callable[[Mapping[str, Tensor]], Iterable[Tuple[str, Tensor]]]]

# geometry fields that may differ between a checkpoint and the model it is loaded into (not a tensor shape)
_FREE_FIELDS = ("architecture", "family", "vocab_size", "moe_router_topk", "num_mtp_layers")


@dataclass(frozen=True)
class HFTarget:
    """What a live model is exported as: HF config, tensor geometry and where tokenizer files come from."""

    config: dict
    """config.json written beside the weights (when ``assets_dir`` has none)."""
    geometry: HFGeometry
    """HF tensor names and shapes (unpadded vocab) of the export."""
    assets_dir: Optional[str] = None
    """Directory whose config.json / tokenizer files are copied beside the weights (None: config only)."""


def check_model_config_matches(hf_cfg: dict, model_cfg: ModelConfig) -> None:
    """Raise CheckpointMismatchError naming every tensor-geometry field where the checkpoint's config.json
    (``hf_cfg``) and ``model_cfg`` disagree, and when the model's vocab cannot hold the checkpoint's."""
    ck = HFGeometry.from_hf_config(hf_cfg)
    model = HFGeometry.from_model_config(model_cfg, ck.architecture, ck.vocab_size)
    diffs = [f"{f.name}: checkpoint {getattr(ck, f.name)!r} vs model {getattr(model, f.name)!r}"
             for f in dataclasses.fields(HFGeometry)
             if f.name not in _FREE_FIELDS and getattr(ck, f.name) != getattr(model, f.name)]
    if model_cfg.vocab_size < ck.vocab_size:
        diffs.append(f"vocab_size: checkpoint {ck.vocab_size} > model {model_cfg.vocab_size}")
    if diffs:
        raise CheckpointMismatchError("checkpoint config.json does not match the model config: " + "; ".join(diffs))


def hf_target(model_cfg: ModelConfig, hf_dir: Optional[str]) -> HFTarget:
    """The HF form of ``model_cfg``: config and assets of ``hf_dir`` (a HF or converted directory; it
    must match ``model_cfg``), or a config.json generated from ``model_cfg`` when ``hf_dir`` is None."""
    if hf_dir:
        assets = storage.hf_assets_dir(hf_dir)
        cfg = storage.read_hf_config(assets)
        check_model_config_matches(cfg, model_cfg)
        return HFTarget(cfg, HFGeometry.from_hf_config(cfg), assets)
    cfg = megatron_to_hf_config(model_cfg, infer_hf_model_type(model_cfg))
    return HFTarget(cfg, HFGeometry.from_hf_config(cfg), None)


# ---------------------------------------------------------------------------------------------- loading

def _tied(model_cfg: ModelConfig) -> bool:
    return not model_cfg.untie_embeddings_and_output_weights


def _stage_sizes(chunk: torch.nn.Module) -> Dict[str, Optional[int]]:
    """Uneven pipeline-stage sizes of a built chunk (its TransformerConfig; None = even split)."""
    cfg = getattr(chunk, "config", None)
    return {"first_stage_layers": getattr(cfg, "num_layers_in_first_pipeline_stage", None),
            "last_stage_layers": getattr(cfg, "num_layers_in_last_pipeline_stage", None)}


def chunk_coords(groups: ActorGroups, chunk: torch.nn.Module, vp_stage: int) -> RankCoords:
    """This rank's coordinates of model chunk ``vp_stage`` (uneven stages read from the chunk's config)."""
    return RankCoords.from_groups(groups, vp_stage=vp_stage, **_stage_sizes(chunk))


def load_full_state_dict_into_model(chunks: Sequence[torch.nn.Module], full: Dict[str, Tensor],
                                    model_cfg: ModelConfig, groups: ActorGroups) -> None:
    """Cut this rank's chunk(s) from the full (TP1/PP1/EP1) Megatron state dict — embedding / output rows
    zero-padded to ``model_cfg.vocab_size`` — and load them strictly (names and shapes checked)."""
    for i, chunk in enumerate(chunks):
        coords = chunk_coords(groups, chunk, i)
        sd = cut_state_dict(full, coords, model_cfg.num_layers, _tied(model_cfg), model_cfg.num_moe_experts or 0,
                            padded_vocab_size=model_cfg.vocab_size)
        load_state_dict_into_model(chunk, sd, where=str(coords))


def load_checkpoint_into_model(chunks: Sequence[torch.nn.Module], ckpt_dir: str, model_cfg: ModelConfig,
                               groups: ActorGroups) -> storage.ReadCount:
    """Load a HF directory or a converted directory into this rank's model chunk(s), strictly; returns what
    this rank read from the checkpoint files.

    Checks first that the checkpoint's shapes match ``model_cfg`` (error names each field), then every
    tensor name and shape of each chunk (error names the chunk's coordinates). Each chunk reads only its
    positions: from a converted directory saved for this layout its own files, from a HF directory or one
    converted for another layout (or loaded with VPP) its slices (``slices``: any TP / PP / uneven PP / VPP /
    EP / ETP layout)."""
    check_model_config_matches(storage.read_hf_config(storage.hf_assets_dir(ckpt_dir)), model_cfg)
    count = storage.ReadCount()
    if not storage.is_converted_dir(ckpt_dir):
        geom = HFGeometry.from_hf_config(storage.read_hf_config(ckpt_dir))
        reader = storage.SafetensorsReader.for_hf_dir(ckpt_dir, count)
        for i, chunk in enumerate(chunks):
            coords = chunk_coords(groups, chunk, i)
            sd = read_chunk_shard(reader, geom, coords, padded_vocab_size=model_cfg.vocab_size)
            load_state_dict_into_model(chunk, sd, where=f"{ckpt_dir} -> {coords}")
            del sd
        return count
    if len(chunks) > 1:  # VPP: a converted directory has no VPP layout, each chunk is read slice by slice
        geom, saved, _ = api.read_mcore_checkpoint(ckpt_dir)
        for i, chunk in enumerate(chunks):
            coords = chunk_coords(groups, chunk, i)
            sd = read_chunk_from_converted(ckpt_dir, geom, saved, coords, model_cfg.vocab_size, count)
            load_state_dict_into_model(chunk, sd, where=f"{ckpt_dir} -> {coords}")
            del sd
        return count
    d = groups.dims
    stages = _stage_sizes(chunks[0])
    layout = ShardLayout(tensor_model_parallel_size=d.tp, pipeline_model_parallel_size=d.pp,
                         expert_model_parallel_size=d.ep, expert_tensor_parallel_size=d.etp,
                         padded_vocab_size=model_cfg.vocab_size,
                         num_layers_in_first_pipeline_stage=stages["first_stage_layers"],
                         num_layers_in_last_pipeline_stage=stages["last_stage_layers"])
    coords = chunk_coords(groups, chunks[0], 0)
    sd = api.load_rank_state_dict(ckpt_dir, layout, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank,
                                  ep_rank=groups.ep_rank, etp_rank=groups.etp_rank, count=count)
    load_state_dict_into_model(chunks[0], sd, where=f"{ckpt_dir} -> {coords}")
    return count


# -------------------------------------------------------------------------------------------- gathering

def _all_gather(t: Tensor, group, size: int) -> List[Tensor]:
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


#: ``gather(t, kind, group, size, name, dtype)``: the full tensor of a split parameter on the group's rank 0 (None
#: on the others), collective over ``group`` -- how a caller that needs it on rank 0 alone gathers (weight sync).
#: A batching one also has ``batch_bytes`` (the bytes of pieces a batch may hold) and ``gather_many(items, group,
#: size, dtype)`` (``items``: ``(t, kind, name)`` of one group) -> per item its full tensor, a ``pieces.Pieces``
#: allowed, on the group's rank 0 (None on the others).
PieceGather = Callable[[Tensor, str, object, int, str, Optional[torch.dtype]], Optional[Tensor]]


def _merge(t: Tensor, kind: str, group, size: int, name: str, copy: bool = True, dtype=None,
           gather: Optional[PieceGather] = None) -> Tensor:
    """The full tensor of the TP (or ETP) split ``t`` of parameter ``name`` (``copy`` False: an unsplit one is
    ``t`` itself, not a copy; ``dtype``: a split floating tensor is cast to it before the gather; ``gather``: the
    gatherer of a split one, see ``PieceGather``)."""
    if kind == "replicated" or (size == 1 and not copy):
        return t
    if gather is not None and size > 1:
        return gather(t, kind, group, size, name, dtype)
    if dtype is not None and size > 1 and t.is_floating_point():
        t = t.to(dtype)
    return merge_tensors(_all_gather(t, group, size), kind, name)


def _entries(chunks, model_cfg: ModelConfig, groups: ActorGroups, owner_only: bool, view: TensorView):
    """``iter_full_tensors``' walk: per parameter this rank takes part in, ``(name, t, kind, group, size, out)``;
    ``out``: the full-state-dict name to yield it as on its owner (None on a rank that only takes part), or
    ``(prefix, fmt, local)`` for a routed expert gathered over EP as well (not ``owner_only``)."""
    sends_dense = groups.dp_rank == 0 and groups.cp_rank == 0
    sends_experts = groups.edp_rank == 0
    owns_dense = not owner_only or groups.tp_rank == 0
    owns_experts = not owner_only or groups.etp_rank == 0
    per_ep = (model_cfg.num_moe_experts or 0) // groups.ep_size
    for i, chunk in enumerate(chunks):
        first_layer, _ = layer_range(model_cfg.num_layers, chunk_coords(groups, chunk, i))
        sd = canonical_state_dict(chunk.state_dict())
        for name, t in (sd.items() if view is None else view(sd)):
            t = t.detach()
            in_layer = split_layer_name(name)
            if in_layer is None:
                if sends_dense and not (name == "output_layer.weight" and _tied(model_cfg)):
                    yield name, t, param_kind(name), groups.tp_group, groups.tp_size, name if owns_dense else None
                continue
            layer, rest = in_layer
            prefix = f"decoder.layers.{layer + first_layer}."
            expert = expert_index(rest)
            if expert is None:
                if sends_dense:
                    yield name, t, param_kind(rest), groups.tp_group, groups.tp_size, \
                        prefix + rest if owns_dense else None
                continue
            if sends_experts:
                local, fmt = expert
                if not owner_only:
                    out = (prefix, fmt, local)
                else:
                    out = prefix + fmt.format(groups.ep_rank * per_ep + local) if owns_experts else None
                yield name, t, param_kind(rest), groups.etp_group, groups.etp_size, out


def _batched(entries, gather, dtype) -> Iterator[Tuple[str, object]]:
    """``owner_only`` with a batching ``gather``: the unsplit tensors as they come, the split ones per batch of one
    group (batches end on each group's own bytes, so every rank of a group cuts the same batches), each batch
    followed by ``pieces.FENCE``."""
    pending: Dict[int, list] = {}  # id(group) -> [group, size, bytes so far, [(name, t, kind, out)]]

    def flush(key):
        group, size, _, items = pending.pop(key)
        fulls = gather.gather_many([(t, kind, name) for name, t, kind, _ in items], group, size, dtype)
        for (_, _, _, out), full in zip(items, fulls):
            if out is not None:
                yield out, full
        yield FENCE, None

    for name, t, kind, group, size, out in entries:
        if kind == "replicated" or size == 1:
            if out is not None:
                yield out, t
            continue
        want = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        n = t.numel() * torch.empty((), dtype=want).element_size()
        entry = pending.get(id(group))
        if entry is not None and entry[3] and entry[2] + n > gather.batch_bytes:
            yield from flush(id(group))
            entry = None
        if entry is None:
            entry = pending[id(group)] = [group, size, 0, []]
        entry[2] += n
        entry[3].append((name, t, kind, out))
    for key in list(pending):
        yield from flush(key)


def iter_full_tensors(chunks: Sequence[torch.nn.Module], model_cfg: ModelConfig,
                      groups: ActorGroups, owner_only: bool = False,
                      gather_dtype: Optional[torch.dtype] = None,
                      gather: Optional[PieceGather] = None, view: TensorView = None
                      ) -> Iterator[Tuple[str, Tensor]]:
    """Collective over the TP / EP / ETP groups of this rank's pipeline stage (every rank calls it): the
    (full-state-dict name, full tensor) of each parameter of this stage's chunks, on every rank of the
    first (expert-)data-parallel replica; other replicas skip what they do not send. Embedding / output
    rows keep the model's padded vocab; the tied output-layer copy of the last stage is skipped. Tensors
    stay on the parameters' device (a gathered tensor is new memory, a replicated one the parameter).

    ``owner_only``: each tensor is yielded on its one owner alone and routed experts are not gathered over
    EP: a dense tensor on TP rank 0 of the first replica, an expert on ETP rank 0 of the first expert replica
    of the EP rank that holds it (its own experts only) -- the shard each weight-sync sender sends; a tensor
    that is not split is then the parameter itself (the sender copies it into its buckets), not a copy.
    ``gather_dtype``: split floating tensors are cast to it before they are gathered (half the bytes of an fp32
    gather for a bf16 engine; the HF mapping only moves data, so the values are those of a cast after it).
    ``gather`` (with ``owner_only``): how split tensors reach their owner (``PieceGather``; default ``all_gather``);
    a batching one (``gather_many``) may yield ``pieces.Pieces`` and ``pieces.FENCE`` markers (see ``pieces``)."""
    if gather is not None and not owner_only:
        raise ValueError("iter_full_tensors: a gather to the owner needs owner_only")
    entries = _entries(chunks, model_cfg, groups, owner_only, view)
    if getattr(gather, "gather_many", None) is not None:
        yield from _batched(entries, gather, gather_dtype)
        return
    per_ep = (model_cfg.num_moe_experts or 0) // groups.ep_size
    for name, t, kind, group, size, out in entries:
        full = _merge(t, kind, group, size, name, not owner_only, gather_dtype, gather)
        if isinstance(out, tuple):
            prefix, fmt, local = out
            for ep_rank, piece in enumerate(_all_gather(full, groups.ep_group, groups.ep_size)):
                yield prefix + fmt.format(ep_rank * per_ep + local), piece
        elif out is not None:
            yield out, full


def iter_hf_tensors(chunks: Sequence[torch.nn.Module], model_cfg: ModelConfig, geometry: HFGeometry,
                    groups: ActorGroups, owner_only: bool = False,
                    gather_dtype: Optional[torch.dtype] = None,
                    gather: Optional[PieceGather] = None, view: TensorView = None, lazy: bool = False
                    ) -> Iterator[Tuple[str, Tensor]]:
    """:func:`iter_full_tensors` mapped to HF: (HF name, tensor) pairs, vocab padding rows dropped (same
    collective contract, ``owner_only``, ``gather_dtype``, ``gather`` and ``view``). A parameter without a HF
    counterpart in ``geometry`` raises, naming it. ``lazy``: tensors may be ``pieces.Pieces`` (a fused qkv's
    q / k / v, a batching gather's pieces: nothing copied) and the stream carries ``(pieces.FENCE, None)`` markers;
    else every tensor is a tensor and there are no markers."""
    rules = {r.mcore_name: r for r in param_rules(geometry)}
    for name, t in iter_full_tensors(chunks, model_cfg, groups, owner_only, gather_dtype, gather=gather, view=view):
        if name is FENCE:
            if lazy:
                yield FENCE, None
            continue
        rule = rules.get(name)
        if rule is None:
            raise CheckpointMismatchError(f"model parameter {name!r} has no HF tensor in {geometry.architecture}")
        rows = geometry.vocab_size if name in _VOCAB_TENSORS else None
        if lazy:
            yield from hf_pieces(rule, t, geometry, rows)
            continue
        t = materialize(t)
        yield from hf_tensors(rule, t if rows is None else t[:rows], geometry)


def is_stage_leader(groups: ActorGroups) -> bool:
    """The first rank of its pipeline stage: it holds every gathered tensor of the stage (the rank that
    sends the stage's :func:`iter_hf_tensors` stream on, e.g. as weight-sync buckets)."""
    return (groups.tp_rank, groups.dp_rank, groups.cp_rank, groups.edp_rank, groups.ep_rank,
            groups.etp_rank) == (0, 0, 0, 0, 0, 0)


def _collect_on_rank0(pairs: Iterator[Tuple[str, Tensor]], groups: ActorGroups) -> Optional[Dict[str, Tensor]]:
    """Run the (collective) stream on every rank; the stage leaders keep CPU copies, which the other leaders
    send to global rank 0 point to point, tensor by tensor (the dict there, None elsewhere).

    Not ``gather_object``: it pads every rank's pickle to the largest stage and has rank 0 allocate world_size
    times that on its device (NCCL stages object bytes on the GPU): a full model per rank, for ranks that send
    nothing. Here only leaders send, each tensor once, staged for the default group's backend one tensor at a
    time (``parallel.devices``)."""
    leader = is_stage_leader(groups)
    mine: Dict[str, Tensor] = {}
    for name, t in pairs:
        if leader:
            mine[name] = t.to("cpu", copy=True).contiguous()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    rank = dist.get_rank()
    leaders: List[Optional[bool]] = [None] * dist.get_world_size()
    dist.all_gather_object(leaders, leader)
    senders = [r for r, lead in enumerate(leaders) if lead and r != 0]
    if rank == 0:
        out: Dict[str, Tensor] = dict(mine)
        for src in senders:
            box: List[Optional[list]] = [None]
            dist.recv_object_list(box, src=src)
            for name, shape, dtype in box[0]:
                out[name] = recv_(torch.empty(shape, dtype=dtype), src=src)
        return out
    if leader:
        dist.send_object_list([[(n, tuple(t.shape), t.dtype) for n, t in mine.items()]], dst=0)
        for t in mine.values():
            send_(t, dst=0)
    return None


def gather_full_state_dict(chunks: Sequence[torch.nn.Module], model_cfg: ModelConfig,
                           groups: ActorGroups, view: TensorView = None) -> Optional[Dict[str, Tensor]]:
    """Collective over all ranks: the full Megatron state dict (local-spec names, padded vocab, CPU) on
    global rank 0, None elsewhere (``view``: as in :func:`iter_full_tensors`, e.g. the LoRA adapters alone)."""
    return _collect_on_rank0(iter_full_tensors(chunks, model_cfg, groups, view=view), groups)


def gather_hf_state_dict(chunks: Sequence[torch.nn.Module], model_cfg: ModelConfig, geometry: HFGeometry,
                         groups: ActorGroups, view: TensorView = None) -> Optional[Dict[str, Tensor]]:
    """Collective over all ranks: {HF name: CPU tensor} on global rank 0 (every HF tensor of ``geometry``
    checked present, with its shape), None elsewhere."""
    sd = _collect_on_rank0(iter_hf_tensors(chunks, model_cfg, geometry, groups, view=view), groups)
    if sd is not None:
        check_state_dict(sd, {n: s for r in param_rules(geometry) for n, s in zip(r.hf_names, r.hf_shapes)},
                         f"HF export of the live model ({geometry.architecture})")
    return sd


def export_model_to_hf(chunks: Sequence[torch.nn.Module], model_cfg: ModelConfig, target: HFTarget, out_dir: str,
                       groups: ActorGroups, max_shard_bytes: int = storage.DEFAULT_MAX_SHARD_BYTES,
                       view: TensorView = None) -> Optional[List[str]]:
    """Collective over all ranks: global rank 0 writes the live model as the HF directory ``out_dir``
    (safetensors in the model's dtype + the target's config / tokenizer files); returns the weight files
    there, None elsewhere (``view``: as in :func:`iter_full_tensors`). Ends with a barrier, so the directory is
    complete when any rank returns."""
    sd = gather_hf_state_dict(chunks, model_cfg, target.geometry, groups, view)
    files = None
    if sd is not None:
        files = storage.write_hf_model_dir(out_dir, sd, target.assets_dir, target.config, max_shard_bytes)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return files
