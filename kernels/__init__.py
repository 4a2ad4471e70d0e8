"""megatron_rl_kernels: Triton kernels for megatron-rl (installed from the ``kernels/`` source dir).

``logprob_kernels``: online log-sum-exp partials and log-prob/entropy gradients over vocab blocks,
the GPU path of ``megatron_rl.logprobs``. Importing this package does not import triton.
"""
