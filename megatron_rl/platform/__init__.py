"""Platform layer: CPU compatibility patches for megatron-core (see ``cpu_compat``)."""
from megatron_rl.platform.cpu_compat import apply_cpu_patches, cpu_patches_applied

__all__ = ["apply_cpu_patches", "cpu_patches_applied"]
