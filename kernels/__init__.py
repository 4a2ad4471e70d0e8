"""megatron_rl_kernels: Triton kernels for megatron-rl (installed from the ``kernels/`` source dir).

``logprob_kernels``: one-pass online softmax statistics (log-probs, entropy, TP partials) and the
log-prob/entropy gradient over vocab blocks, the GPU path of ``megatron_rl.logprobs``. Importing this package does not import triton.
"""
