"""Text-only placeholder for ``torchvision`` on CPU (see ../README.md).

PyPI's torchvision wheel is built against CUDA torch and fails to import beside torch 2.13.0+cpu. sglang
(e.g. ``srt/multimodal/internvl_utils.py``) and transformers (``image_utils``) import torchvision names at
module load even for text models. Every name imports; calling or using one raises ImportError.
"""
from torchvision import io, transforms  # noqa: F401
from torchvision._placeholder import module_getattr

__version__ = "0.0.0+megatron-rl-text-only"
__getattr__ = module_getattr("torchvision")
