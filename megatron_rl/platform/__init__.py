"""Platform layer, the one place the project patches megatron-core: what its local (non-TE) layers lack
(``local_layers``, whenever Transformer Engine is absent) and what a CPU lacks (``cpu_compat``, when CUDA is
absent), chosen by ``select``; megatron's checkpoint file writer replaced by one that cannot hang
(``checkpoint_writer``, every device); megatron's distributed optimizer loading its checkpoints with torch's
Adam (``distrib_optimizer``, every device); SGLang's import-only CPU stand-ins (``sglang_cpu/``)."""
from megatron_rl.platform.cpu_compat import cpu_patches_applied
from megatron_rl.platform.select import (Platform, apply_cpu_patches, apply_platform_patches, applied_patch_sets,
                                         select_patches)

__all__ = ["apply_cpu_patches", "cpu_patches_applied", "Platform", "apply_platform_patches", "applied_patch_sets",
           "select_patches"]
