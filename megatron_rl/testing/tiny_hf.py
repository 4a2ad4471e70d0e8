"""The tiny offline HF checkpoints for tests: ``megatron_rl.convert.tiny_hf`` under its test-helper name.

    from megatron_rl.testing.tiny_hf import build_tiny_hf_model
    python -m megatron_rl.testing.tiny_hf OUT_DIR [--arch qwen2|llama|qwen3_moe|deepseek_v3] [--seed 0]
"""
from megatron_rl.convert.tiny_hf import (ARCHS, DEFAULT_TOKENIZER_VOCAB, SPECIAL_TOKENS, build_tiny_hf_model,
                                         build_tiny_tokenizer, main, tiny_config)

__all__ = ["ARCHS", "DEFAULT_TOKENIZER_VOCAB", "SPECIAL_TOKENS", "build_tiny_hf_model", "build_tiny_tokenizer",
           "main", "tiny_config"]

if __name__ == "__main__":
    main()
