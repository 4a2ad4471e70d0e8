"""LoRA adapters on megatron-core's linear layers (``actor.lora``): config, adapter layers, attach / freeze.

Design, sharding and the names of the adapter parameters: docs/lora.md.
"""
