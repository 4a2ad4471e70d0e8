"""Operations tooling: memory plan and config checker (``megatron-rl check``), run report with plots
(``megatron-rl report``), and the configuration-reference generator (``python -m
megatron_rl.ops.config_reference``)."""
