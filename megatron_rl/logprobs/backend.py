"""Backend choice (Triton kernels on CUDA, torch elsewhere) and the default chunk size.

``backend`` values accepted by the public functions:
  * ``"auto"`` (default): Triton when the logits are on a CUDA device and ``triton`` imports,
    else the torch path;
  * ``"torch"``: the chunked torch path (``torch_path.py``) on any device;
  * ``"triton"``: the Triton kernels (``megatron_rl_kernels``) - also on CPU tensors when
    ``TRITON_INTERPRET=1`` was set before ``megatron_rl_kernels.logprob_kernels`` was imported
    (that is how the kernels are tested without a GPU).

Default chunk size (tokens per chunk) = max(1, CHUNK_ELEMENTS // width) where width is the number
of vocab columns of the block. CPU: 2**20 elements (4 MiB per fp32 workspace, two workspaces): the
torch path's peak extra memory is then ~8 MiB + O(tokens), far below 10% of one fp32 shard copy for
any realistic shard, and the per-chunk buffers stay cache-friendly; ``tools/bench_logprobs.py``
measured time flat (within noise) from 8 to 128 rows x 32768 columns (2**18 - 2**22 elements) while
memory grows linearly (3.7 -> 32.5 MiB), so the budget sits at the small end that still amortises the
per-chunk Python overhead (see that file's docstring for the numbers).
CUDA: up to 2**25 elements per chunk (two fp32 workspaces of 128 MiB), fewer when free device memory is
short (at most 1/64 of it, at least 2**22): few, large chunks keep the per-chunk launch overhead small
(each chunk is ~10 kernel launches) while the extra memory stays a few percent of one fp32 copy of a
large shard. The Triton path of ``vocab_parallel_logprobs`` needs no workspace at all and runs on all
tokens at once unless a ``chunk_size`` is given.
"""
from __future__ import annotations

import torch

from . import torch_path

CPU_CHUNK_ELEMENTS = 2 ** 20
CUDA_CHUNK_ELEMENTS = 2 ** 25
CUDA_MIN_CHUNK_ELEMENTS = 2 ** 22
BACKENDS = ("auto", "torch", "triton")


def default_chunk_rows(width: int, device: torch.device) -> int:
    """Tokens per chunk for a block of ``width`` vocab columns on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = max(CUDA_MIN_CHUNK_ELEMENTS, min(CUDA_CHUNK_ELEMENTS, free // 64))
    else:
        budget = CPU_CHUNK_ELEMENTS
    return max(1, budget // max(1, width))


def resolve_backend(backend: str, device: torch.device) -> str:
    """'torch' or 'triton' for ``backend`` in BACKENDS on ``device`` (raises ValueError otherwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            import megatron_rl_kernels.logprob_kernels  # noqa: F401  (optional: Triton, CUDA only)
        except ImportError:
            return "torch"
        return "triton"
    if backend == "triton":
        try:
            import megatron_rl_kernels.logprob_kernels  # noqa: F401  (optional: Triton, CUDA only)
        except ImportError as e:
            raise ValueError(f"backend='triton' but the Triton kernels cannot be imported: {e}") from e
    return backend


class BlockOps:
    """The two per-block primitives for one backend, with a reusable workspace (torch path)."""

    def __init__(self, backend: str, device: torch.device):
        self.backend = backend
        self.fused_final = backend == "triton"  #: ``logprobs`` (one pass, no TP) is available
        if backend == "triton":
            from megatron_rl_kernels import logprob_kernels as k  # optional: Triton, CUDA only
            self._k = k
        else:
            self._ws = torch_path.Workspace(device)
            fewer = device.type == "cuda"
            self._partials = torch_path.chunk_partials_fewer_passes if fewer else torch_path.chunk_partials
            self._grad = torch_path.chunk_grad_fewer_passes if fewer else torch_path.chunk_grad

    def logprobs(self, x, t_local, inv_temp):
        """Without TP: (logp, ent, M, log_s, status) of the block x [c, W] (Triton only)."""
        return self._k.block_logprobs(x, t_local, inv_temp)

    def partials(self, x, t_local, inv_temp):
        """(m, s, tgt, spz) fp32 [c] for the block x [c, W]; see ``torch_path.chunk_partials``."""
        if self.backend == "triton":
            return self._k.block_partials(x, t_local, inv_temp)
        return self._partials(x, t_local, inv_temp, self._ws)

    def grad(self, x, t_local, inv_temp, mx, log_s, ent, g_logp, g_ent, out):
        """Write d(loss)/dx for the block x [c, W] into ``out``; see ``torch_path.chunk_grad``."""
        if self.backend == "triton":
            return self._k.block_grad(x, t_local, inv_temp, mx, log_s, ent, g_logp, g_ent, out)
        return self._grad(x, t_local, inv_temp, mx, log_s, ent, g_logp, g_ent, out, self._ws)
