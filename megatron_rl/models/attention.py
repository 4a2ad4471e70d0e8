"""Which core attention a job gets, decided before any process group from the device, Transformer Engine
and the actor's precision -- and which jobs that attention cannot run.

    backend = attention_backend(device, has_te, precision.bf16)   # the job plan's (megatron_rl.plan)
    errors = attention_errors(backend, packed, cp)        # ["actor.sequence_packing: ... set actor.bf16: true"]
    backend.keeps_scores(packed=False)                    # True: plan [b, heads, s, s] scores

Rule: ``te-fused`` (CUDA, TE, bf16), ``te-unfused`` (CUDA, TE, fp32) or ``local`` (no TE); what each can run and
keeps: the table in docs/check.md ("Which core attention").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron_rl.platform.select import te_installed

__all__ = ["AttentionBackend", "attention_backend", "attention_errors", "expected_te", "BACKENDS"]


@dataclass(frozen=True)
class AttentionBackend:
    """One core-attention implementation and what it supports."""

    name: str
    """``te-fused``, ``te-unfused`` or ``local``."""
    description: str
    """One line for ``check``'s output."""
    uses_te: bool
    """Built from Transformer Engine's layer spec (else megatron's local spec)."""
    packing: bool
    """Runs packed (THD) sequences."""
    context_parallel: bool
    """Runs ``context_parallel_size > 1``."""
    padded_scores: bool
    """Materialises (and keeps for backward) the ``[b, heads, s, s]`` scores of padded rows."""

    def keeps_scores(self, packed: bool) -> bool:
        """Whether the ``[b, heads, s, s]`` scores exist for a micro-batch (packed rows on the local backend run
        through varlen flash attention or SDPA per segment, which keep none)."""
        return self.padded_scores and not (packed and self.name == "local")


BACKENDS = {
    "te-fused": AttentionBackend("te-fused", "Transformer Engine flash / fused attention (bf16)", True, True, True,
                                 False),
    "te-unfused": AttentionBackend("te-unfused", "Transformer Engine unfused attention (fp32: flash / fused "
                                   "attention take bf16 / fp16 only)", True, False, False, True),
    "local": AttentionBackend("local", "megatron's local DotProductAttention (no Transformer Engine; packed rows "
                              "through varlen flash attention on CUDA bf16, else SDPA per segment)", False, True,
                              False, True),
}


def attention_backend(device: str, has_te: bool, bf16: bool) -> AttentionBackend:
    """The backend a job on ``device`` ("cuda" / "cpu") gets with / without TE and bf16."""
    if device != "cuda" or not has_te:
        return BACKENDS["local"]
    return BACKENDS["te-fused" if bf16 else "te-unfused"]


def expected_te(device: str, has_te: Optional[bool] = None) -> Tuple[bool, str]:
    """(Transformer Engine available to the job, how that is known). ``has_te`` given: that. CPU: never (TE needs
    CUDA). CUDA on a machine with CUDA: whether TE is installed here. CUDA planned from a machine without
    CUDA: assumed installed, as on GPU clusters."""
    import torch

    if has_te is not None:
        return has_te, "given"
    if device != "cuda":
        return False, "CPU: Transformer Engine needs CUDA"
    if torch.cuda.is_available():
        found = te_installed()
        return found, f"Transformer Engine {'found' if found else 'not installed'} on this machine"
    return True, "assumed installed (this machine has no CUDA to check; --no-transformer-engine plans without)"


def attention_errors(backend: AttentionBackend, packed: bool, cp: int) -> List[str]:
    """The job settings ``backend`` cannot run, each naming its key and the fix: ``packed`` rows
    (``actor.sequence_packing``) and ``cp`` (``parallel.context_parallel_size``)."""
    errs: List[str] = []
    if backend.name == "te-unfused":
        why = ("Transformer Engine's flash / fused attention takes bf16 / fp16 only, and its unfused backend "
               "refuses")
        if packed:
            errs.append(f"actor.sequence_packing: {why} packed (THD) sequences: set actor.bf16: true (or "
                        f"actor.sequence_packing: false)")
        if cp > 1:
            errs.append(f"parallel.context_parallel_size: {cp} with fp32: {why} context parallelism: set "
                        f"actor.bf16: true (or context_parallel_size: 1)")
    elif cp > 1 and not backend.context_parallel:
        errs.append(f"parallel.context_parallel_size: {cp} needs Transformer Engine attention (megatron's local "
                    f"DotProductAttention asserts context_parallel_size == 1; {backend.description}): use "
                    f"context_parallel_size: 1 or a CUDA machine with Transformer Engine")
    return errs
