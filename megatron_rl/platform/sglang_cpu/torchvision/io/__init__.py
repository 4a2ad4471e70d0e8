"""Text-only placeholder for ``torchvision.io`` (see the torchvision placeholder's docstring)."""
from torchvision._placeholder import module_getattr

__getattr__ = module_getattr("torchvision.io")
