"""The single owner of HF and checkpoint knowledge: HF config.json <-> ModelConfig, HF <-> Megatron tensors,
per-rank shards at any TP/PP/VPP/EP/ETP, converted / torch_dist checkpoint files, and the one loader /
gatherer / exporter between those and a live, parallel model (Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE).

Modules, each with one job:
  checks       the errors and the one strict name / shape check (``check_state_dict``)
  hf_config    the one reading of a HF config.json (-> ModelConfig) and its inverse (ModelConfig -> config.json)
  geometry     the tensor geometry (HFGeometry) of a ModelConfig saved as a HF architecture
  mapping      HF state dict <-> full Megatron state dict (local-spec names, global indices), per tensor
  partition    full Megatron state dict <-> per-chunk shards of a TP/PP/VPP/EP/ETP layout (RankCoords)
  shard_files  the converter's per-rank shard files: ShardLayout (+ padded vocab), cut and glue them back
  storage      HF safetensors directories and the converted shard directory format
  slices       one chunk's shard read slice by slice (only its positions) from HF or converted files
  model_state  put a rank state dict into a live Megatron model (local or TE spec) / read it back
  torch_dist   read the model tensors of a megatron dist_checkpointing (torch_dist) checkpoint, one process
  api          the one-process conversion entry points used by ``megatron-rl convert``
  live         load into / stream, gather and export from a live parallel model (collective, ActorGroups)

Command line: ``megatron-rl convert hf-to-mcore ...`` / ``megatron-rl convert mcore-to-hf ...``.
"""
from megatron_rl.convert.api import (convert_hf_to_mcore, convert_mcore_to_hf, export_hf_from_full,
                                     export_torch_dist_to_hf, load_rank_state_dict, model_config_for_checkpoint,
                                     read_full_mcore_state_dict, read_full_state_dict, read_hf_checkpoint,
                                     read_mcore_checkpoint)
from megatron_rl.convert.checks import (CheckpointFormatError, CheckpointMismatchError, LayoutError,
                                        UnsupportedCheckpointError, check_state_dict)
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.hf_config import infer_hf_model_type, megatron_to_hf_config, model_config_from_hf
from megatron_rl.convert.live import (HFTarget, check_model_config_matches, export_model_to_hf,
                                      gather_full_state_dict, gather_hf_state_dict, hf_target, iter_full_tensors,
                                      iter_hf_tensors, load_checkpoint_into_model, load_full_state_dict_into_model)
from megatron_rl.convert.mapping import hf_to_mcore, mcore_to_hf, param_rules
from megatron_rl.convert.model_state import adapt_names_to_model, canonical_state_dict, load_state_dict_into_model
from megatron_rl.convert.shard_files import ShardLayout, rank_state_dict, unshard

__all__ = [
    "HFGeometry", "ShardLayout", "HFTarget", "convert_hf_to_mcore", "convert_mcore_to_hf", "export_hf_from_full",
    "export_torch_dist_to_hf", "load_rank_state_dict", "model_config_for_checkpoint", "read_full_mcore_state_dict",
    "read_full_state_dict", "read_hf_checkpoint", "read_mcore_checkpoint", "CheckpointFormatError",
    "CheckpointMismatchError", "LayoutError", "UnsupportedCheckpointError", "check_state_dict",
    "infer_hf_model_type", "megatron_to_hf_config", "model_config_from_hf", "check_model_config_matches",
    "export_model_to_hf", "gather_full_state_dict", "gather_hf_state_dict", "hf_target", "iter_full_tensors",
    "iter_hf_tensors", "load_checkpoint_into_model", "load_full_state_dict_into_model", "hf_to_mcore",
    "mcore_to_hf", "param_rules", "adapt_names_to_model", "canonical_state_dict", "load_state_dict_into_model",
    "rank_state_dict", "unshard",
]
