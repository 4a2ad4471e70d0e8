"""Platform layer: CPU compatibility patches for megatron-core (``cpu_compat``, CPU only), megatron's
checkpoint file writer replaced by one that cannot hang (``checkpoint_writer``, every device), and
SGLang's import-only CPU stand-ins (``sglang_cpu/``)."""
from megatron_rl.platform.cpu_compat import apply_cpu_patches, cpu_patches_applied

__all__ = ["apply_cpu_patches", "cpu_patches_applied"]
