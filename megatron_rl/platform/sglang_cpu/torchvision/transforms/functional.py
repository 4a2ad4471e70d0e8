"""Text-only placeholder for ``torchvision.transforms.functional`` (see the torchvision placeholder's docstring)."""
from torchvision._placeholder import InterpolationMode, module_getattr  # noqa: F401

__getattr__ = module_getattr("torchvision.transforms.functional")
