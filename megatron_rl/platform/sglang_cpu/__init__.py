"""Import-only stand-ins that let an SGLang server start on a CPU-only machine.

This directory (``STANDIN_DIR``) is prepended to ``PYTHONPATH`` ONLY for the SGLang server subprocess on
CPU (see ``megatron_rl.rollout.sglang_server``); it is never on the path of the trainer or of the tests.
It holds two top-level packages:

* ``sgl_kernel`` — sglang imports 9 ``*_cpu`` op names from ``sgl_kernel`` at module load on CPU (and 1 lazily)
  (KV-cache copy, request-to-token pool assignment, speculative-decoding helpers). The CPU build of
  sgl-kernel is not on PyPI, and none of these ops is called for plain Qwen2/Llama text generation.
  Each stand-in raises ``NotImplementedError`` naming itself if it is ever called.
* ``torchvision`` (incl. ``torchvision.io`` and ``torchvision.transforms``) — with CPU torch the PyPI
  torchvision wheel is a CUDA build that fails to import; sglang / transformers only import it for
  image and video processors. Text-only placeholder: any use of an image op raises.

This ``__init__`` is only a marker so the location can be found; it does not import the stand-ins.
"""
from pathlib import Path

#: The directory to prepend to ``PYTHONPATH`` of a CPU SGLang server process.
STANDIN_DIR = str(Path(__file__).resolve().parent)
