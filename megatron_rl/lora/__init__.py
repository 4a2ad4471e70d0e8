"""LoRA adapters on megatron-core linear layers (docs/lora.md)."""
