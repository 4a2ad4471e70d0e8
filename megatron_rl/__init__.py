"""megatron-rl: RL post-training backend on Megatron-Core.

Layout (data flows top to bottom):
  megatron_rl.correction  rollout-vs-training mismatch correction (IS weights, RS masks, metrics)
  megatron_rl.losses      policy losses (decoupled / bypass PPO-clip, REINFORCE), KL penalties
  megatron_rl.logprobs    vocab-parallel log-probs and entropy (fused, memory-bounded)
  megatron_rl.parallel    process groups, parallel config, CPU platform patches for megatron-core
  megatron_rl.testing     multi-rank test launcher (forked gloo ranks with a timeout)
"""
__version__ = "0.1.0"
