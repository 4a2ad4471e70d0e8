"""megatron_rl_kernels: Triton kernels for megatron-rl (source dir ``kernels/megatron_rl_kernels/``; the
top-level ``kernels/`` folder is deliberately not a package, so it never shadows Hugging Face's ``kernels``).

``logprob_kernels``: one-pass online softmax statistics (log-probs, entropy, TP partials) and the
log-prob/entropy gradient over vocab blocks, the GPU path of ``megatron_rl.logprobs``. Importing this package does not import triton.
"""
