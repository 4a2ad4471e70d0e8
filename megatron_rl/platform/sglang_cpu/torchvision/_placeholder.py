"""Helpers for the text-only torchvision placeholder: import-time names exist, any use raises ImportError."""
import enum


class InterpolationMode(enum.Enum):
    """Same members as torchvision's enum (imported at module load by transformers' image utils and by
    sglang's multimodal processors); only a name, no image op behind it."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class Unavailable:
    """Stands for any torchvision attribute: importing it works, calling or using it raises ImportError."""

    def __init__(self, qualname):
        self._qualname = qualname

    def _fail(self, *args, **kwargs):
        raise ImportError(
            f"{self._qualname} is unavailable: torchvision here is megatron-rl's text-only CPU placeholder "
            "(megatron_rl/platform/sglang_cpu); image/video models are not supported by this server")

    __call__ = _fail

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self._qualname}.{name}")

    def __repr__(self):
        return f"<unavailable {self._qualname}>"


def module_getattr(module_name):
    """A module-level ``__getattr__`` returning ``Unavailable`` placeholders for ``module_name``."""

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{module_name}.{name}")

    return __getattr__
