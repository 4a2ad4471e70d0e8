"""Vocab-parallel log-probs and entropy: fused, memory-bounded, exact across tensor parallelism.

Public API::

    from megatron_rl.logprobs import vocab_parallel_logprobs, fused_linear_logprobs
    logp, ent = vocab_parallel_logprobs(logits_shard, target_ids, tp_group=g, temperature=1.0,
                                        compute_entropy=True, chunk_size=None)
    logp, ent = fused_linear_logprobs(hidden, output_weight_shard, target_ids, tp_group=g,
                                      temperature=1.0, compute_entropy=True, chunk_size=None)

Both also take ``backend="auto"|"torch"|"triton"`` (Triton kernels on CUDA by default) and the fused one
``reduce_hidden_grad=True`` (all-reduce d hidden over tp_group in backward; set False when hidden comes
out of megatron's copy_to_tensor_model_parallel_region / gather_from_sequence_parallel_region).

Modules: ``validation`` (input checks, one small cross-rank check), ``torch_path`` (per-chunk torch
primitives), ``combine`` (the TP combine: one MAX + one SUM all-reduce), ``backend`` (Triton on
CUDA, torch elsewhere; default chunk size), ``vocab_parallel`` and ``fused_linear`` (autograd
functions). Triton kernels live in the package ``megatron_rl_kernels`` (source dir ``kernels/megatron_rl_kernels/``).
Tests: ``pytest tests/*/test_logprobs*.py tests/integration/test_kernels*.py``; benchmark: ``tools/bench_logprobs.py``.
"""
from .fused_linear import fused_linear_logprobs
from .vocab_parallel import vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs", "fused_linear_logprobs"]
