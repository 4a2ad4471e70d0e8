"""GPT / MoE models on megatron-core: typed model config and model builder (HF and checkpoint I/O: ``convert``).

    from megatron_rl.models import ModelConfig, build_gpt_model
"""
from megatron_rl.models.builder import build_gpt_model, make_transformer_config, transformer_engine_available
from megatron_rl.models.config import ModelConfig, ModelConfigError, model_config_from_dict

__all__ = ["ModelConfig", "ModelConfigError", "model_config_from_dict", "build_gpt_model",
           "make_transformer_config", "transformer_engine_available"]
