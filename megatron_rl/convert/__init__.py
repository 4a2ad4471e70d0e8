"""HF <-> Megatron-Core checkpoint conversion (Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) at any TP/PP/EP.

Pure tensor work in one process (no process group). Modules, each with one job:
  geometry     HF config.json -> shapes/options that decide the tensor layout (HFGeometry)
  mapping      HF state dict <-> full Megatron state dict (local-spec names, global indices)
  sharding     full Megatron state dict <-> per-rank shards for a TP/PP/EP/ETP layout (ShardLayout)
  storage      HF safetensors directories and the converted shard directory format
  model_state  load a rank state dict into a live Megatron model (local or TE spec) / read it back
  model_config ModelConfig for a HF config.json (+ padded vocab) — what to build to load the shards
  api          the conversion entry points used by ``megatron-rl convert`` (pure, one process)
  torch_dist   read the model tensors of a megatron dist_checkpointing (torch_dist) checkpoint, one process
  live         load a checkpoint into a live parallel model / export a live model to HF (collective)

Command line: ``megatron-rl convert hf-to-mcore ...`` / ``megatron-rl convert mcore-to-hf ...``.
"""
from megatron_rl.convert.api import (convert_hf_to_mcore, convert_mcore_to_hf, export_hf_from_full,
                                     load_rank_state_dict, read_full_mcore_state_dict, read_hf_checkpoint,
                                     read_mcore_checkpoint)
from megatron_rl.convert.live import (check_model_config_matches, export_model_to_hf, gather_full_state_dict,
                                      load_checkpoint_into_model)
from megatron_rl.convert.model_config import model_config_for_checkpoint, model_config_from_hf
from megatron_rl.convert.geometry import HFGeometry, UnsupportedCheckpointError
from megatron_rl.convert.mapping import CheckpointMismatchError, hf_to_mcore, mcore_to_hf, param_rules
from megatron_rl.convert.model_state import (adapt_names_to_model, canonical_state_dict,
                                             load_state_dict_into_model)
from megatron_rl.convert.sharding import LayoutError, ShardLayout, rank_state_dict, unshard
from megatron_rl.convert.storage import CheckpointFormatError

__all__ = [
    "HFGeometry", "ShardLayout", "convert_hf_to_mcore", "convert_mcore_to_hf", "export_hf_from_full",
    "load_rank_state_dict", "read_full_mcore_state_dict", "read_hf_checkpoint", "read_mcore_checkpoint",
    "hf_to_mcore", "mcore_to_hf", "param_rules", "rank_state_dict", "unshard", "adapt_names_to_model",
    "canonical_state_dict", "load_state_dict_into_model", "UnsupportedCheckpointError",
    "CheckpointMismatchError", "LayoutError", "CheckpointFormatError", "model_config_from_hf", "model_config_for_checkpoint",
    "load_checkpoint_into_model", "export_model_to_hf", "gather_full_state_dict", "check_model_config_matches",
]
