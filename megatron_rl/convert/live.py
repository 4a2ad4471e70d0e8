"""Checkpoints <-> a live, parallel Megatron model (the trainer's entry points).

    chunks = build_gpt_model(model_cfg, parallel_cfg)                 # this rank's chunk(s)
    load_checkpoint_into_model(chunks, "hf_or_converted_dir", model_cfg)
    ...train...
    export_model_to_hf(chunks, model_cfg, "out_hf_dir", assets_dir="hf_dir")   # collective, all ranks

Both read the rank's coordinates from megatron's ``parallel_state`` (must be initialised).
Loading: a converted directory saved for the same layout is read file-for-file (only this rank's
shard); any other layout, VPP, or a HF directory goes through the full state dict, cut for each chunk
by ``megatron_rl.models.sharding``. The model's ``vocab_size`` (padded) decides the padding rows.
Exporting gathers the shards of the first data-parallel replica (and first expert-data-parallel
replica for experts) onto ``dst_rank`` with ``gather_object`` over the default group, unshards them,
drops vocab padding and writes HF safetensors + config/tokenizer from ``assets_dir`` — the directory
the rollout engine (SGLang) reloads. Memory: ``dst_rank`` holds one full copy of the weights.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import torch

from megatron_rl.convert import api, storage
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.mapping import CheckpointMismatchError, hf_to_mcore
from megatron_rl.convert.model_state import canonical_state_dict, load_state_dict_into_model
from megatron_rl.convert.sharding import ShardLayout

Tensor = torch.Tensor

# ModelConfig fields that must agree between a checkpoint and the model it is loaded into.
_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "query_groups", "head_dim",
                 "dense_ffn_hidden_size", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights",
                 "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                 "moe_shared_expert_gate")


def check_model_config_matches(geom: HFGeometry, hf_cfg: dict, model_cfg) -> None:
    """Raise CheckpointMismatchError naming every shape field where the checkpoint (``hf_cfg``) and
    ``model_cfg`` disagree, and when the model's vocab cannot hold the checkpoint's."""
    from megatron_rl.convert.model_config import model_config_from_hf

    ck = model_config_from_hf(hf_cfg, padded_vocab_size=max(model_cfg.vocab_size, geom.vocab_size))
    diffs = [f"{f}: checkpoint {getattr(ck, f)!r} vs model {getattr(model_cfg, f)!r}" for f in _SHAPE_FIELDS
             if getattr(ck, f) != getattr(model_cfg, f)]
    if model_cfg.is_moe and ck.moe_layer_pattern() != model_cfg.moe_layer_pattern():
        diffs.append(f"moe layer pattern: checkpoint {ck.moe_layer_pattern()} vs model {model_cfg.moe_layer_pattern()}")
    if model_cfg.vocab_size < geom.vocab_size:
        diffs.append(f"vocab_size: checkpoint {geom.vocab_size} > model {model_cfg.vocab_size}")
    if diffs:
        raise CheckpointMismatchError(f"checkpoint {geom.architecture} does not match the model config: "
                                      + "; ".join(diffs))


def read_full_state_dict(ckpt_dir: str):
    """(geometry, config.json dict, full Megatron state dict) from a HF directory or a converted one."""
    if os.path.isfile(os.path.join(ckpt_dir, storage.METADATA_FILE)):
        geom, full = api.read_full_mcore_state_dict(ckpt_dir)
        hf_cfg = storage.read_hf_config(os.path.join(ckpt_dir, storage.ASSETS_DIR))
        return geom, hf_cfg, full
    geom, hf_cfg, hf_sd = api.read_hf_checkpoint(ckpt_dir)
    return geom, hf_cfg, hf_to_mcore(hf_sd, geom)


def pad_vocab(full: Dict[str, Tensor], rows: int) -> Dict[str, Tensor]:
    """Copy of ``full`` with embedding / output layer padded with zero rows up to ``rows``."""
    out = dict(full)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        t = full.get(name)
        if t is not None and t.shape[0] < rows:
            out[name] = torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])
    return out


def strip_vocab(full: Dict[str, Tensor], rows: int) -> Dict[str, Tensor]:
    """Copy of ``full`` with embedding / output layer cut to the first ``rows`` rows (drop padding)."""
    out = dict(full)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in full:
            out[name] = full[name][:rows].contiguous()
    return out


def _layout_from_state(model_cfg) -> ShardLayout:
    from megatron.core import parallel_state as ps

    return ShardLayout(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                       pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                       expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                       expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
                       padded_vocab_size=model_cfg.vocab_size)


def load_checkpoint_into_model(chunks: Sequence[torch.nn.Module], ckpt_dir: str, model_cfg) -> None:
    """Load a HF directory or a converted directory into this rank's model chunk(s), strictly.

    Checks first that the checkpoint's shapes match ``model_cfg`` (error names each field), then
    every tensor name and shape of each chunk (error names the chunk's coordinates).
    """
    from megatron.core import parallel_state as ps

    from megatron_rl.models.sharding import RankCoords, shard_state_dict

    is_converted = os.path.isfile(os.path.join(ckpt_dir, storage.METADATA_FILE))
    cfg_dir = os.path.join(ckpt_dir, storage.ASSETS_DIR) if is_converted else ckpt_dir
    hf_cfg = storage.read_hf_config(cfg_dir)
    geom = HFGeometry.from_hf_config(hf_cfg)
    check_model_config_matches(geom, hf_cfg, model_cfg)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if is_converted and vpp == 1 and len(chunks) == 1:
        layout = _layout_from_state(model_cfg)
        coords = dict(tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                      ep_rank=ps.get_expert_model_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank())
        sd = api.load_rank_state_dict(ckpt_dir, layout, **coords)
        load_state_dict_into_model(chunks[0], sd, where=str(coords))
        return
    _, _, full = read_full_state_dict(ckpt_dir)
    full = pad_vocab(full, model_cfg.vocab_size)
    for i, chunk in enumerate(chunks):
        # cut with the models package's sharding (handles VPP), load with the strict, TE-aware loader
        c = RankCoords.from_parallel_state(vp_stage=i)
        load_state_dict_into_model(chunk, shard_state_dict(full, model_cfg, c), where=str(c))


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def gather_full_state_dict(chunks: Sequence[torch.nn.Module], model_cfg, dst_rank: int = 0
                           ) -> Optional[Dict[str, Tensor]]:
    """Collective over the default group: the full Megatron state dict (local-spec names, padded vocab)
    on ``dst_rank``, None elsewhere. Only the first (expert-)data-parallel replica sends its tensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.models.sharding import RankCoords, unshard_state_dicts
    from megatron_rl.parallel.config import ParallelConfig

    send_dense = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    send_expert = ps.get_expert_data_parallel_rank() == 0
    payload = []
    for i, chunk in enumerate(chunks):
        sd = canonical_state_dict(chunk.state_dict())
        part = {k: v.detach().cpu() for k, v in sd.items() if (send_expert if _is_expert(k) else send_dense)}
        payload.append((RankCoords.from_parallel_state(vp_stage=i), part))
    rank = dist.get_rank()
    gathered: Optional[List] = [None] * dist.get_world_size() if rank == dst_rank else None
    dist.gather_object(payload, gathered, dst=dst_rank)
    if rank != dst_rank:
        return None
    merged: Dict = {}
    for items in gathered:
        for coords, part in items:
            merged.setdefault(coords, {}).update(part)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    pcfg = ParallelConfig(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                          pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                          virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
                          expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                          expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size())
    return unshard_state_dicts(merged, model_cfg, pcfg)


def export_model_to_hf(chunks: Sequence[torch.nn.Module], model_cfg, out_dir: str, assets_dir: str,
                       dst_rank: int = 0) -> Optional[List[str]]:
    """Collective over the default group: write the live model as a HF safetensors directory on
    ``dst_rank`` (config.json and tokenizer files copied from ``assets_dir``, the original HF directory
    or a converted directory's ``hf_assets``). Returns the weight files on ``dst_rank``, None elsewhere.
    Tensors keep the model's dtype (fp32 params -> fp32 safetensors)."""
    if os.path.isdir(os.path.join(assets_dir, storage.ASSETS_DIR)):
        assets_dir = os.path.join(assets_dir, storage.ASSETS_DIR)
    hf_cfg = storage.read_hf_config(assets_dir)
    geom = HFGeometry.from_hf_config(hf_cfg)
    check_model_config_matches(geom, hf_cfg, model_cfg)
    full = gather_full_state_dict(chunks, model_cfg, dst_rank)
    if full is None:
        return None
    return api.export_hf_from_full(strip_vocab(full, geom.vocab_size), geom, out_dir, assets_dir)
